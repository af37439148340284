// Fake quantization of MoE dispatch and combine (docs/fake_quant.md): one fake-quantized layer
// whose device is a choice, the CPU engines on host tensors or the CUDA engine on device tensors
// (LayerDevice). dispatch_quantizer QDQs the experts' input tokens out of place; combine_quantizer
// reads the combine rows the engine summed (at its own combine offset), QDQs each active routed row
// and sums again in the engine's order (shared slot last, unquantized), replacing the output. A
// layout check proves, once per buffer, that those rows are the ones the engine summed. The logic
// is the one every device shares (src/fakequant/fake_quant_driver.h); the devices' primitives are
// host loops (fake_quant_moe.cpp) and kernels (src/fakequant/cuda, built with CUDA only). The
// model's output, routed + shared expert, is composed in one place: add_shared().
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moefq/expert_backend.h"
#include "moefq/moe_quantizers.h"
#include "moefq/weights.h"

namespace moefq {

class FakeQuantDriver;
class FakeQuantOps;

// Where a fake-quantized layer computes: its tensors (RankBatch's pointers, the shared expert's
// and add_shared's arrays) are host memory on the CPU, memory of the current GPU on CUDA.
enum class LayerDevice { kCpu, kCuda };
const char* layer_device_name(LayerDevice device);
// A CUDA stream (cudaStream_t) as code without CUDA types holds it; nullptr is the default stream.
// The CPU ignores it.
using StreamHandle = void*;

class FakeQuantMoe {
 public:
  // The layer on `device` with its engine made from every rank's weights ([R], all_rank_weights'
  // layout) for at most max_tokens tokens per rank: the CPU engine ("mega_moe"), or the CUDA engine
  // (the weights uploaded). LayerDevice::kCuda needs a build with CUDA and
  // cuda::register_cuda_backends() (the CUDA library): otherwise a clear error.
  static std::unique_ptr<FakeQuantMoe> make(LayerDevice device, const MoeConfig& config, int64_t num_ranks,
                                            int64_t max_tokens, std::vector<LayerWeights> weights,
                                            const EngineOptions& options, int64_t layer);
  // The factory of make()'s CUDA layers (registered by the CUDA library).
  using DeviceFactory = std::function<std::unique_ptr<FakeQuantMoe>(
      const MoeConfig&, int64_t num_ranks, int64_t max_tokens, std::vector<LayerWeights>, const EngineOptions&,
      int64_t layer)>;
  static void register_device_factory(LayerDevice device, DeviceFactory factory);

  // On the CPU around a host-tensor expert back-end (the CPU engines, or a test's). layer: the
  // model layer index, used in the quantizer names.
  FakeQuantMoe(std::unique_ptr<ExpertBackend> backend, int64_t layer);
  // Around a device's primitives (the CUDA implementation: fakequant/cuda/cuda_fake_quant.cuh).
  FakeQuantMoe(std::unique_ptr<FakeQuantOps> ops, LayerDevice device, int64_t layer);
  ~FakeQuantMoe();

  LayerDevice device() const { return device_; }

  static std::string dispatch_name(int64_t layer) { return MoeQuantizers::dispatch_name(layer); }
  static std::string combine_name(int64_t layer) { return MoeQuantizers::combine_name(layer); }
  std::vector<std::string> quantizer_names() const;

  // Sets both quantizers from resolved recipe configs (apply_recipe's output; names of other
  // layers are ignored). Raises the configuration errors of docs/fake_quant.md before any forward:
  // a dispatch quantizer with the shared expert fused, a dynamic global amax on the combine
  // quantizer, a combine quantizer on a back-end that cannot expose its combine rows.
  void configure(const std::map<std::string, QuantizerConfig>& configs);

