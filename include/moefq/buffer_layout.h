// The engine's symmetric buffer (docs/engine.md): one per rank, the same size on every rank, allocated
// once per configuration. This is the only place that computes its size and region offsets;
// everything else (the engine, the fake quantizer) asks it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "moefq/weights.h"

namespace moefq {

struct BufferShape {
  int64_t num_ranks = 1;          // R
  int64_t num_experts = 0;        // E (E % R == 0)
  int64_t max_tokens = 0;         // T, tokens per rank per call at most
  int64_t top_k = 0;              // K
  int64_t hidden = 0;             // H (multiple of 128)
  int64_t intermediate = 0;       // I of a routed expert (multiple of 128)
  int64_t shared_intermediate = 0;  // I * S of the fused shared expert, 0 when not fused
  WeightFormat weight_format = WeightFormat::kE4m3;
  Staging staging = Staging::kE4m3;  // the staged regions hold e4m3 with scales, or bf16 (none)

  // Bytes of one staged element (x and h): 1 (e4m3) or 2 (bf16, staging none).
  int64_t staged_elem_bytes() const { return staging == Staging::kNone ? 2 : 1; }
  int64_t local_experts() const { return num_experts / num_ranks; }
  int64_t fused_shared_slots() const { return shared_intermediate > 0 ? 1 : 0; }
  // Rows an expert rank can receive in one call: every token of every rank, once per local
  // expert it picked (at most min(K, E/R) of them).
  int64_t pool_rows() const;
  void validate() const;  // throws (bad input) naming the field
};

// A region: byte offset from the buffer start and size; offsets are 256-byte aligned.
struct Region {
  size_t offset = 0, bytes = 0;
};

class BufferLayout {
 public:
  explicit BufferLayout(const BufferShape& shape);

  const BufferShape& shape() const { return shape_; }
  size_t total_bytes() const { return total_; }

  // In order. workspace: int32 per-local-expert counters [E/R], per-local-expert entry lists
  // [E/R][R * T] (entry = (src_rank * T + token) * K + slot), then rank_state: 16 int32, of which
  // [0] is the num_tokens of this rank's call, published there for the expert ranks when the
  // ranks are real processes (a peer's host does not know it); the rest is reserved.
  Region workspace, expert_counts, expert_lists, rank_state;
  // The staged regions hold e4m3 elements with fp32 scales, or bf16 elements and no scales (the
  // scale regions then have 0 bytes) when shape.staging is none.
  Region staged_x;       // [T, H] e4m3 or bf16
  Region staged_scales;  // [T, H/128] fp32
  Region topk_idx;       // [T, K] int32
  Region topk_weights;   // [T, K] fp32
  Region pool_x;         // [pool_rows, H] e4m3 or bf16: rows pulled from the token ranks
  Region pool_x_scales;  // [pool_rows, H/128] fp32
  Region pool_h;         // [pool_rows + T, I_max] e4m3 or bf16: SwiGLU outputs (shared expert last)
  Region pool_h_scales;  // [pool_rows + T, I_max/128] fp32
  Region combine;        // LAST: [K + fused_shared_slots][T][H] bf16

  // Byte offset of the combine region; the fake quantizer reads rows through this.
  size_t combine_offset() const { return combine.offset; }
  // Byte offset of row p[token, slot] (slot K is the fused shared expert).
  size_t combine_row_offset(int64_t slot, int64_t token) const;
  std::string describe() const;  // a table of the regions

 private:
  BufferShape shape_;
  size_t total_ = 0;
};

}  // namespace moefq
