// The expert computation of the CPU backends (docs/engine.md, steps 1-5 of a routed row), shared by the
// fused engine and the modular layer so that both produce the same bits.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "engine/gemm_cpu.h"
#include "moefq/cpu_engine.h"
#include "moefq/numerics.h"
#include "moefq/weights.h"

namespace moefq {

// An expert's weights as the GEMM reads them: views of an ExpertWeights' e4m3 codes and block
// scales, or its bf16 values, which must outlive this (the engines own their weights).
struct PreparedExpert {
  int64_t hidden = 0, inter = 0;
  GemmWeights gate_up, down;  // [2I, H] and [H, I]

  // Checks the shape against (hidden, inter); throws (bad input) naming both.
  PreparedExpert(const ExpertWeights& w, int64_t hidden, int64_t inter);
};

// Up to kGemmRows rows through one expert, all with the same staging (weights.h). Row r reads its
// input a[r] ([H]: e4m3 codes with a_scale[r] [H/128] fp32, or bf16 with staging none), is
// weighted by weight[r], leaves its SwiGLU output in h[r] ([I]: re-staged e4m3 with h_scale[r]
// [I/128], or bf16) and its output row in out[r] ([H] bf16). The scale pointers are unused (null)
// with staging none.
struct ExpertGroup {
  const PreparedExpert* expert = nullptr;
  Staging staging = Staging::kE4m3;
  int n = 0;
  const void* a[kGemmRows];
  const float* a_scale[kGemmRows];
  float weight[kGemmRows];
  void* h[kGemmRows];
  float* h_scale[kGemmRows];
  bf16* out[kGemmRows];
};

// Appends a row, starting a new group when asked (a new expert) or when the last one is full.
void add_expert_row(std::vector<ExpertGroup>& groups, const PreparedExpert* e, Staging staging, bool new_group,
                    const void* a, const float* a_scale, float weight, void* h, float* h_scale, bf16* out);

// Runs every group (in any order, on num_threads threads: each writes only its own rows).
void run_expert_groups(const std::vector<ExpertGroup>& groups, std::optional<float> swiglu_clamp,
                       int num_threads);

// An expert on whole tokens, weight 1 (the shared expert run on its own): stages x ([n, H] bf16)
// as `staging` says and writes y ([n, H] bf16).
void run_expert_on_tokens(const PreparedExpert& e, Staging staging, const bf16* x, int64_t n, bf16* y,
                          std::optional<float> swiglu_clamp, int num_threads);

// The most rows a token's combine reads: K <= 32 routed slots and the fused shared slot.
inline constexpr int kMaxCombineRows = 33;

// docs/engine.md's combine of one token: y[h] = bf16 of the fp32 sum from +0 of rows[0][h],
// rows[1][h], ... in the given order (the active routed slots ascending, then the fused shared
// slot). rows: n pointers to [H] bf16 rows; y: [H] bf16. weights (combine_weighting after): null,
// or the fp32 router weight of each of the first num_weighted rows (the routed ones), which then
// add as acc = fma(row[h], weights[i], acc) (numerics.h weighted_add): one rounding, as DeepEP's
// low-latency combine accumulates.
void combine_rows(const bf16* const* rows, int n, int64_t H, bf16* y, const float* weights = nullptr,
                  int num_weighted = 0);

// combine_rows for one token whose slot k's row is row(k) ([H] bf16): the active routed slots
// (idx[k] >= 0, idx: [K]) ascending, each weighted by weights[k] when weights ([K] fp32) is not
// null, then slot K when fused. y: [H] bf16.
template <typename RowOfSlot>
void combine_token(const int32_t* idx, const float* weights, int64_t K, bool fused, int64_t H, RowOfSlot row, bf16* y) {
  const bf16* rows[kMaxCombineRows];
  float w[kMaxCombineRows];
  int n = 0;
  for (int64_t k = 0; k < K; ++k)
    if (idx[k] >= 0) {
      w[n] = weights ? weights[k] : 1.0f;
      rows[n++] = row(k);
    }
  const int routed = n;
  if (fused) rows[n++] = row(K);
  combine_rows(rows, n, H, y, weights ? w : nullptr, routed);
}

// Checks one call's batches (one per rank) against the layer: the batch count, at most max_tokens
// tokens per rank, no null tensors, expert ids in [-1, E) and no expert picked twice by a token.
// Errors (bad input) name the rank, token and slot.
void validate_batches(std::span<const RankBatch> batches, int64_t num_ranks, int64_t max_tokens, int64_t num_experts,
                      int64_t top_k);

// Threads to use for `requested` (0: all hardware threads).
int resolve_threads(int requested);

}  // namespace moefq
