// The evaluation pipeline of `moefq eval` / `moefq calibrate` (include/moefq/eval.h): the options
// resolved, the memory plan checked, then per layer: the runner loads it (and, where the plan
// allows, prepares the next one meanwhile), one calibration pass with both quantizers enabled
// (no QDQ, so its amax holds for every recipe; each method's amax is derived from it) unless a
// calibration file is given, the unquantized reference once, and every recipe on the same held-out
// batches. The runner gives sums; the rows' figures are finalised here, the same way for every
// device.
#include "moefq/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>
#include <sstream>

#include "engine/expert_cpu.h"
#include "eval/layer_runner.h"
#include "moefq/checkpoint.h"
#include "moefq/errors.h"
#include "moefq/fake_quant_moe.h"
#include "moefq/fileio.h"
#include "moefq/quantizer.h"
#include "moefq/qdq.h"
#include "moefq/safetensors.h"
#include "moefq/weight_cache.h"
#include "moefq/wire_bytes.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The resolved options: model, layers, recipes, the activations file.
struct Prepared {
  EvalSetup setup;
  RunnerSetup runner;
  EvalDevice device = EvalDevice::kCpu;
  std::vector<NamedRecipe> recipes;
  std::vector<std::map<std::string, QuantizerConfig>> recipe_configs;  // [recipe], over all layers
  // [recipe]: the calibration method of its calibrated amax (nullopt: it has none).
  std::vector<std::optional<CalibrationMethod>> methods;
  LinkModel link;
  std::vector<std::string> notes;  // for the result's warnings
  std::optional<SafetensorsFile> acts;
  std::function<void(const std::string&)> progress;
  double progress_every_seconds = 5.0;
  void say(const std::string& line) const {
    if (progress) progress(line);
  }
};

std::string plural(int64_t n, const std::string& what) {
  if (n == 1) return "1 " + what;
  return std::to_string(n) + " " + what + (what.back() == 'h' ? "es" : "s");
}

// The rows of each activations tensor the run uses, as the layer gets them (bf16): a NaN or inf
// there would only surface as a calibration error far from its cause, so it is named here: the
// file, the tensor, the first row and column holding one, and how many there are.
void check_activations_finite(const RunnerSetup& r, const std::string& path) {
  const int64_t H = r.config.hidden, need = r.num_tokens(), chunk = std::max<int64_t>(1, (int64_t(1) << 22) / H);
  std::set<std::string> checked;
  for (const auto& [layer, name] : r.act_tensor) {
    if (!checked.insert(name).second) continue;
    int64_t bad = 0, first_row = -1, first_col = -1;
    float first_value = 0;
    for (int64_t row = 0; row < need; row += chunk) {
      const int64_t n = std::min(chunk, need - row);
      const std::vector<bf16> x = layer_activations(r, layer, row, n);
      for (size_t i = 0; i < x.size(); ++i) {
        const float v = to_f32(x[i]);
        if (std::isfinite(v)) continue;
        if (bad++ == 0) {
          first_row = row + int64_t(i) / H;
          first_col = int64_t(i) % H;
          first_value = v;
        }
      }
    }
    MOEFQ_CHECK(bad == 0, "--activations ", path, ": tensor '", name, "' holds ", plural(bad, "NaN or inf value"),
                " in the ", need, " rows the run uses, the first at row ", first_row, ", column ", first_col, " (",
                first_value, "); the hidden states must be finite (an F32 value beyond the bf16 range is inf as bf16)");
  }
}

// The formats of the quantizers that take a calibrated amax.
std::vector<Format> calibrated_formats(const std::map<std::string, QuantizerConfig>& cfgs) {
  std::vector<Format> f;
  for (const auto& [name, c] : cfgs)
    if (c.enable && format_has_global_amax(c.spec.format) && c.spec.amax_source == AmaxSource::kCalibrated)
      f.push_back(c.spec.format);
  return f;
}

// Each recipe with a calibrated amax once per calibration method (--calibration, else its own
// algorithm), named "<recipe>@<method>" when --calibration lists several.
void expand_calibration_methods(const EvalOptions& o, Prepared& p) {
  std::vector<NamedRecipe> recipes;
  std::vector<std::map<std::string, QuantizerConfig>> configs;
  std::set<std::string> names;
  const bool several = o.calibration.size() > 1;
  for (size_t i = 0; i < p.recipes.size(); ++i) {
    std::vector<std::optional<CalibrationMethod>> ms;
    const std::vector<Format> formats = calibrated_formats(p.recipe_configs[i]);
    if (formats.empty())
      ms.push_back(std::nullopt);
    else if (o.calibration.empty())
      ms.push_back(p.recipes[i].recipe.calibration);
    else
      ms.assign(o.calibration.begin(), o.calibration.end());
    for (const auto& m : ms) {
      // nvfp4's mse needs its blocks, from a sample of the calibration rows (calibration_stats.h).
      if (m && m->kind == CalibrationMethod::Kind::kMse &&
          std::find(formats.begin(), formats.end(), Format::kNvfp4) != formats.end()) {
        MOEFQ_CHECK(o.nvfp4_sample_elements > 0, "nvfp4_sample_elements must be > 0, got ", o.nvfp4_sample_elements);
        p.runner.nvfp4_sample_elements = o.nvfp4_sample_elements;
      }
      NamedRecipe r = p.recipes[i];
      if (m && several) r.name += "@" + m->short_name();
      MOEFQ_CHECK(names.insert(r.name).second, "--recipe: two recipes are named '", r.name, "'");
      recipes.push_back(std::move(r));
      configs.push_back(p.recipe_configs[i]);
      p.methods.push_back(m);
    }
  }
  p.recipes = std::move(recipes);
  p.recipe_configs = std::move(configs);
}

// The run's calibration: the methods used (for the header), whether the runner keeps the
// statistics they need, and what cannot be combined.
void resolve_calibration(const EvalOptions& o, bool with_recipes, Prepared& p) {
  std::vector<CalibrationMethod> used;
  if (with_recipes) {
    for (const auto& m : p.methods)
      if (m && std::find(used.begin(), used.end(), *m) == used.end()) used.push_back(*m);
  } else {
    MOEFQ_CHECK(o.calibration.size() <= 1, "moefq calibrate --calibration takes one method");
    if (!o.calibration.empty()) used.push_back(o.calibration.front());
    MOEFQ_CHECK(used.empty() || used.front().kind != CalibrationMethod::Kind::kMse, "moefq calibrate --calibration ",
                "mse: the MSE-optimal amax depends on the recipe's format; use it in moefq eval (or calibrate with max ",
                "or percentile)");
  }
  const bool beyond_max = std::any_of(used.begin(), used.end(), [](const CalibrationMethod& m) {
    return m.kind != CalibrationMethod::Kind::kMax;
  });
  std::string names;
  for (const CalibrationMethod& m : used) names += (names.empty() ? "" : ", ") + m.name();
  p.setup.calibration = names.empty() ? "max" : names;
  if (beyond_max) {
    MOEFQ_CHECK(o.load_calibration.empty(), "--calibration ", names, " cannot be used with --load-calibration (a ",
                "calibration file holds one amax per quantizer; calibrate in this run instead)");
  }
  bool logfmt = false;
  for (const auto& cfgs : p.recipe_configs)
    for (const auto& [name, c] : cfgs) logfmt = logfmt || (c.enable && c.spec.format == Format::kLogfmt10);
  p.runner.calibration_stats = beyond_max || logfmt;
}

