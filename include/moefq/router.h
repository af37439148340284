// The MoE router (docs/models.md): gate logits in fp32, scoring (sigmoid, softmax, sqrtsoftplus), the
// noaux_tc correction bias (selection only), group-limited top-k, normalisation and the routed
// scaling factor. Output: topk_idx [T, K] int32 (-1 = inactive slot) and topk_weights [T, K] fp32.
#pragma once

#include <cstdint>
#include <vector>

#include "moefq/moe_config.h"
#include "moefq/numerics.h"

namespace moefq {

struct Routing {
  int64_t num_tokens = 0, top_k = 0;
  std::vector<int32_t> topk_idx;     // [num_tokens, top_k], global expert ids, -1 inactive
  std::vector<float> topk_weights;   // [num_tokens, top_k], scaling factor folded in; 0 if inactive
};

// x: [num_tokens, H] bf16; gate: [E, H] fp32 (the router weight); bias: [E] fp32 or empty (the
// e_score_correction_bias, used only when cfg.noaux_tc; empty = zero bias). padding: [num_tokens]
// or empty; a padding token gets all slots -1 and weights 0.
// Rules (all fp32, no FMA): logit[t][e] = sum_h x[t][h] * gate[e][h] as 8 lane sums (lane h % 8,
// h ascending, from +0) combined ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)); score s = sigmoid | softmax
// over E | sqrt(softplus), computed with numerics.h's portable functions (sigmoid_f32,
// softplus_f32 with its threshold 20, sqrt_rn, exp_f32; softmax: max over the non-NaN logits,
// exp_f32(l - max), summed in ascending e from +0, each divided by the sum); selection score =
// s + bias (noaux_tc) or s. Groups (n_group > 1): group score = top-2 sum of selection scores
// (noaux_tc) or their max (otherwise); the topk_group best groups are kept, then the K best
// experts of the kept groups. Every ordering is by descending value, ties to the lower id, NaN
// below -inf. Slots come in that order; weight = s of the expert (no bias), divided by
// (sum + 1e-20f) if norm_topk_prob (sum: slot order, from +0), times routed_scaling; a NaN weight
// is the canonical NaN. The per-token rules live in src/engine/router_rules.h, shared with the
// CUDA router (src/engine/cuda/router_kernels.cuh), which gives the same ids and weight bits.
// Deterministic: a token's result depends only on its own row, whatever num_tokens, chunking or
// threading. num_threads: 0 = automatic (threads from 256 tokens on), otherwise at most that many.
Routing route(const MoeConfig& cfg, const bf16* x, int64_t num_tokens, const std::vector<float>& gate,
              const std::vector<float>& bias, const std::vector<bool>& padding = {},
              int num_threads = 0);

// The fp32 gate logit of one token row (the accumulation order above). x: [H] bf16, g: [H] fp32.
float gate_logit(const bf16* x, const float* g, int64_t hidden);

// Marks tokens as padding after the fact (all slots -1, weights 0).
void mark_padding(Routing& r, int64_t token);

}  // namespace moefq
