// The fused MoE layer on the CPU (docs/engine.md): the reference every other backend is checked
// against. R simulated ranks in one process, each with its own symmetric buffer and tokens; rows
// move between the buffers as they would over NVLink. One forward() is one call of every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "moefq/buffer_layout.h"
#include "moefq/moe_config.h"
#include "moefq/quant_spec.h"
#include "moefq/weights.h"

namespace moefq {

struct PreparedExpert;  // src/engine/expert_cpu.h

struct EngineOptions {
  bool fuse_shared = true;  // the shared expert as combine slot K (else the caller runs it)
  int num_threads = 0;      // 0: all hardware threads
  // Where the router weight is applied (quant_spec.h): in the SwiGLU step (before, the combine
  // rows are weighted) or in the combine (after, the rows are unweighted). Sizing and layout do
  // not depend on it.
  CombineWeighting combine_weighting = CombineWeighting::kBefore;
  // The activations into the expert GEMMs (weights.h): e4m3 with 1x128 scales, or bf16 (none).
  // The engine's default is e4m3 whatever the weights; callers that follow the model
  // (eval, the CLI, Python) pass default_staging's choice. It sizes the staged buffer regions.
  Staging staging = Staging::kE4m3;
};

// One rank's inputs and output of a call.
struct RankBatch {
  const bf16* x = nullptr;               // [num_tokens, H]
  int64_t num_tokens = 0;                // <= max_tokens
  const int32_t* topk_idx = nullptr;     // [num_tokens, K], global expert ids, -1 inactive
  const float* topk_weights = nullptr;   // [num_tokens, K], routed scaling folded in
  bf16* y = nullptr;                     // [num_tokens, H] output
};

// The buffer shape of a layer (every engine of the configuration sizes its buffer with this):
// the shared expert fused as slot K when options.fuse_shared and the config has one; the weight
// format of the first expert of rank_weights (the ranks an engine holds: all of them, or a real
// rank its own); options.staging.
BufferShape engine_buffer_shape(const MoeConfig& cfg, int64_t num_ranks, int64_t max_tokens,
                                std::span<const LayerWeights> rank_weights, const EngineOptions& options);

class CpuEngine {
 public:
  // rank_weights[r] holds rank r's local experts (E/R of them, first_expert = r * E/R) and, when
  // the config has shared experts, the shared expert. The engine keeps them as they are (e4m3
  // codes and scales, or bf16): pass an rvalue to hand them over without a copy.
  CpuEngine(const MoeConfig& cfg, int64_t num_ranks, int64_t max_tokens, std::vector<LayerWeights> rank_weights,
            EngineOptions options = {});
  ~CpuEngine();

  // One call of every rank: batches[r] is rank r's. Validates the inputs (bad input errors name
  // the rank, token and slot). With MOEFQ_COMM_KERNEL_DEBUG=1 every buffer is zeroed afterwards.
  void forward(std::span<const RankBatch> batches);

  // The shared expert run separately, as the model does when it is not fused: y = shared(x) for
  // one rank's tokens (same numerics as the fused slot).
  void shared_expert(int64_t rank, const bf16* x, int64_t num_tokens, bf16* y) const;

  const MoeConfig& config() const { return cfg_; }
  const EngineOptions& options() const { return opt_; }
  const BufferLayout& layout() const { return layout_; }
  int64_t num_ranks() const { return layout_.shape().num_ranks; }
  // Rank r's symmetric buffer, as the engine left it after the last call.
  std::span<const uint8_t> buffer(int64_t rank) const;

 private:
  MoeConfig cfg_;
  EngineOptions opt_;
  BufferLayout layout_;
  std::vector<std::vector<uint8_t>> buffers_;         // [R][total_bytes]
  std::vector<LayerWeights> weights_;                 // [R], what experts_ and shared_ read
  std::vector<std::vector<PreparedExpert>> experts_;  // [R][E/R]
  std::vector<PreparedExpert> shared_;                // [R] or empty
  int num_threads_ = 1;
};

}  // namespace moefq