// The model (a checkpoint's config.json, a config file or a preset) and where its weights come from.
void resolve_model(const EvalOptions& o, Prepared& p) {
  EvalSetup& s = p.setup;
  MOEFQ_CHECK(o.config_path.empty() || o.checkpoint_dir.empty(),
              "--config and --checkpoint cannot be used together (a checkpoint brings its own config.json)");
  MOEFQ_CHECK(!o.preset_given || (o.config_path.empty() && o.checkpoint_dir.empty()), "--preset and ",
              o.config_path.empty() ? "--checkpoint" : "--config",
              " cannot be used together: the model comes from exactly one of them");
  if (!o.checkpoint_dir.empty()) {
    MOEFQ_CHECK(fs::is_directory(o.checkpoint_dir), "--checkpoint ", o.checkpoint_dir, ": not a directory");
    const std::string cj = (fs::path(o.checkpoint_dir) / "config.json").string();
    (void)InputFile::open(cj, "--checkpoint " + o.checkpoint_dir + ": config.json");
    s.config = load_hf_config(cj);
    s.model_source = "checkpoint " + o.checkpoint_dir;
    s.weights_source = "checkpoint " + o.checkpoint_dir;
    p.runner.checkpoint_dir = o.checkpoint_dir;
  } else if (!o.config_path.empty()) {
    (void)InputFile::open(o.config_path, "--config " + o.config_path);
    s.config = load_hf_config(o.config_path);
    s.model_source = "config " + o.config_path;
  } else {
    s.config = preset(o.preset);
    s.model_source = "preset " + o.preset;
  }
  s.config.validate();
  const std::string seed = "(seed " + std::to_string(o.seed) + ")";
  const bool model = o.synthetic == SyntheticKind::kModel;
  s.synthetic = synthetic_kind_name(o.synthetic);
  if (p.runner.checkpoint_dir.empty())
    s.weights_source = std::string("synthetic e4m3, ") + (model ? "model-shaped " : "Gaussian ") + seed;
}

// The sizes of the run (ranks, tokens, batches) and how it is described in the reports.
void resolve_sizes(const EvalOptions& o, bool with_recipes, Prepared& p) {
  EvalSetup& s = p.setup;
  MOEFQ_CHECK(o.ranks >= 1, "--ranks must be >= 1, got ", o.ranks);
  MOEFQ_CHECK(s.config.num_experts % o.ranks == 0, "--ranks ", o.ranks, " must divide the ", s.config.num_experts,
              " routed experts of ", s.config.name);
  MOEFQ_CHECK(o.tokens >= 1, "--tokens must be >= 1, got ", o.tokens);
  MOEFQ_CHECK(o.calib_batches >= 1, "--calib-batches must be >= 1, got ", o.calib_batches);
  MOEFQ_CHECK(o.eval_batches >= 1, "--eval-batches must be >= 1, got ", o.eval_batches);
  MOEFQ_CHECK(o.num_threads >= 0, "--threads must be >= 0");
  MOEFQ_CHECK(!o.max_rel_l2 || (std::isfinite(*o.max_rel_l2) && *o.max_rel_l2 > 0), "--max-rel-l2 must be a ",
              "finite number > 0, got ", o.max_rel_l2.value_or(0));
  s.ranks = o.ranks;
  s.tokens = o.tokens;
  s.calib_batches = o.calib_batches;
  s.eval_batches = with_recipes ? o.eval_batches : 0;  // calibration needs only the first batches
  s.seed = o.seed;
  // The engine each runner holds (the reports name it): the CPU engine, or the CUDA engine
  // device-resident.
  s.backend_kind = o.device == EvalDevice::kCuda ? "mega_moe_cuda (device-resident)" : "mega_moe";
  s.device = o.device_name;
  s.version = MOEFQ_VERSION;
  s.max_rel_l2 = o.max_rel_l2;
  p.device = o.device;
  p.progress = o.progress;
  p.progress_every_seconds = o.progress_every_seconds;
}

// The layers, and a checkpoint's tensors for each of them (checked before any work).
void resolve_layers(const EvalOptions& o, Prepared& p) {
  EvalSetup& s = p.setup;
  s.layers = o.layers;
  if (s.layers.empty()) {
    MOEFQ_CHECK(p.runner.checkpoint_dir.empty(), "--checkpoint needs --layers (e.g. --layers 3-10): which of the "
                "checkpoint's layers are MoE layers depends on the model");
    s.layers = {0};
  }
  for (int64_t l : s.layers) MOEFQ_CHECK(l >= 0, "--layers: layer ", l, " must be >= 0");
  if (!p.runner.checkpoint_dir.empty()) {
    // Every layer's tensors from the headers, before any work (a missing one would otherwise stop
    // the run at its layer). The format decides the memory plan and the default staging; either
    // device takes either format.
    WeightFormat f = WeightFormat::kE4m3;
    try {
      f = check_checkpoint_layers(p.runner.checkpoint_dir, s.layers, s.config, &p.runner.stored_format);
    } catch (const Error& e) {
      throw Error(e.kind(), "--checkpoint " + p.runner.checkpoint_dir + ": " + e.what());
    }
    p.runner.weight_format = f;
    s.weights_source += std::string(" (") + stored_weight_format_name(p.runner.stored_format) +
                        (p.runner.stored_format == StoredWeightFormat::kMxfp4 ? ", decoded to bf16 at load)" : ")");
  }
}

// What every runner needs of the run, from the setup resolved so far.
void resolve_runner(const EvalOptions& o, Prepared& p) {
  EvalSetup& s = p.setup;
  p.runner.config = s.config;
  p.runner.ranks = s.ranks;
  p.runner.tokens = s.tokens;
  p.runner.calib_batches = s.calib_batches;
  p.runner.eval_batches = s.eval_batches;
  p.runner.seed = s.seed;
  p.runner.synthetic = o.synthetic;
  p.runner.num_threads = o.num_threads;
}

// The activations: the file's tensors per layer (checked), or the synthetic ones.
void resolve_activations(const EvalOptions& o, Prepared& p) {
  EvalSetup& s = p.setup;
  const std::string seed = "(seed " + std::to_string(o.seed) + ")";
  const bool model = o.synthetic == SyntheticKind::kModel;
  // Activations: one [tokens, H] tensor per layer ("layers.{i}"), else "hidden_states".
  if (!o.activations_path.empty()) {
    p.acts.emplace(SafetensorsFile::open(o.activations_path, "--activations " + o.activations_path));
    const int64_t need = p.runner.num_tokens();
    for (int64_t l : s.layers) {
      const std::string per_layer = "layers." + std::to_string(l);
      std::string name = per_layer;
      if (!p.acts->find(name)) name = "hidden_states";
      const TensorInfo* t = p.acts->find(name);
      if (!t) {
        std::string have;
        int shown = 0;
        for (const TensorInfo& ti : p.acts->header().tensors)
          if (shown++ < 8) have += (have.empty() ? "" : ", ") + ti.name;
        MOEFQ_FAIL(ErrorKind::kBadInput, "--activations ", o.activations_path, ": no tensor '", per_layer, "' (layer ", l,
                   ") and no 'hidden_states' tensor (the file has: ", have.empty() ? "no tensors" : have, ")");
      }
      MOEFQ_CHECK(t->dtype == StDtype::kBF16 || t->dtype == StDtype::kF32, "--activations ", o.activations_path,
                  ": tensor '", name, "' is ", st_dtype_name(t->dtype), "; expected BF16 or F32");
      MOEFQ_CHECK(t->shape.size() == 2 && t->shape[1] == s.config.hidden, "--activations ", o.activations_path,
                  ": tensor '", name, "' must be [tokens, ", s.config.hidden, "] (the hidden size of ", s.config.name,
                  ")");
      MOEFQ_CHECK(t->shape[0] >= need, "--activations ", o.activations_path, ": tensor '", name, "' has ", t->shape[0],
                  " tokens, but ", need, " are needed ((", s.calib_batches, " calibration + ", s.eval_batches,
                  " evaluation batches) x ", s.ranks, " ranks x ", s.tokens,
                  " tokens); lower --tokens, --ranks or the batch counts");
      p.runner.act_tensor[l] = name;
    }
    p.runner.acts = &*p.acts;
    check_activations_finite(p.runner, o.activations_path);
    s.activations_source = o.activations_path;
  } else {
    s.activations_source = model ? "synthetic, model-shaped: RMSNorm gains, outlier channels, sink tokens " + seed
                                 : "synthetic, N(0, 1) " + seed;
  }
}

