// Quantizers, their specs and recipes, and the calibration file, as the C++ API has them
// (quantizer.h, quant_spec.h, recipe.h, calibration_file.h). Tensors a quantizer collects come in
// as DLPack capsules; a CUDA tensor is copied to the host on the caller's stream first
// (calibration is an eager step, never part of a captured graph).

#include <mutex>
#include <shared_mutex>
#include <vector>

#include "bindings.h"
#include "moefq/calibration_file.h"
#include "moefq/errors.h"
#include "moefq/quantizer.h"
#include "moefq/recipe.h"
#ifdef MOEFQ_HAS_CUDA
#include "cuda/cuda_check.h"
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

// Quantizers from several threads: collect runs with the GIL released, and several threads may
// collect into one quantizer at once (the C++ quantizer folds under its own lock). The calls that
// change a quantizer's state (start, finish, abort, reset, the amax, the switch) hold this lock
// exclusively and collects hold it shared, so a finish on one thread waits for the collects in
// flight on others and never sees half of one. One lock for all quantizers: state changes are rare
// and short. It is taken with the GIL released (a holder may be waiting for the GIL).
std::shared_mutex g_quantizer_state;

std::unique_lock<std::shared_mutex> exclusive_state() {
  pb::gil_scoped_release release;
  return std::unique_lock<std::shared_mutex>(g_quantizer_state);
}

// Calls outside a calibration are the caller's mistake (bad input), not a broken invariant.
void expect_calibrating(const Quantizer& q, const char* call) {
  MOEFQ_CHECK(q.calibrating(), q.name(), ": ", call,
              " called outside calibration; call start_calibration() first (or use `with q.calibrate():`)");
}

// Folds a tensor into the quantizer's calibration: in place on the CPU, through a host copy of a
// CUDA tensor (ordered on the caller's stream).
void collect(Quantizer& q, const pb::capsule& xc, uintptr_t stream) {
  expect_calibrating(q, "collect");
  Tensor x(xc, q.name() + ": collect: x");
  x.expect_elem({Elem::kBF16, Elem::kF32}, "bfloat16 or float32 (or uint16 holding bf16 bits)");
  require_cuda_build(x);
  const bool bf = x.elem() == Elem::kBF16;
  pb::gil_scoped_release release;
  const std::shared_lock<std::shared_mutex> held(g_quantizer_state);
  expect_calibrating(q, "collect");  // a finish on another thread may have come first
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
  if (!host.empty()) {
    MOEFQ_CUDA_CHECK(cudaMemcpyAsync(host.data(), x.data(), host.size(), cudaMemcpyDeviceToHost, as_stream(stream)));
    MOEFQ_CUDA_CHECK(cudaStreamSynchronize(as_stream(stream)));
  }
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
                    [](Quantizer& q, bool on) {
                      const auto held = exclusive_state();
                      q.set_enabled(on);
                    })
      .def_property_readonly("needs_calibration", &Quantizer::needs_calibration)
      .def_property_readonly("calibrating", &Quantizer::calibrating)
      .def_property_readonly("seen_data", &Quantizer::seen_data)
      .def_property_readonly("collected_max",
                             [](const Quantizer& q) {
                               const auto held = exclusive_state();
                               return q.collected_max();
                             })
      .def_property_readonly("amax", &Quantizer::amax)
      .def(
          "set_amax",
          [](Quantizer& q, float amax) {
            const auto held = exclusive_state();
            q.set_amax(amax);
          },
          py::arg("amax"))
      .def("start_calibration",
           [](Quantizer& q) {
             const auto held = exclusive_state();
             q.start_calibration();
           })
      .def("collect", &collect, py::arg("x"), py::arg("stream"))
      .def(
          "collect_max",
          [](Quantizer& q, float partial_max) {
            const auto held = exclusive_state();
            expect_calibrating(q, "collect_max");
            q.collect_max(partial_max);
          },
          py::arg("partial_max"))
      .def("finish_calibration",
           [](Quantizer& q) {
             const auto held = exclusive_state();
             expect_calibrating(q, "finish_calibration");
             q.finish_calibration();
           })
      .def(
          "abort_calibration",
          [](Quantizer& q) {
            const auto held = exclusive_state();
            q.abort_calibration();
          },
          "Leaves a calibration without finishing it: the amax as before start_calibration, not calibrating.")
      .def("reset", [](Quantizer& q) {
        const auto held = exclusive_state();
        q.reset();
      });

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
        const std::vector<Quantizer*> ps = as_pointers(qs, "load_calibration");
        const auto held = exclusive_state();
        load_calibration(path, ps);
      },
      py::arg("path"), py::arg("quantizers"));
}

}  // namespace moefq::py
