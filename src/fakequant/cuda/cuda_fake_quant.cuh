// The CUDA implementation behind FakeQuantMoe (moefq/fake_quant_moe.h, LayerDevice::kCuda), and
// CudaFakeQuantMoe: that same layer as code holding CUDA types sees it (cudaStream_t, the engine,
// the device amax; the kernels' tests, the benchmarks, real ranks). Fake quantization of MoE
// dispatch and combine (docs/fake_quant.md) around the CUDA engine, all on the device: the shared
// driver (fakequant/fake_quant_driver.h) over device primitives. Dispatch QDQ
// out of place, combine QDQ + exact re-sum in one kernel that reads the rows once, max calibration
// on the device (MAX over the ranks at the end: simulated ones on the host, real ones through the
// engine's RankLink all-reduce), and the layout check: eager (one host synchronisation, once per
// buffer, on the first call with routed rows) or, when a CUDA graph is captured before a buffer was
// checked, recorded in the graph: every replay compares on the device and a mismatch sets the
// buffer's error record, which synchronize() turns into the eager check's error (or, opt-in,
// traps and kills the context). It works on the ranks its engine computes; a per-rank index i
// below is rank engine().first_rank() + i.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cuda_base/device_buffer.h"
#include "engine/cuda/cuda_engine.cuh"
#include "moefq/fake_quant_moe.h"
#include "moefq/moe_quantizers.h"

namespace moefq::cuda {

class CudaFakeQuantOps;

// The fake-quantized layer on this engine (its first_rank() .. : the ranks the layer computes), as
// FakeQuantMoe::make(LayerDevice::kCuda) makes it from weights: for a caller that made the engine
// itself (the evaluation's device runner generates the weights in place).
std::unique_ptr<FakeQuantMoe> make_fake_quant_moe(std::unique_ptr<CudaEngine> engine, int64_t layer);

class CudaFakeQuantMoe {
 public:
  CudaFakeQuantMoe(std::unique_ptr<CudaEngine> engine, int64_t layer);
  ~CudaFakeQuantMoe();

  std::vector<std::string> quantizer_names() const;
  // As FakeQuantMoe::configure (the same errors), then the amax values go to the device.
  void configure(const std::map<std::string, QuantizerConfig>& configs);
  // Calibration starts and finishes on the host (both synchronise the device); the forwards in
  // between collect on the device. Real ranks: finish_calibration is collective.
  void start_calibration();
  void finish_calibration();
  // Leaves a calibration that did not finish: as FakeQuantMoe::abort_calibration.
  void abort_calibration();
  // Each local rank's own max of the last calibration, before the reduction (which 0: dispatch).
  const std::vector<float>& rank_amax(int which) const;
  void load_calibration_file(const std::string& path);
  void set_calibrated_amax(float dispatch_amax, float combine_amax);
  // Where the combine quantizer's re-sum applies the router weight; by default the engine's own
  // (EngineOptions::combine_weighting). Set apart from it, the layout check fails.
  CombineWeighting combine_weighting() const;
  void set_combine_weighting(CombineWeighting w);

  // One call of every rank, enqueued on `stream`; batches[r].y receives rank r's output. No host
  // synchronisation, except the eager layout check (once per buffer). Once a rank's buffer passed
  // the check, its combine quantizer's re-sum is y's only writer: the engine skips its combine.
  void forward(std::span<const DeviceBatch> batches, cudaStream_t stream);
  // The quantizers' own work in forward() without the engine call (dispatch QDQ, combine QDQ +
  // re-sum over the rows the last forward left): with the engine's combine that a checked
  // combine quantizer skips (CudaEngine::combine), what the benchmarks time as their cost.
  void quantizers_only(std::span<const DeviceBatch> batches, cudaStream_t stream);
  // Synchronises `stream` and raises (kFailedCheck) a barrier timeout of real ranks, else the
  // first mismatch a device-side layout check recorded since the last call (the eager check's
  // message).
  void synchronize(cudaStream_t stream);
  // Opt-in: a device-side mismatch traps (the CUDA context is lost) instead of being recorded.
  // Also set by MOEFQ_LAYOUT_CHECK_TRAP=1. Applies to checks enqueued or captured afterwards.
  void set_trap_on_mismatch(bool trap);
  // Counting of elements beyond the global amax in the forwards that quantize ([2][R]: dispatch,
  // combine), read (synchronising) and reset.
  void set_count_clipping(bool on);
  std::vector<ClipCounts> read_clip_counts(cudaStream_t stream);

  // The global amax every QDQ reads on the device ([2][R]: dispatch, combine), which graphs read
  // at replay, not at capture: a caller that replays graphs captured under different
  // configurations restores each one's values first (bench moe does).
  DeviceBuffer<float>& device_amax();

  CudaEngine& engine();
  const MoeQuantizers& quantizers() const;
  bool layout_checked(int64_t rank) const;
  // Where the combine rows are read: the engine layout's combine offset. Changing it simulates a
  // back-end whose layout changed (the layout check's own tests use this).
  size_t combine_offset() const;
  void set_combine_offset(size_t offset);

  // The layer facade this face works on (shared_expert, add_shared, ...).
  FakeQuantMoe& layer() { return *layer_; }

 private:
  CudaFakeQuantOps* ops_ = nullptr;  // owned by layer_'s driver
  std::unique_ptr<FakeQuantMoe> layer_;
};

}  // namespace moefq::cuda