// The recipes (a sweep or files), resolved against the quantizers of every evaluated layer, their
// calibration methods and the link.
void resolve_recipes(const EvalOptions& o, bool with_recipes, Prepared& p) {
  EvalSetup& s = p.setup;
  MOEFQ_CHECK(o.recipe_root.empty() || fs::is_directory(o.recipe_root), "--recipe-root ", o.recipe_root,
              ": not a directory (it holds the configs/ tree recipe imports are looked up in)");
  // Recipes, resolved against the quantizers of every evaluated layer (so a recipe may name one
  // layer's quantizer).
  if (with_recipes) {
    MOEFQ_CHECK(o.sweep.empty() || o.sweep == "default" || o.sweep == "peers", "--sweep '", o.sweep,
                "': unknown sweep (expected default or peers)");
    MOEFQ_CHECK(o.sweep.empty() || o.recipes.empty(), "--sweep ", o.sweep,
                " and --recipe both choose the recipes; give one of them");
    if (o.recipes.empty()) {
      p.recipes = o.sweep == "peers" ? peers_sweep(o.combine_weighting) : default_sweep();
    } else {
      std::set<std::string> names;
      for (const std::string& r : o.recipes) {
        // "none" is the default sweep's unquantized baseline (a file of that name: ./none).
        NamedRecipe nr = r == "none" ? default_sweep().front() : NamedRecipe{"", load_recipe(r, o.recipe_root)};
        nr.name = nr.recipe.name;
        if (!nr.recipe.ignored.empty()) p.say(ignored_entries_notice(nr.recipe));
        MOEFQ_CHECK(names.insert(nr.name).second, "--recipe: two recipes are named '", nr.name,
                    "' (recipes are named by their file stem); give each a distinct file name");
        p.recipes.push_back(std::move(nr));
      }
    }
    std::vector<std::string> qnames;
    for (int64_t l : s.layers) {
      qnames.push_back(FakeQuantMoe::dispatch_name(l));
      qnames.push_back(FakeQuantMoe::combine_name(l));
    }
    for (const NamedRecipe& r : p.recipes) p.recipe_configs.push_back(apply_recipe(r.recipe, qnames));
    expand_calibration_methods(o, p);
    for (const NamedRecipe& r : p.recipes) s.recipe_names.push_back(r.name);
  }
  resolve_calibration(o, with_recipes, p);
  p.link = s.link = make_link_model(o.link, o.link_gbps);
}

// The layer's modes for the whole run: where the router weight is applied, and the staging (the
// baseline).
void resolve_modes(const EvalOptions& o, Prepared& p) {
  EvalSetup& s = p.setup;
  // Where the router weight is applied: one mode for the run (the rows every recipe quantizes, and
  // the calibrated combine amax, depend on it): the option, else the recipes' (which must agree).
  std::optional<CombineWeighting> weighting = o.combine_weighting;
  std::string said_by = "--combine-weighting";
  for (const NamedRecipe& r : p.recipes) {
    const std::optional<CombineWeighting>& w = r.recipe.combine_weighting;
    if (!w) continue;
    if (!weighting) {
      weighting = w;
      said_by = "recipe " + r.name;
    }
    MOEFQ_CHECK(*w == *weighting, "recipe ", r.name, " has combine_weighting: ", combine_weighting_name(*w), ", but ",
                said_by, " says ", combine_weighting_name(*weighting),
                "; one run evaluates one weighting (run the recipes separately, or change the recipe)");
  }
  s.combine_weighting = weighting.value_or(CombineWeighting::kBefore);
  p.runner.combine_weighting = s.combine_weighting;
  // The baseline: as the model is served unless --staging says otherwise.
  // An MXFP4 checkpoint's staging follows its architecture (DeepSeek-V4: e4m3), not its bf16 decode.
  const bool own_format = !p.runner.checkpoint_dir.empty() && p.runner.stored_format != StoredWeightFormat::kMxfp4;
  s.staging = o.staging.value_or(
      default_staging(s.config, own_format ? std::optional(p.runner.weight_format) : std::nullopt));
  p.runner.staging = s.staging;
}

// The options resolved and checked, every bad input refused before any work, in this order.
void prepare(const EvalOptions& o, bool with_recipes, Prepared& p) {
  resolve_model(o, p);
  resolve_sizes(o, with_recipes, p);
  resolve_layers(o, p);
  resolve_runner(o, p);
  resolve_activations(o, p);
  resolve_recipes(o, with_recipes, p);
  resolve_modes(o, p);
}

// The memory plan, refused with the figures when the run does not fit; `command` ("moefq eval")
// starts the message.
MemoryPlan check_memory(const Prepared& p, const std::string& command) {
  MemoryPlan plan = plan_run_memory(p.runner, p.device);  // a CPU run's has no device figure
  if (memory_fits(plan)) return plan;
  // --device cuda only where it would help: a GPU evaluation in this build (its memory query
  // registered) and a run that fits that GPU. Asked only for a refused run (the query starts the
  // GPU).
  bool gpu_fits = false;
  if (p.device == EvalDevice::kCpu) {
    const MemoryPlan gpu = plan_run_memory(p.runner, EvalDevice::kCuda);
    gpu_fits = gpu.device_available > 0 && gpu.device_bytes <= kUsableFraction * gpu.device_available &&
               gpu.host_bytes <= kUsableFraction * plan.host_available;
  }
  // The layer's weights alone (the first item) beyond what the machine can give: fewer tokens or
  // batches cannot help, so the advice says so.
  const bool on_device = p.device == EvalDevice::kCuda;
  const double weights = on_device ? plan.items.front().device_bytes : plan.items.front().host_bytes;
  const double usable = kUsableFraction * (on_device ? plan.device_available : plan.host_available);
  char gib[64];
  std::snprintf(gib, sizeof gib, "%.1f GiB", weights / double(1 << 30));
  const std::string advice =
      usable > 0 && weights > usable
          ? std::string("one layer's expert weights alone need ") + gib + ", more than this " +
                (on_device ? "GPU" : "machine") + " can give, so fewer tokens or batches cannot help: " +
                (gpu_fits ? "use --device cuda (the layer then lives on the GPU), " : "") +
                "run on a machine with more memory, or use a smaller model"
      : gpu_fits ? "use --device cuda (the layer then lives on the GPU), fewer --tokens or batches, or a smaller model"
                 : "use fewer --ranks, --tokens or batches, or a smaller model";
  require_memory_fits(plan, command + ":", advice);
  return plan;
}

// Per-layer figures of one recipe from the runner's sums.
struct TokenShape {
  double p50 = 0, p99 = 0, max = 0;
};

