// The evaluation pipeline of `moefq eval` / `moefq calibrate` (include/moefq/eval.h).
//
// Per layer: the weights of every rank, one expert back-end with the shared expert UNFUSED (the
// dispatch quantizer is a configuration error with a fused shared expert; the model adds the
// shared expert, computed on the unquantized x, to the routed output), the layer's activations
// cut into batches of ranks x tokens (calibration batches first, then the held-out evaluation
// batches), routed by the layer's own router. Max calibration runs once per layer with both
// quantizers enabled (it applies no QDQ, so its amax is the same for every recipe) and its amax is
// loaded into each recipe's quantizers. The unquantized reference of each evaluation batch is
// computed once and shared by every recipe.
#include "moefq/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "moefq/errors.h"
#include "moefq/expert_backend.h"
#include "moefq/fake_quant_moe.h"
#include "moefq/fileio.h"
#include "moefq/quantizer.h"
#include "moefq/router.h"
#include "moefq/safetensors.h"
#include "moefq/synthetic.h"
#include "moefq/weights.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int kCalibrationFileVersion = 1;
constexpr const char* kCalibrationFileKind = "moefq eval calibration";

// Seeds of layer i's synthetic weights and activations: distinct per layer, fixed per (seed, i).
uint64_t layer_seed(uint64_t seed, int64_t layer, uint64_t stream) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * uint64_t(layer + 1) + 0xBF58476D1CE4E5B9ull * stream;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::string hex32(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", u);
  return buf;
}

// The resolved options: model, layers, recipes, the activations file.
struct Prepared {
  EvalSetup setup;
  std::vector<NamedRecipe> recipes;
  std::vector<std::map<std::string, QuantizerConfig>> recipe_configs;  // [recipe], over all layers
  std::optional<SafetensorsFile> acts;
  std::map<int64_t, std::string> act_tensor;  // layer -> tensor name in acts
  std::string checkpoint_dir;
  int num_threads = 0;
  std::function<void(const std::string&)> progress;
  int64_t num_tokens() const { return int64_t(setup.calib_batches + setup.eval_batches) * setup.ranks * setup.tokens; }
  void say(const std::string& line) const {
    if (progress) progress(line);
  }
};

std::string plural(int64_t n, const std::string& what) {
  if (n == 1) return "1 " + what;
  return std::to_string(n) + " " + what + (what.back() == 'h' ? "es" : "s");
}

