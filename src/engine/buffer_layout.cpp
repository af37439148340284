#include "moefq/buffer_layout.h"

#include <algorithm>

#include "moefq/errors.h"
#include "moefq/numerics.h"

namespace moefq {

int64_t BufferShape::pool_rows() const {
  return num_ranks * max_tokens * std::min(top_k, local_experts());
}

void BufferShape::validate() const {
  MOEFQ_CHECK(num_ranks >= 1, "buffer: num_ranks must be >= 1, got ", num_ranks);
  MOEFQ_CHECK(num_experts >= 1 && num_experts % num_ranks == 0, "buffer: num_experts (", num_experts,
              ") must be a positive multiple of num_ranks (", num_ranks, ")");
  MOEFQ_CHECK(max_tokens >= 1, "buffer: max_tokens must be >= 1, got ", max_tokens);
  MOEFQ_CHECK(top_k >= 1 && top_k <= 32 && top_k <= num_experts, "buffer: top_k must be in [1, min(32, E)], got ", top_k);
  MOEFQ_CHECK(hidden > 0 && hidden % kStageBlock == 0, "buffer: hidden must be a positive multiple of 128, got ", hidden);
  MOEFQ_CHECK(intermediate > 0 && intermediate % kStageBlock == 0,
              "buffer: intermediate must be a positive multiple of 128, got ", intermediate);
  MOEFQ_CHECK(shared_intermediate >= 0 && shared_intermediate % kStageBlock == 0,
              "buffer: shared_intermediate must be a multiple of 128, got ", shared_intermediate);
}

BufferLayout::BufferLayout(const BufferShape& s) : shape_(s) {
  s.validate();
  size_t cursor = 0;
  auto take = [&cursor](size_t bytes) {
    const Region r{cursor, bytes};
    cursor = (cursor + bytes + 255) / 256 * 256;
    return r;
  };
  const size_t el = size_t(s.local_experts()), R = size_t(s.num_ranks), T = size_t(s.max_tokens);
  const size_t K = size_t(s.top_k), H = size_t(s.hidden), P = size_t(s.pool_rows());
  const size_t imax = size_t(std::max(s.intermediate, s.shared_intermediate));
  const size_t eb = size_t(s.staged_elem_bytes()), scaled = s.staging == Staging::kNone ? 0 : 1;
  const size_t ws_begin = cursor;
  expert_counts = take(el * 4);
  expert_lists = take(el * R * T * 4);
  rank_state = take(16 * 4);
  workspace = {ws_begin, cursor - ws_begin};
  staged_x = take(T * H * eb);
  staged_scales = take(T * (H / kStageBlock) * 4 * scaled);
  topk_idx = take(T * K * 4);
  topk_weights = take(T * K * 4);
  pool_x = take(P * H * eb);
  pool_x_scales = take(P * (H / kStageBlock) * 4 * scaled);
  pool_h = take((P + T) * imax * eb);
  pool_h_scales = take((P + T) * (imax / kStageBlock) * 4 * scaled);
  combine = take((K + size_t(s.fused_shared_slots())) * T * H * 2);
  total_ = cursor;
}

size_t BufferLayout::combine_row_offset(int64_t slot, int64_t token) const {
  MOEFQ_ASSERT(slot >= 0 && slot < shape_.top_k + shape_.fused_shared_slots() && token >= 0 &&
                   token < shape_.max_tokens,
               "combine_row_offset: slot ", slot, " token ", token, " out of range");
  return combine.offset + size_t(slot * shape_.max_tokens + token) * size_t(shape_.hidden) * 2;
}

std::string BufferLayout::describe() const {
  std::string s;
  const std::pair<const char*, const Region*> rows[] = {
      {"workspace", &workspace},   {"staged_x", &staged_x}, {"staged_scales", &staged_scales},
      {"topk_idx", &topk_idx},     {"topk_weights", &topk_weights}, {"pool_x", &pool_x},
      {"pool_x_scales", &pool_x_scales}, {"pool_h", &pool_h}, {"pool_h_scales", &pool_h_scales},
      {"combine", &combine}};
  for (const auto& [name, r] : rows) s += detail::concat(name, " @", r->offset, " +", r->bytes, "\n");
  return s + detail::concat("total ", total_, " bytes\n");
}

}  // namespace moefq
