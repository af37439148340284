#include "moefq/qdq.h"

#include <algorithm>
#include <vector>

#include "moefq/errors.h"
#include "moefq/wire_bytes.h"

namespace moefq {

const char* format_name(Format f) {
  switch (f) {
    case Format::kFp8: return "fp8";
    case Format::kNvfp4: return "nvfp4";
    case Format::kMxfp8: return "mxfp8";
    case Format::kMxfp4: return "mxfp4";
    case Format::kInt8: return "int8";
    case Format::kFp8Block128: return "fp8_block128";
    case Format::kFp8Block128Ue8m0: return "fp8_block128_ue8m0";
    case Format::kLogfmt10: return "logfmt10";
    case Format::kFp8Cast: return "fp8_cast";
    case Format::kFp8CastNan: return "fp8_cast_nan";
    case Format::kFp8Block128Ue8m0NoFloor: return "fp8_block128_ue8m0_nofloor";
    case Format::kFp8Block128Mori: return "fp8_block128_mori";
    case Format::kFp4Block128Mori: return "fp4_block128_mori";
    case Format::kFp8Block128DeepGemm: return "fp8_block128_deepgemm";
    case Format::kFp8Block128Vllm: return "fp8_block128_vllm";
    case Format::kFp4Block16FlashInfer: return "fp4_block16_flashinfer";
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
    case Format::kFp8Block128:
    case Format::kFp8Block128Ue8m0: return kFp8BlockSize;
    case Format::kLogfmt10: return kLogFmtBlock;
    case Format::kFp8Block128Ue8m0NoFloor:
    case Format::kFp8Block128Mori:
    case Format::kFp4Block128Mori:
    case Format::kFp8Block128DeepGemm:
    case Format::kFp8Block128Vllm: return kPeerBlock;
    case Format::kFp4Block16FlashInfer: return kFlashInferFp4Block;
    default: return 0;
  }
}

bool format_has_global_amax(Format f) {
  return f == Format::kFp8 || f == Format::kNvfp4 || f == Format::kInt8;
}

double wire_bytes_per_row(std::optional<Format> f, int64_t cols) {
  MOEFQ_ASSERT(cols >= 0, "wire_bytes_per_row: negative cols");
  const auto blocks = [cols](int64_t size) { return double((cols + size - 1) / size); };
  const double nibbles = double((cols + 1) / 2);  // two 4-bit elements per byte
  if (!f) return 2.0 * double(cols);
  switch (*f) {
    case Format::kFp8:
    case Format::kInt8:
    case Format::kFp8Cast:
    case Format::kFp8CastNan: return double(cols);
    case Format::kNvfp4: return nibbles + blocks(kNvfp4Block);
    case Format::kMxfp8: return double(cols) + blocks(kMxBlock);
    case Format::kMxfp4: return nibbles + blocks(kMxBlock);
    case Format::kFp8Block128: return double(cols) + 4.0 * blocks(kFp8BlockSize);
    case Format::kFp8Block128Ue8m0: return double(cols) + blocks(kFp8BlockSize);
    case Format::kLogfmt10: return double((cols * 10 + 7) / 8) + 4.0 * blocks(kLogFmtBlock);
    case Format::kFp8Block128Ue8m0NoFloor: return double(cols) + blocks(kPeerBlock);
    case Format::kFp8Block128Mori:
    case Format::kFp8Block128DeepGemm:
    case Format::kFp8Block128Vllm: return double(cols) + 4.0 * blocks(kPeerBlock);
    case Format::kFp4Block128Mori: return nibbles + 4.0 * blocks(kPeerBlock);
    case Format::kFp4Block16FlashInfer: return nibbles + 2.0 * blocks(kFlashInferFp4Block);
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

// max |x| over the block's non-NaN elements (+inf counts), 0 if none.
template <typename T>
float block_amax(const T* b, int64_t len) {
  float bmax = 0.0f;
  for (int64_t i = 0; i < len; ++i) bmax = max_ignore_nan(bmax, abs_f32(to_f32(b[i])));
  return bmax;
}

// The blocks of one logfmt10 cast group [g0, g1) of a row of bf16-rounded values, and whether the
// group is cast (every block can be). The one cast decision of qdq_ref and logfmt10_cast_groups.
bool logfmt_group(const float* v, int64_t g0, int64_t g1, LogFmtBlock* blocks) {
  bool cast = true;
  for (int64_t b0 = g0, i = 0; b0 < g1; b0 += kLogFmtBlock, ++i) {
    float amax = 0.0f, amin = f32_from_bits(0x7F800000u);
    for (int64_t c = b0; c < std::min(g1, b0 + kLogFmtBlock); ++c) {
      const float a = abs_f32(v[c]);
      if (is_nan(a)) continue;
      amax = a > amax ? a : amax;
      amin = a < amin ? a : amin;
    }
    blocks[i] = logfmt_block(amax, amin);
    cast = cast && blocks[i].ok;
  }
  return cast;
}

// One row's values as bf16 (what logfmt10 reads), in a thread's scratch.
template <typename T>
const float* logfmt_values(const T* x, int64_t cols) {
  thread_local std::vector<float> v;
  v.resize(size_t(cols));
  for (int64_t c = 0; c < cols; ++c) v[size_t(c)] = bf16_to_f32(bf16_round(to_f32(x[c])));
  return v.data();
}

// logfmt10 of one row (numerics.h): the values as bf16, blocks of 128, each cast group cast only
// when all its blocks can be; other groups keep the bf16 values.
template <typename T>
void logfmt_row(const T* x, T* y, int64_t cols) {
  const float* v = logfmt_values(x, cols);
  const int64_t group = int64_t(logfmt_group_blocks(cols)) * kLogFmtBlock;
  for (int64_t g0 = 0; g0 < cols; g0 += group) {
    const int64_t g1 = std::min(cols, g0 + group);
    LogFmtBlock blocks[8];
    const bool cast = logfmt_group(v, g0, g1, blocks);
    for (int64_t c = g0; c < g1; ++c)
      store_out(&y[c], cast ? logfmt_qdq(v[c], blocks[(c - g0) / kLogFmtBlock]) : v[c]);
  }
}

template <typename T>
CastGroups logfmt_cast_groups(const T* x, int64_t rows, int64_t cols) {
  CastGroups g;
  const int64_t group = int64_t(logfmt_group_blocks(cols)) * kLogFmtBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const float* v = logfmt_values(x + r * cols, cols);
    for (int64_t g0 = 0; g0 < cols; g0 += group, ++g.total) {
      LogFmtBlock blocks[8];
      g.cast += logfmt_group(v, g0, std::min(cols, g0 + group), blocks) ? 1u : 0u;
    }
  }
  return g;
}

// A peer rule (numerics.h): per block of peer_block_size (per element for the unscaled casts).
template <PeerRule R, typename T>
void peer_impl(const T* x, T* y, int64_t rows, int64_t cols) {
  constexpr bool kBlocked = peer_block_size(R) > 0;
  for_each_block(
      x, y, rows, cols, kBlocked ? peer_block_size(R) : 1,
      [](const T* b, int64_t len) { return peer_params<R>(kBlocked ? block_amax(b, len) : 0.0f); },
      [](float v, PeerParams p) { return peer_qdq<R>(v, p); });
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
          [gs](const T* b, int64_t len) { return nvfp4_block_scale(block_amax(b, len), gs); },
          [](float v, float scale) { return nvfp4_qdq(v, scale); });
      return;
    }
    case Format::kMxfp8:
    case Format::kMxfp4: {
      const bool fp8 = f == Format::kMxfp8;
      for_each_block(
          x, y, rows, cols, kMxBlock,
          [fp8](const T* b, int64_t len) {
            return mx_scale(mx_block_exponent(block_amax(b, len), fp8 ? kE4m3Max : kE2m1Max));
          },
          [fp8](float v, MxScale s) { return fp8 ? mxfp8_qdq(v, s) : mxfp4_qdq(v, s); });
      return;
    }
    case Format::kFp8Block128:
      for_each_block(
          x, y, rows, cols, kFp8BlockSize, [](const T* b, int64_t len) { return fp8_block128_params(block_amax(b, len)); },
          [](float v, Fp8Params p) { return fp8_qdq(v, p); });
      return;
    case Format::kFp8Block128Ue8m0:
      for_each_block(
          x, y, rows, cols, kFp8BlockSize,
          [](const T* b, int64_t len) { return fp8_block128_ue8m0_scale(block_amax(b, len)); },
          [](float v, MxScale s) { return mxfp8_qdq(v, s); });
      return;
    case Format::kLogfmt10:
      for (int64_t r = 0; r < rows; ++r) logfmt_row(x + r * cols, y + r * cols, cols);
      return;
    case Format::kFp8Cast: return peer_impl<PeerRule::kFp8Cast>(x, y, rows, cols);
    case Format::kFp8CastNan: return peer_impl<PeerRule::kFp8CastNan>(x, y, rows, cols);
    case Format::kFp8Block128Ue8m0NoFloor: return peer_impl<PeerRule::kUe8m0NoFloor>(x, y, rows, cols);
    case Format::kFp8Block128Mori: return peer_impl<PeerRule::kMoriFp8Block>(x, y, rows, cols);
    case Format::kFp4Block128Mori: return peer_impl<PeerRule::kMoriFp4Block>(x, y, rows, cols);
    case Format::kFp8Block128DeepGemm: return peer_impl<PeerRule::kDeepGemmBlock>(x, y, rows, cols);
    case Format::kFp8Block128Vllm: return peer_impl<PeerRule::kVllmBlock>(x, y, rows, cols);
    case Format::kFp4Block16FlashInfer: return peer_impl<PeerRule::kFlashInferFp4>(x, y, rows, cols);
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
      const float sf = stage_scale(block_amax(x + r * cols + c0, c1 - c0));
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

CastGroups logfmt10_cast_groups(const bf16* x, int64_t rows, int64_t cols) { return logfmt_cast_groups(x, rows, cols); }
CastGroups logfmt10_cast_groups(const float* x, int64_t rows, int64_t cols) { return logfmt_cast_groups(x, rows, cols); }

}  // namespace moefq
