// combine_qdq_ref: the combine quantizer on host tensors, from qdq_ref and the engine's combine_rows.
#include "moefq/combine_qdq.h"

#include <vector>

#include "engine/expert_cpu.h"
#include "moefq/errors.h"

namespace moefq {

void combine_qdq_ref(const HostCombineRows& r, std::optional<Format> format, float amax, bf16* y) {
  const int64_t K = r.top_k, T = r.num_tokens, H = r.hidden;
  MOEFQ_CHECK(K >= 1 && K <= kMaxCombineRows - 1, "combine: top_k is ", K, "; top-k must be 1..",
              kMaxCombineRows - 1);
  MOEFQ_CHECK(T >= 0 && H >= 0 && r.slot_stride >= T * H, "combine: bad shape (", T, " tokens, H ", H,
              ", slot stride ", r.slot_stride, ")");
  if (T == 0 || H == 0) return;
  MOEFQ_CHECK(r.rows && y, "combine: null rows or output");
  std::vector<bf16> qrows(format ? size_t(K * H) : 0);
  const std::vector<int32_t> all_active(static_cast<size_t>(K), 0);  // for a null topk_idx
  for (int64_t t = 0; t < T; ++t) {
    // Slot k's row, QDQ'd into qrows first when a format is given; slot K is the shared row.
    const auto row = [&](int64_t k) -> const bf16* {
      if (k == K) return r.shared + t * H;
      const bf16* x = r.rows + k * r.slot_stride + t * H;
      if (!format) return x;
      bf16* q = qrows.data() + k * H;
      qdq_ref(*format, x, q, 1, H, amax);
      return q;
    };
    combine_token(r.topk_idx ? r.topk_idx + t * K : all_active.data(), r.topk_weights ? r.topk_weights + t * K : nullptr,
                  K, r.shared != nullptr, H, row, y + t * H);
  }
}

}  // namespace moefq
