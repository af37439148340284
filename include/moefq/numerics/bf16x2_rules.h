// The sum-exact rules on packed bf16x2 words (two bf16 of a combine row in 32 bits), and which
// mx and fp8_block128 blocks they apply to. Part of moefq/numerics.h.
#pragma once

#include <cstdint>

#include "moefq/numerics/sum_exact.h"

namespace moefq {

// ---------------------------------------------------------------------------------------------
// Packed bf16x2 rules: two bf16 in one 32-bit word (lo in bits 0-15), as a combine row holds them.
// Kernels use the bf16x2 instructions (max.xorsign.abs, sm_86+; fma.rn, one rounding of the exact
// a * b + c); the host versions apply the scalar rules to each half.

// The host form of bf16x2_max_abs / bf16x2_min_abs: per half, the larger (kMax) or smaller
// magnitude of the non-NaN operands, the canonical NaN when both are NaN, the sign bit a XOR b.
template <bool kMax>
inline uint32_t bf16x2_pick_abs_host(uint32_t a, uint32_t b) {
  uint32_t r = 0;
  for (int h = 0; h < 32; h += 16) {
    const uint32_t x = (a >> h) & 0x7FFFu, y = (b >> h) & 0x7FFFu;
    const bool xn = x > 0x7F80u, yn = y > 0x7F80u;
    const uint32_t m = xn && yn ? kCanonicalNanBf16 : (xn ? y : (yn ? x : ((kMax ? x > y : x < y) ? x : y)));
    r |= (m | (((a ^ b) >> h) & 0x8000u)) << h;
  }
  return r;
}

// Per half, max(|a|, |b|) over the non-NaN of the two (NaN only when both are NaN); the sign bit of
// each half is unspecified (max.xorsign.abs.bf16x2 sets it to the XOR of the operands' signs).
// Reduces a block's max |x| over packed words with one instruction per word.
MOEFQ_HD uint32_t bf16x2_max_abs(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return bf16x2_pick_abs_host<true>(a, b);
#endif
}
// Per half, min(|a|, |b|) over the non-NaN of the two (NaN only when both are NaN); the sign bit of
// each half is unspecified (min.xorsign.abs.bf16x2).
MOEFQ_HD uint32_t bf16x2_min_abs(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("min.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
#else
  return bf16x2_pick_abs_host<false>(a, b);
#endif
}

// The unscaled mx rule on both halves at once (the MX element grid scaled by 2^e is the grid of x
// itself): for |x| <= M * 2^e, mid = sign(x) * 1.5 * 2^E (E: x's exponent; +-2^-127 for a zero or
// subnormal x, NaN for NaN); c = sign(x) * max(|mid|, floor); C = c * 2^k lies in binade
// max(E, E_floor) + k, whose bf16 step 2^(max(E, E_floor) + k - 7) is the element step (k = 4:
// e4m3's 2^(E - 3); k = 6: e2m1's 2^(E - 1)); x + C stays in that binade, so fma(c, 2^k, x) rounds
// x on the element grid (ties to even: C's mantissa is even) and fma(c, -2^k, t) is exact. No
// saturation: every |x| of the block is <= M * 2^e, and M * 2^e is on the grid. NaN stays NaN
// (the addend). The result is mx_qdq_sum_unscaled's value, a bf16 value; floor2: the floor
// (mx_unscaled_bounds) in both halves, from mx_packed_block.
template <bool kFp8>
MOEFQ_HD uint32_t mx_qdq_sum_unscaled_x2(uint32_t w, uint32_t floor2) {
#if defined(__CUDA_ARCH__)
  constexpr uint32_t kPos = kFp8 ? 0x41804180u : 0x42804280u;  // 2^k: 16 or 64 in both halves
  constexpr uint32_t kNeg = kPos | 0x80008000u;
  const uint32_t mid = and_or(w, 0xFF80FF80u, 0x00400040u);
  uint32_t c, t, r;
  asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(c) : "r"(mid), "r"(floor2));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(t) : "r"(c), "r"(kPos), "r"(w));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(c), "r"(kNeg), "r"(t));
  return r;
#else
  const MxBounds b{f32_from_bits(0x7F800000u), bf16_to_f32(uint16_t(floor2))};
  return uint32_t(bf16_round(mx_qdq_sum_unscaled<kFp8>(bf16_to_f32(uint16_t(w)), b))) |
         (uint32_t(bf16_round(mx_qdq_sum_unscaled<kFp8>(bf16_to_f32(uint16_t(w >> 16)), b))) << 16);
#endif
}

// Where the packed rule applies: block exponents in [-110, 99]. Above, C would overflow for the
// largest elements. Below (blocks of max |x| < 2^-100, which real rows do not have) the floor would
// come near bf16's subnormal range; inside the range the element step is at least 2^-119, so a
// subnormal x rounds to 0 and a subnormal mid loses to the floor whether or not the hardware
// flushes them, and the floor, C and every nonzero result are normal. Other blocks take the scalar
// rules.
inline constexpr int kMxPackedMinExp = -110;
inline constexpr int kMxPackedMaxExp = 99;
struct MxPacked {
  bool ok;          // mx_qdq_sum_unscaled_x2 applies to the block
  uint32_t floor2;  // its floor, in both halves
};
// The block exponent of mx_block_exponent_bf16 from the bits of a bf16 maximum (bits 0-14 = |bmax|;
// bit 15 and bits 16-31 are ignored), in integer operations: e = E(bmax) - E(M) + (mantissa(bmax) >
// mantissa(M)), where adding 0x7F - mantissa(M) carries into the exponent field exactly when the
// mantissa is larger. A zero maximum (e = 0 there) and an infinite or NaN one are not ok.
template <bool kFp8>
MOEFQ_HD MxPacked mx_packed_block(uint32_t bits) {
  constexpr uint32_t kCarry = kFp8 ? 0x1Fu : 0x3Fu;         // 0x7F - 0x60 (1.75), 0x7F - 0x40 (1.5)
  constexpr int kBias = 127 + (kFp8 ? 8 : 2);               // exponent bias + E(M)
  constexpr int kFloorBias = kFp8 ? 127 - 6 : 127;          // floor 1.5 * 2^(e - 6) or 1.5 * 2^e
  const uint32_t u = bits & 0x7FFFu;
  const int e = int((u + kCarry) >> 7) - kBias;
  const uint32_t floor = (uint32_t(e + kFloorBias) << 7) | 0x40u;
  return {u != 0 && e >= kMxPackedMinExp && e <= kMxPackedMaxExp, floor | (floor << 16)};
}

// fp8_block128_ue8m0's block in the packed rule: its element rule is mxfp8_qdq's with the scale
// 2^e of fp8_block128_ue8m0_scale, so mx_qdq_sum_unscaled_x2<true> applies with that e's floor.
// No element needs the saturation: for a bf16 (or floored) maximum a, RN(a * RN(1/448)) exceeds
// a / 448 by less than the gap to the next power of two, so 448 * 2^e >= a. Not ok for an infinite
// maximum (the NaN scale) or e above the packed range; e >= -22 is always inside it.
MOEFQ_HD MxPacked fp8_block128_ue8m0_packed(float bmax) {
  const float a = fp8_block_amax(bmax);
  if (!is_finite(a)) return {false, 0u};
  const int e = fp8_block128_ue8m0_exponent(a);
  const uint32_t floor = (uint32_t(e + 127 - 6) << 7) | 0x40u;  // 1.5 * 2^(e - 6) as bf16
  return {e <= kMxPackedMaxExp, floor | (floor << 16)};
}

}  // namespace moefq
