// The per-format rules of the QDQ kernels (numerics.md), shared by every kernel that QDQs rows on
// the device (qdq_kernels.cu, combine_kernels.cu), so each rule is written once. All numerics come
// from moefq/numerics.h. Rule<F>'s constructor may fill a per-CTA table in shared memory with the
// CTA's first 128 threads: kernels launch at least 128 threads and __syncthreads() after it.
#pragma once

#include <cuda_runtime.h>

#include "moefq/numerics.h"
#include "moefq/qdq.h"

namespace moefq::cuda::rules {

// 16 bytes of T: the unit every thread loads and stores.
template <typename T>
union Chunk {
  static constexpr int kN = 16 / int(sizeof(T));
  int4 raw;
  T v[kN];
};

// ---------------------------------------------------------------------------------------------
// Sum-exact element rules, for the combine quantizer only. The combine adds each QDQ'd row into an
// fp32 sum that starts at +0, so a QDQ result enters it only through its value: the sign of a zero
// cannot change the sum (x + (+-0) == x, and a sum from +0 is never -0), nor can a NaN's payload
// (the sum's final bf16 rounding makes every NaN canonical). For every input, each *_sum function
// returns the value of the numerics.h rule up to those two freedoms, with fp32 and integer
// operations only (no conversion instructions, which run at 1/8 of the fp32 rate and made the
// combine compute-bound). tests/cuda/test_combine_cuda.cu proves each on every input it can get.

// min / max that return NaN when an operand is NaN (fminf/fmaxf drop it).
MOEFQ_HD float min_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return is_nan(a) || is_nan(b) ? canonical_nan_f32() : (b < a ? b : a);
#endif
}
MOEFQ_HD float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return is_nan(a) || is_nan(b) ? canonical_nan_f32() : (b > a ? b : a);
#endif
}
// max(c, floor) for a c that may be NaN: the floor then (fmaxf's rule; the host spells it out).
MOEFQ_HD float max_or_floor(float c, float floor) {
#if defined(__CUDA_ARCH__)
  return fmaxf(c, floor);
#else
  return c > floor ? c : floor;
#endif
}

// |x| as an operand modifier in kernels (a free |R| on the fp32 instruction that uses it).
MOEFQ_HD float abs_mod(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return abs_f32(x);
#endif
}
// 1.5 * 2^E for a >= 0 of exponent E (one LOP3): the middle of a's binade. A subnormal or zero a
// gives 2^-127, inf and NaN give NaN; every caller raises it to a floor with max_or_floor, which
// also takes the floor for NaN.
MOEFQ_HD float binade_mid(float a) { return f32_from_bits((f32_bits(a) & 0x7F800000u) | 0x00400000u); }
// RN(a + C) - C for C = c * 2^k, with c = 1.5 * 2^E: rounds a (in [0, 2^(E+1))) to nearest even on
// a multiple of 2^(E + k - 23), the last place of C's binade, which a + C never leaves. Both steps
// are single roundings of exact operands (c * 2^k is exact), so each FMA equals the add of C.
template <int kK>
MOEFQ_HD float round_on_mid(float a, float c) {
  constexpr float kScale = float(1u << kK);
  return fma_rn(-c, kScale, fma_rn(c, kScale, a));
}

// The value of e4m3_encode_sat(a) for a >= 0 (NaN for NaN): saturate (every a >= 448 rounds to
// 448), then round on a multiple of 2^(E - 3), the e4m3 step of a's binade E (C = 1.5 * 2^(E + 20));
// below 2^-6 the step is the subnormal 2^-9, so E is floored at -6.
MOEFQ_HD float e4m3_round_sat_mag(float a) {
  a = min_nan(a, kE4m3Max);
  return round_on_mid<20>(a, max_or_floor(binade_mid(a), 0.0234375f /* 1.5 * 2^-6 */));
}
// e2m1_round_sat(v) for v >= 0 (NaN for NaN), the same way: saturating first (rounding is
// monotone and 6 is on the grid, so saturating before or after gives the same value), then a
// multiple of 2^(E - 1), at least 0.5 (E floored at 0).
MOEFQ_HD float e2m1_round_sat_mag(float v) {
  v = min_nan(v, kE2m1Max);
  return round_on_mid<22>(v, max_or_floor(binade_mid(v), 1.5f));
}

