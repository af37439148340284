// The evaluation pipeline behind `moefq eval` and `moefq calibrate`: for each MoE layer, one
// calibration pass (max, and the methods beyond it from the same pass's histograms; the amax does
// not depend on the recipe, since calibration applies no QDQ),
// then every recipe on the same held-out batches against one shared unquantized reference, with
// the error metrics of docs/numerics.md, the error's shape (per token, outside the outlier channels),
// the clipped fractions and the wire bytes of each recipe. On the CPU it runs the CPU engine on
// host tensors; with a GPU everything stays on the device (weights generated or loaded there, the
// CUDA router, the fake quantizers' kernels, the metrics reduced there in fp64). Options in, a
// result struct out; no printing, no files except the calibration file helpers. Every
// user-caused problem is moefq::Error kBadInput naming the option or file; a failed layout check
// is kFailedCheck; a run that does not fit the machine is refused before any allocation.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moefq/calibration_stats.h"
#include "moefq/metrics.h"
#include "moefq/moe_config.h"
#include "moefq/recipe.h"
#include "moefq/link_model.h"
#include "moefq/synthetic.h"
#include "moefq/wire_bytes.h"

namespace moefq {

enum class EvalDevice { kCpu, kCuda };

struct EvalOptions {
  // The model: a preset, a Hugging Face config.json (synthetic weights) or a Hugging Face
  // checkpoint directory (DIR/config.json and its weights, named as checkpoint.h says; e4m3 with
  // block scales, or bf16 on the CPU only). At most one of config_path and
  // checkpoint_dir; preset_given says the user named the preset (then neither may be set).
  std::string preset = "tiny";
  bool preset_given = false;
  std::string config_path;
  std::string checkpoint_dir;
  // Layer indices (parse_layers). Empty: {0} for synthetic weights; required with a checkpoint.
  std::vector<int64_t> layers;
  // Hidden states [tokens, H] per layer (safetensors "layers.{i}", else "hidden_states"); empty:
  // synthetic activations.
  std::string activations_path;
  // The synthetic data (weights, and activations unless a file is given): shaped like a real
  // model's (default) or plain Gaussian.
  SyntheticKind synthetic = SyntheticKind::kModel;
  // Recipe files or unit names; empty: default_sweep(). recipe_root: the first recipe root their
  // imports are looked up in (recipe.h); empty: none besides the files' own and the shipped one.
  std::vector<std::string> recipes;
  std::string recipe_root;
  // Without recipes: "" or "default" (default_sweep()), or "peers" (peers_sweep(): every peer's
  // recipe; without combine_weighting, one pass per weighting, merged).
  std::string sweep;
  // Where the layer applies the router weight (quant_spec.h): one mode per run, since the combine
  // rows and their calibrated amax depend on it. nullopt: the recipes' own combine_weighting (they
  // must agree), else before. A recipe that names another mode than this is an error.
  std::optional<CombineWeighting> combine_weighting;
  // The activations into the expert GEMMs, i.e. the baseline every recipe is compared with
  // (weights.h): nullopt follows the model (default_staging: the checkpoint's weight format, else
  // the architecture's).
  std::optional<Staging> staging;
  int64_t ranks = 4;    // simulated expert-parallel ranks (must divide E)
  int64_t tokens = 256;  // tokens per rank per batch
  int calib_batches = 2, eval_batches = 2;
  uint64_t seed = 1;  // synthetic weights and activations
  // Where the layer runs, one runner per device: the CPU engine on host tensors, or everything on
  // the current GPU (needs a build with CUDA and register_cuda_layer_runner()).
  EvalDevice device = EvalDevice::kCpu;
  // How the device is described in the reports.
  std::string device_name = "cpu";
  int num_threads = 0;            // CPU threads (0: all)
  std::string load_calibration;   // eval: reuse this calibration file instead of calibrating
  // The calibration methods (calibration_stats.h) of the recipes' calibrated amax; empty: each
  // recipe's own `algorithm:` (max by default). With several, each recipe with a calibrated amax is
  // evaluated once per method, named "<recipe>@<method>" (dispatch_fp8@p99.99). Methods other than
  // max need a calibration (not a calibration file).
  std::vector<CalibrationMethod> calibration;
  // The bound of the calibration rows nvfp4's mse keeps per quantizer, in elements (SampleRows).
  int64_t nvfp4_sample_elements = kNvfp4SampleElements;
  // The link the wire bytes are turned into transfer time on (link_model.h): a named link, or
  // link_gbps > 0 (GB/s per GPU, one direction, no latency). Empty and 0: no times.
  std::string link;
  double link_gbps = 0;
  // Rows whose rel_l2 exceeds this are over budget; the result names the cheapest recipe within it.
  std::optional<double> max_rel_l2;
  // Progress lines (no newline), e.g. "[3/13] layer 0 dispatch_fp8 (2.1 s, eta 12 s)", and within a
  // layer's load on the host the experts' weights made ("      64/257 experts' weights (31.0 s,
  // eta 95 s)"), at most one such line per progress_every_seconds; may be empty. The estimate
  // measures each kind of step (loads, calibrations, recipe batches) on its own and is shown once
  // every kind still ahead has been measured.
  std::function<void(const std::string&)> progress;
  double progress_every_seconds = 5.0;
};

// A recipe with the name the reports use.
struct NamedRecipe {
  std::string name;
  Recipe recipe;
};

// none, then {dispatch, combine, both} x {fp8, nvfp4, mxfp8, mxfp4}, named "none",
// "dispatch_fp8", "combine_fp8", "both_fp8", ... (13 recipes).
std::vector<NamedRecipe> default_sweep();

// none, then each expert-parallel system's recipe as that system computes its dispatch and combine
// (recipes/configs/ptq/presets/peers; docs/numerics.md): DeepEP's low-latency kernels (weighting
// after), the SGLang DeepGEMM fork's FP8 combine, MoRI's combine options, vLLM's and DeepGEMM's
// dispatch casts (before). With `only`, the recipes meant for that weighting (and none).
std::vector<NamedRecipe> peers_sweep(std::optional<CombineWeighting> only = std::nullopt);
// The system a peer recipe reproduces ("DeepEP", "MoRI", ...); "" for other recipes.
std::string peer_of(const std::string& recipe);

// "4", "3-10", "3,5,7", "1-2,6" -> sorted unique layer indices; bad input naming --layers.
std::vector<int64_t> parse_layers(const std::string& text);

// Max calibration of one layer: the reduced amax of each quantizer and each rank's own max before
// the MAX reduction (what the per-rank chart shows).
// One method's amax for one quantizer and format (the methods beyond max, derived from the
// histograms of the one calibration pass).
struct DerivedCalibration {
  std::string quantizer;  // "dispatch" or "combine"
  std::string method;     // CalibrationMethod::name()
  std::string format;
  DerivedAmax amax;
};
struct LayerCalibration {
  int64_t layer = 0;
  float dispatch_amax = 0, combine_amax = 0;
  std::vector<float> dispatch_rank_amax, combine_rank_amax;  // [ranks]
  // |x| histograms over every rank's calibration data (only when a method beyond max is asked for).
  std::shared_ptr<const AbsHistogram> dispatch_hist, combine_hist;
  // The nvfp4 blocks of the sampled calibration rows (only when nvfp4's mse is asked for).
  std::shared_ptr<const Nvfp4Blocks> dispatch_nvfp4, combine_nvfp4;
  std::vector<DerivedCalibration> derived;  // each (quantizer, method, format) the recipes used
  // logfmt10's cast groups on the calibration data (wire_bytes.h; collected with the histograms, or
  // when a recipe sends logfmt10).
  CastGroups dispatch_logfmt, combine_logfmt;
};

struct CalibrationState {
  std::string source;  // "calibrated on 2 batches x 4 ranks x 256 tokens" or "loaded from FILE"
  std::string algorithm = "max";  // "max" or "percentile P" (moefq calibrate --calibration)
  std::vector<LayerCalibration> layers;
  const LayerCalibration* find(int64_t layer) const;
};

// What was evaluated, resolved from the options (for the reports' header).
struct EvalSetup {
  MoeConfig config;
  std::string model_source;        // "preset tiny", "config PATH", "checkpoint DIR"
  std::string weights_source;      // "synthetic e4m3, model-shaped (seed 1)" or "checkpoint DIR"
  std::string activations_source;  // "synthetic, model-shaped (seed 1)" or "FILE"
  std::string synthetic;           // "model" or "gaussian"
  std::vector<int64_t> layers;
  std::vector<std::string> recipe_names;
  CombineWeighting combine_weighting = CombineWeighting::kBefore;  // the run's, resolved
  Staging staging = Staging::kE4m3;  // the run's, resolved: the baseline (staging_baseline)
  int64_t ranks = 0, tokens = 0;
  int calib_batches = 0, eval_batches = 0;
  uint64_t seed = 0;
  std::string backend_kind, device, version;
  std::optional<double> max_rel_l2;
  std::string calibration = "max";  // the methods used, "max" or e.g. "percentile 99.99, mse"
  LinkModel link;                   // link.name empty: no transfer times
};

// One (layer, recipe) result over the whole evaluation set.
struct EvalRow {
  int64_t layer = 0;
  std::string recipe;
  std::optional<std::string> dispatch_format, combine_format;  // nullopt: quantizer disabled
  std::optional<float> dispatch_amax, combine_amax;  // the global amax used (nullopt: none)
  ErrorMetrics metrics;  // over every element of the evaluation set
  // The error's shape: relative L2 per token (its median, 99th percentile and max over the
  // evaluation tokens), and over the channels outside the layer's outlier output channels
  // (outlier_channels below). With none (num_outlier_channels 0) it is rel_l2 itself.
  double rel_l2_token_p50 = 0, rel_l2_token_p99 = 0, rel_l2_token_max = 0;
  double rel_l2_non_outlier = 0;
  int64_t num_outlier_channels = 0;  // the layer's; the same on each of its rows
  // Fraction of the elements each quantizer saw that lay beyond its global amax (nullopt: the
  // quantizer is disabled or has no fixed global amax: mx formats, dynamic amax).
  std::optional<double> dispatch_clipped_fraction, combine_clipped_fraction;
  // Bytes per token per destination on the wire, scales included (bf16 when disabled), and the
  // saving of dispatch + combine against bf16 (0.25: a quarter fewer bytes).
  double dispatch_wire_bytes_per_token = 0, combine_wire_bytes_per_token = 0, wire_saving = 0;
  // "pass": the combine quantizer read the engine's rows and every buffer's layout check passed;
  // "n/a": combine quantization off, the output does not depend on the buffer layout.
  std::string layout_check;
  bool over_budget = false;  // rel_l2 > max_rel_l2
  // The calibration method of the row's calibrated amax ("" when it has none).
  std::string calibration;
  // logfmt10 sends a cast group as bf16 when it cannot be cast: the fraction of the groups that
  // were cast on the evaluation data (nullopt: not logfmt10); the wire bytes above are then the
  // bytes actually sent (cast groups compressed, the others bf16).
  std::optional<double> dispatch_cast_fraction, combine_cast_fraction;
  // Transfer time of the dispatch and the combine of one batch (ranks x tokens) on setup.link
  // (link_model.h), and the saving of both against bf16, in microseconds (0 without a link).
  double dispatch_us = 0, combine_us = 0, saved_us = 0;
};

// A layer's outlier output channels: those whose RMS over the unquantized reference output is
// more than kOutlierChannelFactor times the median channel's, at most kOutlierChannelMaxFraction
// of the channels (the largest; at least one may be). ref2: [H] the sum of squares per channel.
inline constexpr double kOutlierChannelFactor = 6.0;
inline constexpr double kOutlierChannelMaxFraction = 0.01;
std::vector<bool> outlier_channels(const std::vector<double>& ref2);

// Mean and worst rel_l2 of one recipe over the layers.
struct RecipeSummary {
  std::string recipe;
  double mean_rel_l2 = 0, max_rel_l2 = 0, min_cosine = 1;
  double wire_bytes_per_token = 0;  // dispatch + combine
};

// Seconds one layer spent in each stage of the pipeline (moefq bench eval).
struct StageTimes {
  int64_t layer = 0;
  double load = 0;       // weights generated or loaded, activations, routing
  double calibrate = 0;  // calibration forwards
  double reference = 0;  // the unquantized reference (and the shared expert)
  double recipes = 0;    // every recipe's forwards (engine and quantizers)
  double metrics = 0;    // reducing the metrics
  double total = 0;
};

// The bytes a run needs, by item, on the host and on the device, against what is available.
struct MemoryItem {
  std::string what;
  double host_bytes = 0, device_bytes = 0;
};
struct MemoryPlan {
  std::vector<MemoryItem> items;
  double host_bytes = 0, device_bytes = 0;          // the peak the run needs
  double host_available = 0, device_available = 0;  // 0 where unknown (no device)
  bool streaming = false;  // the next layer is prepared while the current one is evaluated
  std::string describe() const;
};

struct EvalResult {
  EvalSetup setup;
  CalibrationState calibration;
  // Sorted by layer, then best first: rel_l2 ascending (ties keep the sweep order, NaN last).
  std::vector<EvalRow> rows;
  std::vector<RecipeSummary> summary;  // best first by mean_rel_l2
  // With max_rel_l2: the recipe with the fewest wire bytes whose rel_l2 is within the budget on
  // every layer (ties: the lower mean rel_l2); empty when none is.
  std::optional<std::string> cheapest_within_budget;
  std::vector<std::string> warnings;  // clipping, a calibration file from another setup, ...
  std::vector<StageTimes> stage_times;
  MemoryPlan memory;
  double wall_seconds = 0;
};

// The bytes the run needs against what this machine (and its GPU) has; run_eval refuses (bad
// input, with the figures and what to change) when it does not fit.
MemoryPlan plan_eval_memory(const EvalOptions& options);

// A run's rough wall time on the CPU, told before any work: the weights made (the time of one
// expert made here, times the experts over the threads; a layer in the weight cache is read at
// kDiskBytesPerSecond) or read from a checkpoint (the same rate), and the engine's forwards (6 x H
// x I flops per routed row and per token for the shared expert, at the rate of one expert of the
// layer's shape run here on 64 tokens per thread). Forwards per layer: the calibration batches, and
// per evaluation batch the reference and one per distinct dispatch configuration. QDQ and metrics
// are left out (they are small beside the GEMMs). Both probes measure the machine as it is, load
// included.
struct RunEstimate {
  double weights_seconds = 0, forwards_seconds = 0;
  int64_t layers = 0, cached_layers = 0;
  double total() const { return weights_seconds + forwards_seconds; }
  std::string describe() const;  // "about 6 min (weights 3 min, of 2 layers none cached; forwards 3 min)"
};
inline constexpr double kDiskBytesPerSecond = 1.0e9;
// Runs estimated longer than this say so before they start (moefq eval and calibrate).
inline constexpr double kLongRunSeconds = 60.0;
// nullopt for a GPU run (its estimate is the progress lines').
std::optional<RunEstimate> estimate_eval_time(const EvalOptions& options);

// The whole evaluation (load_calibration honoured).
EvalResult run_eval(const EvalOptions& options);

// Calibration only (what `moefq calibrate` saves); recipes are not used.
CalibrationState run_calibration(const EvalOptions& options, EvalSetup* setup = nullptr);

// The calibration file of `moefq calibrate --save`: the quantizers' calibration file
// (save_calibration in quantizer.h) with each quantizer's per-rank maxima and the setup it was
// made with; written atomically.
void save_eval_calibration(const std::string& path, const CalibrationState& state, const EvalSetup& setup);
// Reads it back; every layer in setup.layers must be present and the model shape (H, E, K) must
// match. An amax that is 0, negative or not finite, or a per-rank list of the wrong length, is an
// error naming the file; a setup that differs from this run's (model, layers, seed, tokens, data)
// adds a warning naming the difference to `warnings`.
CalibrationState load_eval_calibration(const std::string& path, const EvalSetup& setup,
                                       std::vector<std::string>* warnings = nullptr);

}  // namespace moefq
