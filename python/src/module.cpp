// The _moefq extension module: moefq's C++ API for the Python package (python/moefq), with
// moefq::Error turned into ValueError (bad input) or RuntimeError (a failed check, an internal
// error), keeping the message.
#include <pybind11/pybind11.h>

#include <cmath>
#include <filesystem>
#include <stdexcept>

#include "bindings.h"
#include "moefq/errors.h"
#include "moefq/fileio.h"
#ifdef MOEFQ_HAS_CUDA
#include "moefq/cuda_device.h"
#endif

namespace moefq::py {

Format parse_format_arg(const std::string& name, const char* who) {
  const auto f = parse_format(name);
  MOEFQ_CHECK(f.has_value(), who, ": unknown format '", name, "' (expected ", format_choices(), ")");
  return *f;
}

float check_amax(float amax, const char* who) {
  MOEFQ_CHECK(std::isfinite(amax) && amax >= 0.0f, who, ": amax must be a finite number >= 0, got ", amax);
  return amax;
}

bool built_with_cuda() {
#ifdef MOEFQ_HAS_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef MOEFQ_HAS_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

void require_cuda_build(const Tensor& t) {
  if (t.cuda() && !built_with_cuda())
    throw std::runtime_error(t.what() + " is on " + t.device_name() +
                             ", but this moefq was built without CUDA (rebuild with nvcc to use GPU tensors)");
}

}  // namespace moefq::py

PYBIND11_MODULE(_moefq, m) {
  namespace py = pybind11;
  m.doc() = "moefq's C++ API (tensors as DLPack capsules); use the moefq package instead";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const moefq::Error& e) {
      PyErr_SetString(e.kind() == moefq::ErrorKind::kBadInput ? PyExc_ValueError : PyExc_RuntimeError, e.what());
    } catch (const std::filesystem::filesystem_error& e) {
      // A path the caller gave that the system refuses (a link loop, a name too long): bad input.
      PyErr_SetString(PyExc_ValueError, moefq::filesystem_error_message(e).c_str());
    }
  });
  m.attr("version") = MOEFQ_VERSION;
  m.def("built_with_cuda", &moefq::py::built_with_cuda, "Whether this build has the CUDA kernels.");
  m.def("cuda_device_count", &moefq::py::cuda_device_count, "Usable GPUs (0 without a driver or a CUDA build).");
  m.def("formats", [] {
    py::list names;
    for (moefq::Format f : moefq::kAllFormats) names.append(moefq::format_name(f));
    return names;
  });
  m.def(
      "format_info",
      [](const std::string& name, const std::string& who) {
        const moefq::Format f = moefq::py::parse_format_arg(name, who.c_str());
        return py::make_tuple(moefq::format_block_size(f), moefq::format_has_global_amax(f));
      },
      py::arg("name"), py::arg("who"), "(block size along the last dimension or 0, whether it has a global amax)");
  m.def(
      "check_output_path",
      [](const std::string& path, const std::string& what) {
        moefq::check_output_path(path, what);
        return path;
      },
      py::arg("path"), py::arg("what"),
      "Checks, before any work, that `path` can be written as a file output (not empty, not a directory, "
      "in a directory that exists and can be written); returns it.");
  moefq::py::init_ops(m);
  moefq::py::init_quantizer(m);
  moefq::py::init_layer(m);
  moefq::py::init_eval(m);
}