Prepared prepare(const EvalOptions& o, bool with_recipes) {
  Prepared p;
  EvalSetup& s = p.setup;
  // The model.
  MOEFQ_CHECK(o.config_path.empty() || o.checkpoint_dir.empty(),
              "--config and --checkpoint cannot be used together (a checkpoint brings its own config.json)");
  MOEFQ_CHECK(!o.preset_given || (o.config_path.empty() && o.checkpoint_dir.empty()), "--preset and ",
              o.config_path.empty() ? "--checkpoint" : "--config",
              " cannot be used together: the model comes from exactly one of them");
  if (!o.checkpoint_dir.empty()) {
    MOEFQ_CHECK(fs::is_directory(o.checkpoint_dir), "--checkpoint ", o.checkpoint_dir, ": not a directory");
    const std::string cj = (fs::path(o.checkpoint_dir) / "config.json").string();
    MOEFQ_CHECK(fs::is_regular_file(cj), "--checkpoint ", o.checkpoint_dir, ": no config.json in the directory");
    s.config = load_hf_config(cj);
    s.model_source = "checkpoint " + o.checkpoint_dir;
    s.weights_source = "checkpoint " + o.checkpoint_dir;
    p.checkpoint_dir = o.checkpoint_dir;
  } else if (!o.config_path.empty()) {
    MOEFQ_CHECK(fs::is_regular_file(o.config_path), "--config ", o.config_path, ": no such file");
    s.config = load_hf_config(o.config_path);
    s.model_source = "config " + o.config_path;
  } else {
    s.config = preset(o.preset);
    s.model_source = "preset " + o.preset;
  }
  s.config.validate();
  if (p.checkpoint_dir.empty())
    s.weights_source = "synthetic e4m3 (seed " + std::to_string(o.seed) + ")";

  // Sizes.
  MOEFQ_CHECK(o.ranks >= 1, "--ranks must be >= 1, got ", o.ranks);
  MOEFQ_CHECK(s.config.num_experts % o.ranks == 0, "--ranks ", o.ranks, " must divide the ",
              s.config.num_experts, " routed experts of ", s.config.name);
  MOEFQ_CHECK(o.tokens >= 1, "--tokens must be >= 1, got ", o.tokens);
  MOEFQ_CHECK(o.calib_batches >= 1, "--calib-batches must be >= 1, got ", o.calib_batches);
  MOEFQ_CHECK(o.eval_batches >= 1, "--eval-batches must be >= 1, got ", o.eval_batches);
  MOEFQ_CHECK(o.num_threads >= 0, "--threads must be >= 0");
  s.ranks = o.ranks;
  s.tokens = o.tokens;
  s.calib_batches = o.calib_batches;
  s.eval_batches = with_recipes ? o.eval_batches : 0;  // calibration needs only the first batches
  s.seed = o.seed;
  s.backend_kind = o.backend_kind;
  s.device = o.device;
  s.version = MOEFQ_VERSION;
  p.num_threads = o.num_threads;
  p.progress = o.progress;
  const auto kinds = expert_backend_kinds();
  if (std::find(kinds.begin(), kinds.end(), o.backend_kind) == kinds.end()) {
    std::string names;
    for (const auto& k : kinds) names += (names.empty() ? "" : ", ") + k;
    MOEFQ_FAIL(ErrorKind::kBadInput, "--device: the expert back-end '", o.backend_kind,
               "' is not available in this build (registered: ", names, ")");
  }

  // Layers.
  s.layers = o.layers;
  if (s.layers.empty()) {
    MOEFQ_CHECK(p.checkpoint_dir.empty(), "--checkpoint needs --layers (e.g. --layers 3-10): which of the "
                "checkpoint's layers are MoE layers depends on the model");
    s.layers = {0};
  }
  for (int64_t l : s.layers) MOEFQ_CHECK(l >= 0, "--layers: layer ", l, " must be >= 0");

  // Activations: one [tokens, H] tensor per layer ("layers.{i}"), else "hidden_states".
  if (!o.activations_path.empty()) {
    p.acts.emplace(SafetensorsFile::open(o.activations_path));
    const int64_t need = p.num_tokens();
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
        MOEFQ_FAIL(ErrorKind::kBadInput, "--activations ", o.activations_path, ": no tensor '", per_layer,
                   "' (layer ", l, ") and no 'hidden_states' tensor (the file has: ",
                   have.empty() ? "no tensors" : have, ")");
      }
      MOEFQ_CHECK(t->dtype == StDtype::kBF16 || t->dtype == StDtype::kF32, "--activations ", o.activations_path,
                  ": tensor '", name, "' is ", st_dtype_name(t->dtype), "; expected BF16 or F32");
      MOEFQ_CHECK(t->shape.size() == 2 && t->shape[1] == s.config.hidden, "--activations ", o.activations_path,
                  ": tensor '", name, "' must be [tokens, ", s.config.hidden, "] (the hidden size of ",
                  s.config.name, ")");
      MOEFQ_CHECK(t->shape[0] >= need, "--activations ", o.activations_path, ": tensor '", name, "' has ",
                  t->shape[0], " tokens, but ", need, " are needed ((", s.calib_batches, " calibration + ",
                  s.eval_batches, " evaluation batches) x ", s.ranks, " ranks x ", s.tokens,
                  " tokens); lower --tokens, --ranks or the batch counts");
      p.act_tensor[l] = name;
    }
    s.activations_source = o.activations_path;
  } else {
    s.activations_source = "synthetic, heavy-tailed with outlier channels (seed " + std::to_string(o.seed) + ")";
  }

  // Recipes, resolved against the quantizers of every evaluated layer (so a recipe may name one
  // layer's quantizer).
  if (with_recipes) {
    if (o.recipes.empty()) {
      p.recipes = default_sweep();
    } else {
      std::set<std::string> names;
      for (const std::string& r : o.recipes) {
        NamedRecipe nr{"", load_recipe(r)};
        nr.name = nr.recipe.name;
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
    for (const NamedRecipe& r : p.recipes) {
      p.recipe_configs.push_back(apply_recipe(r.recipe, qnames));
      s.recipe_names.push_back(r.name);
    }
  }
  return p;
}

// One evaluation or calibration batch: every rank's tokens (pointing into the layer's
// activations), routing and output.
struct Batch {
  std::vector<const bf16*> x;           // [R] -> [T, H]
  std::vector<Routing> routing;         // [R]
  std::vector<std::vector<bf16>> y;     // [R][T * H]
  std::vector<std::vector<bf16>> shared;  // [R][T * H] the separately run shared expert (eval only)
  std::vector<RankBatch> views() {
    std::vector<RankBatch> b;
    for (size_t r = 0; r < x.size(); ++r)
      b.push_back({x[r], routing[r].num_tokens, routing[r].topk_idx.data(), routing[r].topk_weights.data(),
                   y[r].data()});
    return b;
  }
};

// Everything one layer needs: the fake-quantized layer and its batches.
struct LayerRun {
  int64_t layer = 0;
  std::vector<bf16> acts;  // [num_tokens, H]
  std::unique_ptr<FakeQuantMoe> fq;
  std::vector<Batch> calib, eval;
};

std::vector<bf16> layer_activations(const Prepared& p, int64_t layer) {
  const int64_t n = p.num_tokens(), H = p.setup.config.hidden;
  std::vector<bf16> out(size_t(n * H));
  if (!p.acts) {
    const std::vector<float> x = synthetic_activations(n, H, layer_seed(p.setup.seed, layer, 1));
    for (size_t i = 0; i < out.size(); ++i) out[i].bits = bf16_round(x[i]);
    return out;
  }
  const TensorInfo& t = *p.acts->find(p.act_tensor.at(layer));
  const auto bytes = p.acts->bytes(t);
  if (t.dtype == StDtype::kBF16) {
    std::memcpy(out.data(), bytes.data(), out.size() * 2);
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      float v;
      std::memcpy(&v, bytes.data() + i * 4, 4);
      out[i].bits = bf16_round(v);
    }
  }
  return out;
}

