// The CPU engine's GEMM: up to kGemmRows rows at once against one weight matrix, in a fixed
// accumulation order (so every rank count, thread count and instruction set gives the same bits).
#pragma once

#include <cstdint>

#include "moefq/numerics.h"

namespace moefq {

inline constexpr int kGemmRows = 4;

// A weight matrix [n_out, k_dim] as stored: e4m3 codes with fp32 128 x 128 block scales
// ([n_out / 128, k_dim / 128]), bf16 values (no scales), or fp32 element values with optional
// block scales. Exactly one of e4m3, b16, f32 is set; scale null means 1 for every block.
struct GemmWeights {
  const uint8_t* e4m3 = nullptr;
  const bf16* b16 = nullptr;
  const float* f32 = nullptr;
  const float* scale = nullptr;
};

// For each row r < num_rows and output n < n_out:
//   out[r][n] = sum over 128-blocks b of K ascending, from +0, of
//               dot(a[r] block b, w[n] block b) * (a_scale[r][b] * w_scale[n / 128][b]),
//   each block added with one rounding: acc = fma(dot, a_scale * w_scale, acc)
// where dot sums 16 lanes over k mod 16 sequentially, then the lanes pairwise (8, 4, 2, 1), over
// the weights' element values (e4m3 codes and bf16 decoded exactly).
// a[r]: [k_dim] element values (e4m3 decoded, unscaled); a_scale[r]: [k_dim / 128];
// out[r]: [n_out]. Every product a * w is exact in fp32 (e4m3 x e4m3 or e4m3 x bf16
// significands), so the lanes use fused multiply-adds (one instruction where the CPU has FMA) with
// the same bits as a separate multiply and add. The promotion of a block sum is a true fused
// multiply-add (fmaf from libm without FMA hardware: the same correctly rounded bits), as the
// CUDA GEMMs promote.
void gemm_rows(int num_rows, const float* const* a, const float* const* a_scale, const GemmWeights& w,
               int64_t n_out, int64_t k_dim, float* const* out);
// Rows [row0, row0 + rows) of w ([*, k_dim], row0 and rows multiples of 128) decoded to fp32 values
// in out ([rows, k_dim]); returns them as fp32 weights with the rows' block scales.
GemmWeights decode_weight_rows(const GemmWeights& w, int64_t row0, int64_t rows, int64_t k_dim, float* out);
// The same with fp32 weight values w [n_out, k_dim] and scales w_scale.
void gemm_rows(int num_rows, const float* const* a, const float* const* a_scale, const float* w,
               const float* w_scale, int64_t n_out, int64_t k_dim, float* const* out);

}  // namespace moefq
