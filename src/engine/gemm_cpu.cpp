#include "engine/gemm_cpu.h"

#include "moefq/numerics.h"

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

template <bool kFma, int kRows>
__attribute__((always_inline)) inline void gemm_tile(const float* const* a, const float* const* a_scale, const float* w, const float* w_scale,
                      int64_t n_out, int64_t k_dim, float* const* out) {
  const int64_t kb = k_dim / kBlock;
  for (int64_t n = 0; n < n_out; ++n) {
    const float* wn = w + n * k_dim;
    const float* sn = w_scale + (n / kBlock) * kb;
    float acc[kRows] = {};
    for (int64_t b = 0; b < kb; ++b) {
      float lane[kRows][kLanes] = {};
      const float* wb = wn + b * kBlock;
      for (int k = 0; k < kBlock; k += kLanes)
        for (int r = 0; r < kRows; ++r)
          for (int j = 0; j < kLanes; ++j) lane[r][j] = madd<kFma>(a[r][b * kBlock + k + j], wb[k + j], lane[r][j]);
      // The promotion, one rounding: the CUDA GEMMs' form (an FMA per block and output).
      for (int r = 0; r < kRows; ++r) acc[r] = fma_rn(reduce_lanes(lane[r]), a_scale[r][b] * sn[b], acc[r]);
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

void gemm_rows(int num_rows, const float* const* a, const float* const* a_scale, const float* w,
               const float* w_scale, int64_t n_out, int64_t k_dim, float* const* out) {
  static const GemmFn impl = pick_gemm();
  impl(num_rows, a, a_scale, w, w_scale, n_out, k_dim, out);
}

}  // namespace moefq