TokenShape token_shape(const std::vector<MetricSums>& tokens) {
  std::vector<double> v;
  bool nan = false;
  for (const MetricSums& t : tokens) {
    if (t.count == 0) continue;
    const ErrorMetrics m = finalize_metrics(t);
    if (std::isnan(m.rel_l2)) {
      nan = true;
      continue;
    }
    v.push_back(m.rel_l2);
  }
  TokenShape s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  // Nearest rank: the smallest value with at least q of the tokens at or below it.
  const auto at = [&](double q) { return v[size_t(std::max(1.0, std::ceil(q * double(v.size())))) - 1]; };
  s.p50 = at(0.5);
  s.p99 = at(0.99);
  s.max = v.back();
  if (nan) s.p99 = s.max = std::nan("");
  return s;
}

}  // namespace

std::vector<bool> outlier_channels(const std::vector<double>& ref2) {
  std::vector<bool> out(ref2.size(), false);
  if (ref2.empty()) return out;
  std::vector<double> sorted = ref2;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  std::vector<size_t> order(ref2.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ref2[a] > ref2[b]; });
  const size_t cap = std::max<size_t>(1, size_t(double(ref2.size()) * kOutlierChannelMaxFraction));
  // Sums of squares: the RMS ratio squared.
  for (size_t i = 0; i < cap && i < order.size(); ++i)
    if (ref2[order[i]] > kOutlierChannelFactor * kOutlierChannelFactor * median) out[order[i]] = true;
  return out;
}

namespace {

// The global amax a quantizer configured this way uses: the calibrated one, its constant, or none
// (a dynamic amax, a format without one, disabled).
std::optional<float> global_amax(const QuantizerConfig& c, float calibrated) {
  if (!c.enable || !format_has_global_amax(c.spec.format)) return std::nullopt;
  if (c.spec.amax_source == AmaxSource::kCalibrated) return calibrated;
  if (c.spec.amax_source == AmaxSource::kConstant) return c.spec.constant_amax;
  return std::nullopt;
}

// The clipped fraction above which a warning is given: held-out data exceeds a max calibration's
// amax now and then (a few elements of millions, which the clip_* columns show); one element in
// ten thousand saturating is a calibration that does not represent the data.
constexpr double kClipWarnFraction = 1e-4;

std::string pct(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g%%", 100.0 * f);
  return buf;
}

// Progress lines with the elapsed time and an estimate of what is left. The steps are of three
// kinds whose durations differ by orders of magnitude (a layer's weights for a large model take
// minutes, a batch of a recipe a fraction of a second), so each kind has its own measured time per
// step and the estimate is given once every kind still ahead has been measured. Within a layer's
// load the weights' progress (experts made) is told at most every progress_every_seconds, with
// the load's own estimate from its rate so far while the other kinds are not measured yet.
class Progress {
 public:
  enum Kind { kLoad, kCalibrate, kEval, kNumKinds };

  Progress(const Prepared& p, int64_t loads, int64_t calibrations, int64_t evals)
      : p_(p), total_{loads, calibrations, evals}, t0_(Clock::now()) {}

  void step(Kind kind, const std::string& what) {
    finish();
    current_ = kind;
    step_t0_ = last_told_ = Clock::now();
    ++steps_;
    p_.say("[" + std::to_string(steps_) + "/" + std::to_string(total_[0] + total_[1] + total_[2]) + "] " + what +
           times(estimate(0)));
  }

  // Within the current step: `done` of `total` units (e.g. experts) made.
  void within(int64_t done, int64_t total, const std::string& units) {
    if (done <= 0 || done >= total || seconds_since(last_told_) < p_.progress_every_seconds) return;
    last_told_ = Clock::now();
    const double in_step = seconds_since(step_t0_);
    const double step_left = in_step * double(total - done) / double(done);
    const std::optional<double> left = estimate(step_left);
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f s", seconds_since(t0_));
    p_.say("      " + std::to_string(done) + "/" + std::to_string(total) + " " + units + " (" + buf + ", " +
           (left ? "eta " + fmt_seconds(*left) : "this step's eta " + fmt_seconds(step_left)) + ")");
  }

 private:
  // The step under way is over: its time goes to its kind.
  void finish() {
    if (current_ == kNumKinds) return;
    seconds_[current_] += seconds_since(step_t0_);
    ++done_[current_];
  }

  // Seconds left: what the current step has left (current_left, or by its kind's rate when
  // current_left is 0), then every later step by its kind's rate; nullopt while a kind ahead has
  // not been measured.
  std::optional<double> estimate(double current_left) const {
    double left = 0;
    for (int k = 0; k < kNumKinds; ++k) {
      int64_t ahead = total_[k] - done_[k];
      if (k == current_ && current_left > 0) {
        left += current_left;
        --ahead;
      }
      if (ahead <= 0) continue;
      if (done_[k] == 0) return std::nullopt;
      left += double(ahead) * seconds_[k] / double(done_[k]);
    }
    return left;
  }

  static std::string fmt_seconds(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.0f s", s);
    return buf;
  }

  std::string times(std::optional<double> left) const {
    const double el = seconds_since(t0_);
    if (steps_ <= 1 && el < 0.05) return "";
    char buf[64];
    std::snprintf(buf, sizeof buf, " (%.1f s", el);
    return buf + (left ? ", eta " + fmt_seconds(*left) : std::string()) + ")";
  }

