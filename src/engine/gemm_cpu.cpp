#include "engine/gemm_cpu.h"

#include <bit>
#include <vector>

namespace moefq {
namespace {

constexpr int kBlock = 128, kLanes = 16;

// Lanes reduced pairwise: (l[j] + l[j+8]), then +4, +2, +1.
__attribute__((always_inline)) inline float reduce_lanes(float* l) {
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) l[j] += l[j + width];
  return l[0];
}

// Exact products (see the header): a fused multiply-add and a multiply then add agree.
template <bool kFma>
__attribute__((always_inline)) inline float madd(float a, float w, float acc) {
  if constexpr (kFma)
    return __builtin_fmaf(a, w, acc);
  else
    return acc + a * w;
}

// One 128-block of a weight row as fp32 element values. e4m3 by integer operations only (selects
// as masks, so the loop vectorises; no float arithmetic on subnormals, which is slow on x86): a
// normal code's exponent rebiased by 120 (= 127 - 7) with its 3 mantissa bits on top of binary32's,
// a subnormal one (exponent 0) as mantissa * 2^-9 (exact), the NaN codes 0x7F / 0xFF as the
// canonical NaN; the sign bit moved to bit 31.
__attribute__((always_inline)) inline const float* decode_block(const GemmWeights& w, int64_t offset, float* buf) {
  if (w.f32) return w.f32 + offset;
  if (w.b16) {
    const bf16* s = w.b16 + offset;
    for (int j = 0; j < kBlock; ++j) buf[j] = std::bit_cast<float>(uint32_t(s[j].bits) << 16);
    return buf;
  }
  const uint8_t* s = w.e4m3 + offset;
  for (int j = 0; j < kBlock; ++j) {
    const uint32_t c = s[j], mag = c & 0x7Fu, sign = (c & 0x80u) << 24;
    const uint32_t sub = std::bit_cast<uint32_t>(float(int32_t(mag)) * 0x1p-9f);
    const uint32_t normal = (mag + (120u << 3)) << 20;
    const uint32_t is_sub = 0u - uint32_t(mag < 8u), is_nan = 0u - uint32_t(mag == 0x7Fu);
    const uint32_t bits = ((sub & is_sub) | (normal & ~is_sub) | sign | is_nan) & (0x7FFFFFFFu | ~is_nan);
    buf[j] = std::bit_cast<float>(bits);
  }
  return buf;
}

template <bool kFma, int kRows>
__attribute__((always_inline)) inline void gemm_tile(const float* const* a, const float* const* a_scale, const float* w,
                                                     const float* w_scale, int64_t n_out, int64_t k_dim,
                                                     float* const* out) {
  const int64_t kb = k_dim / kBlock;
  for (int64_t n = 0; n < n_out; ++n) {
    const float* wn = w + n * k_dim;
    const float* sn = w_scale ? w_scale + (n / kBlock) * kb : nullptr;
    float acc[kRows] = {};
    for (int64_t b = 0; b < kb; ++b) {
      float lane[kRows][kLanes] = {};
      const float* wb = wn + b * kBlock;
      for (int k = 0; k < kBlock; k += kLanes)
        for (int r = 0; r < kRows; ++r)
          for (int j = 0; j < kLanes; ++j) lane[r][j] = madd<kFma>(a[r][b * kBlock + k + j], wb[k + j], lane[r][j]);
      // The promotion, one rounding: the CUDA GEMMs' form (an FMA per block and output).
      const float ws = sn ? sn[b] : 1.0f;
      for (int r = 0; r < kRows; ++r) acc[r] = fma_rn(reduce_lanes(lane[r]), a_scale[r][b] * ws, acc[r]);
    }
    for (int r = 0; r < kRows; ++r) out[r][n] = acc[r];
  }
}

template <bool kFma>
__attribute__((always_inline)) inline void gemm_any(int num_rows, const float* const* a, const float* const* a_scale,
                                                    const float* w, const float* w_scale, int64_t n_out, int64_t k_dim,
                                                    float* const* out) {
  switch (num_rows) {
    case 4: return gemm_tile<kFma, 4>(a, a_scale, w, w_scale, n_out, k_dim, out);
    case 3: return gemm_tile<kFma, 3>(a, a_scale, w, w_scale, n_out, k_dim, out);
    case 2: return gemm_tile<kFma, 2>(a, a_scale, w, w_scale, n_out, k_dim, out);
    default: return gemm_tile<kFma, 1>(a, a_scale, w, w_scale, n_out, k_dim, out);
  }
}

using GemmFn = void (*)(int, const float* const*, const float* const*, const float*, const float*, int64_t, int64_t,
                        float* const*);

// One build per instruction set, chosen once at run time; the source fixes the order, so all
// three compute the same bits.
__attribute__((target("avx512f,avx512vl,fma"))) void gemm_avx512(int num_rows, const float* const* a,
                                                                 const float* const* a_scale, const float* w,
                                                                 const float* w_scale, int64_t n_out, int64_t k_dim,
                                                                 float* const* out) {
  gemm_any<true>(num_rows, a, a_scale, w, w_scale, n_out, k_dim, out);
}
__attribute__((target("avx2,fma"))) void gemm_avx2(int num_rows, const float* const* a, const float* const* a_scale,
                                                   const float* w, const float* w_scale, int64_t n_out, int64_t k_dim,
                                                   float* const* out) {
  gemm_any<true>(num_rows, a, a_scale, w, w_scale, n_out, k_dim, out);
}
void gemm_generic(int num_rows, const float* const* a, const float* const* a_scale, const float* w,
                  const float* w_scale, int64_t n_out, int64_t k_dim, float* const* out) {
  gemm_any<false>(num_rows, a, a_scale, w, w_scale, n_out, k_dim, out);
}

GemmFn pick_gemm() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
    return gemm_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return gemm_avx2;
  return gemm_generic;
}

}  // namespace

