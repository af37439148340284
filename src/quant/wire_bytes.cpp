// logfmt10's cast groups (include/moefq/wire_bytes.h): the cast decision of qdq_ref's logfmt_row.
#include "moefq/wire_bytes.h"

#include <algorithm>
#include <optional>

#include "moefq/qdq.h"

namespace moefq {
namespace {

template <typename T>
CastGroups cast_groups_impl(const T* x, int64_t rows, int64_t cols) {
  CastGroups g;
  const int64_t group = int64_t(logfmt_group_blocks(cols)) * kLogFmtBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = x + r * cols;
    for (int64_t g0 = 0; g0 < cols; g0 += group) {
      const int64_t g1 = std::min(cols, g0 + group);
      bool cast = true;
      for (int64_t b0 = g0; b0 < g1 && cast; b0 += kLogFmtBlock) {
        float amax = 0.0f, amin = f32_from_bits(0x7F800000u);
        for (int64_t c = b0; c < std::min(g1, b0 + kLogFmtBlock); ++c) {
          const float a = abs_f32(bf16_to_f32(bf16_round(to_f32(row[c]))));
          if (is_nan(a)) continue;
          amax = a > amax ? a : amax;
          amin = a < amin ? a : amin;
        }
        cast = logfmt_block(amax, amin).ok;
      }
      g.cast += cast ? 1u : 0u;
      ++g.total;
    }
  }
  return g;
}

}  // namespace

CastGroups logfmt10_cast_groups(const bf16* x, int64_t rows, int64_t cols) { return cast_groups_impl(x, rows, cols); }
CastGroups logfmt10_cast_groups(const float* x, int64_t rows, int64_t cols) { return cast_groups_impl(x, rows, cols); }

double logfmt10_bytes_per_row(int64_t cols, double cast_fraction) {
  return cast_fraction * wire_bytes_per_row(Format::kLogfmt10, cols) + (1.0 - cast_fraction) * 2.0 * double(cols);
}

}  // namespace moefq