  const Prepared& p_;
  int64_t total_[kNumKinds];
  int64_t done_[kNumKinds] = {0, 0, 0};
  double seconds_[kNumKinds] = {0, 0, 0};
  int current_ = kNumKinds;
  int64_t steps_ = 0;
  Clock::time_point t0_, step_t0_, last_told_;
};

std::string calib_source(const EvalSetup& s) {
  return s.calibration + " calibration on " + plural(s.calib_batches, "batch") + " x " + plural(s.ranks, "rank") + " x " +
         plural(s.tokens, "token");
}

// Max calibration with both quantizers enabled (fp8, calibrated amax): no QDQ meanwhile, so the
// collected maxima hold for every recipe.
LayerCalibration calibrate_layer(LayerRunner& runner, int64_t layer) {
  QuantizerConfig on;
  on.enable = true;
  on.configured = true;  // QuantSpec{}: fp8, calibrated amax
  runner.configure({{FakeQuantMoe::dispatch_name(layer), on}, {FakeQuantMoe::combine_name(layer), on}});
  LayerCalibration c = runner.calibrate();
  c.layer = layer;
  return c;
}

bool less_rel_l2(double a, double b) {
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  return a < b;
}

void summarise(EvalResult& result) {
  const EvalSetup& s = result.setup;
  for (const std::string& name : s.recipe_names) {
    RecipeSummary sum;
    sum.recipe = name;
    int64_t n = 0;
    bool within = true;
    for (const EvalRow& r : result.rows) {
      if (r.recipe != name) continue;
      sum.mean_rel_l2 += r.metrics.rel_l2;
      sum.max_rel_l2 = n == 0 ? r.metrics.rel_l2 : std::max(sum.max_rel_l2, r.metrics.rel_l2);
      sum.min_cosine = n == 0 ? r.metrics.cosine : std::min(sum.min_cosine, r.metrics.cosine);
      sum.wire_bytes_per_token = r.dispatch_wire_bytes_per_token + r.combine_wire_bytes_per_token;
      within = within && !r.over_budget;
      ++n;
    }
    sum.mean_rel_l2 /= double(std::max<int64_t>(n, 1));
    result.summary.push_back(sum);
    if (!s.max_rel_l2 || !within) continue;
    const auto best = std::find_if(result.summary.begin(), result.summary.end(), [&](const RecipeSummary& x) {
      return result.cheapest_within_budget && x.recipe == *result.cheapest_within_budget;
    });
    if (!result.cheapest_within_budget || sum.wire_bytes_per_token < best->wire_bytes_per_token ||
        (sum.wire_bytes_per_token == best->wire_bytes_per_token && sum.mean_rel_l2 < best->mean_rel_l2))
      result.cheapest_within_budget = name;
  }
  std::stable_sort(result.summary.begin(), result.summary.end(), [](const RecipeSummary& a, const RecipeSummary& b) {
    return less_rel_l2(a.mean_rel_l2, b.mean_rel_l2);
  });
}

std::string duration(double s) {
  char buf[32];
  if (s < 90)
    std::snprintf(buf, sizeof buf, "%.0f s", s);
  else if (s < 5400)
    std::snprintf(buf, sizeof buf, "%.0f min", s / 60);
  else
    std::snprintf(buf, sizeof buf, "%.1f h", s / 3600);
  return buf;
}

// The estimate of estimate_eval_time for a prepared run; with_recipes: the evaluation's forwards.
std::optional<RunEstimate> estimate(const Prepared& p, bool calibrate, bool with_recipes) {
  if (p.device != EvalDevice::kCpu) return std::nullopt;
  const RunnerSetup& r = p.runner;
  const MoeConfig& c = r.config;
  const int num_threads = resolve_threads(r.num_threads);
  const double threads = double(num_threads);
  RunEstimate e;
  // The GEMM rate here and now: one expert of the layer's shape on 64 tokens per thread (one
  // group of rows per thread, as the engine runs them).
  const SyntheticLayer probe_layer = r.synthetic_layer(p.setup.layers.front());
  double gflops = 0, per_expert = 0;  // per_expert: making one expert's weights on one thread
  {
    const auto made = Clock::now();
    const LayerWeights probe = synthetic_layer_weights(probe_layer, c, WeightFormat::kE4m3, 0, 1, 1);
    per_expert = seconds_since(made);
    const int64_t n = 64 * int64_t(num_threads);
    const std::vector<bf16> x = synthetic_activations(probe_layer, 0, n, num_threads);
    std::vector<bf16> y(x.size());
    const PreparedExpert pe(probe.experts[0], c.hidden, c.intermediate);
    const auto t = Clock::now();
    run_expert_on_tokens(pe, r.staging, x.data(), n, y.data(), c.swiglu_clamp, num_threads);
    gflops = 6.0 * double(c.hidden) * double(c.intermediate) * double(n) / std::max(seconds_since(t), 1e-6) / 1e9;
  }
  e.layers = int64_t(p.setup.layers.size());
  const double expert_bytes = 3.0 * double(c.hidden) * double(c.intermediate);  // e4m3: a byte per weight
  const double layer_bytes =
      double(c.num_experts) * expert_bytes + (c.num_shared > 0 ? double(r.ranks * c.num_shared) * expert_bytes : 0.0);
  if (!r.checkpoint_dir.empty()) {
    e.weights_seconds = double(e.layers) * layer_bytes / kDiskBytesPerSecond;
  } else {
    // The probe's expert, made on one thread; the layer's experts spread over the threads.
    const double experts = double(c.num_experts) + (c.num_shared > 0 ? double(r.ranks * c.num_shared) : 0.0);
    const WeightCacheSettings cache = WeightCacheSettings::from_env();
    const int64_t el = c.num_experts / r.ranks;
    for (int64_t layer : p.setup.layers) {
      bool cached = cache.enabled;
      const SyntheticLayer sl = r.synthetic_layer(layer);
      for (int64_t rank = 0; cached && rank < r.ranks; ++rank)
        cached = fs::exists(weight_cache_path(cache, weight_cache_key(sl, c, WeightFormat::kE4m3, rank * el, el)));
      e.cached_layers += cached ? 1 : 0;
      e.weights_seconds += cached ? layer_bytes / kDiskBytesPerSecond : per_expert * experts / threads;
    }
  }
  // Forwards per layer: calibration batches, then per evaluation batch the reference and one engine
  // call per distinct dispatch configuration.
  int64_t dispatch_groups = 0;
  if (with_recipes) {
    std::vector<QuantSpec> seen;
    for (const auto& cfgs : p.recipe_configs)
      for (int64_t layer : p.setup.layers) {
        const auto it = cfgs.find(FakeQuantMoe::dispatch_name(layer));
        if (it == cfgs.end() || !it->second.enable) continue;
        if (std::none_of(seen.begin(), seen.end(), [&](const QuantSpec& q) { return q == it->second.spec; }))
          seen.push_back(it->second.spec);
        break;
      }
    dispatch_groups = int64_t(seen.size());
  }
  const double forwards =
      double(calibrate ? r.calib_batches : 0) + (with_recipes ? double(r.eval_batches * (1 + dispatch_groups)) : 0.0);
  const double flops = double(r.batch_tokens()) * 6.0 * double(c.hidden) * double(c.intermediate) *
                       double(c.top_k + c.num_shared);
  e.forwards_seconds = double(e.layers) * forwards * flops / (gflops * 1e9);
  return e;
}

void tell_estimate(const Prepared& p, const std::optional<RunEstimate>& e) {
  if (e && e->total() > kLongRunSeconds)
    p.say("this run on the CPU: estimate " + e->describe() + "; a GPU takes seconds (--device cuda)");
}

}  // namespace

std::string RunEstimate::describe() const {
  std::string cached = cached_layers == 0 ? "none" : cached_layers == layers ? "all" : std::to_string(cached_layers);
  return "about " + duration(total()) + " (weights " + duration(weights_seconds) + ", " + cached + " of " +
         std::to_string(layers) + (layers == 1 ? " layer" : " layers") + " in the weight cache; forwards " +
         duration(forwards_seconds) + ")";
}

std::optional<RunEstimate> estimate_eval_time(const EvalOptions& options) {
  Prepared p;
  prepare(options, true, p);
  return estimate(p, options.load_calibration.empty(), true);
}

const LayerCalibration* CalibrationState::find(int64_t layer) const {
  for (const LayerCalibration& l : layers)
    if (l.layer == layer) return &l;
  return nullptr;
}

std::vector<NamedRecipe> default_sweep() {
  std::vector<NamedRecipe> sweep;
  sweep.push_back({"none", Recipe{}});  // no entries: every quantizer disabled
  sweep.back().recipe.name = "none";
  for (const char* f : {"fp8", "nvfp4", "mxfp8", "mxfp4"})
    for (const char* side : {"dispatch", "combine", "both"}) {
      const std::string name = std::string(side) + "_" + f;
      const std::string units = std::string(side) == "both"
                                    ? std::string("moe_dispatch_") + f + ", moe_combine_" + f
                                    : std::string("moe_") + side + "_" + f;
      NamedRecipe r{name, parse_recipe_text("$import: [" + units + "]\nalgorithm: max\n", name)};
      r.recipe.name = name;
      sweep.push_back(std::move(r));
    }
  return sweep;
}

namespace {
// The peer recipes, grouped by system (the HTML report's order).
struct PeerRecipe {
  const char* peer;
  const char* name;
};
constexpr PeerRecipe kPeerRecipes[] = {
    {"DeepEP", "deepep_ll_fp8"},
    {"DeepEP", "deepep_ll_fp8_ue8m0"},
    {"DeepEP", "deepep_ll_logfmt10"},
    {"DeepGEMM", "deepgemm_fp8_dispatch"},
    {"SGLang DeepGEMM fork", "sglang_deepgemm_fp8_combine"},
    {"MoRI", "mori_fp8_direct"},
    {"MoRI", "mori_fp8_direct_sat"},
    {"MoRI", "mori_fp8_blockwise"},
    {"MoRI", "mori_fp4_blockwise"},
    {"vLLM", "vllm_fp8_dispatch"},
    {"FlashInfer", "flashinfer_mxfp8_combine"},
    {"FlashInfer", "flashinfer_fp4_combine"},
};
}  // namespace

