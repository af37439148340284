// combine_qdq_ref: the combine quantizer on host tensors, from qdq_ref and the engine's combine_rows.
#include "moefq/combine_qdq.h"

#include <vector>

#include "engine/expert_cpu.h"
#include "moefq/errors.h"

namespace moefq {

void combine_qdq_ref(const HostCombineRows& r, std::optional<Format> format, float amax, bf16* y) {
  const int64_t K = r.top_k, T = r.num_tokens, H = r.hidden;
  MOEFQ_CHECK(K >= 1 && K <= kMaxCombineRows - 1, "combine: top_k is ", K, "; engine.md allows 1..",
              kMaxCombineRows - 1);
  MOEFQ_CHECK(T >= 0 && H >= 0 && r.slot_stride >= T * H, "combine: bad shape (", T, " tokens, H ", H,
              ", slot stride ", r.slot_stride, ")");
  if (T == 0 || H == 0) return;
  MOEFQ_CHECK(r.rows && y, "combine: null rows or output");
  std::vector<bf16> qrows(format ? size_t(K * H) : 0);
  for (int64_t t = 0; t < T; ++t) {
    const bf16* rows[kMaxCombineRows];
    float w[kMaxCombineRows];
    int n = 0;
    for (int64_t k = 0; k < K; ++k) {
      if (r.topk_idx && r.topk_idx[t * K + k] < 0) continue;
      w[n] = r.topk_weights ? r.topk_weights[t * K + k] : 1.0f;
      const bf16* row = r.rows + k * r.slot_stride + t * H;
      if (format) {
        bf16* q = qrows.data() + n * H;
        qdq_ref(*format, row, q, 1, H, amax);
        row = q;
      }
      rows[n++] = row;
    }
    const int routed = n;
    if (r.shared) rows[n++] = r.shared + t * H;
    combine_rows(rows, n, H, y + t * H, r.topk_weights ? w : nullptr, routed);
  }
}

}  // namespace moefq
