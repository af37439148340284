// The fused MoE layer on a Hopper GPU (docs/engine.md): the same contract and buffer layout as the CPU
// engine (its reference). Either R simulated ranks on one GPU, each with its own symmetric buffer
// in device memory, or one real rank of R, one process per GPU, whose buffer is a symmetric
// buffer of a RankLink (NCCL) and whose peers' buffers are reached by loads and stores over NVLink.
// Both run the same kernels, each launch computing for the ranks this process holds, so they give
// the same bits. A forward is a fixed sequence of kernels on one stream with every per-call count
// kept on the device, so it does no host synchronisation and can be captured in a CUDA graph:
//   stage x (e4m3, 1x128) and publish topk -> [real ranks: barrier] -> dispatch (per expert, its
//   (token, slot) entries in (rank, token, slot) order, the CPU engine's order) -> plan (pool
//   offsets; the dispatch counters are reset here: the workspace cleans itself) -> pull the staged
//   rows into the expert rank's pool -> grouped gate/up GEMM with the SwiGLU epilogue -> grouped
//   down GEMM writing bf16 rows into the token rank's combine region -> [real ranks: barrier] ->
//   combine.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "cuda_base/device_buffer.h"
#include "engine/cuda/rank_link.h"
#include "moefq/buffer_layout.h"
#include "moefq/cpu_engine.h"

namespace moefq::cuda {

// One rank's tensors of a call, all in device memory: RankBatch's fields and meaning
// (x [num_tokens, H] bf16, topk_idx and topk_weights [num_tokens, K], y [num_tokens, H] bf16).
using DeviceBatch = RankBatch;

// Where one set of experts' weights live on the device (a rank's routed experts, or its shared
// expert): expert e's gate/up [2I, H] at gate_up + e * 2I * H elements with its fp32 128 x 128
// block scales [2I/128, H/128] at gate_up_scale + e * (2I/128) * (H/128), down [H, I] and its
// scales likewise (scales null for bf16 weights). `count` is 0 for an absent set.
struct DeviceExpertSet {
  uint8_t* gate_up;
  float* gate_up_scale;
  uint8_t* down;
  float* down_scale;
  int64_t count, inter;
};
// Fills rank `rank`'s sets (enqueued on the caller's streams; the engine's first call must come
// after them, on a stream that waits for them).
using WeightFill = std::function<void(int64_t rank, const DeviceExpertSet& routed, const DeviceExpertSet& shared)>;

class CudaEngine {
 public:
  // R simulated ranks on the current GPU: uploads each rank's weights (rank_weights as for
  // CpuEngine) and allocates the buffers.
  CudaEngine(const MoeConfig& cfg, int64_t num_ranks, int64_t max_tokens,
             const std::vector<LayerWeights>& rank_weights, EngineOptions options = {});
  // R simulated ranks whose weights are made on the device: allocates each rank's expert sets in
  // `format` and calls fill(rank, routed, shared) for every rank (weights generated there, or copied
  // from pinned staging), without a host copy of the layer.
  CudaEngine(const MoeConfig& cfg, int64_t num_ranks, int64_t max_tokens, WeightFormat format, const WeightFill& fill,
             EngineOptions options = {});
  // One real rank, link.rank() of link.num_ranks(), on the current GPU: rank_weights are its own
  // experts (first_expert = rank * E/R). Collective: every rank builds its engine of the same
  // configuration at the same point (the buffers come from link.symmetric_buffers). The link
  // outlives the engine.
  CudaEngine(const MoeConfig& cfg, RankLink& link, int64_t max_tokens, const LayerWeights& rank_weights,
             EngineOptions options = {});
  ~CudaEngine();
  CudaEngine(const CudaEngine&) = delete;
  CudaEngine& operator=(const CudaEngine&) = delete;

  // One call of every rank this process computes (batches[i] is rank first_rank() + i's),
  // enqueued on `stream`; real ranks: every rank calls it, in the same order (it holds two
  // barriers). Checks what the host knows (batch count, token counts, null tensors); expert ids
  // are device data and are not validated here (an id outside [-1, E) is never dispatched; the
  // host-tensor back-end validates before upload). With MOEFQ_COMM_KERNEL_DEBUG=1 (read at
  // construction) every buffer of this process is zeroed after the call. skip_combine (empty or
  // one per local rank): ranks whose y the caller replaces with its own sum of the combine rows
  // (the combine quantizer once its layout check passed); their combine is not run and their y
  // is left as it was (the barrier before the combine still is).
  void forward(std::span<const DeviceBatch> batches, cudaStream_t stream, const std::vector<bool>& skip_combine = {});
  // The combine of forward() alone, on the rows the last forward left in the buffers (the
  // benchmarks time what skip_combine saves).
  void combine(std::span<const DeviceBatch> batches, cudaStream_t stream, const std::vector<bool>& skip = {});

  // The shared expert run on its own (not fused): y = shared(x), [n, H] bf16 device tensors,
  // n <= max_tokens.
  void shared_expert(int64_t rank, const bf16* x, int64_t n, bf16* y, cudaStream_t stream);

  // Synchronises `stream`; real ranks: then raises a barrier timeout the link recorded (a peer
  // that died, hung or skipped a call), before anything reads rows that rank never wrote.
  void synchronize(cudaStream_t stream);

  const MoeConfig& config() const { return cfg_; }
  const BufferLayout& layout() const { return layout_; }
  int64_t num_ranks() const { return layout_.shape().num_ranks; }  // R, all ranks of the layer
  // The ranks this process computes: first_rank() .. first_rank() + num_local_ranks() - 1 (all R
  // when simulated, one when real).
  int64_t first_rank() const { return first_rank_; }
  int64_t num_local_ranks() const { return int64_t(ranks_.size()); }
  RankLink* link() const { return link_; }  // null when the ranks are simulated
  int64_t max_tokens() const { return layout_.shape().max_tokens; }
  bool fused_shared() const { return layout_.shape().fused_shared_slots() > 0; }
  // Where the router weight is applied: the routed rows' SwiGLU (before) or the combine (after).
  CombineWeighting combine_weighting() const { return weighting_; }
  // Rank r's symmetric buffer (device memory of this GPU, layout().total_bytes()); r must be a
  // rank this process computes.
  const uint8_t* buffer(int64_t rank) const;

 private:
  // combine() on each rank; pdl: the stream's previous operation is one of forward()'s kernels.
  void combine_ranks(std::span<const DeviceBatch> batches, cudaStream_t stream, const std::vector<bool>& skip, bool pdl);
  struct RankState;
  void init(std::span<const LayerWeights> rank_weights, const WeightFill* fill);

  MoeConfig cfg_;
  BufferLayout layout_;
  bool debug_zeroing_ = false;
  CombineWeighting weighting_ = CombineWeighting::kBefore;
  RankLink* link_ = nullptr;
  int64_t first_rank_ = 0;
  std::vector<std::unique_ptr<RankState>> ranks_;  // [num_local_ranks]
  DeviceBuffer<uint8_t> rank_ptrs_;  // [R] per-rank device pointers for the kernels
};

}  // namespace moefq::cuda
