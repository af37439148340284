// The combine quantizer's sum-exact element rules: each QDQ rule's value up to the sign of a zero
// and a NaN's payload, in fp32 and integer operations only. Part of moefq/numerics.h.
#pragma once

#include <cstdint>

#include "moefq/numerics/peer_rules.h"
#include "moefq/numerics/qdq_rules.h"

namespace moefq {

// ---------------------------------------------------------------------------------------------
// Sum-exact element rules, for the combine quantizer only. The combine adds each QDQ'd row into an
// fp32 sum that starts at +0, so a QDQ result enters it only through its value: the sign of a zero
// cannot change the sum (x + (+-0) == x, and a sum from +0 is never -0), nor can a NaN's payload
// (the sum's final bf16 rounding makes every NaN canonical). For every input, each *_sum function
// returns the value of the numerics.h rule up to those two freedoms, with fp32 and integer
// operations only (no conversion instructions, which run at 1/8 of the fp32 rate and made the
// combine compute-bound). Used by src/quant/cuda/qdq_rules.cuh;
// tests/cuda/test_combine_cuda.cu proves each on every input it can get.

// min that returns NaN when an operand is NaN (fminf drops it).
MOEFQ_HD float min_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return is_nan(a) || is_nan(b) ? canonical_nan_f32() : (b < a ? b : a);
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

// nvfp4_qdq_recip<true> without its +0 rule: any block (the quotient clamped at 8, so inf and
// elements far beyond the scale stay finite).
MOEFQ_HD float nvfp4_qdq_sum_clamped(float x, float scale, float rcp) {
  const float a = abs_f32(x);
  float q0 = mul_rn(a, rcp);
  q0 = q0 < 8.0f ? q0 : 8.0f;
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

// Signed forms. The rounding cores above are sign-symmetric (RN is), so they round a signed value
// as they round its magnitude when C carries the value's sign. That drops the magnitude forms' |x|
// and copysign: the saturation and the floor each take one instruction that keeps the sign
// (min/max with .xorsign.abs, sm_86+: |result| = min/max(|x|, |m|), sign = sign(x) XOR sign(m),
// with m > 0).

// sign(x) * min(|x|, m) for m > 0; NaN for NaN x.
MOEFQ_HD float clamp_abs_nan(float x, float m) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("min.NaN.xorsign.abs.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(m));
  return r;
#else
  return is_nan(x) ? canonical_nan_f32() : copysign_f32(abs_f32(x) < m ? abs_f32(x) : m, x);
#endif
}
// sign(x) * max(|x|, floor) for non-NaN x and floor > 0. A NaN x gives a value every caller feeds
// to an FMA whose addend is the same NaN, so the result is NaN whatever it is (the host: floor).
MOEFQ_HD float max_abs_signed(float x, float floor) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.xorsign.abs.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(floor));
  return r;
#else
  return is_nan(x) ? floor : copysign_f32(abs_f32(x) > floor ? abs_f32(x) : floor, x);
#endif
}
// (u & mask) | set as one LOP3 (the compiler splits two immediates into two; here set sits in a
// register, materialised once).
MOEFQ_HD uint32_t and_or(uint32_t u, uint32_t mask, uint32_t set) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(u), "r"(mask), "r"(set));  // 0xEA: (a & b) | c
  return r;
#else
  return (u & mask) | set;
#endif
}
// sign(v) * binade_mid(|v|).
MOEFQ_HD float binade_mid_signed(float v) { return f32_from_bits(and_or(f32_bits(v), 0xFF800000u, 0x00400000u)); }

