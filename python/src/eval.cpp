// moefq eval and moefq calibrate from Python (eval.h, report.h): keyword options in, the report as
// the JSON text `moefq eval --out` writes; safetensors files (the activations file of
// `moefq eval --activations`), and docs/numerics.md's error metrics on tensors.
#include <pybind11/functional.h>

#include <limits>
#include <memory>
#include <thread>

#include "bindings.h"
#include "moefq/errors.h"
#include "moefq/eval.h"
#include "moefq/fileio.h"
#include "moefq/metrics.h"
#include "moefq/report.h"
#include "moefq/safetensors.h"
#ifdef MOEFQ_HAS_CUDA
#include "moefq/cuda.h"
#include "eval/layer_runner.h"
#endif

namespace moefq::py {
namespace {

namespace pb = pybind11;

// The options both entry points take, as `moefq eval` spells them (messages name the keyword).
template <typename T>
T option(const pb::handle& value, const std::string& key, const char* expected) {
  try {
    return value.cast<T>();
  } catch (const pb::cast_error&) {
    MOEFQ_FAIL(ErrorKind::kBadInput, key, ": expected ", expected, ", got ", std::string(pb::str(value.get_type())));
  }
}

// An integer option (a Python int or anything with __index__, not a float) that fits T, else bad
// input naming the keyword: the type, or the value and T's range.
template <typename T>
T integer_option(const pb::handle& value, const std::string& key) {
  pb::object index;
  if (!PyFloat_Check(value.ptr())) index = pb::reinterpret_steal<pb::object>(PyNumber_Index(value.ptr()));
  if (!index) {
    PyErr_Clear();
    MOEFQ_FAIL(ErrorKind::kBadInput, key, ": expected an integer, got ", std::string(pb::str(value.get_type())));
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  constexpr long long lo = std::numeric_limits<T>::min(), hi = std::numeric_limits<T>::max();
  MOEFQ_CHECK(overflow == 0 && v >= lo && v <= hi, key, "=", std::string(pb::str(index)), " is out of range (",
              overflow < 0 || (overflow == 0 && v < lo) ? "at least " + std::to_string(lo)
                                                        : "at most " + std::to_string(hi),
              ")");
  return T(v);
}

// The keywords and the `moefq eval` flags they stand for: the library's messages name the flags
// ("--ranks must be >= 1"); a Python caller reads the keyword ("ranks must be >= 1", and
// "ranks=3 must divide ..." where the flag is followed by its value).
constexpr const char* kKeywords[] = {"preset", "config", "checkpoint", "layers", "activations", "synthetic",
                                     "recipes", "ranks", "tokens", "calib_batches", "eval_batches", "seed",
                                     "device", "threads", "combine_weighting", "staging", "load_calibration",
                                     "max_rel_l2", "recipe_root", "calibration", "link", "link_gbps"};

std::string flag_of(const std::string& keyword) {
  if (keyword == "recipes") return "--recipe";  // the CLI's flag is repeated, one recipe each
  std::string f = "--" + keyword;
  for (char& c : f)
    if (c == '_') c = '-';
  return f;
}

std::string with_keywords(std::string message) {
  const auto flag_char = [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-'; };
  // Words that follow a flag named on its own ("--ranks must be ..."); anything else after it is
  // its value ("--ranks 3 must divide ...").
  const auto is_word = [](const std::string& w) {
    for (const char* s : {"and", "or", "must", "cannot", "needs", "is"})
      if (w == s) return true;
    return false;
  };
  for (const char* keyword : kKeywords) {
    const std::string flag = flag_of(keyword);
    for (size_t at = message.find(flag); at != std::string::npos; at = message.find(flag, at + 1)) {
      const size_t end = at + flag.size();
      if (end < message.size() && flag_char(message[end])) continue;  // a longer flag (--recipe-root)
      std::string replacement = keyword;
      if (end + 1 < message.size() && message[end] == ' ') {
        const size_t word_end = message.find_first_of(" :,()", end + 1);
        if (!is_word(message.substr(end + 1, word_end == std::string::npos ? std::string::npos : word_end - end - 1))) {
          message.replace(at, flag.size() + 1, replacement + "=");
          continue;
        }
      }
      message.replace(at, flag.size(), replacement);
    }
  }
  return message;
}

// Runs f, the library's errors with keywords for flags (the same kind).
template <typename F>
auto keyword_errors(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    throw Error(e.kind(), with_keywords(e.what()));
  }
}

// Stops a run on Ctrl-C: Python's handler runs (its KeyboardInterrupt, or what the caller's own
// handler raises) and the exception unwinds the run. The GIL is released during the run; this
// takes it for the check.
void check_signals() {
  pb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw pb::error_already_set();
}

EvalOptions make_options(const pb::kwargs& kw, bool with_recipes) {
  EvalOptions o;
  std::string device = "auto";
  std::shared_ptr<pb::function> progress;
  for (const auto& [key, value] : kw) {
    const std::string k = pb::str(key);
    // Removed (one runner per device), with any value: an old script is told, not ignored.
    if (k == "pipeline")
      MOEFQ_FAIL(ErrorKind::kBadInput, "pipeline=", std::string(pb::str(value)), ": the option was removed; the "
                 "device runner gives the same bits the host pipeline gave (device='cuda' runs it, device='cpu' the "
                 "CPU engine): drop pipeline=");
    if (value.is_none()) continue;
    if (k == "preset") {
      o.preset = option<std::string>(value, k, "a string");
      o.preset_given = true;
    } else if (k == "config") {
      o.config_path = option<std::string>(value, k, "a string");
    } else if (k == "checkpoint") {
      o.checkpoint_dir = option<std::string>(value, k, "a string");
    } else if (k == "layers") {
      o.layers = parse_layers(option<std::string>(value, k, "a string"));
    } else if (k == "activations") {
      o.activations_path = option<std::string>(value, k, "a string");
    } else if (k == "synthetic") {
      const auto s = parse_synthetic_kind(option<std::string>(value, k, "a string"));
      MOEFQ_CHECK(s.has_value(), "synthetic: unknown kind '", option<std::string>(value, k, "a string"), "' (expected model or gaussian)");
      o.synthetic = *s;
    } else if (k == "recipes" && with_recipes) {
      o.recipes = option<std::vector<std::string>>(value, k, "a list of strings");
    } else if (k == "recipe_root" && with_recipes) {
      o.recipe_root = option<std::string>(value, k, "a string");
    } else if (k == "ranks") {
      o.ranks = integer_option<int64_t>(value, k);
    } else if (k == "tokens") {
      o.tokens = integer_option<int64_t>(value, k);
    } else if (k == "calib_batches") {
      o.calib_batches = integer_option<int>(value, k);
    } else if (k == "eval_batches" && with_recipes) {
      o.eval_batches = integer_option<int>(value, k);
    } else if (k == "seed") {
      const int64_t seed = integer_option<int64_t>(value, k);
      MOEFQ_CHECK(seed >= 0, "seed must be >= 0, got ", seed);
      o.seed = uint64_t(seed);
    } else if (k == "device") {
      device = option<std::string>(value, k, "a string");
    } else if (k == "threads") {
      o.num_threads = integer_option<int>(value, k);
    } else if (k == "combine_weighting") {
      o.combine_weighting = combine_weighting_option(option<std::string>(value, k, "a string"), k);
    } else if (k == "staging") {
      o.staging = staging_from_name(option<std::string>(value, k, "a string"), k);
    } else if (k == "load_calibration" && with_recipes) {
      o.load_calibration = option<std::string>(value, k, "a string");
    } else if (k == "max_rel_l2" && with_recipes) {
      o.max_rel_l2 = option<double>(value, k, "a number");
    } else if (k == "calibration") {
      o.calibration = parse_calibration_methods(option<std::string>(value, k, "a string"), k);
    } else if (k == "link" && with_recipes) {
      o.link = option<std::string>(value, k, "a string");
    } else if (k == "link_gbps" && with_recipes) {
      o.link_gbps = option<double>(value, k, "a number");
    } else if (k == "progress") {
      MOEFQ_CHECK(PyCallable_Check(value.ptr()), k, ": expected a callable, got ", std::string(pb::str(value.get_type())));
      // Shared: the run copies the hook with the GIL released; only the options' copy, destroyed
      // with the GIL held, owns a reference of the Python object.
      progress = std::make_shared<pb::function>(pb::reinterpret_borrow<pb::function>(value));
    } else {
      MOEFQ_FAIL(ErrorKind::kBadInput, with_recipes ? "eval" : "calibrate", ": unknown option '", k, "'");
    }
  }
  // Every progress step (each stage of a layer, each batch and recipe) checks for Ctrl-C first.
  o.progress = [progress](const std::string& line) {
    check_signals();
    if (!progress) return;
    pb::gil_scoped_acquire gil;
    (*progress)(line);
  };
  MOEFQ_CHECK(device == "auto" || device == "cpu" || device == "cuda", "device: unknown device '", device,
              "' (expected auto, cpu or cuda)");
  const bool gpu = cuda_device_count() > 0;
  MOEFQ_CHECK(gpu || device != "cuda", "device cuda: no CUDA device is visible",
              built_with_cuda() ? "" : " (this moefq was built without CUDA)");
  if (device != "cpu" && gpu) {
#ifdef MOEFQ_HAS_CUDA
    register_cuda_layer_runner();
    o.device = EvalDevice::kCuda;
    o.device_name = cuda::device_description();
#endif
  } else {
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    const unsigned n = o.num_threads > 0 ? unsigned(o.num_threads) : hw;
    o.device_name = "cpu (" + std::to_string(n) + (n == 1 ? " thread)" : " threads)");
  }
  return o;
}

// eval(**options) -> (report JSON text, warnings); out: also write report.{json,csv,html} there.
std::string eval_json(const pb::kwargs& kw) {
  pb::kwargs options;
  std::string out;
  for (const auto& [key, value] : kw) {
    if (pb::str(key).cast<std::string>() == "out") {
      if (!value.is_none()) out = value.cast<std::string>();
    } else {
      options[key] = value;
    }
  }
  const EvalOptions o = keyword_errors([&] { return make_options(options, true); });
  if (!out.empty()) check_output_dir(out, "out", kEvalReportFiles);  // before any work, as the CLI
  pb::gil_scoped_release release;
  const EvalResult r = keyword_errors([&] { return run_eval(o); });
  check_signals();  // a Ctrl-C during the last step: nothing written
  if (!out.empty()) write_eval_reports(r, out);
  return eval_report_json(r);
}

// calibrate(save, **options) -> [{layer, dispatch_amax, combine_amax, *_rank_amax}]; writes `save`.
pb::list calibrate(const std::string& save, const pb::kwargs& kw) {
  const EvalOptions o = keyword_errors([&] { return make_options(kw, false); });
  const NamedPath inputs[] = {{"config", o.config_path}, {"activations", o.activations_path}};
  check_output_path(save, "save", inputs);  // before any work, as the CLI
  CalibrationState state;
  {
    pb::gil_scoped_release release;
    EvalSetup setup;
    state = keyword_errors([&] { return run_calibration(o, &setup); });
    check_signals();  // a Ctrl-C during the last step: nothing written
    save_eval_calibration(save, state, setup);
  }
  pb::list layers;
  for (const LayerCalibration& c : state.layers) {
    pb::dict d;
    d["layer"] = c.layer;
    d["dispatch_amax"] = c.dispatch_amax;
    d["combine_amax"] = c.combine_amax;
    d["dispatch_rank_amax"] = c.dispatch_rank_amax;
    d["combine_rank_amax"] = c.combine_rank_amax;
    layers.append(d);
  }
  return layers;
}

StDtype st_dtype_of(const Tensor& t) {
  switch (t.elem()) {
    case Elem::kBF16: return StDtype::kBF16;
    case Elem::kF32: return StDtype::kF32;
    case Elem::kI32: return StDtype::kI32;
    case Elem::kI64: return StDtype::kI64;
    default: break;
  }
  MOEFQ_FAIL(ErrorKind::kBadInput, t.what(), " has dtype ", t.dtype_name(),
             "; safetensors files here take bfloat16, float32, int32 or int64");
}

// save_safetensors(path, [(name, capsule)], metadata): CPU tensors, written atomically.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, pb::capsule>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter w;
  for (const auto& [name, cap] : tensors) {
    Tensor t(cap, "save_safetensors: tensor '" + name + "'");
    MOEFQ_CHECK(!t.cuda(), t.what(), " is on ", t.device_name(), "; move it to the CPU first");
    w.add(name, st_dtype_of(t), t.shape(), {static_cast<const uint8_t*>(t.data()), t.bytes()});
  }
  for (const auto& [k, v] : metadata) w.set_metadata(k, v);
  pb::gil_scoped_release release;
  w.write(path);
}

// load_safetensors(path) -> ([(name, dtype name, shape, bytes)], metadata).
pb::tuple load_safetensors(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  pb::list tensors;
  for (const TensorInfo& t : f.header().tensors) {
    const std::vector<uint8_t> b = f.read(t);
    tensors.append(pb::make_tuple(t.name, st_dtype_name(t.dtype), t.shape,
                                  pb::bytes(reinterpret_cast<const char*>(b.data()), b.size())));
  }
  return pb::make_tuple(tensors, f.header().metadata);
}

// metrics(y, ref): docs/numerics.md's error metrics of y against ref (CPU tensors of one dtype and shape).
pb::dict metrics(const pb::capsule& yc, const pb::capsule& rc) {
  Tensor y(yc, "metrics: y"), r(rc, "metrics: ref");
  y.expect_elem({Elem::kBF16, Elem::kF32}, "bfloat16 or float32 (or uint16 holding bf16 bits)");
  r.expect_like(y);
  MOEFQ_CHECK(!y.cuda(), "metrics: the tensors are on ", y.device_name(), "; move them to the CPU first");
  ErrorMetrics m;
  {
    pb::gil_scoped_release release;
    m = y.elem() == Elem::kBF16 ? compute_metrics(y.ptr<bf16>(), r.ptr<bf16>(), y.numel())
                                : compute_metrics(y.ptr<float>(), r.ptr<float>(), y.numel());
  }
  pb::dict d;
  d["rel_l2"] = m.rel_l2;
  d["cosine"] = m.cosine;
  d["calc_diff"] = m.calc_diff;
  d["max_abs"] = m.max_abs;
  d["snr_db"] = m.snr_db;
  d["count"] = m.count;
  d["skipped_nonfinite"] = m.skipped_nonfinite;
  return d;
}

}  // namespace

void init_eval(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("eval_json", &eval_json);
  m.def("calibrate", &calibrate, py::arg("save"));
  m.def("save_safetensors", &save_safetensors, py::arg("path"), py::arg("tensors"), py::arg("metadata"));
  m.def("load_safetensors", &load_safetensors, py::arg("path"));
  m.def("metrics", &metrics, py::arg("y"), py::arg("ref"));
}

}  // namespace moefq::py
