// Format conversions: binary32 to and from bf16 (scalar and bf16x2) and the output store, the
// minifloats e4m3, e5m2 and e2m1 (in kernels through the hardware's conversions, proven equal),
// the ue8m0 block scale and int8 codes. Part of moefq/numerics.h.
#pragma once

#include <cstdint>

#include "moefq/numerics/binary32.h"

namespace moefq {

// ---------------------------------------------------------------------------------------------
// bf16
MOEFQ_HD float bf16_to_f32(uint16_t b) { return f32_from_bits(uint32_t(b) << 16); }
MOEFQ_HD float to_f32(bf16 b) { return bf16_to_f32(b.bits); }
MOEFQ_HD float to_f32(float f) { return f; }

// binary32 -> bf16, round to nearest even; inf stays inf, any NaN becomes the canonical 0x7FFF.
MOEFQ_HD uint16_t bf16_round_sw(float x) {
  uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kCanonicalNanBf16;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
// The same conversion; in kernels the hardware's cvt.rn.bf16.f32, proven equal to bf16_round_sw
// on all 2^32 inputs by tests/cuda/test_qdq_cuda.cu.
MOEFQ_HD uint16_t bf16_round(float x) {
#if defined(__CUDA_ARCH__)
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
#else
  return bf16_round_sw(x);
#endif
}

// Two conversions packed as bf16x2 (lo in bits 0-15); in kernels one cvt.rn.bf16x2.f32.
MOEFQ_HD uint32_t bf16x2_round(float lo, float hi) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return uint32_t(bf16_round_sw(lo)) | (uint32_t(bf16_round_sw(hi)) << 16);
#endif
}

// Output rounding of a QDQ result to the tensor's dtype: bf16 rounds, fp32 keeps the value;
// either way a NaN becomes canonical so CPU and GPU agree bit for bit.
MOEFQ_HD void store_out(bf16* p, float v) { p->bits = bf16_round(v); }
MOEFQ_HD void store_out(float* p, float v) { *p = is_nan(v) ? canonical_nan_f32() : v; }

// ---------------------------------------------------------------------------------------------
// Minifloats with kExp exponent bits, kMan mantissa bits and bias kBias (e4m3, e5m2, e2m1).
template <int kExp, int kMan, int kBias>
struct Minifloat {
  static constexpr int kEmin = 1 - kBias;  // exponent of the smallest normal

  // Code of the magnitude a (finite, >= 0), rounded to nearest even. The code may exceed the
  // largest finite code (or land on an inf/NaN code): callers saturate or map to inf.
  MOEFQ_HD static uint32_t encode_magnitude(float a) {
    const uint32_t u = f32_bits(a);
    const int e = int(u >> 23) - 127;
    if (e < kEmin) {
      // Target subnormal: a multiple of 2^(kEmin - kMan). Scaling up by a power of two is exact;
      // m == 2^kMan rounds up into the smallest normal, which is the next code.
      return uint32_t(rint_f32(mul_rn(a, exp2i(kMan - kEmin))));
    }
    constexpr int kShift = 23 - kMan;
    const uint32_t mant = u & 0x7FFFFFu;
    uint32_t m = mant >> kShift;
    const uint32_t rem = mant & ((1u << kShift) - 1u);
    const uint32_t half = 1u << (kShift - 1);
    if (rem > half || (rem == half && (m & 1u))) ++m;  // a carry moves into the exponent field
    return (uint32_t(e + kBias) << kMan) + m;
  }

  // Exact value of a magnitude code (no inf/NaN handling).
  MOEFQ_HD static float decode_magnitude(uint32_t code) {
    const uint32_t e = code >> kMan;
    const uint32_t m = code & ((1u << kMan) - 1u);
    if (e == 0) return mul_rn(float(m), exp2i(kEmin - kMan));
    return f32_from_bits(((e - kBias + 127u) << 23) | (m << (23 - kMan)));
  }
};
using E4m3 = Minifloat<4, 3, 7>;
using E5m2 = Minifloat<5, 2, 15>;
using E2m1 = Minifloat<2, 1, 1>;

// e4m3 (OCP "fn"): saturating conversion; |x| above 448 and +-inf become +-448, NaN becomes 0x7F.
MOEFQ_HD uint8_t e4m3_encode_sat_sw(float x) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kE4m3Nan;
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const float a = f32_from_bits(u & 0x7FFFFFFFu);
  if (a >= kE4m3Max) return sign | 0x7E;
  const uint32_t c = E4m3::encode_magnitude(a);
  return sign | uint8_t(c > 0x7Eu ? 0x7Eu : c);
}
// The same conversion; in kernels the hardware's cvt.rn.satfinite.e4m3x2.f32, proven equal to
// e4m3_encode_sat_sw on all 2^32 inputs by tests/cuda/test_qdq_cuda.cu.
MOEFQ_HD uint8_t e4m3_encode_sat(float x) {
#if defined(__CUDA_ARCH__)
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(x));
  return uint8_t(r & 0xFFu);
#else
  return e4m3_encode_sat_sw(x);
#endif
}
// Decoding is exact; for a code known not to be NaN (every saturating encode result) kernels use
// the hardware's cvt through f16, which represents every e4m3 value exactly.
MOEFQ_HD float e4m3_decode_finite(uint8_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(uint16_t(c)));
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(uint16_t(h2 & 0xFFFFu)));
  return f;
