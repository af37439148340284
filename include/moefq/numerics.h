// Every number format and every QDQ rule of the project (docs/numerics.md), written
// once as host+device scalar functions. The CPU reference and the CUDA kernels call these, so they
// produce the same bits on every input, NaN, +-inf, +-0 and subnormals included.
// Invariants: binary32 round-to-nearest-even everywhere, no FMA contraction (mul_rn/add_rn),
// exact division (div_rn); NaN results are canonical (f32 0x7FFFFFFF, bf16 0x7FFF, e4m3 0x7F).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOEFQ_HD __host__ __device__ __forceinline__
#else
#define MOEFQ_HD inline
#endif

namespace moefq {

// bf16 storage: the raw bits, so CPU headers need no CUDA type.
struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2);

inline constexpr float kE4m3Max = 448.0f;
inline constexpr float kE2m1Max = 6.0f;
inline constexpr float kE5m2Max = 57344.0f;
inline constexpr float kFltMax = 3.40282346638528859812e+38f;
inline constexpr uint32_t kCanonicalNanF32 = 0x7FFFFFFFu;
inline constexpr uint16_t kCanonicalNanBf16 = 0x7FFF;
inline constexpr uint8_t kE4m3Nan = 0x7F;
inline constexpr uint8_t kE5m2Nan = 0x7F;
inline constexpr uint8_t kUe8m0Nan = 0xFF;

inline constexpr int kNvfp4Block = 16;
inline constexpr int kMxBlock = 32;
inline constexpr int kStageBlock = 128;  // e4m3 staging: 1 x 128 blocks along H

