// The evaluation pipeline behind `moefq eval` and `moefq calibrate`: for each MoE layer, max
// calibration once (the amax does not depend on the recipe, since calibration applies no QDQ),
// then every recipe on the same held-out batches against one shared unquantized reference, with
// the error metrics of numerics.md. Options in, a result struct out; no printing, no files except
// the calibration file helpers. Every user-caused problem is moefq::Error kBadInput naming the
// option or file; a failed layout check is kFailedCheck.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moefq/metrics.h"
#include "moefq/moe_config.h"
#include "moefq/recipe.h"

namespace moefq {

struct EvalOptions {
  // The model: a preset, a Hugging Face config.json (synthetic weights) or a DeepSeek-V3-format
  // checkpoint directory (DIR/config.json and its weights). At most one of config_path and
  // checkpoint_dir; preset_given says the user named the preset (then neither may be set).
  std::string preset = "tiny";
  bool preset_given = false;
  std::string config_path;
  std::string checkpoint_dir;
  // Layer indices (parse_layers). Empty: {0} for synthetic weights; required with a checkpoint.
  std::vector<int64_t> layers;
  // Hidden states [tokens, H] per layer (safetensors "layers.{i}", else "hidden_states"); empty:
  // synthetic activations with outlier channels.
  std::string activations_path;
  // Recipe files or unit names; empty: default_sweep().
  std::vector<std::string> recipes;
  int64_t ranks = 4;    // simulated expert-parallel ranks (must divide E)
  int64_t tokens = 256;  // tokens per rank per batch
  int calib_batches = 2, eval_batches = 2;
  uint64_t seed = 1;  // synthetic weights and activations
  // The expert back-end ("mega_moe" on the CPU, "mega_moe_cuda" on a GPU; must be registered)
  // and how the device is described in the reports.
  std::string backend_kind = "mega_moe";
  std::string device = "cpu";
  int num_threads = 0;            // CPU engine threads (0: all)
  std::string load_calibration;   // eval: reuse this calibration file instead of calibrating
  // Progress lines (no newline), e.g. "[3/13] layer 0 dispatch_fp8"; may be empty.
  std::function<void(const std::string&)> progress;
};

// A recipe with the name the reports use.
struct NamedRecipe {
  std::string name;
  Recipe recipe;
};

// none, then {dispatch, combine, both} x {fp8, nvfp4, mxfp8, mxfp4}, named "none",
// "dispatch_fp8", "combine_fp8", "both_fp8", ... (13 recipes).
std::vector<NamedRecipe> default_sweep();

// "4", "3-10", "3,5,7", "1-2,6" -> sorted unique layer indices; bad input naming --layers.
std::vector<int64_t> parse_layers(const std::string& text);

// Max calibration of one layer: the reduced amax of each quantizer and each rank's own max before
// the MAX reduction (what the per-rank chart shows).
struct LayerCalibration {
  int64_t layer = 0;
  float dispatch_amax = 0, combine_amax = 0;
  std::vector<float> dispatch_rank_amax, combine_rank_amax;  // [ranks]
};

struct CalibrationState {
  std::string source;  // "calibrated on 2 batches x 4 ranks x 256 tokens" or "loaded from FILE"
  std::vector<LayerCalibration> layers;
  const LayerCalibration* find(int64_t layer) const;
};

// What was evaluated, resolved from the options (for the reports' header).
struct EvalSetup {
  MoeConfig config;
  std::string model_source;        // "preset tiny", "config.json PATH", "checkpoint DIR"
  std::string weights_source;      // "synthetic (seed 1)" or "checkpoint DIR"
  std::string activations_source;  // "synthetic, outlier channels (seed 1)" or "FILE"
  std::vector<int64_t> layers;
  std::vector<std::string> recipe_names;
  int64_t ranks = 0, tokens = 0;
  int calib_batches = 0, eval_batches = 0;
  uint64_t seed = 0;
  std::string backend_kind, device, version;
};

// One (layer, recipe) result over the whole evaluation set.
struct EvalRow {
  int64_t layer = 0;
  std::string recipe;
  std::optional<std::string> dispatch_format, combine_format;  // nullopt: quantizer disabled
  std::optional<float> dispatch_amax, combine_amax;  // the global amax used (nullopt: none)
  ErrorMetrics metrics;
  // "pass": the combine quantizer read the engine's rows and every buffer's layout check passed;
  // "n/a": combine quantization off, the output does not depend on the buffer layout.
  std::string layout_check;
};

// Mean and worst rel_l2 of one recipe over the layers.
struct RecipeSummary {
  std::string recipe;
  double mean_rel_l2 = 0, max_rel_l2 = 0, min_cosine = 1;
};

struct EvalResult {
  EvalSetup setup;
  CalibrationState calibration;
  // Sorted by layer, then best first: rel_l2 ascending (ties keep the sweep order, NaN last).
  std::vector<EvalRow> rows;
  std::vector<RecipeSummary> summary;  // best first by mean_rel_l2
  double wall_seconds = 0;
};

// Checks the options without doing any work (cheap: reads config files and file headers only).
void validate_eval_options(const EvalOptions& options);

// The whole evaluation (load_calibration honoured).
EvalResult run_eval(const EvalOptions& options);

// Calibration only (what `moefq calibrate` saves); recipes are not used.
CalibrationState run_calibration(const EvalOptions& options, EvalSetup* setup = nullptr);

// The calibration file of `moefq calibrate --save` (JSON; see docs/eval.md): written atomically.
void save_eval_calibration(const std::string& path, const CalibrationState& state, const EvalSetup& setup);
// Reads it back; every layer in `layers` must be present and the model shape (H, E, K) must
// match `config`. Errors name the file.
CalibrationState load_eval_calibration(const std::string& path, const MoeConfig& config,
                                       const std::vector<int64_t>& layers);

}  // namespace moefq