// fp8_qdq: the same product |x| * s, rounded as above, times si, with x's sign.
MOEFQ_HD float fp8_qdq_sum(float x, Fp8Params p) {
  return copysign_f32(mul_rn(e4m3_round_sat_mag(mul_rn(abs_mod(x), p.s)), p.si), x);
}
// int8_qdq_recip (for an amax with !zero and amax < 2^127): clamping to +-127 before rounding
// gives the same integer (the bounds are integers), and adding then subtracting 1.5 * 2^23 rounds
// |v| <= 127 to an integer, ties to even, as rint does; NaN stays NaN through the clamps.
MOEFQ_HD float int8_qdq_sum(float x, Int8Params p, float rcp) {
  const float v = max_nan(min_nan(mul_rn(x, p.s), 127.0f), -127.0f);
  return div_rn_recip(add_rn(add_rn(v, 12582912.0f), -12582912.0f), p.s, rcp);
}
// nvfp4_qdq_recip<kClamp> without its +0 rule.
template <bool kClamp>
MOEFQ_HD float nvfp4_qdq_sum(float x, float scale, float rcp) {
  const float a = abs_f32(x);
  float q0 = mul_rn(a, rcp);
  if (kClamp) q0 = q0 < 8.0f ? q0 : 8.0f;
  const float q = e2m1_round_sat_mag(fma_rn(fma_rn(-scale, q0, a), rcp, q0));
  return copysign_f32(mul_rn(q, scale), x);
}
// mx_block_exponent(bmax, M) for a bmax that is a bf16 value (or +inf; never NaN), without the
// division: RN(bmax / M) <= 2^k holds exactly when bmax <= M * 2^k, because no value with 8
// significant bits lies between M * 2^k and M * 2^k * (1 + 2^-24) (M = 1.75 * 2^8 or 1.5 * 2^2).
// So e = E(bmax) - E(M) + (mantissa(bmax) > mantissa(M)), clamped; inf counts as the largest
// finite float, which gives the same e. Subnormal bmax gives e <= -128, clamped to -127.
template <bool kFp8>
MOEFQ_HD int mx_block_exponent_bf16(float bmax) {
  if (!(bmax > 0.0f)) return 0;
  const uint32_t u = f32_bits(bmax);
  constexpr int kExpM = kFp8 ? 8 : 2;
  constexpr uint32_t kMantM = kFp8 ? 0x600000u : 0x400000u;  // 1.75, 1.5
  const int e = int(u >> 23) - 127 - kExpM + ((u & 0x7FFFFFu) > kMantM ? 1 : 0);
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}
MOEFQ_HD float mxfp8_qdq_sum(float x, MxScale s) {
  return copysign_f32(mul_rn(e4m3_round_sat_mag(mul_rn(abs_f32(x), s.to_elem)), s.from_elem), x);
}
MOEFQ_HD float mxfp4_qdq_sum(float x, MxScale s) {
  return copysign_f32(mul_rn(e2m1_round_sat_mag(mul_rn(abs_f32(x), s.to_elem)), s.from_elem), x);
}

// The same two rules with the block's power of two left out: the element grid scaled by 2^e is the
// grid of x itself (steps 2^(E_x - 3) or 2^(E_x - 1) in x's binade E_x, floored at the scaled
// subnormal step), so x is saturated at M * 2^e and rounded where it stands, with no multiply by
// 2^-e and 2^e. `sat` = M * 2^e and `floor` = 1.5 * 2^(e - 6) (e4m3) or 1.5 * 2^e (e2m1), both
// exact. Valid where mx_unscaled_ok(e): there every |x| <= M * 2^e keeps C = c * 2^k finite
// (e <= 99 or 103); the floor is above 2^-127, binade_mid's value for subnormal x (e >= -121 for
// e4m3; always for e2m1); and the result is a bf16 value (no bf16 rounding; see MxRule).
template <bool kFp8>
MOEFQ_HD bool mx_unscaled_ok(int e) {
  return kFp8 ? (e >= -121 && e <= 99) : e <= 103;
}
struct MxBounds {
  float sat, floor;
};
template <bool kFp8>
MOEFQ_HD MxBounds mx_unscaled_bounds(float pow2e /* 2^e */) {
  return {mul_rn(kFp8 ? kE4m3Max : kE2m1Max, pow2e), mul_rn(kFp8 ? 0.0234375f : 1.5f, pow2e)};
}
template <bool kFp8>
MOEFQ_HD float mx_qdq_sum_unscaled(float x, MxBounds b) {
  const float sat = b.sat, floor = b.floor;
  const float a = min_nan(abs_mod(x), sat);
  const float c = max_or_floor(binade_mid(a), floor);
  return copysign_f32(kFp8 ? round_on_mid<20>(a, c) : round_on_mid<22>(a, c), x);
}