std::vector<NamedRecipe> peers_sweep(std::optional<CombineWeighting> only) {
  std::vector<NamedRecipe> sweep{default_sweep().front()};  // none
  for (const PeerRecipe& p : kPeerRecipes) {
    NamedRecipe r{p.name, load_recipe(std::string("configs/ptq/presets/peers/") + p.name)};
    r.recipe.name = p.name;
    if (!only || r.recipe.combine_weighting.value_or(CombineWeighting::kBefore) == *only) sweep.push_back(std::move(r));
  }
  return sweep;
}

std::string peer_of(const std::string& recipe) {
  for (const PeerRecipe& p : kPeerRecipes)
    if (recipe == p.name) return p.peer;
  return "";
}

std::vector<int64_t> parse_layers(const std::string& text) {
  const auto number = [&](const std::string& part) -> int64_t {
    MOEFQ_CHECK(!part.empty() && part.size() <= 9 &&
                    std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; }),
                "--layers '", text, "': '", part, "' is not a layer index (expected e.g. 4, 3-10 or 3,5,7; indices >= 0)");
    return std::stoll(part);
  };
  std::set<int64_t> layers;
  std::stringstream in(text);
  std::string item;
  MOEFQ_CHECK(!text.empty(), "--layers: empty (expected e.g. 4, 3-10 or 3,5,7)");
  MOEFQ_CHECK(text.back() != ',', "--layers '", text, "': trailing comma");
  while (std::getline(in, item, ',')) {
    const size_t dash = item.find('-');
    if (dash == std::string::npos) {
      layers.insert(number(item));
      continue;
    }
    const int64_t a = number(item.substr(0, dash)), b = number(item.substr(dash + 1));
    MOEFQ_CHECK(a <= b, "--layers '", text, "': the range ", item, " is empty (the first layer is greater)");
    MOEFQ_CHECK(b - a < 4096, "--layers '", text, "': the range ", item, " is too long");
    for (int64_t l = a; l <= b; ++l) layers.insert(l);
  }
  return {layers.begin(), layers.end()};
}

MemoryPlan plan_eval_memory(const EvalOptions& options) {
  Prepared p;
  prepare(options, false, p);
  p.runner.eval_batches = options.eval_batches;
  return plan_run_memory(p.runner, p.device);
}

CalibrationState run_calibration(const EvalOptions& options, EvalSetup* setup) {
  Prepared p;
  prepare(options, false, p);
  const MemoryPlan plan = check_memory(p, "moefq calibrate");
  p.runner.prefetch = plan.streaming;
  tell_estimate(p, estimate(p, true, false));
  const std::unique_ptr<LayerRunner> runner = make_layer_runner(p.device, p.runner);
  CalibrationState state;
  state.source = calib_source(p.setup);
  const int64_t num_layers = int64_t(p.setup.layers.size());
  Progress progress(p, num_layers, num_layers, 0);
  runner->on_weights = [&](int64_t done, int64_t total) { progress.within(done, total, "experts' weights"); };
  for (size_t li = 0; li < p.setup.layers.size(); ++li) {
    const int64_t layer = p.setup.layers[li];
    progress.step(Progress::kLoad, "layer " + std::to_string(layer) + ": " +
                                       (p.runner.checkpoint_dir.empty() ? "generating" : "loading") + " weights and " +
                                       plural(p.runner.num_tokens(), "token") + " of activations");
    runner->load(layer, true);
    if (li + 1 < p.setup.layers.size()) runner->prefetch(p.setup.layers[li + 1]);
    progress.step(Progress::kCalibrate,
                  "layer " + std::to_string(layer) + ": calibrating on " + plural(p.setup.calib_batches, "batch"));
    state.layers.push_back(calibrate_layer(*runner, layer));
    if (!options.calibration.empty() && options.calibration.front().kind != CalibrationMethod::Kind::kMax) {
      // A percentile: the amax from the histograms (the ranks' own maxima no longer bound it).
      LayerCalibration& c = state.layers.back();
      const CalibrationMethod& m = options.calibration.front();
      c.dispatch_amax = derive_amax(*c.dispatch_hist, m, Format::kFp8, "layer dispatch").amax;
      c.combine_amax = derive_amax(*c.combine_hist, m, Format::kFp8, "layer combine").amax;
      state.algorithm = m.name();
    }
  }
  if (setup) *setup = p.setup;
  return state;
}