#else
  const float a = E4m3::decode_magnitude(c & 0x7Fu);
  return (c & 0x80u) ? -a : a;
#endif
}
MOEFQ_HD float e4m3_decode(uint8_t c) {
  return (c & 0x7Fu) == 0x7Fu ? canonical_nan_f32() : e4m3_decode_finite(c);
}
// Two finite e4m3 codes (low byte first) as bf16x2 (lo in bits 0-15), exactly: every e4m3 value is
// a bf16 value. In kernels one packed conversion decodes both codes.
MOEFQ_HD uint32_t e4m3x2_to_bf16x2(uint32_t two) {
#if defined(__CUDA_ARCH__)
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(uint16_t(two & 0xFFFFu)));
  float lo, hi;
  asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"(uint16_t(h2 & 0xFFFFu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"(uint16_t(h2 >> 16)));
  return bf16x2_round(lo, hi);
#else
  return bf16x2_round(e4m3_decode_finite(uint8_t(two)), e4m3_decode_finite(uint8_t(two >> 8)));
#endif
}

// e5m2 (IEEE-like): round to nearest even; overflow past 57344 (rounded) becomes inf.
// With saturate, it becomes +-57344 instead (inf too). NaN becomes 0x7F.
MOEFQ_HD uint8_t e5m2_encode(float x, bool saturate) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kE5m2Nan;
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const float a = f32_from_bits(u & 0x7FFFFFFFu);
  const uint32_t c = is_finite(a) ? E5m2::encode_magnitude(a) : 0x7Cu;
  if (c >= 0x7Cu) return sign | (saturate ? 0x7B : 0x7C);
  return sign | uint8_t(c);
}
MOEFQ_HD float e5m2_decode(uint8_t c) {
  const uint32_t m = c & 0x7Fu;
  if (m > 0x7Cu) return canonical_nan_f32();
  const float a = m == 0x7Cu ? f32_from_bits(0x7F800000u) : E5m2::decode_magnitude(m);
  return (c & 0x80u) ? -a : a;
}

// e2m1 (FP4): saturating, ties to the even code; magnitudes above 5 and +inf become 6.
// Returns a 4-bit code (sign in bit 3). NaN is a QDQ rule, so it is mapped to the max code here.
MOEFQ_HD uint8_t e2m1_encode_sat(float x) {
  const uint32_t u = f32_bits(x);
  const uint8_t sign = uint8_t((u >> 28) & 0x8u);
  const float a = f32_from_bits(u & 0x7FFFFFFFu);
  if (!(a < kE2m1Max)) return sign | 0x7;  // >= 6, inf, NaN
  const uint32_t c = E2m1::encode_magnitude(a);
  return sign | uint8_t(c > 7u ? 7u : c);
}
MOEFQ_HD float e2m1_decode(uint8_t c) {
  const float a = E2m1::decode_magnitude(c & 0x7u);
  return (c & 0x8u) ? -a : a;
}
// e2m1_decode(e2m1_encode_sat(v)) for v >= 0 (inf included), computed on the value; NaN stays
// NaN. In each binade of e2m1 the step is a power of two (0.5 below 2, 1 below 4, 2 above), and
// adding then subtracting C = 1.5 * 2^23 * step rounds v to a multiple of the step, to nearest
// even: the even multiple is the even code. Both additions are exact apart from that rounding.
// Checked against the code path on every non-negative binary32 by tests/numerics/test_division.cpp.
MOEFQ_HD float e2m1_round_sat(float v) {
  const float c = v < 2.0f ? 6291456.0f : (v < 4.0f ? 12582912.0f : 25165824.0f);
  const float q = add_rn(add_rn(v, c), -c);
  return q > kE2m1Max ? kE2m1Max : q;  // NaN stays NaN
}

// ue8m0 (MX block scale): value 2^(c - 127); 0xFF is NaN.
MOEFQ_HD uint8_t ue8m0_from_exponent(int e) { return uint8_t(e + 127); }
MOEFQ_HD float ue8m0_decode(uint8_t c) { return c == kUe8m0Nan ? canonical_nan_f32() : exp2i(int(c) - 127); }
// ceil(log2(r)) for finite r > 0, read exactly from the bits (subnormal r included).
MOEFQ_HD int ceil_log2(float r) {
  const uint32_t u = f32_bits(r) & 0x7FFFFFFFu;
  const int be = int(u >> 23);
  const uint32_t mant = u & 0x7FFFFFu;
  if (be != 0) return be - 127 + (mant != 0 ? 1 : 0);
  // subnormal: r = mant * 2^-149, mant in [1, 2^23)
#if defined(__CUDA_ARCH__)
  const int fl = 31 - __clz(int(mant));
#else
  const int fl = 31 - __builtin_clz(mant);
#endif
  return fl - 149 + ((mant & (mant - 1u)) != 0 ? 1 : 0);
}

// int8, narrow range [-127, 127], round to nearest even, as the binary32 value docs/numerics.md calls q:
// it keeps the sign of v, so a negative v that rounds to zero gives -0.0. v must not be NaN.
MOEFQ_HD float int8_round_sat(float v) {
  const float r = rint_f32(v);
  return r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
}
// The int8 code (an integer: its zero has no sign). NaN is a QDQ rule (maps to 0 here).
MOEFQ_HD int8_t int8_encode_sat(float v) {
  if (is_nan(v)) return 0;
  return int8_t(int(int8_round_sat(v)));
}

}  // namespace moefq