// Per-format rule: the per-tensor parameters (from the device amax), the per-block reduction and
// parameter, and the element function. All numerics come from numerics.h. A rule may keep a
// per-tensor table in shared memory (Shared), filled by the CTA's first threads in the
// constructor; kernels call __syncthreads() after constructing the rule.
struct NoShared {};

template <Format F>
struct Rule;

template <>
struct Rule<Format::kFp8> {
  static constexpr int kBlock = 0;
  using Shared = NoShared;
  Fp8Params p;
  __device__ Rule(const float* amax, Shared&) : p(fp8_params(*amax)) {}
  __device__ float reduce(float m, float) const { return m; }
  __device__ int block_param(float) const { return 0; }
  __device__ float apply(float x, int) const { return fp8_qdq(x, p); }
  // The combine's sum-exact counterparts (see "Sum-exact element rules").
  __device__ int sum_block_param(float) const { return 0; }
  __device__ float apply_sum(float x, int) const { return fp8_qdq_sum(x, p); }
  __device__ bool sum_needs_bf16_round(int) const { return true; }
};

template <>
struct Rule<Format::kInt8> {
  static constexpr int kBlock = 0;
  using Shared = NoShared;
  Int8Params p;
  float rcp;
  bool recip;  // q * rcp cannot overflow (int8_qdq_recip's condition)
  __device__ Rule(const float* amax, Shared&)
      : p(int8_params(*amax)), rcp(div_rn(1.0f, p.s)), recip(*amax < 1.7014118e38f) {}
  __device__ float reduce(float m, float) const { return m; }
  __device__ int block_param(float) const { return 0; }
  __device__ float apply(float x, int) const {
    return recip ? int8_qdq_recip(x, p, rcp) : int8_qdq(x, p);
  }
  __device__ int sum_block_param(float) const { return 0; }
  // One (uniform) branch per chunk: the sum-exact path wherever int8_qdq_recip applies.
  template <int kN>
  __device__ void apply_chunk_sum(float (&v)[kN], int) const {
    if (recip && !p.zero) {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = int8_qdq_sum(v[i], p, rcp);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = int8_qdq(v[i], p);
    }
  }
  __device__ bool sum_needs_bf16_round(int) const { return true; }
};

struct Nvfp4Block {
  float scale, rcp;
  bool clamp;
};
template <>
struct Rule<Format::kNvfp4> {
  static constexpr int kBlock = kNvfp4Block;
  // Every block scale the tensor can have, and its RN reciprocal, by e4m3 code: two divisions
  // per CTA instead of one per block.
  struct Shared {
    float scale[128], rcp[128];
  };
  float gs, rcp6;
  const Shared& table;
  __device__ Rule(const float* amax, Shared& sh)
      : gs(nvfp4_global_scale(*amax)), rcp6(div_rn(1.0f, mul_rn(6.0f, gs))), table(sh) {
    if (threadIdx.x < 128) {
      const float scale = nvfp4_scale_from_code(uint8_t(threadIdx.x), gs);
      sh.scale[threadIdx.x] = scale;
      sh.rcp[threadIdx.x] = div_rn(1.0f, scale);
    }
  }
  __device__ float reduce(float m, float x) const { return max_ignore_nan(m, abs_f32(x)); }
  __device__ Nvfp4Block block_param(float bmax) const {
    const uint8_t sf = nvfp4_block_code_recip(bmax, gs, rcp6);  // 0..0x7F (bmax >= 0)
    const float rcp = table.rcp[sf];
    return {table.scale[sf], rcp, nvfp4_block_needs_clamp(bmax, rcp)};
  }
  // The clamp is needed only in blocks with |x| far beyond the scale (data above the calibrated
  // amax, or inf).
  __device__ float apply(float x, Nvfp4Block b) const {
    return b.clamp ? nvfp4_qdq_recip<true>(x, b.scale, b.rcp) : nvfp4_qdq_recip<false>(x, b.scale, b.rcp);
  }
  // The same over a chunk, with the branch outside the element loop and uniform across the warp
  // (a warp with any saturating block takes the clamped path): no divergence.
  template <int kN>
  __device__ void apply_chunk(float (&v)[kN], Nvfp4Block b) const {
    if (__any_sync(0xFFFFFFFFu, b.clamp)) {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = nvfp4_qdq_recip<true>(v[i], b.scale, b.rcp);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = nvfp4_qdq_recip<false>(v[i], b.scale, b.rcp);
    }
  }
  __device__ Nvfp4Block sum_block_param(float bmax) const { return block_param(bmax); }
  template <int kN>
  __device__ void apply_chunk_sum(float (&v)[kN], Nvfp4Block b) const {
    if (__any_sync(0xFFFFFFFFu, b.clamp)) {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = nvfp4_qdq_sum<true>(v[i], b.scale, b.rcp);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = nvfp4_qdq_sum<false>(v[i], b.scale, b.rcp);
    }
  }
  __device__ bool sum_needs_bf16_round(Nvfp4Block) const { return true; }
};

