#include "moefq/qdq.h"

#include <algorithm>

#include "moefq/errors.h"

namespace moefq {

const char* format_name(Format f) {
  switch (f) {
    case Format::kFp8: return "fp8";
    case Format::kNvfp4: return "nvfp4";
    case Format::kMxfp8: return "mxfp8";
    case Format::kMxfp4: return "mxfp4";
    case Format::kInt8: return "int8";
  }
  return "?";
}

std::optional<Format> parse_format(std::string_view name) {
  for (Format f : kAllFormats)
    if (name == format_name(f)) return f;
  return std::nullopt;
}

std::string format_choices() {
  std::string s;
  for (Format f : kAllFormats) s += (s.empty() ? "" : "|") + std::string(format_name(f));
  return s;
}

int format_block_size(Format f) {
  switch (f) {
    case Format::kNvfp4: return kNvfp4Block;
    case Format::kMxfp8:
    case Format::kMxfp4: return kMxBlock;
    default: return 0;
  }
}

bool format_has_global_amax(Format f) { return format_block_size(f) != kMxBlock; }

double wire_bytes_per_row(std::optional<Format> f, int64_t cols) {
  MOEFQ_ASSERT(cols >= 0, "wire_bytes_per_row: negative cols");
  const auto blocks = [cols](int64_t size) { return double((cols + size - 1) / size); };
  const double nibbles = double((cols + 1) / 2);  // two 4-bit elements per byte
  if (!f) return 2.0 * double(cols);
  switch (*f) {
    case Format::kFp8:
    case Format::kInt8: return double(cols);
    case Format::kNvfp4: return nibbles + blocks(kNvfp4Block);
    case Format::kMxfp8: return double(cols) + blocks(kMxBlock);
    case Format::kMxfp4: return nibbles + blocks(kMxBlock);
  }
  MOEFQ_FAIL(ErrorKind::kInternal, "wire_bytes_per_row: unknown format");
}

namespace {

template <typename T>
float amax_impl(const T* x, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = max_ignore_nan(m, abs_f32(to_f32(x[i])));
  return m;
}

// Applies a per-block rule: for each block of `block` elements of a row, `prepare` maps the
// block's values to a per-block parameter and `elem` maps (x, parameter) to the output value.
template <typename T, typename Prepare, typename Elem>
void for_each_block(const T* x, T* y, int64_t rows, int64_t cols, int64_t block, Prepare prepare,
                    Elem elem) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c0 = 0; c0 < cols; c0 += block) {
      const int64_t c1 = std::min(cols, c0 + block);
      const int64_t base = r * cols;
      const auto param = prepare(x + base + c0, c1 - c0);
      for (int64_t c = c0; c < c1; ++c) store_out(&y[base + c], elem(to_f32(x[base + c]), param));
    }
  }
}

template <typename T>
void qdq_impl(Format f, const T* x, T* y, int64_t rows, int64_t cols, float amax) {
  MOEFQ_ASSERT(rows >= 0 && cols >= 0, "qdq_ref: negative shape");
  const int64_t n = rows * cols;
  switch (f) {
    case Format::kFp8: {
      const Fp8Params p = fp8_params(amax);
      for (int64_t i = 0; i < n; ++i) store_out(&y[i], fp8_qdq(to_f32(x[i]), p));
      return;
    }
    case Format::kInt8: {
      const Int8Params p = int8_params(amax);
      for (int64_t i = 0; i < n; ++i) store_out(&y[i], int8_qdq(to_f32(x[i]), p));
      return;
    }
    case Format::kNvfp4: {
      const float gs = nvfp4_global_scale(amax);
      for_each_block(
          x, y, rows, cols, kNvfp4Block,
          [gs](const T* b, int64_t len) {
            float bmax = 0.0f;
            for (int64_t i = 0; i < len; ++i) bmax = max_ignore_nan(bmax, abs_f32(to_f32(b[i])));
            return nvfp4_block_scale(bmax, gs);
          },
          [](float v, float scale) { return nvfp4_qdq(v, scale); });
      return;
    }
    case Format::kMxfp8:
    case Format::kMxfp4: {
      const bool fp8 = f == Format::kMxfp8;
      for_each_block(
          x, y, rows, cols, kMxBlock,
          [fp8](const T* b, int64_t len) {
            float bmax = 0.0f;
            for (int64_t i = 0; i < len; ++i) bmax = max_ignore_nan(bmax, abs_f32(to_f32(b[i])));
            return mx_scale(mx_block_exponent(bmax, fp8 ? kE4m3Max : kE2m1Max));
          },
          [fp8](float v, MxScale s) { return fp8 ? mxfp8_qdq(v, s) : mxfp4_qdq(v, s); });
      return;
    }
  }
}

}  // namespace

float amax_ref(const bf16* x, int64_t n) { return amax_impl(x, n); }
float amax_ref(const float* x, int64_t n) { return amax_impl(x, n); }

void qdq_ref(Format f, const bf16* x, bf16* y, int64_t rows, int64_t cols, float amax) {
  qdq_impl(f, x, y, rows, cols, amax);
}
void qdq_ref(Format f, const float* x, float* y, int64_t rows, int64_t cols, float amax) {
  qdq_impl(f, x, y, rows, cols, amax);
}

namespace {
template <typename T>
void stage_impl(const T* x, uint8_t* x8, float* scales, int64_t rows, int64_t cols) {
  const int64_t nblocks = (cols + kStageBlock - 1) / kStageBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t c0 = b * kStageBlock, c1 = std::min(cols, c0 + kStageBlock);
      float bmax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) bmax = max_ignore_nan(bmax, abs_f32(to_f32(x[r * cols + c])));
      const float sf = stage_scale(bmax);
      const float inv = div_rn(1.0f, sf);
      for (int64_t c = c0; c < c1; ++c) x8[r * cols + c] = stage_encode(to_f32(x[r * cols + c]), inv);
      scales[r * nblocks + b] = sf;
    }
  }
}
}  // namespace

void stage_e4m3_ref(const bf16* x, uint8_t* x8, float* scales, int64_t rows, int64_t cols) {
  stage_impl(x, x8, scales, rows, cols);
}
void stage_e4m3_ref(const float* x, uint8_t* x8, float* scales, int64_t rows, int64_t cols) {
  stage_impl(x, x8, scales, rows, cols);
}

}  // namespace moefq