LayerRun build_layer(const Prepared& p, int64_t layer, bool need_calib) {
  const EvalSetup& s = p.setup;
  const MoeConfig& cfg = s.config;
  const int64_t R = s.ranks, T = s.tokens, H = cfg.hidden, el = cfg.num_experts / R;
  LayerRun run;
  run.layer = layer;
  p.say("layer " + std::to_string(layer) + ": " + (p.checkpoint_dir.empty() ? "generating" : "loading") +
        " weights of " + plural(R, "rank") + ", " + plural(p.num_tokens(), "token") + " of activations");
  std::vector<LayerWeights> w;
  for (int64_t r = 0; r < R; ++r)
    w.push_back(p.checkpoint_dir.empty()
                    ? synthetic_weights(cfg, WeightFormat::kE4m3, layer_seed(s.seed, layer, 0), r * el, el)
                    : load_deepseek_layer(p.checkpoint_dir, layer, cfg, r * el, el));
  run.acts = layer_activations(p, layer);
  // The shared expert runs unfused, as the model does, so dispatch quantization is allowed.
  EngineOptions eo;
  eo.fuse_shared = false;
  eo.num_threads = p.num_threads;
  run.fq = std::make_unique<FakeQuantMoe>(make_expert_backend(s.backend_kind, cfg, R, T, w, eo), layer);
  const auto make_batch = [&](int64_t b) {
    Batch batch;
    for (int64_t r = 0; r < R; ++r) {
      const bf16* x = run.acts.data() + (b * R + r) * T * H;
      batch.x.push_back(x);
      batch.routing.push_back(route(cfg, x, T, w[0].gate, w[0].gate_bias, {}, p.num_threads));
      batch.y.emplace_back(size_t(T * H));
    }
    return batch;
  };
  if (need_calib)
    for (int64_t b = 0; b < s.calib_batches; ++b) run.calib.push_back(make_batch(b));
  for (int64_t b = 0; b < s.eval_batches; ++b) run.eval.push_back(make_batch(s.calib_batches + b));
  return run;
}

// Max calibration with both quantizers enabled (fp8, calibrated amax): no QDQ meanwhile, so the
// collected maxima hold for every recipe.
LayerCalibration calibrate_layer(LayerRun& run, const EvalSetup& s) {
  FakeQuantMoe& fq = *run.fq;
  QuantizerConfig on;
  on.enable = true;
  on.configured = true;  // QuantSpec{}: fp8, calibrated amax
  fq.configure({{FakeQuantMoe::dispatch_name(run.layer), on}, {FakeQuantMoe::combine_name(run.layer), on}});
  fq.start_calibration();
  for (Batch& b : run.calib) fq.forward(b.views());
  LayerCalibration c;
  c.layer = run.layer;
  for (int64_t r = 0; r < s.ranks; ++r) {
    c.dispatch_rank_amax.push_back(fq.dispatch_quantizer(r).collected_max());
    c.combine_rank_amax.push_back(fq.combine_quantizer(r).collected_max());
  }
  fq.finish_calibration();  // MAX over the ranks; errors name the quantizer when nothing was seen
  c.dispatch_amax = *fq.dispatch_quantizer(0).amax();
  c.combine_amax = *fq.combine_quantizer(0).amax();
  return c;
}