// ---------------------------------------------------------------------------------------------
// binary32 bit access and the arithmetic of docs/numerics.md (RN, exact division, no contraction)
MOEFQ_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
MOEFQ_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}
MOEFQ_HD bool is_nan(float x) { return (f32_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
MOEFQ_HD bool is_finite(float x) { return (f32_bits(x) & 0x7F800000u) != 0x7F800000u; }
MOEFQ_HD float abs_f32(float x) { return f32_from_bits(f32_bits(x) & 0x7FFFFFFFu); }
MOEFQ_HD float copysign_f32(float mag, float sign) {
  return f32_from_bits((f32_bits(mag) & 0x7FFFFFFFu) | (f32_bits(sign) & 0x80000000u));
}
MOEFQ_HD float canonical_nan_f32() { return f32_from_bits(kCanonicalNanF32); }

MOEFQ_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
MOEFQ_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
MOEFQ_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MOEFQ_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return __builtin_fmaf(a, b, c);
#endif
}
// RN(a / b), given r = RN(1 / b), with one multiply and two fused multiply-adds (Markstein's
// correction: the residual a - b*q0 is exact, and q0 + residual*r rounds to the correctly rounded
// quotient). Holds while the quotient and the residual stay normal; callers use it only where a
// quotient outside that range cannot change the result. tests/numerics/test_division.cpp checks
// it against div_rn on every bf16 input for every scale the callers can produce.
MOEFQ_HD float div_rn_recip(float a, float b, float r) {
  const float q0 = mul_rn(a, r);
  return fma_rn(fma_rn(-b, q0, a), r, q0);
}
// Round to an integral value, ties to even (the default rounding mode on the host).
MOEFQ_HD float rint_f32(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return __builtin_rintf(x);
#endif
}
// max over non-NaN values: NaN in x leaves m unchanged (m itself is never NaN, and neither is -0
// among the |x| this is used on). fmaxf has exactly this behaviour and is one instruction.
MOEFQ_HD float max_ignore_nan(float m, float x) {
#if defined(__CUDA_ARCH__)
  return fmaxf(m, x);
#else
  return x > m ? x : m;
#endif
}

// 2^e exactly, for e in [-149, 127] (subnormal results included).
MOEFQ_HD float exp2i(int e) {
  return e >= -126 ? f32_from_bits(uint32_t(e + 127) << 23) : f32_from_bits(1u << (e + 149));
}

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
// on all 2^32 inputs by tests/cuda/test_numerics_cuda.cu.
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
// e4m3_encode_sat_sw on all 2^32 inputs by tests/cuda/test_numerics_cuda.cu.
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

// exp and SiLU for the engine's SwiGLU, written with explicit binary32 operations only, so CPU
// and GPU compute the same bits (library expf differs between them). Cody-Waite reduction
// x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial; a few ulp from exact.
MOEFQ_HD float exp_f32(float x) {
  if (is_nan(x)) return canonical_nan_f32();
  if (x > 88.72283935546875f) return f32_from_bits(0x7F800000u);
  if (x < -103.97207641601562f) return 0.0f;
  const float n = rint_f32(mul_rn(x, 1.44269502162933349609f));
  // ln2 = kLn2Hi + kLn2Lo; n * kLn2Hi is exact for |n| < 2^12 (kLn2Hi has 12 significant bits).
  const float r = add_rn(add_rn(x, -mul_rn(n, 0.693145751953125f)), -mul_rn(n, 1.42860682030941723212e-6f));
  float p = 1.98412698412698412526e-4f;  // 1/5040
  p = add_rn(mul_rn(p, r), 1.38888888888888894189e-3f);
  p = add_rn(mul_rn(p, r), 8.33333333333333321769e-3f);
  p = add_rn(mul_rn(p, r), 4.16666666666666643537e-2f);
  p = add_rn(mul_rn(p, r), 1.66666666666666657415e-1f);
  p = add_rn(mul_rn(p, r), 0.5f);
  p = add_rn(mul_rn(p, r), 1.0f);
  p = add_rn(mul_rn(p, r), 1.0f);
  const int ni = int(n);
  // 2^n in two steps so that results in the subnormal range are reached without overflow.
  if (ni < -126) return mul_rn(mul_rn(p, exp2i(ni + 64)), exp2i(-64));
  if (ni > 127) return mul_rn(mul_rn(p, exp2i(ni - 1)), 2.0f);
  return mul_rn(p, exp2i(ni));
}
// silu(g) = g / (1 + exp(-g)).
MOEFQ_HD float silu_f32(float g) { return div_rn(g, add_rn(1.0f, exp_f32(-g))); }

// The router's scoring functions (router.h), also written with explicit binary32 operations
// only: the CPU router and the CUDA router call these same functions, so they agree bit for bit
// (library expf / log1pf / sqrtf may differ between host and device, or between libm versions).
// Worst errors against exact (tests/numerics/test_router_math.cpp bounds them): exp_f32 1.2 ulp,
// log1p_f32 0.82 ulp, sigmoid_f32 2.4 ulp, softplus_f32 1.7 ulp (where its result is normal).

// IEEE square root, correctly rounded on both sides (sqrtss on the host, sqrt.rn.f32 in kernels,
// which -prec-sqrt=true keeps exact). sqrt(-0) = -0; a negative or NaN x gives the canonical NaN.
MOEFQ_HD float sqrt_rn(float x) {
  if (!(x >= 0.0f)) return canonical_nan_f32();
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return __builtin_sqrtf(x);
#endif
}
// log(1 + x): musl's log1pf (from FreeBSD / fdlibm) in explicit binary32 operations, less than 1 ulp
// from exact. 1 + x = 2^k (1 + f) with 1 + f in [sqrt(2)/2, sqrt(2)); c corrects the rounding of
// 1 + x; log(1 + f) = f - f^2/2 + s (f^2/2 + R(s^2)) with s = f / (2 + f). x = -1 gives -inf,
// x < -1 and NaN the canonical NaN, +inf gives +inf; |x| < 2^-24 gives x (sign of zero kept).
MOEFQ_HD float log1p_f32(float x) {
  constexpr float kLn2Hi = 6.9313812256e-01f;  // 0x3f317180
  constexpr float kLn2Lo = 9.0580006145e-06f;  // 0x3717f7d1
  constexpr float kLg1 = 0.66666662693f, kLg2 = 0.40000972152f, kLg3 = 0.28498786688f,
                  kLg4 = 0.24279078841f;
  if (is_nan(x)) return canonical_nan_f32();
  const uint32_t ix = f32_bits(x);
  int k = 1;
  float c = 0.0f, f = 0.0f;
  if (ix < 0x3ED413D0u || (ix >> 31) != 0u) {  // 1 + x < sqrt(2)+
    if (ix >= 0xBF800000u)                     // x <= -1
      return x == -1.0f ? f32_from_bits(0xFF800000u) : canonical_nan_f32();
    if ((ix << 1) < (0x33800000u << 1)) return x;  // |x| < 2^-24
    if (ix <= 0xBE95F619u) {                       // sqrt(2)/2- <= 1 + x < sqrt(2)+
      k = 0;
      f = x;
    }
  } else if (ix >= 0x7F800000u) {
    return x;  // +inf
  }
  if (k != 0) {
    const float u = add_rn(1.0f, x);
    uint32_t iu = f32_bits(u) + (0x3F800000u - 0x3F3504F3u);
    k = int(iu >> 23) - 0x7F;
    // c = (1 + x) - u, exactly, divided by u: log(1 + x) = log(u) + c / u to first order.
    if (k < 25) {
      c = k >= 2 ? add_rn(1.0f, -add_rn(u, -x)) : add_rn(x, -add_rn(u, -1.0f));
      c = div_rn(c, u);
    }
    iu = (iu & 0x007FFFFFu) + 0x3F3504F3u;  // u / 2^k, in [sqrt(2)/2, sqrt(2))
    f = add_rn(f32_from_bits(iu), -1.0f);
  }
  const float s = div_rn(f, add_rn(2.0f, f));
  const float z = mul_rn(s, s);
  const float w = mul_rn(z, z);
  const float t1 = mul_rn(w, add_rn(kLg2, mul_rn(w, kLg4)));
  const float t2 = mul_rn(z, add_rn(kLg1, mul_rn(w, kLg3)));
  const float r = add_rn(t2, t1);
  const float hfsq = mul_rn(mul_rn(0.5f, f), f);
  const float dk = float(k);
  // ((((s (hfsq + R)) + (k ln2_lo + c)) - hfsq) + f) + k ln2_hi, in this order.
  const float lo = add_rn(mul_rn(s, add_rn(hfsq, r)), add_rn(mul_rn(dk, kLn2Lo), c));
  return add_rn(add_rn(add_rn(lo, -hfsq), f), mul_rn(dk, kLn2Hi));
}
// sigmoid(l) = 1 / (1 + exp(-l)) for l >= 0 and exp(l) / (1 + exp(l)) below, the same function
// written so that exp never overflows: results keep their precision down to the subnormals.
// NaN gives the canonical NaN; +-inf give 1 and 0.
MOEFQ_HD float sigmoid_f32(float l) {
  if (l >= 0.0f) return div_rn(1.0f, add_rn(1.0f, exp_f32(-l)));
  const float e = exp_f32(l);  // NaN stays NaN (canonical)
  return div_rn(e, add_rn(1.0f, e));
}
// softplus(l) = log(1 + exp(l)), and l itself above 20 (where the two round to the same binary32,
// the threshold of torch.nn.functional.softplus). NaN gives the canonical NaN.
MOEFQ_HD float softplus_f32(float l) { return l > 20.0f ? l : log1p_f32(exp_f32(l)); }

// log2 and exp2 for LogFMT, in explicit binary32 operations (fma_rn included), so CPU and GPU
// compute the same bits (the GPU's lg2.approx / ex2.approx and the C library's log2f / exp2f differ
// between platforms). tests/numerics/test_log2_exp2.cpp bounds them against long double:
// exp2_f32 within 1 ulp, log2_f32 within 2 ulp (2^-23 absolute for x in [1/2, 1)).

// floor, exactly (both sides compute the exact value, so any correct instruction gives the bits).
MOEFQ_HD float floor_f32(float x) {
#if defined(__CUDA_ARCH__)
  return floorf(x);
#else
  return __builtin_floorf(x);
#endif
}
// x rounded to an integral value, ties to even, for |x| < 2^22: adding and subtracting 1.5 * 2^23
// puts the rounding at the units place; both additions are single RN operations.
inline constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23
MOEFQ_HD float round_magic(float x) { return add_rn(add_rn(x, kRoundMagic), -kRoundMagic); }

// 2^f for |f| <= 1/2: a degree-6 polynomial (Chebyshev fit on [-1/2, 1/2], coefficients rounded to
// binary32, Horner with fma_rn); under 1 ulp from 2^f.
MOEFQ_HD float exp2_poly(float f) {
  float p = 0x1.444p-13f;
  p = fma_rn(p, f, 0x1.5f48cp-10f);
  p = fma_rn(p, f, 0x1.3b2a1cp-7f);
  p = fma_rn(p, f, 0x1.c6aeccp-5f);
  p = fma_rn(p, f, 0x1.ebfbep-3f);
  p = fma_rn(p, f, 0x1.62e43p-1f);
  return fma_rn(p, f, 1.0f);
}
// 2^y: y = n + f with n = round(y) (ties to even) and |f| <= 1/2, 2^y = exp2_poly(f) * 2^n (exact
// while normal; one rounding into the subnormals). NaN gives the canonical NaN, y >= 128 gives +inf,
// y < -151 gives +0.
// exp2_f32's path for n in [-126, 127] (2^n normal), without the range tests: the bits of exp2_f32(y)
// wherever round(y) is in that range (y in [-126, 127] is). 2^n comes from the bits of y + 1.5 * 2^23,
// which are 0x4B400000 + n: times 2^23 (mod 2^32) that is n * 2^23, plus 127 * 2^23.
MOEFQ_HD float exp2_f32_normal(float y) {
  const float nm = add_rn(y, kRoundMagic);
  const float p = exp2_poly(add_rn(y, -add_rn(nm, -kRoundMagic)));  // y - n is exact
  return mul_rn(p, f32_from_bits(f32_bits(nm) * 0x800000u + 0x3F800000u));
}
MOEFQ_HD float exp2_f32(float y) {
  if (is_nan(y)) return canonical_nan_f32();
  if (y >= 128.0f) return f32_from_bits(0x7F800000u);
  if (y < -151.0f) return 0.0f;
  const float n = round_magic(y);
  const int ni = int(n);
  if (ni >= -126 && ni <= 127) return exp2_f32_normal(y);
  const float p = exp2_poly(add_rn(y, -n));  // y - n is exact
  if (ni < -126) return mul_rn(mul_rn(p, exp2i(ni + 64)), exp2i(-64));
  return mul_rn(mul_rn(p, exp2i(ni - 1)), 2.0f);
}
// log2(1 + f) for f in [0, 1) (f = m - 1 for a significand m, exact): f / ln2 + f^2 R(f), with
// 1 / ln2 split as kHi + kLo and R a degree-9 polynomial (Chebyshev fit on [0, 1]). Under 2 ulp.
MOEFQ_HD float log2_1p_unit(float f) {
  float r = 0x1.08e414p-8f;
  r = fma_rn(r, f, -0x1.962fbep-6f);
  r = fma_rn(r, f, 0x1.2362eap-4f);
  r = fma_rn(r, f, -0x1.0e0966p-3f);
  r = fma_rn(r, f, 0x1.8116c4p-3f);
  r = fma_rn(r, f, -0x1.e388p-3f);
  r = fma_rn(r, f, 0x1.26d30ap-2f);
  r = fma_rn(r, f, -0x1.714836p-2f);
  r = fma_rn(r, f, 0x1.ec704p-2f);
  r = fma_rn(r, f, -0x1.715476p-1f);
  const float t = fma_rn(f, r, 0x1.4ae0cp-26f);  // kLo + f R(f)
  return fma_rn(f, 0x1.715476p+0f, mul_rn(f, t));  // f kHi + f (kLo + f R(f))
}
// log2(x) = E + log2(m) for x = 2^E m, m in [1, 2) (subnormal x normalised): the sum of the exact
// float(E) and log2_1p_unit(m - 1), one rounding. So for a bf16 x (m = 1 + j/128) it is
// add_rn(float(E), log2_1p_unit(j / 128)): a kernel could read it from a 128-entry table.
// +-0 gives -inf, +inf gives +inf, NaN and x < 0 the canonical NaN.
// log2_f32 of a normal bf16 magnitude (bits 0x0080..0x7F7F) as that comment says: float(E - 127)
// (exact, from the bits of 2^23 + E) plus table[j] = log2_1p_unit(j / 128), one rounding.
MOEFQ_HD float log2_bf16_normal(uint32_t mag, const float* table) {
  return add_rn(add_rn(f32_from_bits(0x4B000000u | (mag >> 7)), -8388735.0f), table[mag & 0x7Fu]);
}
MOEFQ_HD float log2_f32(float x) {
  if (is_nan(x) || x < 0.0f) return canonical_nan_f32();
  uint32_t u = f32_bits(x);
  if (u == 0 || u == 0x80000000u) return f32_from_bits(0xFF800000u);
  if (u == 0x7F800000u) return x;
  int e = int(u >> 23) - 127;
  if (e == -127) {  // subnormal: shift the significand up to the hidden bit
    int shift = 0;
    while ((u & 0x00800000u) == 0) {
      u <<= 1;
      ++shift;
    }
    e = -126 - shift;
  }
  const float f = add_rn(f32_from_bits((u & 0x007FFFFFu) | 0x3F800000u), -1.0f);
  return add_rn(float(e), log2_1p_unit(f));
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

// ---------------------------------------------------------------------------------------------
// The other peers' wire formats (docs/numerics.md, "Wire formats of the expert-parallel
// libraries"). Each is a per-element rule with per-block parameters {s, si} computed from the
// block's max |x| over its non-NaN elements (+inf counts); the CPU reference and the CUDA kernels
// call peer_params<R> and peer_qdq<R>, so both compute the same bits.
enum class PeerRule : uint8_t {
  kFp8Cast,         // e4m3, no scale, saturating at +-448 (MoRI's FP8 direct cast, saturating)
  kFp8CastNan,      // e4m3, no scale, |x| > 448 and inf become NaN (MoRI's main path, OCP targets)
  kUe8m0NoFloor,    // the SGLang DeepGEMM fork's FP8 Mega-MoE combine: ue8m0 per 128, amax from 0
  kMoriFp8Block,    // MoRI's FP8 blockwise combine: a block is scaled only when its max > 448
  kMoriFp4Block,    // MoRI's FP4 blockwise combine: e2m1, an fp32 scale bmax / 6 per block
  kDeepGemmBlock,   // DeepGEMM's per_token_cast_to_fp8: sf = max(bmax, 1e-4) / 448, x * (1 / sf)
  kVllmBlock,       // vLLM's per-token-group FP8 quant: sf = max(bmax, 1e-10) / 448, x / sf
  kFlashInferFp4,   // FlashInfer's Mega-MoE nvfp4 combine (16e2m1xbf16): e2m1 per 16, the bf16 bmax
};
struct PeerParams {
  float s;   // into the element format (a multiplier; kVllmBlock: the divisor sf)
  float si;  // back (the dequantization scale)
};
inline constexpr int kPeerBlock = 128;  // the blocked peer rules' block, but for kFlashInferFp4
inline constexpr int kFlashInferFp4Block = 16;
inline constexpr float kVllmAmaxFloor = 1e-10f;
inline constexpr float kInvE2m1Max = 1.0f / 6.0f;  // RN(1/6)
inline constexpr float kFltMin = 1.17549435082228750797e-38f;  // 2^-126, the smallest normal

// Channels per block of a peer rule; 0 for the unscaled casts (no block).
constexpr int peer_block_size(PeerRule r) {
  return r == PeerRule::kFp8Cast || r == PeerRule::kFp8CastNan ? 0
         : r == PeerRule::kFlashInferFp4                       ? kFlashInferFp4Block
                                                               : kPeerBlock;
}

// ceil(log2(r)) as the fork's fast_log2_ceil reads it from the bits: biased exponent - 127, plus 1
// when the mantissa field is not zero. Exact for normal r; a subnormal r gives -126 (exponent field
// 0 with a mantissa), and 0 gives -127.
MOEFQ_HD int ceil_log2_bits(float r) {
  const uint32_t u = f32_bits(r) & 0x7FFFFFFFu;
  return int(u >> 23) - 127 + ((u & 0x7FFFFFu) != 0u ? 1 : 0);
}

template <PeerRule R>
MOEFQ_HD PeerParams peer_params(float bmax) {
  if constexpr (R == PeerRule::kFp8Cast || R == PeerRule::kFp8CastNan) {
    return {1.0f, 1.0f};
  } else if constexpr (R == PeerRule::kUe8m0NoFloor) {
    // e = ceil(log2(bmax * RN(1/448))) in [-127, 120] for finite bmax; s = 2^-e, si = 2^e. A
    // block holding +-inf gets a NaN scale (every element NaN), as fp8_block128_ue8m0.
    if (!is_finite(bmax)) return {0.0f, canonical_nan_f32()};
    const int e = ceil_log2_bits(mul_rn(bmax, kInvE4m3Max));
    return {exp2i(-e), exp2i(e)};
  } else if constexpr (R == PeerRule::kMoriFp8Block) {
    // Unscaled (a plain saturating cast) unless bmax > 448; then s = 448 / bmax (a division) and
    // si = bmax * RN(1/448). An infinite bmax gives s = 0, si = inf: every element NaN.
    if (!(bmax > kE4m3Max)) return {1.0f, 1.0f};
    return {div_rn(kE4m3Max, bmax), mul_rn(bmax, kInvE4m3Max)};
  } else if constexpr (R == PeerRule::kMoriFp4Block) {
    // s = 6 / bmax and si = bmax / 6, two divisions; a zero block s = 0, si = 1. An infinite bmax
    // gives s = 0, si = inf: every element NaN.
    if (!(bmax > 0.0f)) return {0.0f, 1.0f};
    return {div_rn(kE2m1Max, bmax), div_rn(bmax, kE2m1Max)};
  } else if constexpr (R == PeerRule::kFlashInferFp4) {
    // The wire carries the block's maximum as bf16 (a, exact for bf16 rows); d = a * RN(1/6) is the
    // dequantization scale (si). Into e2m1: enc = rcp(d) (moefq: RN(1/d); the peer's rcp.approx.ftz
    // reads a subnormal or zero d as 0 and gives inf, capped at FLT_MAX), times the peer's mask
    // min(d * 1e30, 1), which makes a zero block's enc 0 and shrinks it for d < 1e-30. An infinite
    // bmax gives enc = 0, d = inf: every element NaN.
    const float d = mul_rn(bf16_to_f32(bf16_round(bmax)), kInvE2m1Max);
    const float r = d < kFltMin ? kFltMax : div_rn(1.0f, d);
    const float mask = mul_rn(d, 1e30f);
    return {mul_rn(r, mask < 1.0f ? mask : 1.0f), d};
  } else if constexpr (R == PeerRule::kDeepGemmBlock) {
    const float sf = div_rn(bmax > kFp8BlockAmaxFloor ? bmax : kFp8BlockAmaxFloor, kE4m3Max);
    return {div_rn(1.0f, sf), sf};
  } else {
    const float sf = div_rn(bmax > kVllmAmaxFloor ? bmax : kVllmAmaxFloor, kE4m3Max);
    return {sf, sf};
  }
}

// The dequantized value of x (binary32; the caller rounds it to the tensor's dtype). NaN x gives
// NaN; the sign of zero is kept.
template <PeerRule R>
MOEFQ_HD float peer_qdq(float x, PeerParams p) {
  if (is_nan(x)) return canonical_nan_f32();
  if constexpr (R == PeerRule::kFp8CastNan) {
    if (abs_f32(x) > kE4m3Max) return canonical_nan_f32();  // inf too
  }
  if constexpr (R == PeerRule::kMoriFp4Block || R == PeerRule::kFlashInferFp4) {
    // e2m1 of |x| * s, ties to the even code, saturating at 6; inf * 0 (an infinite block) is NaN.
    const float q = e2m1_round_sat(mul_rn(abs_f32(x), p.s));
    return copysign_f32(mul_rn(q, p.si), x);
  }
  const float v = R == PeerRule::kVllmBlock ? div_rn(x, p.s) : mul_rn(x, p.s);
  // Checked decode: inf * 0 (an infinite block) is NaN and must stay NaN.
  return mul_rn(e4m3_decode(e4m3_encode_sat(v)), p.si);
}

// The combine's weighting `after` (docs/fake_quant.md): a routed row's value v enters the fp32 sum
// as acc = fma(v, w, acc), one rounding, as DeepEP's low-latency combine accumulates (nvcc
// contracts its `accum += decoded * weight`). The CPU engine, the fake quantizer's re-sum and the
// CUDA combine all call this.
MOEFQ_HD float weighted_add(float acc, float v, float w) { return fma_rn(v, w, acc); }

// ---------------------------------------------------------------------------------------------
// LogFMT-10 (DeepEP's low-latency combine, csrc/kernels/legacy/internode_ll.cu logfmt_encode and
// decode_and_accumulate): per block of 128 channels of a bf16 row, amax and amin of |x|; the
// block's magnitudes are coded on a log-uniform grid of 511 values from 2^log_amin to 2^log_amax
// (code 0 = zero), 9 bits plus a sign; a block is cast only when log2(amax) < 0 and log_amin <
// log2(amax), and only when every block of its cast group is (DeepEP's send unit: 1024 channels when
// the row length is a multiple of 1024, else 512); other groups are sent as bf16. DeepEP computes
// its logarithms with lg2.approx / ex2.approx; moefq uses log2_f32 / exp2_f32 in exactly the same
// formulas (its CPU and GPU agree bit for bit), and keeps NaN as NaN where DeepEP codes it as zero.
inline constexpr int kLogFmtBlock = 128;
inline constexpr int kLogFmtMaxCode = 511;       // 9-bit magnitude codes, 1..511 on the grid
inline constexpr float kLogFmtSteps = 510.0f;    // kNumValues - 2: grid steps from amin to amax
inline constexpr float kLogFmtMinClip = 32.0f;   // log_amin >= log_amax - 32
// Blocks per cast group for a row of `cols` elements (the last group may be short).
MOEFQ_HD int logfmt_group_blocks(int64_t cols) { return cols % 1024 == 0 ? 8 : 4; }

struct LogFmtBlock {
  float log_amin;  // the grid's first value is 2^log_amin (code 1)
  float step;      // log2 of the grid's ratio
  float step_inv;  // 1 / step
  float fused;     // the encoder's offset: code = floor(log2|x| * step_inv + fused)
  bool ok;         // the block alone could be cast
};
// From the block's amax and amin of |x| over its non-NaN elements (bf16 values; amax 0 and amin
// +inf for a block with none): DeepEP's formulas, in its order, with its contractions (fma where
// nvcc contracts a * b + c).
MOEFQ_HD LogFmtBlock logfmt_block(float amax, float amin) {
  LogFmtBlock b;
  const float log_amax = log2_f32(amax);
  const float clip = add_rn(log_amax, -kLogFmtMinClip);
  const float log_amin_raw = log2_f32(amin);  // -inf for 0, so the clip applies (fmaxf's rule)
  const float log_amin = log_amin_raw > clip ? log_amin_raw : clip;
  b.ok = log_amax < 0.0f && log_amin < log_amax;
  b.log_amin = log_amin;
  b.step = div_rn(add_rn(log_amax, -log_amin), kLogFmtSteps);
  b.step_inv = div_rn(1.0f, b.step);
  // rounding = 2 - log2((1 + 2^step) / 2) / step: codes change at the linear midpoints of the grid.
  const float rounding = fma_rn(-log2_f32(mul_rn(add_rn(1.0f, exp2_f32(b.step)), 0.5f)), b.step_inv, 2.0f);
  b.fused = fma_rn(-log_amin, b.step_inv, rounding);
  return b;
}
// The code of |x| (0..511) from t = log2|x| * step_inv + fused: below 1 is code 0 (zero), and codes
// are capped at 511 (the 9-bit field; reached only by rounding at amax).
MOEFQ_HD float logfmt_code(float t) {
  if (!(t >= 1.0f)) return 0.0f;
  const float k = floor_f32(t);
  return k < float(kLogFmtMaxCode) ? k : float(kLogFmtMaxCode);
}
// log2 of code k's grid value (k >= 1): (k - 1) * step + log_amin, in [log_amin, log_amax].
MOEFQ_HD float logfmt_grid_log2(float k, const LogFmtBlock& b) { return fma_rn(add_rn(k, -1.0f), b.step, b.log_amin); }
// The decoded magnitude of code k >= 1: 2^((k - 1) * step + log_amin).
MOEFQ_HD float logfmt_decode(float k, const LogFmtBlock& b) { return exp2_f32(logfmt_grid_log2(k, b)); }
// QDQ of one element x (a bf16 value) of a cast block, given l = log2_f32(|x|) (kernels read it from
// a table): NaN stays NaN, zero codes keep the sign.
MOEFQ_HD float logfmt_qdq_log2(float x, float l, const LogFmtBlock& b) {
  if (is_nan(x)) return canonical_nan_f32();
  const float k = logfmt_code(fma_rn(l, b.step_inv, b.fused));
  return copysign_f32(k == 0.0f ? 0.0f : logfmt_decode(k, b), x);
}
MOEFQ_HD float logfmt_qdq(float x, const LogFmtBlock& b) { return logfmt_qdq_log2(x, log2_f32(abs_f32(x)), b); }
// logfmt_qdq for a bf16 value x with log2 read from `table` (log2_bf16_normal's) where x is a
// normal bf16; subnormals, zeros and NaN take log2_f32.
MOEFQ_HD float logfmt_qdq_table(float x, const LogFmtBlock& b, const float* table) {
  const uint32_t mag = (f32_bits(x) >> 16) & 0x7FFFu;
  return logfmt_qdq_log2(x, mag - 0x80u < 0x7F00u ? log2_bf16_normal(mag, table) : log2_f32(abs_f32(x)), b);
}
// The same value without branches, for blocks with log_amin >= -126 and x normal, zero or NaN (not
// subnormal): the table's log2 for every element, exp2_f32_normal for the decode (grid values lie
// in [2^log_amin, 2^log_amax] with log_amax < 0, where it gives exp2_f32's bits), and zeros (code
// 0, or x = +-0, whose table value is not log2 0) and NaN chosen at the end.
MOEFQ_HD float logfmt_qdq_table_normal(float x, const LogFmtBlock& b, const float* table) {
  const uint32_t mag = (f32_bits(x) >> 16) & 0x7FFFu;
  const float k = logfmt_code(fma_rn(log2_bf16_normal(mag, table), b.step_inv, b.fused));
  const float r = exp2_f32_normal(logfmt_grid_log2(k, b));
  return mag > 0x7F80u ? canonical_nan_f32() : copysign_f32(k == 0.0f || mag == 0 ? 0.0f : r, x);
}

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
