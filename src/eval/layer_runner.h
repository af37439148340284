// One layer's evaluation on one device, behind the pipeline of src/eval/eval.cpp: one runner per
// device, the CPU runner (the CPU engine on host tensors; cpu_runner.cpp) and the device-resident
// CUDA runner (eval/cuda/device_runner.cu). Both drive the one layer facade, FakeQuantMoe. A runner holds one layer at a time: its weights, the
// activations of every batch (calibration batches first, then the held-out evaluation batches,
// each ranks x tokens rows, rank-major), their routing, the fake-quantized layer with the shared
// expert unfused (the model adds the shared expert, computed on the unquantized x, to the routed
// output, in fp32 with one bf16 rounding) and the unquantized reference of the evaluation batches.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "moefq/eval.h"
#include "moefq/fake_quant_moe.h"
#include "moefq/metrics.h"
#include "moefq/moe_quantizers.h"
#include "moefq/safetensors.h"
#include "moefq/synthetic.h"

namespace moefq {

// What every runner needs to know of the run (resolved from EvalOptions).
struct RunnerSetup {
  MoeConfig config;
  int64_t ranks = 0, tokens = 0;
  int calib_batches = 0, eval_batches = 0;
  uint64_t seed = 0;
  SyntheticKind synthetic = SyntheticKind::kModel;
  std::string checkpoint_dir;                  // empty: synthetic weights
  WeightFormat weight_format = WeightFormat::kE4m3;  // the checkpoint's as loaded (synthetic weights: e4m3)
  StoredWeightFormat stored_format = StoredWeightFormat::kE4m3;  // the checkpoint's as stored
  const SafetensorsFile* acts = nullptr;       // null: synthetic activations
  std::map<int64_t, std::string> act_tensor;   // layer -> tensor name in acts
  int num_threads = 0;
  CombineWeighting combine_weighting = CombineWeighting::kBefore;  // the engine's (EngineOptions)
  Staging staging = Staging::kE4m3;                                 // the engine's (EngineOptions)
  bool prefetch = false;     // the memory plan allows preparing the next layer meanwhile
  // calibrate() also fills LayerCalibration's histograms and logfmt10 cast groups, and with
  // nvfp4_sample_elements > 0 the nvfp4 blocks of the rows SampleRows keeps (that many elements at
  // most per quantizer), the same on every runner.
  bool calibration_stats = false;
  int64_t nvfp4_sample_elements = 0;

  int64_t batch_tokens() const { return ranks * tokens; }
  int64_t num_tokens() const { return int64_t(calib_batches + eval_batches) * batch_tokens(); }
  // The seed of layer i's synthetic model: distinct per layer, fixed per (seed, i).
  uint64_t layer_seed(int64_t layer) const;
  SyntheticLayer synthetic_layer(int64_t layer) const;
};

// What one recipe's evaluation gives: the metric sums per evaluation token (in the batches'
// order), the squared error per channel, and the quantizers' clip counters ([2][R]).
struct RecipeStats {
  std::vector<MetricSums> tokens;
  std::vector<double> channel_err2;  // [H]
  std::vector<ClipCounts> clips;
};

// One recipe as the evaluation runs it: its quantizer configurations, and whether the engine runs
// for it. Without, it reuses the combine rows the previous engine call left (the reference's for
// the first steps): recipes that quantize dispatch the same way share one expert computation, and
// only their combine quantizers run again.
struct RecipeStep {
  std::string name;
  std::map<std::string, QuantizerConfig> configs;
  bool with_engine = true;
  // The calibrated amax of this step (its calibration method's); nullopt: evaluate()'s.
  std::optional<float> dispatch_amax, combine_amax;
};

// What a whole evaluation gives: the reference's sum of squares per channel ([H], which picks the
// layer's outlier channels), each step's stats, and where the time went.
struct EvalPassStats {
  std::vector<double> reference_channels;
  std::vector<RecipeStats> steps;
  double reference_seconds = 0, recipes_seconds = 0, metrics_seconds = 0;
};

class LayerRunner {
 public:
  virtual ~LayerRunner() = default;
  // Makes `layer` the current one: weights generated or loaded, activations, routing, the shared
  // expert's output on the evaluation batches. need_calibration: the calibration batches too.
  virtual void load(int64_t layer, bool need_calibration) = 0;
  // Starts preparing `layer` (the next load's) while the current one is evaluated, where the
  // runner can (setup.prefetch); load() then takes it over.
  virtual void prefetch(int64_t /*layer*/) {}

  // As FakeQuantMoe's (configuration errors before any forward).
  virtual void configure(const std::map<std::string, QuantizerConfig>& configs) = 0;
  virtual void set_calibrated_amax(float dispatch_amax, float combine_amax) = 0;
  virtual const MoeQuantizers& quantizers() const = 0;
  virtual bool layout_checked(int64_t rank) const = 0;