// out[((b * R + r) * T + t) * H + h] = bf16(routed + shared), as the model adds them.
void layer_output(const Batch& b, int64_t T, int64_t H, float* out) {
  for (size_t r = 0; r < b.y.size(); ++r) {
    float* o = out + r * size_t(T * H);
    const auto& y = b.y[r];
    if (b.shared.empty() || b.shared[r].empty()) {
      for (size_t i = 0; i < y.size(); ++i) o[i] = to_f32(y[i]);
    } else {
      const auto& sh = b.shared[r];
      for (size_t i = 0; i < y.size(); ++i) o[i] = bf16_to_f32(bf16_round(add_rn(to_f32(y[i]), to_f32(sh[i]))));
    }
  }
}

std::vector<float> run_eval_batches(LayerRun& run, const EvalSetup& s) {
  const int64_t T = s.tokens, H = s.config.hidden, per_batch = s.ranks * T * H;
  std::vector<float> out(size_t(per_batch) * run.eval.size());
  for (size_t i = 0; i < run.eval.size(); ++i) {
    run.fq->forward(run.eval[i].views());
    layer_output(run.eval[i], T, H, out.data() + i * size_t(per_batch));
  }
  return out;
}

bool less_rel_l2(double a, double b) {
  if (std::isnan(a)) return false;
  if (std::isnan(b)) return true;
  return a < b;
}

std::string calib_source(const EvalSetup& s) {
  return "max calibration on " + plural(s.calib_batches, "batch") + " x " + plural(s.ranks, "rank") + " x " +
         plural(s.tokens, "token");
}

CalibrationState calibrate_all(const Prepared& p) {
  CalibrationState state;
  state.source = calib_source(p.setup);
  for (int64_t layer : p.setup.layers) {
    LayerRun run = build_layer(p, layer, true);
    p.say("layer " + std::to_string(layer) + ": calibrating on " + plural(p.setup.calib_batches, "batch"));
    state.layers.push_back(calibrate_layer(run, p.setup));
  }
  return state;
}

}  // namespace

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

std::vector<int64_t> parse_layers(const std::string& text) {
  const auto number = [&](const std::string& part) -> int64_t {
    MOEFQ_CHECK(!part.empty() && part.size() <= 9 &&
                    std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; }),
                "--layers '", text, "': '", part,
                "' is not a layer index (expected e.g. 4, 3-10 or 3,5,7; indices >= 0)");
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

CalibrationState run_calibration(const EvalOptions& options, EvalSetup* setup) {
  const Prepared p = prepare(options, false);
  CalibrationState state = calibrate_all(p);
  if (setup) *setup = p.setup;
  return state;
}