namespace {

// Recipe i's configuration of quantizer q (a disabled one when the recipe leaves it alone).
QuantizerConfig config_of(const Prepared& p, size_t i, const std::string& q) {
  const auto it = p.recipe_configs[i].find(q);
  return it == p.recipe_configs[i].end() ? QuantizerConfig{} : it->second;
}

// The calibrated amax of one (quantizer, method, format) (which 0: dispatch, 1: combine), derived
// once per layer from the one calibration and kept in cal.derived; nullopt where q takes none.
std::optional<float> derived_amax(LayerCalibration& cal, int which, const std::optional<CalibrationMethod>& m,
                                  const QuantizerConfig& q, const std::string& L) {
  const float max = which == 0 ? cal.dispatch_amax : cal.combine_amax;
  if (!m || !q.enable || !format_has_global_amax(q.spec.format) || q.spec.amax_source != AmaxSource::kCalibrated)
    return std::nullopt;
  const AbsHistogram* h = which == 0 ? cal.dispatch_hist.get() : cal.combine_hist.get();
  if (!h) return max;  // max calibration without statistics (or a loaded file)
  const std::string quantizer = which == 0 ? "dispatch" : "combine", format = format_name(q.spec.format);
  for (const DerivedCalibration& d : cal.derived)
    if (d.quantizer == quantizer && d.method == m->name() && d.format == format) return d.amax.amax;
  const Nvfp4Blocks* blocks = which == 0 ? cal.dispatch_nvfp4.get() : cal.combine_nvfp4.get();
  DerivedCalibration d{quantizer, m->name(), format, derive_amax(*h, *m, q.spec.format, L + " " + quantizer, blocks)};
  if (m->kind == CalibrationMethod::Kind::kMax) d.amax.amax = max;  // the running max (bf16 data: the same)
  cal.derived.push_back(d);
  return d.amax.amax;
}

// One layer's steps: every recipe's calibrated amax, and the recipes in the order they run.
struct StepPlan {
  std::vector<size_t> order;  // [step] -> recipe
  std::vector<RecipeStep> steps;
  std::vector<std::optional<float>> dispatch_amax, combine_amax;  // [recipe]
};

// The recipes in the order they run: those that leave dispatch unquantized first (they reuse the
// reference's engine call), then the others grouped by their dispatch configuration, the engine
// once per group.
StepPlan plan_steps(const Prepared& p, int64_t layer, LayerCalibration& cal, const std::string& L) {
  const size_t num_recipes = p.recipes.size();
  const std::string dname = FakeQuantMoe::dispatch_name(layer), cname = FakeQuantMoe::combine_name(layer);
  StepPlan plan;
  plan.dispatch_amax.resize(num_recipes);
  plan.combine_amax.resize(num_recipes);
  for (size_t i = 0; i < num_recipes; ++i) {
    plan.dispatch_amax[i] = derived_amax(cal, 0, p.methods[i], config_of(p, i, dname), L);
    plan.combine_amax[i] = derived_amax(cal, 1, p.methods[i], config_of(p, i, cname), L);
  }
  std::vector<size_t>& order = plan.order;
  const auto add = [&](size_t i, bool with_engine) {
    order.push_back(i);
    plan.steps.push_back(RecipeStep{p.recipes[i].name, p.recipe_configs[i], with_engine, plan.dispatch_amax[i],
                                    plan.combine_amax[i]});
  };
  for (size_t i = 0; i < num_recipes; ++i)
    if (!config_of(p, i, dname).enable) add(i, false);
  for (size_t i = 0; i < num_recipes; ++i) {
    const QuantizerConfig d = config_of(p, i, dname);
    if (!d.enable || std::find(order.begin(), order.end(), i) != order.end()) continue;
    for (size_t j = i; j < num_recipes; ++j) {
      const QuantizerConfig dj = config_of(p, j, dname);
      if (!dj.enable || !(dj.spec == d.spec) || plan.dispatch_amax[j] != plan.dispatch_amax[i] ||
          std::find(order.begin(), order.end(), j) != order.end())
        continue;
      add(j, j == i);
    }
  }
  return plan;
}

// What the rows of a layer are made from, beside the run.
struct LayerPass {
  int64_t layer = 0;
  std::string L;  // "layer 3"
  const LayerCalibration* cal = nullptr;
  const StepPlan* plan = nullptr;
  const EvalPassStats* pass = nullptr;
  const LayerRunner* runner = nullptr;
  bool loaded = false;                 // the amax came from a calibration file
  std::string loaded_calibration;      // the setup's calibration name when loaded and not max
};

// Recipe i's row from its step's statistics: the metrics, token shape, outlier-free error, the
// clipped fractions, wire bytes and transfer times.
EvalRow make_row(const Prepared& p, const LayerPass& lp, size_t i, const RecipeStats& st,
                 const std::vector<bool>& outliers, int64_t num_outliers) {
  const EvalSetup& s = p.setup;
  const int64_t H = s.config.hidden, R = s.ranks;
  const LayerCalibration& cal = *lp.cal;
  EvalRow row;
  row.layer = lp.layer;
  row.recipe = p.recipes[i].name;
  const QuantizerConfig d = config_of(p, i, FakeQuantMoe::dispatch_name(lp.layer)),
                        c = config_of(p, i, FakeQuantMoe::combine_name(lp.layer));
  const auto clipped = [&](int which) {
    uint64_t clip = 0, total = 0;
    for (int64_t r = 0; r < R; ++r) {
      clip += st.clips[size_t(which * R + r)].clipped;
      total += st.clips[size_t(which * R + r)].total;
    }
    return total ? double(clip) / double(total) : 0.0;
  };
  // A loaded file's amax is of the method that made it.
  if (p.methods[i]) row.calibration = !lp.loaded_calibration.empty() ? lp.loaded_calibration : p.methods[i]->name();
  if (d.enable) {
    row.dispatch_format = format_name(d.spec.format);
    row.dispatch_amax = global_amax(d, lp.plan->dispatch_amax[i].value_or(cal.dispatch_amax));
    if (row.dispatch_amax) row.dispatch_clipped_fraction = clipped(0);
  }
  if (c.enable) {
    row.combine_format = format_name(c.spec.format);
    row.combine_amax = global_amax(c, lp.plan->combine_amax[i].value_or(cal.combine_amax));
    if (row.combine_amax) row.combine_clipped_fraction = clipped(1);
    for (int64_t r = 0; r < R; ++r)
      MOEFQ_ASSERT(lp.runner->layout_checked(r), lp.L, ": the combine quantizer of rank ", r,
                   " ran without a layout check");
  }
  row.layout_check = c.enable ? "pass" : "n/a";
  MetricSums all;
  for (const MetricSums& tk : st.tokens) all.merge(tk);
  row.metrics = finalize_metrics(all);
  const TokenShape shape = token_shape(st.tokens);
  row.rel_l2_token_p50 = shape.p50;
  row.rel_l2_token_p99 = shape.p99;
  row.rel_l2_token_max = shape.max;
  // The error outside the outlier channels, from the per-channel sums. Without outlier channels
  // it is rel_l2 itself, exactly (the per-channel sums would give it in another order).
  row.num_outlier_channels = num_outliers;
  row.rel_l2_non_outlier = row.metrics.rel_l2;
  if (num_outliers > 0 && !std::isnan(row.metrics.rel_l2)) {
    double err2 = 0, ref2 = 0;
    for (int64_t h = 0; h < H; ++h)
      if (!outliers[size_t(h)]) {
        err2 += st.channel_err2[size_t(h)];
        ref2 += lp.pass->reference_channels[size_t(h)];
      }
    row.rel_l2_non_outlier = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
  }
  row.dispatch_wire_bytes_per_token = wire_bytes_per_row(d.enable ? std::optional<Format>(d.spec.format) : std::nullopt, H);
  row.combine_wire_bytes_per_token = wire_bytes_per_row(c.enable ? std::optional<Format>(c.spec.format) : std::nullopt, H);
  // logfmt10 sends the groups it cannot cast as bf16: its bytes at the cast fraction measured on
  // the calibration data (where it was collected).
  if (d.enable && d.spec.format == Format::kLogfmt10 && cal.dispatch_logfmt.total) {
    row.dispatch_cast_fraction = cal.dispatch_logfmt.fraction();
    row.dispatch_wire_bytes_per_token = logfmt10_bytes_per_row(H, *row.dispatch_cast_fraction);
  }
  if (c.enable && c.spec.format == Format::kLogfmt10 && cal.combine_logfmt.total) {
    row.combine_cast_fraction = cal.combine_logfmt.fraction();
    row.combine_wire_bytes_per_token = logfmt10_bytes_per_row(H, *row.combine_cast_fraction);
  }
  row.wire_saving = 1.0 - (row.dispatch_wire_bytes_per_token + row.combine_wire_bytes_per_token) / (4.0 * double(H));
  const int64_t K = s.config.top_k;
  row.dispatch_us = transfer_us(p.link, row.dispatch_wire_bytes_per_token, s.tokens, R, K);
  row.combine_us = transfer_us(p.link, row.combine_wire_bytes_per_token, s.tokens, R, K);
  row.saved_us = 2.0 * transfer_us(p.link, 2.0 * double(H), s.tokens, R, K) - row.dispatch_us - row.combine_us;
  row.over_budget = s.max_rel_l2 && !(row.metrics.rel_l2 <= *s.max_rel_l2);
  return row;
}

// One warning per layer and quantizer that clipped: the largest fraction and its recipes, each
// with where its amax came from. Methods that clip by design (percentile, mse) are left out.
// rows: [recipe], in the recipes' order.
void warn_clipping(const Prepared& p, const LayerPass& lp, const std::vector<EvalRow>& rows,
                   const std::string& load_path, std::vector<std::string>& warnings) {
  for (int which = 0; which < 2; ++which) {
    double worst = 0;
    std::string names;
    bool calibrated = false, constant = false;
    for (size_t i = 0; i < rows.size(); ++i) {
      const EvalRow& r = rows[i];
      const auto& f = which == 0 ? r.dispatch_clipped_fraction : r.combine_clipped_fraction;
      if (!f || *f <= kClipWarnFraction) continue;
      const QuantizerConfig q =
          config_of(p, i, which == 0 ? FakeQuantMoe::dispatch_name(lp.layer) : FakeQuantMoe::combine_name(lp.layer));
      std::string source;
      if (q.spec.amax_source == AmaxSource::kConstant) {
        source = "constant amax " + std::to_string(q.spec.constant_amax);
        source.erase(source.find_last_not_of('0') + 1);
        if (source.back() == '.') source.pop_back();
        constant = true;
      } else {
        if (p.methods[i] && p.methods[i]->kind != CalibrationMethod::Kind::kMax) continue;
        source = lp.loaded ? "amax loaded from " + load_path : "max-calibrated amax";
        calibrated = true;
      }
      worst = std::max(worst, *f);
      names += (names.empty() ? "" : ", ") + r.recipe + ": " + source;
    }
    if (worst > kClipWarnFraction)
      warnings.push_back(lp.L + ": up to " + pct(worst) + " of the " + (which == 0 ? "dispatch" : "combine") +
                         " elements lie beyond their amax and saturate (" + names + "); " +
                         (calibrated ? "calibrate on more data, or on data more like the evaluation's" : "") +
                         (calibrated && constant ? "; " : "") + (constant ? "raise the recipe's constant_amax" : ""));
  }
}

EvalResult run_eval_once(const EvalOptions& options) {
  const auto t0 = Clock::now();
  Prepared p;
  prepare(options, true, p);
  const EvalSetup& s = p.setup;
  EvalResult result;
  result.setup = s;
  result.memory = check_memory(p, "moefq eval");
  result.warnings = p.notes;
  tell_estimate(p, estimate(p, options.load_calibration.empty(), true));
  p.runner.prefetch = result.memory.streaming;
  const bool loaded = !options.load_calibration.empty();
  if (loaded) {
    result.calibration = load_eval_calibration(options.load_calibration, s, &result.warnings);
    if (result.calibration.algorithm != "max") result.setup.calibration = result.calibration.algorithm + " (loaded)";
  } else {
    result.calibration.source = calib_source(s);
  }
  const std::unique_ptr<LayerRunner> runner = make_layer_runner(p.device, p.runner);
  const size_t num_recipes = p.recipes.size();
  const int64_t num_layers = int64_t(s.layers.size());
  Progress progress(p, num_layers, loaded ? 0 : num_layers,
                    num_layers * int64_t(s.eval_batches) * int64_t(num_recipes + 1));
  runner->on_weights = [&](int64_t done, int64_t total) { progress.within(done, total, "experts' weights"); };
  for (size_t li = 0; li < s.layers.size(); ++li) {
    const int64_t layer = s.layers[li];
    const std::string L = "layer " + std::to_string(layer);
    StageTimes times;
    times.layer = layer;
    auto t = Clock::now();
    progress.step(Progress::kLoad, L + ": " + (p.runner.checkpoint_dir.empty() ? "generating" : "loading") +
                                       " weights and " + plural(p.runner.num_tokens(), "token") + " of activations");
    runner->load(layer, !loaded);
    if (li + 1 < s.layers.size()) runner->prefetch(s.layers[li + 1]);
    // Configuration errors of any recipe (a dynamic combine amax, ...) before the first forward.
    for (const auto& cfgs : p.recipe_configs) runner->configure(cfgs);
    times.load = seconds_since(t);
    if (!loaded) {
      t = Clock::now();
      progress.step(Progress::kCalibrate, L + ": calibrating on " + plural(s.calib_batches, "batch") +
                                              " (once for all recipes)");
      result.calibration.layers.push_back(calibrate_layer(*runner, layer));
      times.calibrate = seconds_since(t);
    }
    LayerCalibration& cal = *std::find_if(result.calibration.layers.begin(), result.calibration.layers.end(),
                                          [&](const LayerCalibration& c) { return c.layer == layer; });
    const StepPlan plan = plan_steps(p, layer, cal, L);
    const EvalPassStats pass = runner->evaluate(plan.steps, cal.dispatch_amax, cal.combine_amax,
                                                [&](const std::string& what) { progress.step(Progress::kEval, L + " " + what); });
    times.reference = pass.reference_seconds;
    times.recipes = pass.recipes_seconds;
    t = Clock::now();
    const std::vector<bool> outliers = outlier_channels(pass.reference_channels);
    const int64_t num_outliers = int64_t(std::count(outliers.begin(), outliers.end(), true));
    LayerPass lp{layer, L, &cal, &plan, &pass, runner.get(), loaded,
                 loaded && result.calibration.algorithm != "max" ? result.setup.calibration : std::string()};
    std::vector<EvalRow> rows(num_recipes);
    bool zero_reference = false;  // the reference output compared against was all zero
    for (size_t k = 0; k < plan.order.size(); ++k) {
      const size_t i = plan.order[k];
      rows[i] = make_row(p, lp, i, pass.steps[k], outliers, num_outliers);
      MetricSums all;
      for (const MetricSums& tk : pass.steps[k].tokens) all.merge(tk);
      zero_reference = zero_reference || (all.count > 0 && all.ref2 == 0);
    }
    times.metrics = pass.metrics_seconds + seconds_since(t);
    warn_clipping(p, lp, rows, options.load_calibration, result.warnings);
    // All-zero weights or block scales make every recipe look perfect (rel_l2 0, cosine 1).
    if (zero_reference)
      result.warnings.push_back(L + ": the reference output is all zero (all-zero weights or block scales?), so every "
                                    "recipe's error is 0 and says nothing about it; check the checkpoint");
    std::stable_sort(rows.begin(), rows.end(), [](const EvalRow& a, const EvalRow& b) {
      return less_rel_l2(a.metrics.rel_l2, b.metrics.rel_l2);
    });
    result.rows.insert(result.rows.end(), rows.begin(), rows.end());
    times.total = times.load + times.calibrate + times.reference + times.recipes + times.metrics;
    result.stage_times.push_back(times);
  }
  summarise(result);
  result.wall_seconds = seconds_since(t0);
  return result;
}
}  // namespace

