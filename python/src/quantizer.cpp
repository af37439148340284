// Quantizers, their specs and recipes, and the calibration file, as the C++ API has them
// (quantizer.h, quant_spec.h, recipe.h, calibration_file.h). Tensors a quantizer collects come in
// as DLPack capsules; a CUDA tensor is copied to the host on the caller's stream first
// (calibration is an eager step, never part of a captured graph).

#include <vector>

#include "bindings.h"
#include "moefq/calibration_file.h"
#include "moefq/errors.h"
#include "moefq/quantizer.h"
#include "moefq/recipe.h"
#ifdef MOEFQ_HAS_CUDA
#include "moefq/cuda_device.h"
#endif

namespace moefq::py {
namespace {

namespace pb = pybind11;

AmaxSource parse_amax_source(const std::string& s) {
  if (s == "calibrated") return AmaxSource::kCalibrated;
  if (s == "constant") return AmaxSource::kConstant;
  if (s == "dynamic") return AmaxSource::kDynamic;
  MOEFQ_FAIL(ErrorKind::kBadInput, "amax_source: unknown source '", s, "' (expected calibrated, constant or dynamic)");
}

QuantSpec make_spec(const std::string& format, int block_size, const std::string& amax_source,
                    std::optional<float> constant_amax) {
  QuantSpec s;
  s.format = parse_format_arg(format, "format");
  s.block_size = block_size;
  s.amax_source = parse_amax_source(amax_source);
  if (constant_amax) {
    MOEFQ_CHECK(s.amax_source == AmaxSource::kConstant, "constant_amax is given but amax_source is '", amax_source,
                "'; use amax_source='constant'");
    s.constant_amax = *constant_amax;
  }
  return s;
}

// Folds a tensor into the quantizer's calibration: in place on the CPU, through a host copy of a
// CUDA tensor (ordered on the caller's stream).
void collect(Quantizer& q, const pb::capsule& xc, uintptr_t stream) {
  // Several threads may collect into one quantizer; a state change on another thread waits for
  // the collect (the quantizer's own locks, moefq/quantizer.h).
  MOEFQ_CHECK(q.calibrating(), q.name(), ": collect called outside calibration; call start_calibration() first");
  Tensor x(xc, q.name() + ": collect: x");
  x.expect_elem({Elem::kBF16, Elem::kF32}, "bfloat16 or float32 (or uint16 holding bf16 bits)");
  require_cuda_build(x);
  const bool bf = x.elem() == Elem::kBF16;
  pb::gil_scoped_release release;
  if (!x.cuda()) {
    if (bf)
      q.collect(x.ptr<bf16>(), x.numel());
    else
      q.collect(x.ptr<float>(), x.numel());
    return;
  }
#ifdef MOEFQ_HAS_CUDA
  DeviceGuard device(x.device_id());
  std::vector<uint8_t> host(x.bytes());
  cuda::copy_to_host(host.data(), x.data(), host.size(), as_stream(stream));
  if (bf)
    q.collect(reinterpret_cast<const bf16*>(host.data()), x.numel());
  else
    q.collect(reinterpret_cast<const float*>(host.data()), x.numel());
#else
  (void)stream;
#endif
}

std::vector<Quantizer*> as_pointers(const std::vector<Quantizer*>& qs, const char* who) {
  for (Quantizer* q : qs) MOEFQ_CHECK(q != nullptr, who, ": None in the quantizer list");
  return qs;
}

}  // namespace

void init_quantizer(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<QuantSpec>(m, "QuantSpec", "What a fake quantizer does: format, block size, amax source.")
      .def(py::init(&make_spec), py::arg("format"), py::arg("block_size") = 0, py::arg("amax_source") = "calibrated",
           py::arg("constant_amax") = py::none())
      .def_property_readonly("format", [](const QuantSpec& s) { return std::string(format_name(s.format)); })
      .def_readonly("block_size", &QuantSpec::block_size)
      .def_property_readonly("amax_source", [](const QuantSpec& s) { return std::string(amax_source_name(s.amax_source)); })
      .def_property_readonly("constant_amax", [](const QuantSpec& s) -> std::optional<float> {
        if (s.amax_source != AmaxSource::kConstant) return std::nullopt;
        return s.constant_amax;
      })
      .def("validate", [](const QuantSpec& s, const std::string& name) { s.validate(name); }, py::arg("name"))
      .def("describe", &QuantSpec::describe)
      .def("__eq__", [](const QuantSpec& a, const QuantSpec& b) { return a == b; })
      .def("__repr__", [](const QuantSpec& s) { return "QuantSpec(" + s.describe() + ")"; });

  py::class_<Quantizer>(m, "Quantizer", "A named fake quantizer: a spec plus its state (quantizer.h).")
      .def(py::init<std::string, QuantSpec, bool>(), py::arg("name"), py::arg("spec"), py::arg("enabled") = true)
      .def_property_readonly("name", &Quantizer::name)
      .def_property_readonly("spec", &Quantizer::spec)
      .def_property("enabled", &Quantizer::enabled,
                    py::cpp_function(&Quantizer::set_enabled, py::call_guard<py::gil_scoped_release>()))
      .def_property_readonly("needs_calibration", &Quantizer::needs_calibration)
      .def_property_readonly("calibrating", &Quantizer::calibrating)
      .def_property_readonly("seen_data", &Quantizer::seen_data)
      .def_property_readonly("collected_max",
                             py::cpp_function(&Quantizer::collected_max, py::call_guard<py::gil_scoped_release>()))
      .def_property_readonly("amax", &Quantizer::amax)
      // The state changes may wait for collects running without the GIL: release it meanwhile.
      .def("set_amax", &Quantizer::set_amax, py::arg("amax"), py::call_guard<py::gil_scoped_release>())
      .def("start_calibration", &Quantizer::start_calibration, py::call_guard<py::gil_scoped_release>())
      .def("collect", &collect, py::arg("x"), py::arg("stream"))
      .def("collect_max", &Quantizer::collect_max, py::arg("partial_max"), py::call_guard<py::gil_scoped_release>())
      .def("finish_calibration", &Quantizer::finish_calibration, py::call_guard<py::gil_scoped_release>())
      .def("abort_calibration", &Quantizer::abort_calibration, py::call_guard<py::gil_scoped_release>(),
           "Leaves a calibration without finishing it: the amax as before start_calibration, not calibrating.")
      .def("reset", &Quantizer::reset, py::call_guard<py::gil_scoped_release>());

  py::class_<QuantizerConfig>(m, "QuantizerConfig", "One quantizer's configuration after a recipe.")
      .def_readonly("enable", &QuantizerConfig::enable)
      .def_readonly("spec", &QuantizerConfig::spec)
      .def_readonly("configured", &QuantizerConfig::configured)
      .def("__repr__", [](const QuantizerConfig& c) {
        return std::string("QuantizerConfig(enable=") + (c.enable ? "True" : "False") +
               (c.configured ? ", " + c.spec.describe() : std::string()) + ")";
      });

  py::class_<RecipeEntry>(m, "RecipeEntry")
      .def_readonly("pattern", &RecipeEntry::pattern)
      .def_readonly("enable", &RecipeEntry::enable)
      .def_readonly("cfg", &RecipeEntry::cfg)
      .def_readonly("origin", &RecipeEntry::origin);
  py::class_<Recipe>(m, "Recipe", "A quantization recipe with its imports expanded (recipe.h).")
      .def_readonly("name", &Recipe::name)
      .def_readonly("entries", &Recipe::entries)
      .def_readonly("algorithm", &Recipe::algorithm)
      .def_property_readonly("combine_weighting",
                             [](const Recipe& r) -> std::optional<std::string> {
                               if (!r.combine_weighting) return std::nullopt;
                               return std::string(combine_weighting_name(*r.combine_weighting));
                             })
      .def("__repr__", [](const Recipe& r) {
        return "Recipe(" + r.name + ", " + std::to_string(r.entries.size()) + " entries)";
      });
  m.def("load_recipe", &load_recipe, py::arg("path_or_unit_name"), py::arg("recipe_root") = "");
  m.def(
      "parse_recipe_text",
      [](const std::string& text, const std::string& origin, const std::string& root) {
        return parse_recipe_text(text, origin, root);
      },
      py::arg("yaml_text"), py::arg("origin"), py::arg("recipe_root") = "");
  m.def("list_recipe_units", &list_recipe_units, py::arg("recipe_root") = "");
  m.def("apply_recipe", &apply_recipe, py::arg("recipe"), py::arg("quantizer_names"));
  m.def("wildcard_match", &wildcard_match, py::arg("pattern"), py::arg("name"));

  m.def(
      "save_calibration",
      [](const std::string& path, const std::vector<Quantizer*>& qs) {
        const std::vector<Quantizer*> ps = as_pointers(qs, "save_calibration");
        std::vector<const Quantizer*> cs(ps.begin(), ps.end());
        save_calibration(path, cs);
      },
      py::arg("path"), py::arg("quantizers"));
  m.def(
      "load_calibration",
      [](const std::string& path, const std::vector<Quantizer*>& qs) {
        load_calibration(path, as_pointers(qs, "load_calibration"));
      },
      py::arg("path"), py::arg("quantizers"));
}

}  // namespace moefq::py