  // Max calibration over exactly what each quantizer sees; no QDQ meanwhile. finish reduces
  // each amax with MAX over the ranks (every rank then holds the same value); NaN or inf in the
  // data is an error naming the quantizer and the rank.
  void start_calibration();
  void finish_calibration();
  // Leaves a calibration that did not finish (an error, an interrupt): both quantizers as they
  // were at start_calibration. Nothing happens outside a calibration.
  void abort_calibration();
  // Each rank's own max of the last calibration, before the reduction (which 0: dispatch, 1:
  // combine).
  const std::vector<float>& rank_amax(int which) const;
  // Hears every element a quantizer folds into its calibration (which 0: dispatch, 1: combine; the
  // rank; n bf16 values), one rank after the other; empty: none. For statistics beyond the max;
  // the CPU only (an error on CUDA, where the statistics stay on the device).
  using CalibrationObserver = std::function<void(int which, int64_t rank, const bf16* x, int64_t n)>;
  void set_calibration_observer(CalibrationObserver observer);

  // One call of every rank; batches[r].y receives rank r's routed output (the shared expert
  // unfused: without it). A dynamic dispatch amax is the max |x| over the rank's tokens that have
  // an active routed slot (the tokens that are sent). An enabled quantizer that needs a calibrated
  // amax and has none (and is not calibrating) is an error naming it, before any work. On CUDA the
  // work is enqueued on `stream`, with no host synchronisation except the eager layout check (once
  // per buffer).
  void forward(std::span<const RankBatch> batches, StreamHandle stream = nullptr);
  // The quantizers' work in forward() alone, on the combine rows the last call left (the engine is
  // not called): a combine quantizer configured since re-sums those rows into y.
  void quantizers_only(std::span<const RankBatch> batches, StreamHandle stream = nullptr);
  // Synchronises `stream` (CUDA) and raises a barrier timeout of real ranks, else the first layout
  // mismatch a captured graph recorded since the last call. Nothing to do on the CPU.
  void synchronize(StreamHandle stream = nullptr);

  // The model's shared expert (unfused) on local rank r's unquantized tokens: y = shared(x),
  // x and y [n, H] bf16, n <= max_tokens.
  void shared_expert(int64_t rank, const bf16* x, int64_t n, bf16* y, StreamHandle stream = nullptr);
  // The model's output from the routed output and the shared expert's, as the model adds them:
  // out = bf16(float(routed) + float(shared)), one round-to-nearest rounding; out = routed when
  // shared is null. routed, shared, out: [n, H] bf16 (out may be routed). The one place the sum is
  // formed: every caller (the evaluation's runners, Python's MoeLayer) composes through it.
  void add_shared(const bf16* routed, const bf16* shared, bf16* out, int64_t n, StreamHandle stream = nullptr);
  // forward(), then, with a shared expert, each rank's shared expert on its x into shared[r] ([n_r,
  // H] bf16 scratch) and y = add_shared(y, shared[r]): the layer's whole output. Without a shared
  // expert in the config, forward() alone (shared may be empty).
  void forward_with_shared(std::span<const RankBatch> batches, std::span<bf16* const> shared,
                           StreamHandle stream = nullptr);

  // The host-tensor expert back-end (the CPU only: an error on CUDA).
  ExpertBackend& backend();
  const MoeQuantizers& quantizers() const;
  const Quantizer& dispatch_quantizer(int64_t rank) const;
  const Quantizer& combine_quantizer(int64_t rank) const;
  // Rank 0's quantizers (identical on every rank after calibration) for save_calibration, and
  // loading into every rank.
  std::vector<const Quantizer*> calibration_state() const;
  void load_calibration_file(const std::string& path);
  void set_calibrated_amax(float dispatch_amax, float combine_amax);
  // Where the combine quantizer's re-sum applies the router weight (quant_spec.h); by default the
  // back-end's own. Set apart from the back-end's, the layout check fails on the first call.
  CombineWeighting combine_weighting() const;
  void set_combine_weighting(CombineWeighting w);
  bool layout_checked(int64_t rank) const;
  // Counting of elements beyond the global amax in the forwards that quantize ([2][R]: dispatch,
  // combine), read (on CUDA synchronising `stream`) and reset.
  void set_count_clipping(bool on);
  std::vector<ClipCounts> read_clip_counts(StreamHandle stream = nullptr);

 private:
  LayerDevice device_;
  FakeQuantOps* ops_;                   // owned by the driver
  ExpertBackend* backend_ = nullptr;    // the CPU's, owned by the driver's ops
  std::unique_ptr<FakeQuantDriver> driver_;
  std::shared_ptr<CalibrationObserver> observer_;  // shared with the CPU's ops
};

}  // namespace moefq
