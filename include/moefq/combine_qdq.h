// The combine quantizer of docs/fake_quant.md as one operation on host tensors, for callers that hold
// the combine rows themselves (the Python binding): each active routed row QDQ'd along H, then
// docs/engine.md's re-sum (fp32 from +0, active slots ascending, each routed row times its router
// weight when the rows are unweighted, the shared row last and unquantized, one bf16 rounding).
// FakeQuantMoe's host combine quantizer is this function on its buffer's rows.
#pragma once

#include <cstdint>
#include <optional>

#include "moefq/numerics.h"
#include "moefq/qdq.h"

namespace moefq {

struct HostCombineRows {
  const bf16* rows = nullptr;        // row (slot k, token t), [H] bf16, at rows + k * slot_stride + t * H
  int64_t slot_stride = 0;           // elements from one slot's rows to the next (>= num_tokens * H)
  int64_t top_k = 0;                 // K, 1..32
  int64_t num_tokens = 0, hidden = 0;
  const int32_t* topk_idx = nullptr; // [num_tokens, K]; a negative id marks an inactive slot (its row
                                     // is never read); null: every slot is active
  const bf16* shared = nullptr;      // [num_tokens, H] bf16 added last, unquantized; null: none
  // combine_weighting after: [num_tokens, K] fp32 router weights, each routed row's QDQ'd value q
  // added as acc = fma(q, w, acc) (one rounding, numerics.h weighted_add). null:
  // combine_weighting before (the rows are already weighted).
  const float* topk_weights = nullptr;
};

// y[t] = bf16(sum from +0 of [w[t, k] *] QDQ_f(row (k, t)) over the active slots k ascending, then
// shared[t]).
// format nullopt: no QDQ (docs/engine.md's plain combine). amax: the global amax of fp8, nvfp4 and int8
// (ignored by mxfp8 and mxfp4). y: [num_tokens, H] bf16, must not overlap the rows. Bad shapes are
// errors (bad input).
void combine_qdq_ref(const HostCombineRows& rows, std::optional<Format> format, float amax, bf16* y);

}  // namespace moefq