EvalResult run_eval(const EvalOptions& options) {
  if (options.sweep != "peers" || options.combine_weighting || !options.recipes.empty()) return run_eval_once(options);
  // The peers apply the router weight in different places (DeepEP at the receiver, the others in
  // the expert), and one run evaluates one weighting: a run per weighting, the rows merged.
  EvalResult merged;
  for (const CombineWeighting w : {CombineWeighting::kBefore, CombineWeighting::kAfter}) {
    EvalOptions o = options;
    o.combine_weighting = w;
    EvalResult r = run_eval_once(o);
    if (w == CombineWeighting::kBefore) {
      merged = std::move(r);
      continue;
    }
    for (const EvalRow& row : r.rows)
      if (row.recipe != "none") merged.rows.push_back(row);  // the baseline is the same in both
    for (const std::string& n : r.setup.recipe_names)
      if (n != "none") merged.setup.recipe_names.push_back(n);
    merged.stage_times.insert(merged.stage_times.end(), r.stage_times.begin(), r.stage_times.end());
    merged.warnings.insert(merged.warnings.end(), r.warnings.begin(), r.warnings.end());
    merged.wall_seconds += r.wall_seconds;
  }
  merged.warnings.push_back(
      "--sweep peers: the recipes with combine_weighting after (DeepEP's) ran in a second pass of each layer, "
      "with unweighted combine rows; the header's weighting and calibration are the first pass's (before)");
  const std::vector<int64_t>& layers = merged.setup.layers;
  const auto layer_index = [&](int64_t l) { return std::find(layers.begin(), layers.end(), l) - layers.begin(); };
  std::stable_sort(merged.rows.begin(), merged.rows.end(), [&](const EvalRow& a, const EvalRow& b) {
    if (a.layer != b.layer) return layer_index(a.layer) < layer_index(b.layer);
    return less_rel_l2(a.metrics.rel_l2, b.metrics.rel_l2);
  });
  merged.summary.clear();
  merged.cheapest_within_budget.reset();
  summarise(merged);
  return merged;
}

}  // namespace moefq
