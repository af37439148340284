// The scalar QDQ rules of the quantizer formats (fp8, nvfp4, mxfp8, mxfp4, int8), the engine's
// e4m3 staging cast, and the expert-parallel libraries' FP8 per 128 channels (fp8_block128).
// Part of moefq/numerics.h.
#pragma once

#include <cstdint>

#include "moefq/numerics/conversions.h"

namespace moefq {

// ---------------------------------------------------------------------------------------------
// QDQ rules. Each element function returns the dequantized binary32 value; the caller stores it
// with store_out (bf16 rounding or fp32 as is). NaN in x gives the canonical NaN.

// fp8: per-tensor e4m3.
struct Fp8Params {
  float s;   // 448 / a
  float si;  // 1 / s (not a / 448)
};
MOEFQ_HD Fp8Params fp8_params(float amax) {
  const float a = amax <= 5.9604644775390625e-08f ? 1.0f : amax;  // 2^-24
  const float s = div_rn(kE4m3Max, a);
  return {s, div_rn(1.0f, s)};
}
MOEFQ_HD float fp8_qdq(float x, Fp8Params p) {
  if (is_nan(x)) return canonical_nan_f32();
  // Checked decode: with amax = +inf, s = 0 and inf * 0 is NaN, which must stay NaN.
  return mul_rn(e4m3_decode(e4m3_encode_sat(mul_rn(x, p.s))), p.si);
}

// nvfp4: e2m1 elements, blocks of 16, e4m3 block scales, fp32 global scale.
MOEFQ_HD float nvfp4_global_scale(float amax) {
  const float gs = mul_rn(amax, 1.0f / 2688.0f);  // the rounded reciprocal, as Model Optimizer does
  return gs <= 0.0f ? 1e-12f : gs;
}
// The block's e4m3 scale code from its max |x| over non-NaN elements.
MOEFQ_HD uint8_t nvfp4_block_code(float bmax, float gs) {
  const float t = div_rn(bmax, mul_rn(6.0f, gs));
  return e4m3_encode_sat(t > kE4m3Max ? kE4m3Max : t);  // NaN (amax = +inf) stays NaN: code 0x7F
}
// The same code with the division done as div_rn_recip, rcp6 = RN(1 / (6 * gs)) computed once per
// tensor. Exact while quotient and residual are normal; for bmax below 2^-100 the residual may not
// be, so that (rare) case divides. tests/numerics/test_division.cpp checks it on every bf16 bmax.
MOEFQ_HD uint8_t nvfp4_block_code_recip(float bmax, float gs, float rcp6) {
  if (bmax < 7.888609052210118e-31f) return nvfp4_block_code(bmax, gs);
  // As in nvfp4_qdq_recip, q0 is clamped (any t >= 448 saturates) so the correction stays finite.
  const float b6 = mul_rn(6.0f, gs);
  float q0 = mul_rn(bmax, rcp6);
  q0 = q0 < 512.0f ? q0 : 512.0f;
  const float t = fma_rn(fma_rn(-b6, q0, bmax), rcp6, q0);
  return e4m3_encode_sat(t > kE4m3Max ? kE4m3Max : t);
}
// The block's dequantization scale from its code (NaN for the NaN code).
MOEFQ_HD float nvfp4_scale_from_code(uint8_t sf, float gs) {
  const float scale = mul_rn(e4m3_decode(sf), gs);
  return scale < 1e-5f ? 1.0f : scale;
}
MOEFQ_HD float nvfp4_block_scale(float bmax, float gs) {
  return nvfp4_scale_from_code(nvfp4_block_code(bmax, gs), gs);
}
MOEFQ_HD float nvfp4_qdq(float x, float scale) {
  if (is_nan(x)) return canonical_nan_f32();
  const float q = e2m1_decode(e2m1_encode_sat(div_rn(abs_f32(x), scale)));
  if (q == 0.0f) return 0.0f;  // Model Optimizer's nvfp4 rule: a zero is +0 whatever the sign
  return copysign_f32(mul_rn(q, scale), x);
}
// The same result with the block's division done as div_rn_recip (rcp = RN(1 / scale), computed
// once per block). scale >= 1e-5, so a quotient that could round to an e2m1 boundary (>= 0.25)
// has a normal dividend; quotients >= 8 saturate to 6 either way. NaN x or scale gives NaN.
template <bool kClamp = true>
MOEFQ_HD float nvfp4_qdq_recip(float x, float scale, float rcp) {
  const float a = abs_f32(x);
  // Clamping q0 to 8 keeps the correction finite for huge |x| (the result still saturates). A
  // block whose max |x| times rcp is below 16 cannot overflow, and kernels skip the clamp there
  // (kClamp = false). A NaN x makes v NaN either way (through the first fma), and NaN propagates
  // to the result (store_out makes it canonical).
  float q0 = mul_rn(a, rcp);
  if (kClamp) q0 = q0 < 8.0f ? q0 : 8.0f;
  const float q = e2m1_round_sat(fma_rn(fma_rn(-scale, q0, a), rcp, q0));
  // Adding +0 turns -0 into +0 and changes nothing else: the "zero is +0" rule without a branch.
  return add_rn(copysign_f32(mul_rn(q, scale), x), 0.0f);
}
// Whether every element of a block with this max |x| may use nvfp4_qdq_recip<false>.
MOEFQ_HD bool nvfp4_block_needs_clamp(float bmax, float rcp) { return !(mul_rn(bmax, rcp) < 16.0f); }

// mxfp8 / mxfp4: blocks of 32, ue8m0 scales. bmax is the block's max |x| over non-NaN elements;
// +-inf counts as the largest finite float (clamping the maximum is the same as clamping each |x|).
// Returns the block exponent e (the scale is 2^e, ue8m0 code e + 127) for element maximum
// elem_max (448 or 6).
MOEFQ_HD int mx_block_exponent(float bmax, float elem_max) {
  bmax = bmax > kFltMax ? kFltMax : bmax;
  if (!(bmax > 0.0f)) return 0;
  const int e = ceil_log2(div_rn(bmax, elem_max));
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}
// The block's two powers of two: 2^-e scales into the element format, 2^e back.
struct MxScale {
  float to_elem;
  float from_elem;
};
MOEFQ_HD MxScale mx_scale(int e) { return {exp2i(-e), exp2i(e)}; }
MOEFQ_HD float mxfp8_qdq(float x, MxScale s) {
  if (is_nan(x)) return canonical_nan_f32();
  // e4m3 is sign-symmetric, so converting x itself equals sign(x) * conv(|x| ...).
  return mul_rn(e4m3_decode_finite(e4m3_encode_sat(mul_rn(x, s.to_elem))), s.from_elem);
}
MOEFQ_HD float mxfp4_qdq(float x, MxScale s) {
  // NaN x propagates through e2m1_round_sat; store_out makes it canonical.
  return copysign_f32(mul_rn(e2m1_round_sat(abs_f32(mul_rn(x, s.to_elem))), s.from_elem), x);
}

// int8: per-tensor, narrow range. With amax = +inf, s = 0 and every y = q / 0 is NaN. y keeps the
// sign of q: -0.0 for a negative x that rounds to zero (Model Optimizer's int8 kernel does too).
struct Int8Params {
  float s;    // 127 / amax
  bool zero;  // amax < 2^-24: y = 0
};
MOEFQ_HD Int8Params int8_params(float amax) {
  const bool zero = amax < 5.9604644775390625e-08f;
  return {zero ? 0.0f : div_rn(127.0f, amax), zero};
}
MOEFQ_HD float int8_qdq(float x, Int8Params p) {
  if (is_nan(x)) return canonical_nan_f32();
  if (p.zero) return 0.0f;
  return div_rn(int8_round_sat(mul_rn(x, p.s)), p.s);
}
// The same with rcp = RN(1 / s): q is an integer of magnitude <= 127, so quotient and residual stay
// normal whenever q != 0 (s = 127 / amax with amax >= 2^-24). Only for amax < 2^127, where
// q * rcp cannot overflow. The residual step turns q = -0 into +0 (-0 + +0 is +0); copysign puts
// the sign of q back (a no-op for q != 0, whose quotient already has it: s > 0).
MOEFQ_HD float int8_qdq_recip(float x, Int8Params p, float rcp) {
  if (is_nan(x)) return canonical_nan_f32();
  if (p.zero) return 0.0f;
  const float q = int8_round_sat(mul_rn(x, p.s));
  return copysign_f32(div_rn_recip(q, p.s, rcp), q);
}

// e4m3 staging of expert inputs (1 x 128 blocks, fp32 scales): the real FP8 cast of the engine.
// block_amax is the max |x| over the block's non-NaN elements.
MOEFQ_HD float stage_scale(float block_amax) {
  const float a = block_amax > 1e-4f ? block_amax : 1e-4f;
  return div_rn(a, kE4m3Max);
}
MOEFQ_HD uint8_t stage_encode(float x, float inv_scale) { return e4m3_encode_sat(mul_rn(x, inv_scale)); }
MOEFQ_HD float stage_decode(uint8_t x8, float scale) { return mul_rn(e4m3_decode(x8), scale); }

// ---------------------------------------------------------------------------------------------
// The expert-parallel libraries' FP8 per row and 128 channels (DeepEP's low-latency dispatch cast,
// csrc/kernels/legacy/utils.cuh calculate_fp8_scales, with its round_scale option for the ue8m0
// form; the SGLang DeepGEMM fork's FP8 combine, which has no 1e-4 floor, is PeerRule::kUe8m0NoFloor
// below). Per block of 128 along a row: a = max(bmax, 1e-4) (bmax: max |x| over
// the non-NaN elements, +inf counts); the wire carries e4m3(x * s) and a scale si; the receiver
// decodes float(e4m3) * si, rounded once to the output dtype.
inline constexpr int kFp8BlockSize = 128;
inline constexpr float kFp8BlockAmaxFloor = 1e-4f;
inline constexpr float kInvE4m3Max = 1.0f / 448.0f;  // RN(1/448): the kernels' 1/448 constant

MOEFQ_HD float fp8_block_amax(float bmax) { return bmax > kFp8BlockAmaxFloor ? bmax : kFp8BlockAmaxFloor; }
// fp8_block128: s = 448 / a (a division), si = a * RN(1/448) (a multiply, not a / 448). The element
// rule is fp8_qdq's with these per-block parameters. A block holding +-inf has s = 0 and si = inf:
// every element NaN, as per-tensor fp8 with an infinite amax.
MOEFQ_HD Fp8Params fp8_block128_params(float bmax) {
  const float a = fp8_block_amax(bmax);
  return {div_rn(kE4m3Max, a), mul_rn(a, kInvE4m3Max)};
}
// fp8_block128_ue8m0: the scale rounded up to a power of two, si = 2^e with e = ceil(log2(a *
// RN(1/448))) (ue8m0 code e + 127, e in [-22, 120]), s = 2^-e; the element rule is mxfp8_qdq's. A
// block holding +-inf has the ue8m0 NaN code (0xFF): every element NaN.
inline constexpr int kFp8BlockUe8m0MinExp = -22;  // ceil(log2(1e-4 * RN(1/448)))
// The exponent e for a finite floored maximum a.
MOEFQ_HD int fp8_block128_ue8m0_exponent(float a) { return ceil_log2(mul_rn(a, kInvE4m3Max)); }
MOEFQ_HD MxScale fp8_block128_ue8m0_scale(float bmax) {
  const float a = fp8_block_amax(bmax);
  if (!is_finite(a)) return {0.0f, canonical_nan_f32()};
  return mx_scale(fp8_block128_ue8m0_exponent(a));
}

}  // namespace moefq