// mxfp8 and mxfp4 differ only in the element format.
template <Format F>
struct MxRule {
  static constexpr int kBlock = kMxBlock;
  static constexpr bool kFp8 = F == Format::kMxfp8;
  using Shared = NoShared;
  __device__ MxRule(const float*, Shared&) {}
  __device__ float reduce(float m, float x) const { return max_ignore_nan(m, abs_f32(x)); }
  __device__ MxScale block_param(float bmax) const {
    return mx_scale(mx_block_exponent(bmax, kFp8 ? kE4m3Max : kE2m1Max));
  }
  __device__ float apply(float x, MxScale s) const { return kFp8 ? mxfp8_qdq(x, s) : mxfp4_qdq(x, s); }
  // For bf16 rows. A result q * 2^e (q an element value, 4 or 2 significant bits, a multiple of
  // 2^-9 or 2^-1) is a bf16 value unless it falls below bf16's subnormal step 2^-133, which only
  // mxfp8 with e < -124 can do: only there does the result need its bf16 rounding.
  struct SumScale {
    MxScale s;
    int e;
    MxBounds bounds;  // mx_qdq_sum_unscaled's, where mx_unscaled_ok(e)
  };
  __device__ SumScale sum_block_param(float bmax) const {
    const int e = mx_block_exponent_bf16<kFp8>(bmax);
    const MxScale s = mx_scale(e);
    return {s, e, mx_unscaled_bounds<kFp8>(s.from_elem)};
  }
  __device__ float apply_sum(float x, SumScale b) const {
    return kFp8 ? mxfp8_qdq_sum(x, b.s) : mxfp4_qdq_sum(x, b.s);
  }
  // Blocks outside mx_unscaled_ok (inf elements, huge or tiny scales) take the scaled rule.
  template <int kN>
  __device__ void apply_chunk_sum(float (&v)[kN], SumScale b) const {
    if (mx_unscaled_ok<kFp8>(b.e)) {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = mx_qdq_sum_unscaled<kFp8>(v[i], b.bounds);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = apply_sum(v[i], b);
    }
  }
  __device__ bool sum_needs_bf16_round(SumScale b) const { return kFp8 && b.e < -124; }
};
template <>
struct Rule<Format::kMxfp8> : MxRule<Format::kMxfp8> {
  using MxRule::MxRule;
};
template <>
struct Rule<Format::kMxfp4> : MxRule<Format::kMxfp4> {
  using MxRule::MxRule;
};

// 16 bytes of outputs: bf16 pairs with one packed conversion each, fp32 as is (NaN canonical).
__device__ __forceinline__ int4 pack(const float (&v)[8]) {
  return make_int4(int(bf16x2_round(v[0], v[1])), int(bf16x2_round(v[2], v[3])),
                   int(bf16x2_round(v[4], v[5])), int(bf16x2_round(v[6], v[7])));
}
__device__ __forceinline__ int4 pack(const float (&v)[4]) {
  Chunk<float> out;
#pragma unroll
  for (int i = 0; i < 4; ++i) store_out(&out.v[i], v[i]);
  return out.raw;
}

}  // namespace moefq::cuda::rules