EvalResult run_eval(const EvalOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const Prepared p = prepare(options, true);
  const EvalSetup& s = p.setup;
  EvalResult result;
  result.setup = s;
  const bool loaded = !options.load_calibration.empty();
  if (loaded) {
    result.calibration = load_eval_calibration(options.load_calibration, s.config, s.layers);
    result.calibration.source = "loaded from " + options.load_calibration;
  } else {
    result.calibration.source = calib_source(s);
  }
  const size_t num_recipes = p.recipes.size();
  size_t step = 0;
  for (int64_t layer : s.layers) {
    LayerRun run = build_layer(p, layer, !loaded);
    FakeQuantMoe& fq = *run.fq;
    // Configuration errors of any recipe (a dynamic combine amax, ...) before the first forward.
    for (const auto& cfgs : p.recipe_configs) fq.configure(cfgs);
    if (!loaded) {
      p.say("layer " + std::to_string(layer) + ": calibrating on " + plural(s.calib_batches, "batch") +
            " (once for all recipes)");
      result.calibration.layers.push_back(calibrate_layer(run, s));
    }
    const LayerCalibration& cal = *result.calibration.find(layer);

    // The shared expert on the unquantized x, and the unquantized reference, once per batch.
    const int64_t T = s.tokens, H = s.config.hidden;
    if (s.config.num_shared > 0)
      for (Batch& b : run.eval)
        for (int64_t r = 0; r < s.ranks; ++r) {
          b.shared.emplace_back(size_t(T * H));
          fq.backend().shared_expert(r, b.x[size_t(r)], T, b.shared.back().data());
        }
    p.say("layer " + std::to_string(layer) + ": unquantized reference on " + plural(s.eval_batches, "batch"));
    fq.configure({});
    const std::vector<float> reference = run_eval_batches(run, s);

    std::vector<EvalRow> rows;
    for (size_t i = 0; i < num_recipes; ++i) {
      const std::string& name = p.recipes[i].name;
      p.say("[" + std::to_string(++step) + "/" + std::to_string(num_recipes * s.layers.size()) + "] layer " +
            std::to_string(layer) + " " + name);
      fq.configure(p.recipe_configs[i]);
      fq.set_calibrated_amax(cal.dispatch_amax, cal.combine_amax);
      const std::vector<float> y = run_eval_batches(run, s);
      EvalRow row;
      row.layer = layer;
      row.recipe = name;
      const Quantizer& d = fq.dispatch_quantizer(0);
      const Quantizer& c = fq.combine_quantizer(0);
      if (d.enabled()) {
        row.dispatch_format = format_name(d.spec().format);
        row.dispatch_amax = d.amax();
      }
      if (c.enabled()) {
        row.combine_format = format_name(c.spec().format);
        row.combine_amax = c.amax();
        for (int64_t r = 0; r < s.ranks; ++r)
          MOEFQ_ASSERT(fq.layout_checked(r), "layer ", layer, ": the combine quantizer of rank ", r,
                       " ran without a layout check");
      }
      row.layout_check = c.enabled() ? "pass" : "n/a";
      row.metrics = compute_metrics(y.data(), reference.data(), int64_t(y.size()));
      rows.push_back(std::move(row));
    }
    std::stable_sort(rows.begin(), rows.end(),
                     [](const EvalRow& a, const EvalRow& b) { return less_rel_l2(a.metrics.rel_l2, b.metrics.rel_l2); });
    result.rows.insert(result.rows.end(), rows.begin(), rows.end());
  }

  for (const std::string& name : s.recipe_names) {
    RecipeSummary sum;
    sum.recipe = name;
    int64_t n = 0;
    for (const EvalRow& r : result.rows) {
      if (r.recipe != name) continue;
      sum.mean_rel_l2 += r.metrics.rel_l2;
      sum.max_rel_l2 = n == 0 ? r.metrics.rel_l2 : std::max(sum.max_rel_l2, r.metrics.rel_l2);
      sum.min_cosine = n == 0 ? r.metrics.cosine : std::min(sum.min_cosine, r.metrics.cosine);
      ++n;
    }
    sum.mean_rel_l2 /= double(std::max<int64_t>(n, 1));
    result.summary.push_back(sum);
  }
  std::stable_sort(result.summary.begin(), result.summary.end(), [](const RecipeSummary& a, const RecipeSummary& b) {
    return less_rel_l2(a.mean_rel_l2, b.mean_rel_l2);
  });
  result.wall_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

// ---- The calibration file.

void save_eval_calibration(const std::string& path, const CalibrationState& state, const EvalSetup& s) {
  json layers = json::object();
  for (const LayerCalibration& l : state.layers) {
    const auto side = [](float amax, const std::vector<float>& ranks) {
      json j = {{"amax", amax}, {"amax_bits", hex32(amax)}, {"rank_amax", json::array()}};
      for (float v : ranks) j["rank_amax"].push_back(v);
      return j;
    };
    layers[std::to_string(l.layer)] = {{"dispatch", side(l.dispatch_amax, l.dispatch_rank_amax)},
                                       {"combine", side(l.combine_amax, l.combine_rank_amax)}};
  }
  const json j = {
      {"version", kCalibrationFileVersion},
      {"kind", kCalibrationFileKind},
      {"moefq_version", s.version},
      {"algorithm", "max"},
      {"source", state.source},
      {"model", {{"name", s.config.name}, {"hidden", s.config.hidden}, {"num_experts", s.config.num_experts},
                 {"top_k", s.config.top_k}}},
      {"setup", {{"model", s.model_source}, {"weights", s.weights_source}, {"activations", s.activations_source},
                 {"ranks", s.ranks}, {"tokens_per_rank", s.tokens}, {"calib_batches", s.calib_batches},
                 {"seed", s.seed}}},
      {"layers", layers}};
  write_file_atomic(path, j.dump(2) + "\n");
}

CalibrationState load_eval_calibration(const std::string& path, const MoeConfig& config,
                                       const std::vector<int64_t>& layers) {
  std::ifstream in(path, std::ios::binary);
  MOEFQ_CHECK(in.is_open(), "--load-calibration ", path, ": cannot open the file: ", std::strerror(errno));
  std::stringstream buf;
  buf << in.rdbuf();
  json root;
  try {
    root = json::parse(buf.str());
  } catch (const json::exception& e) {
    MOEFQ_FAIL(ErrorKind::kBadInput, "--load-calibration ", path, ": malformed JSON (", e.what(), ")");
  }
  const std::string where = "--load-calibration " + path;
  MOEFQ_CHECK(root.is_object() && root.value("kind", json()) == kCalibrationFileKind, where,
              ": not a calibration file of 'moefq calibrate --save' (no \"kind\": \"", kCalibrationFileKind, "\")");
  MOEFQ_CHECK(root.value("version", json()) == kCalibrationFileVersion, where, ": version ",
              root.value("version", json()).dump(), " is not supported (expected ", kCalibrationFileVersion, ")");
  const json model = root.value("model", json());
  MOEFQ_CHECK(model.is_object(), where, ": 'model' must be an object");
  for (const auto& [key, want] : {std::pair<const char*, int64_t>{"hidden", config.hidden},
                                  {"num_experts", config.num_experts},
                                  {"top_k", config.top_k}}) {
    const json v = model.value(key, json());
    MOEFQ_CHECK(v.is_number_integer(), where, ": model.", key, " must be an integer");
    MOEFQ_CHECK(v.get<int64_t>() == want, where, ": the file was made for a model with ", key, " ",
                v.get<int64_t>(), ", but this run's model (", config.name, ") has ", want);
  }
  const json ls = root.value("layers", json());
  MOEFQ_CHECK(ls.is_object(), where, ": 'layers' must be an object mapping layer indices to amax entries");
  CalibrationState state;
  for (int64_t l : layers) {
    const std::string key = std::to_string(l);
    MOEFQ_CHECK(ls.contains(key), where, ": no calibration for layer ", l, "; calibrate that layer (moefq "
                "calibrate --layers ...) and save again");
    const json& e = ls[key];
    MOEFQ_CHECK(e.is_object(), where, ": layers.", key, " must be an object");
    LayerCalibration c;
    c.layer = l;
    for (const char* side : {"dispatch", "combine"}) {
      const std::string at = std::string("layers.") + key + "." + side;
      const json q = e.value(side, json());
      MOEFQ_CHECK(q.is_object(), where, ": ", at, " must be an object with amax, amax_bits, rank_amax");
      float amax;
      const json bits = q.value("amax_bits", json());
      if (bits.is_string()) {
        const std::string b = bits.get<std::string>();
        char* end = nullptr;
        const unsigned long u = std::strtoul(b.c_str(), &end, 16);
        MOEFQ_CHECK(b.size() == 10 && b.rfind("0x", 0) == 0 && end && *end == '\0', where, ": ", at,
                    ".amax_bits '", b, "' is not 0x followed by 8 hex digits");
        const uint32_t u32 = uint32_t(u);
        std::memcpy(&amax, &u32, 4);
        const json a = q.value("amax", json());
        MOEFQ_CHECK(!a.is_number() || float(a.get<double>()) == amax, where, ": ", at, ".amax ", a.dump(),
                    " disagrees with amax_bits ", b);
      } else {
        const json a = q.value("amax", json());
        MOEFQ_CHECK(a.is_number(), where, ": ", at, ".amax must be a number");
        amax = float(a.get<double>());
      }
      MOEFQ_CHECK(std::isfinite(amax) && amax >= 0, where, ": ", at, ".amax must be finite and >= 0, got ", amax);
      std::vector<float> ranks;
      const json ra = q.value("rank_amax", json::array());
      MOEFQ_CHECK(ra.is_array(), where, ": ", at, ".rank_amax must be an array of numbers");
      for (const json& v : ra) {
        MOEFQ_CHECK(v.is_number(), where, ": ", at, ".rank_amax must be an array of numbers");
        ranks.push_back(float(v.get<double>()));
      }
      (std::string(side) == "dispatch" ? c.dispatch_amax : c.combine_amax) = amax;
      (std::string(side) == "dispatch" ? c.dispatch_rank_amax : c.combine_rank_amax) = std::move(ranks);
    }
    state.layers.push_back(std::move(c));
  }
  state.source = "loaded from " + path;
  return state;
}

}  // namespace moefq
