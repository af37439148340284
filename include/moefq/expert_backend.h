// Expert back-ends: the MoE layer implementations the fake quantizers wrap, registered by kind.
// Built in: "mega_moe" (the fused engine; its combine rows live in the symmetric buffer) and
// "routed_experts" (a modular layer: prepare, dispatch, expert GEMMs, finalize). Both compute the
// same bits for the same inputs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moefq/cpu_engine.h"

namespace moefq {

class ExpertBackend {
 public:
  virtual ~ExpertBackend() = default;
  virtual std::string kind() const = 0;
  virtual const MoeConfig& config() const = 0;
  virtual int64_t num_ranks() const = 0;
  virtual int64_t max_tokens() const = 0;
  virtual bool fused_shared() const = 0;
  // Where the layer applies the router weight (EngineOptions::combine_weighting).
  virtual CombineWeighting combine_weighting() const { return CombineWeighting::kBefore; }
  // One call of every rank; batches[r] is rank r's (x already dispatch-quantized by the caller).
  virtual void forward(std::span<const RankBatch> batches) = 0;
  // Where rank r's combine rows p[t, k] are after forward(): combine_bytes(r) from
  // combine_offset(), laid out [K + fused][max_tokens][H] bf16 (docs/engine.md). nullopt when this
  // kind cannot expose them (then no combine quantizer can be enabled on it).
  virtual std::optional<size_t> combine_offset() const = 0;
  virtual std::span<const uint8_t> combine_bytes(int64_t rank) const = 0;
  // The size of the region combine_bytes() covers (the same for every rank).
  virtual size_t buffer_bytes() const { return combine_bytes(0).size(); }
  // The shared expert run separately (when not fused): y = shared(x), [n, H] bf16.
  virtual void shared_expert(int64_t rank, const bf16* x, int64_t n, bf16* y) const = 0;
};

// A factory gets the weights by value: a back-end may keep them (the CPU ones do) without a copy.
using ExpertBackendFactory = std::function<std::unique_ptr<ExpertBackend>(
    const MoeConfig&, int64_t num_ranks, int64_t max_tokens, std::vector<LayerWeights>, EngineOptions)>;

// Registers a kind (replacing one of the same name).
void register_expert_backend(const std::string& kind, ExpertBackendFactory factory);
std::vector<std::string> expert_backend_kinds();
// Throws (bad input) for an unknown kind, listing the registered ones.
std::unique_ptr<ExpertBackend> make_expert_backend(const std::string& kind, const MoeConfig& cfg, int64_t num_ranks,
                                                   int64_t max_tokens, std::vector<LayerWeights> weights,
                                                   EngineOptions options = {});

}  // namespace moefq
