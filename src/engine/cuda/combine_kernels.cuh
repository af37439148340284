// CUDA kernels of docs/engine.md's combine and of docs/fake_quant.md's combine quantizer (QDQ of the active
// routed rows, re-sum, and the device-side layout check), bit-identical to the CPU (combine_rows,
// qdq_ref). Plain host launchers: device pointers, a stream; no host synchronisation, so every
// launch can be captured in a CUDA graph (read_check is the one host-side sync point).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "moefq/numerics.h"
#include "moefq/qdq.h"

namespace moefq::cuda {

// One rank's combine rows as docs/engine.md lays them out: row (slot k, token t) is [H] bf16 at
// buffer + combine_offset + (k * T + t) * H * 2; slot K is the fused shared expert (if any).
// H must be a multiple of 32 (docs/engine.md: of 128) and buffer + combine_offset 16-byte aligned.
struct CombineRows {
  const uint8_t* buffer = nullptr;  // device, the rank's symmetric buffer
  size_t combine_offset = 0;        // bytes, from the engine's sizing function
  int64_t max_tokens = 0 /*T*/, top_k = 0 /*K, 1..32*/, hidden = 0 /*H*/;
  bool fused_shared = false;
  const int32_t* topk_idx = nullptr;  // device [num_tokens, K]; -1 inactive
  int64_t num_tokens = 0;             // <= T
  // With fused_shared: where the shared rows are, device [num_tokens, H] bf16, 16-byte aligned
  // (row t at shared + t * H); null: slot K of the buffer (the engine's layout). Callers holding
  // the rows and the shared expert's output in separate tensors (the Python binding) set it.
  const bf16* shared = nullptr;
  // combine_weighting after: device [num_tokens, K] fp32 router weights (the rank's topk_weights
  // region); each routed row x is added as acc = fma(x, w, acc) (one rounding, numerics.h
  // weighted_add). null: combine_weighting before (the rows are already weighted).
  const float* topk_weights = nullptr;
};

// docs/engine.md's combine: y[t] = bf16(fp32 sum from +0 of the active routed rows (each times its
// router weight when topk_weights is set) in ascending slot order, then the fused shared row,
// never weighted). y: [num_tokens, H] bf16, 16-byte aligned. Rows of inactive slots are never read.
// pdl: launched as a programmatic dependent of the stream's previous kernel (cuda_base/pdl.cuh).
void launch_combine(const CombineRows& rows, bf16* y, cudaStream_t stream, bool pdl = false);

// Device-side record of the layout check (one per buffer/rank); reset_check_record sets it to
// {first = ~0ull, mismatches = 0}. first packs the lowest mismatching position and both values:
// ((token * H + element) << 32) | (engine_bits << 16) | resum_bits (atomicMin keeps the first).
// The record accumulates over launches (graph replays) until read_check reads and resets it.
struct CheckRecord {
  unsigned long long first;
  unsigned long long mismatches;  // elements that differed, summed over launches
};
static_assert(sizeof(CheckRecord) == 16);

struct CombineCheck {
  const bf16* y_engine = nullptr;  // [num_tokens, H] bf16, the engine's output; null = no check
  CheckRecord* record = nullptr;   // device
  bool trap = false;               // opt-in: __trap() on mismatch (kills the CUDA context)
};

// docs/fake_quant.md's combine quantizer. For each token: QDQ each active ROUTED row (blocks along H;
// format f with the global amax *d_amax for fp8/nvfp4/int8, none for mxfp8/mxfp4; quantize =
// false: no QDQ) to bf16, exactly as qdq_ref on a [1, H] row; re-sum exactly like launch_combine
// (each dequantized row times its router weight when rows.topk_weights is set) with the fused
// shared row last and NOT quantized; write y_out ([num_tokens, H] bf16).
// With a check, the same pass also forms the UNQUANTIZED (equally weighted) re-sum and compares its bits with
// y_engine for every token < num_tokens (padding tokens included, as the CPU check does), before
// y_out is written: y_out may alias y_engine. Rows are read once, in place; nothing is written to
// the buffer. d_amax may be null when !quantize or for mxfp8/mxfp4.
void launch_combine_qdq(const CombineRows& rows, bool quantize, Format f, const float* d_amax,
                        const CombineCheck& check, bf16* y_out, cudaStream_t stream);

// Sets *record to "no mismatch" (two memsets on the stream; capturable).
void reset_check_record(CheckRecord* record, cudaStream_t stream);

// The first mismatch of a layout check, decoded.
struct CheckMismatch {
  int64_t token = 0, element = 0;
  uint16_t engine_bits = 0, resum_bits = 0;
  uint64_t count = 0;  // mismatching elements since the last reset
};
// Host side of the check: synchronises the stream, reads the record and, when it holds a
// mismatch, resets it (on the stream) and returns it; nullopt when there was none. Call it at the
// caller's sync points. hidden: the H the record's positions were formed with.
std::optional<CheckMismatch> read_check(CheckRecord* record, int64_t hidden, cudaStream_t stream);

}  // namespace moefq::cuda