  // Max calibration on the calibration batches with both quantizers enabled (no QDQ meanwhile):
  // the reduced amax and each rank's own (and the statistics setup.calibration_stats asks for).
  virtual LayerCalibration calibrate() = 0;
  // The evaluation batches, one at a time: the unquantized reference first, then every step in
  // order (each configured with `configs` and the calibrated amax), its output compared with the
  // batch's reference. on_step (may be empty) hears "batch 1/2 reference", "batch 1/2 <name>", ...
  // before each.
  virtual EvalPassStats evaluate(const std::vector<RecipeStep>& steps, float dispatch_amax, float combine_amax,
                                 const std::function<void(const std::string&)>& on_step) = 0;

  // Progress of load() making the layer's weights on the host (may be empty): the experts made so
  // far and in all, over every rank. A runner that makes them otherwise (on the GPU) need not call it.
  std::function<void(int64_t num_done, int64_t num_total)> on_weights;
};

// The bytes a run needs on the host and the device, by item, against what is available (the
// device's figures come from the function registered with set_device_memory_query). A run may
// use kUsableFraction of what is available; streaming (the next layer prepared meanwhile) is
// planned when it fits too.
inline constexpr double kUsableFraction = 0.9;
MemoryPlan plan_run_memory(const RunnerSetup& setup, EvalDevice device);
// Free and total bytes of the current GPU (registered with the CUDA runner).
void set_device_memory_query(std::function<std::pair<double, double>()> query);
// The registered query's free and total bytes; {0, 0} (unknown) when none is registered.
std::pair<double, double> query_device_memory();
// Fills a plan's totals from its items, the host's available memory and, with `device`, the GPU's
// free memory (query_device_memory).
void total_memory_plan(MemoryPlan& plan, bool device);
// Whether the plan fits kUsableFraction of the host's and of the GPU's available memory (a figure
// that is unknown, 0, is not checked).
bool memory_fits(const MemoryPlan& plan);
// Refuses (bad input) a plan that does not fit: "<what> needs X GiB of host|GPU memory, Y GiB
// available: <advice>", then the plan's table.
void require_memory_fits(const MemoryPlan& plan, const std::string& what, const std::string& advice);

// The calibration sequence every runner shares: start, one forward per calibration batch, finish,
// then the reduced amax and each rank's own from the fake-quantized layer.
template <typename Forward>
LayerCalibration calibrate_with(FakeQuantMoe& fq, int num_batches, Forward&& forward) {
  fq.start_calibration();
  for (int b = 0; b < num_batches; ++b) forward(b);
  fq.finish_calibration();
  LayerCalibration c;
  c.dispatch_rank_amax = fq.rank_amax(0);
  c.combine_rank_amax = fq.rank_amax(1);
  c.dispatch_amax = *fq.quantizers().dispatch(0).amax();
  c.combine_amax = *fq.quantizers().combine(0).amax();
  return c;
}

// The SampleRows of the nvfp4 blocks (RunnerSetup::nvfp4_sample_elements): which 0 dispatch, 1 combine.
SampleRows nvfp4_sample_rows(const RunnerSetup& setup, int which);

// Creates the runner for a device; the CUDA one is registered by register_cuda_layer_runner().
using LayerRunnerFactory = std::function<std::unique_ptr<LayerRunner>(const RunnerSetup&)>;
void register_layer_runner(EvalDevice device, LayerRunnerFactory factory);
std::unique_ptr<LayerRunner> make_layer_runner(EvalDevice device, const RunnerSetup& setup);

// Registers the device-resident CUDA runner and the GPU memory query (builds with CUDA only;
// src/eval/cuda/device_runner.cu). Idempotent.
void register_cuda_layer_runner();

// The CPU runner (the CPU engine).
std::unique_ptr<LayerRunner> make_cpu_runner(const RunnerSetup& setup);

// Rows [first, first + n) of the layer's activations: synthetic (the layer model) or from the
// activations file (F32 rounded to bf16, as the layer's input is bf16). [n, H] bf16.
std::vector<bf16> layer_activations(const RunnerSetup& setup, int64_t layer, int64_t first, int64_t n);

// The layer's weights for rank r (its E/R experts, the shared expert, the router): synthetic or
// from the checkpoint.
LayerWeights rank_weights(const RunnerSetup& setup, int64_t layer, int64_t rank, const ExpertProgress& on_progress = {});
// Every rank's rank_weights; on_weights (may be empty) hears the experts made so far over all ranks
// and their number (LayerRunner::on_weights).
std::vector<LayerWeights> all_rank_weights(const RunnerSetup& setup, int64_t layer,
                                           const std::function<void(int64_t, int64_t)>& on_weights = {});

}  // namespace moefq