__attribute__((target_clones("avx2", "default"))) GemmWeights decode_weight_rows(const GemmWeights& w, int64_t row0,
                                                                                 int64_t rows, int64_t k_dim,
                                                                                 float* out) {
  GemmWeights d;
  d.scale = w.scale ? w.scale + (row0 / kBlock) * (k_dim / kBlock) : nullptr;
  if (w.f32) {
    d.f32 = w.f32 + row0 * k_dim;
    return d;
  }
  for (int64_t i = 0; i < rows * k_dim; i += kBlock) decode_block(w, row0 * k_dim + i, out + i);
  d.f32 = out;
  return d;
}

void gemm_rows(int num_rows, const float* const* a, const float* const* a_scale, const float* w,
               const float* w_scale, int64_t n_out, int64_t k_dim, float* const* out) {
  static const GemmFn impl = pick_gemm();
  impl(num_rows, a, a_scale, w, w_scale, n_out, k_dim, out);
}

void gemm_rows(int num_rows, const float* const* a, const float* const* a_scale, const GemmWeights& w, int64_t n_out,
               int64_t k_dim, float* const* out) {
  if (w.f32) return gemm_rows(num_rows, a, a_scale, w.f32, w.scale, n_out, k_dim, out);
  // 128 weight rows at a time, decoded once.
  thread_local std::vector<float> buf;
  buf.resize(size_t(kBlock * k_dim));
  for (int64_t n0 = 0; n0 < n_out; n0 += kBlock) {
    const GemmWeights d = decode_weight_rows(w, n0, kBlock, k_dim, buf.data());
    float* o[kGemmRows];
    for (int r = 0; r < num_rows; ++r) o[r] = out[r] + n0;
    gemm_rows(num_rows, a, a_scale, d.f32, d.scale, kBlock, k_dim, o);
  }
}

}  // namespace moefq