// fp8_qdq: the product x * s, saturated at +-448 with its sign kept, rounded by the e4m3 core with
// a signed C (C = +-1.5 * 2^(E + 20), E floored at -6; RN is sign-symmetric), times si.
MOEFQ_HD float fp8_qdq_sum(float x, Fp8Params p) {
  const float v = clamp_abs_nan(mul_rn(x, p.s), kE4m3Max);
  return mul_rn(round_on_mid<20>(v, max_abs_signed(binade_mid_signed(v), 0.0234375f)), p.si);
}
// int8_qdq_recip (for an amax with !zero and amax < 2^127): clamping to +-127 (one signed
// saturation) before rounding gives the same integer (the bounds are integers), and adding then
// subtracting 1.5 * 2^23 rounds |v| <= 127 to an integer, ties to even, as rint does; NaN stays NaN.
MOEFQ_HD float int8_qdq_sum(float x, Int8Params p, float rcp) {
  const float v = clamp_abs_nan(mul_rn(x, p.s), 127.0f);
  return div_rn_recip(add_rn(add_rn(v, 12582912.0f), -12582912.0f), p.s, rcp);
}
// nvfp4 blocks whose maximum keeps every quotient small: bmax * rcp < 6.5 (rcp = RN(1 / scale)).
// Then every |x| of the block has RN(|x| * rcp) < 6.5 (RN is monotone), so RN(|x| / scale) < 7:
// no clamp of the quotient is needed (nvfp4_block_needs_clamp is false), and the e2m1 rounding of a
// value below 7 cannot pass 6 (6 <= q < 7 rounds to 6), so the saturation can be left out. Blocks of
// calibrated data are tame; a NaN scale or an infinite bmax is not.
MOEFQ_HD bool nvfp4_block_is_tame(float bmax, float rcp) { return mul_rn(bmax, rcp) < 6.5f; }
// nvfp4_qdq_sum_unclamped for an element of a tame block, without the saturation: the quotient RN(x / scale) by
// div_rn_recip on x itself, rounded to e2m1 with a signed C (floor 1.5: the e2m1 step is 0.5 below 2).
MOEFQ_HD float nvfp4_qdq_sum_tame(float x, float scale, float rcp) {
  const float q = div_rn_recip(x, scale, rcp);
  return mul_rn(round_on_mid<22>(q, max_abs_signed(binade_mid_signed(q), 1.5f)), scale);
}
// nvfp4_qdq_recip<false> without its +0 rule, for blocks that need no clamp (bmax * rcp < 16): the
// tame rule with the saturation put back, as one signed min (saturating before the rounding gives
// the same e2m1 value, as in e2m1_round_sat_mag).
MOEFQ_HD float nvfp4_qdq_sum_unclamped(float x, float scale, float rcp) {
  const float q = clamp_abs_nan(div_rn_recip(x, scale, rcp), kE2m1Max);
  return mul_rn(round_on_mid<22>(q, max_abs_signed(binade_mid_signed(q), 1.5f)), scale);
}

// peer_qdq<R> in the combine's sum-exact form: the value of peer_qdq up to the sign of a zero and a
// NaN's payload (the freedoms above), through the fp32 rounding cores instead of the conversion
// instructions where a rule has one: the e4m3 rules with a multiplier take fp8_qdq_sum, the
// power-of-two one mxfp8_qdq_sum; the e2m1 rule is fp32 operations already, and vLLM's divides.
// tests/numerics/test_qdq_peers.cpp compares the two on every bf16 x for many block parameters.
template <PeerRule R>
MOEFQ_HD float peer_qdq_sum(float x, PeerParams p) {
  if constexpr (R == PeerRule::kUe8m0NoFloor) {
    return mxfp8_qdq_sum(x, MxScale{p.s, p.si});
  } else if constexpr (R == PeerRule::kFp8CastNan) {
    return abs_mod(x) > kE4m3Max ? canonical_nan_f32() : fp8_qdq_sum(x, Fp8Params{p.s, p.si});
  } else if constexpr (R == PeerRule::kMoriFp4Block || R == PeerRule::kFlashInferFp4 || R == PeerRule::kVllmBlock) {
    return peer_qdq<R>(x, p);
  } else {
    return fp8_qdq_sum(x, Fp8Params{p.s, p.si});
  }
}

}  // namespace moefq
