// A second implementation of every conversion and QDQ rule of docs/numerics.md, written the slow way so
// that it shares nothing with include/moefq/numerics.h: integer arithmetic only on every path that
// decides a result. A non-negative finite value is an exact dyadic rational m * 2^e (m an unsigned
// integer); binary32 multiply and divide form the exact product, or a long quotient whose
// remainder is the sticky bit, in unsigned __int128 and round it to nearest even into binary32
// (subnormals and overflow to inf included); conversions to the small formats round by searching
// the ascending table of the format's values (built from integers), ties to the even code, never
// bit tricks. No long double or float arithmetic decides any result, so the reference computes
// the same bits under any compiler and optimisation level (floats are only compared, negated,
// and reinterpreted; IEEE comparisons are exact).
// It also follows the project's choices on points real kernels differ on: every NaN result is
// canonical (f32 0x7FFFFFFF, bf16 0x7FFF, e4m3/e5m2 0x7F, sign dropped), int8 QDQ of -0 gives +0,
// mx blocks keep the sign of zero, the dynamic amax is max |x| over non-NaN elements (+inf counts),
// and NaN propagates through every step (docs/numerics.md taken literally with IEEE arithmetic: a NaN
// scale gives NaN elements, e4m3_sat(NaN) and e2m1 of NaN are NaN).
// Header only: every .cpp under tests/numerics is its own test program.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "moefq/qdq.h"

namespace moefq::slow {

using u128 = unsigned __int128;

inline constexpr uint32_t kNanF32 = 0x7FFFFFFFu;
inline constexpr uint16_t kNanBf16 = 0x7FFF;
inline constexpr uint8_t kNanE4m3 = 0x7F;
inline constexpr uint8_t kNanE5m2 = 0x7F;
inline constexpr uint32_t kInfBits = 0x7F800000u;
inline constexpr uint32_t kSignBit = 0x80000000u;
inline constexpr float kFltMax = std::numeric_limits<float>::max();

inline float f32_from_bits(uint32_t u) { return std::bit_cast<float>(u); }
inline uint32_t f32_to_bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float quiet_nan() { return f32_from_bits(kNanF32); }
inline float infinity() { return f32_from_bits(kInfBits); }
inline float with_sign(float magnitude, bool negative) {
  return f32_from_bits((f32_to_bits(magnitude) & ~kSignBit) | (negative ? kSignBit : 0u));
}

// Classification on the bits (no floating-point operation involved).
inline bool nan_bits(uint32_t u) { return (u & ~kSignBit) > kInfBits; }
inline bool inf_bits(uint32_t u) { return (u & ~kSignBit) == kInfBits; }
inline bool zero_bits(uint32_t u) { return (u & ~kSignBit) == 0; }
inline bool neg_bits(uint32_t u) { return (u & kSignBit) != 0; }

// ---------------------------------------------------------------------------------------------
// Exact non-negative dyadic rationals and binary32 rounding, in integers

struct Dyadic {
  uint64_t m = 0;  // value m * 2^e
  int e = 0;
};

inline int bit_length(u128 v) {
  const uint64_t hi = uint64_t(v >> 64);
  return hi != 0 ? 64 + int(std::bit_width(hi)) : int(std::bit_width(uint64_t(v)));
}

// sign(a - b), exactly.
inline int compare(Dyadic a, Dyadic b) {
  if (a.m == 0 || b.m == 0) return int(a.m != 0) - int(b.m != 0);
  const int top_a = a.e + bit_length(a.m);  // 2^(top-1) <= value < 2^top
  const int top_b = b.e + bit_length(b.m);
  if (top_a != top_b) return top_a < top_b ? -1 : 1;
  // Same top bit, so |a.e - b.e| = |len(a.m) - len(b.m)| < 64: the aligned values fit in 128 bits.
  const int k = std::min(a.e, b.e);
  const u128 x = u128(a.m) << (a.e - k);
  const u128 y = u128(b.m) << (b.e - k);
  return x < y ? -1 : (x > y ? 1 : 0);
}

// (a + b) / 2, exactly (the operands used here are neighbours in a table: close exponents).
inline Dyadic midpoint(Dyadic a, Dyadic b) {
  if (a.m == 0) return {b.m, b.e - 1};
  if (b.m == 0) return {a.m, a.e - 1};
  const int k = std::min(a.e, b.e);
  if (std::max(a.e, b.e) - k > 60) std::abort();
  u128 sum = (u128(a.m) << (a.e - k)) + (u128(b.m) << (b.e - k));
  int e = k - 1;
  while (sum % 2 == 0) {
    sum /= 2;
    ++e;
  }
  if (sum >> 64 != 0) std::abort();
  return {uint64_t(sum), e};
}

// |x| of a finite binary32 as m * 2^e: m = the significand with its hidden bit (24 bits at most).
inline Dyadic magnitude_bits(uint32_t u) {
  const uint32_t biased = (u >> 23) & 0xFFu;
  const uint32_t frac = u & 0x7FFFFFu;
  if (biased == 0) return {frac, -149};
  return {uint64_t(frac) | (uint64_t(1) << 23), int(biased) - 150};
}
inline Dyadic magnitude(float x) { return magnitude_bits(f32_to_bits(x)); }

// RN binary32 bits of (-1)^neg * (mant + f) * 2^exp, where 0 <= f < 1 and f > 0 exactly when
// `sticky`. A binary32 is n * 2^q with n < 2^24 and q >= -149 (n >= 2^23 unless q = -149); the
// result's quantum q follows from the top bit of the value; below it, the remainder is compared
// with half a quantum (the sticky bit decides a remainder equal to the half), ties go to even n.
inline uint32_t round_to_f32_bits(bool neg, u128 mant, int exp, bool sticky) {
  const uint32_t sign = neg ? kSignBit : 0u;
  if (mant == 0) {
    if (sticky) std::abort();  // callers keep enough quotient bits for this never to happen
    return sign;
  }
  const int len = bit_length(mant);
  int q = std::max(exp + len - 24, -149);
  u128 n = 0;
  if (q <= exp) {
    if (sticky) std::abort();
    n = mant << (exp - q);  // exact: fewer than 24 significant bits
  } else {
    const int shift = q - exp;
    if (shift >= 128) {
      n = 0;  // value < 2^len * 2^exp <= half a quantum (len <= 127)
    } else {
      n = mant >> shift;
      const u128 rem = mant & ((u128(1) << shift) - 1);
      const u128 half = u128(1) << (shift - 1);
      if (rem > half || (rem == half && (sticky || n % 2 == 1))) n += 1;
    }
  }
  if (n == (u128(1) << 24)) {  // rounded up into the next binade
    n >>= 1;
    ++q;
  }
  if (q > 104) return sign | kInfBits;      // past FLT_MAX = (2^24 - 1) * 2^104
  if (n < (u128(1) << 23)) return sign | uint32_t(n);  // subnormal (q = -149) or zero
  return sign | (uint32_t(q + 150) << 23) | (uint32_t(n) - (uint32_t(1) << 23));
}

// The binary32 with value d; d must be representable (table values, powers of two).
inline float to_f32(Dyadic d) {
  const uint32_t u = round_to_f32_bits(false, d.m, d.e, false);
  if (compare(magnitude_bits(u), d) != 0 || inf_bits(u)) std::abort();
  return f32_from_bits(u);
}
inline float pow2_f32(int e) { return to_f32({1, e}); }

// ---------------------------------------------------------------------------------------------
// Value tables

// Magnitude of code `code` of a binary format with man_bits and bias, IEEE layout: an exponent
// field of 0 is subnormal. Specials are not applied here, so a code past the largest finite one
// gives the value the format would have with its exponent range extended.
inline Dyadic minifloat_magnitude(uint32_t code, int man_bits, int bias) {
  const uint32_t man_codes = uint32_t(1) << man_bits;
  const uint32_t exp_field = code / man_codes;
  const uint32_t man_field = code % man_codes;
  if (exp_field == 0) return {man_field, 1 - bias - man_bits};
  return {man_codes + man_field, int(exp_field) - bias - man_bits};
}

// The non-negative finite values of a format, ascending; index = magnitude code. `beyond` is the
// value of the next code with the exponent range extended: the value rounding overflows to.
struct ValueTable {
  std::vector<Dyadic> values;
  Dyadic beyond;
  // Value i as a binary32 (every finite value of these formats is one).
  float value(size_t i) const { return to_f32(values[i]); }
  size_t size() const { return values.size(); }
  // The value after i: values[i + 1], or `beyond` after the last.
  Dyadic next(size_t i) const { return i + 1 < values.size() ? values[i + 1] : beyond; }
};

inline ValueTable make_table(uint32_t num_finite_codes, int man_bits, int bias) {
  ValueTable t;
  for (uint32_t c = 0; c < num_finite_codes; ++c) t.values.push_back(minifloat_magnitude(c, man_bits, bias));
  t.beyond = minifloat_magnitude(num_finite_codes, man_bits, bias);
  return t;
}

inline const ValueTable& bf16_table() {  // 1-8-7, codes 0x0000..0x7F7F finite, 0x7F80 = inf
  static const ValueTable t = make_table(0x7F80, 7, 127);
  return t;
}
inline const ValueTable& e4m3_table() {  // 1-4-3 bias 7, codes 0x00..0x7E finite (448), 0x7F NaN
  static const ValueTable t = make_table(0x7F, 3, 7);
  return t;
}
inline const ValueTable& e5m2_table() {  // 1-5-2 bias 15, codes 0x00..0x7B finite, 0x7C inf
  static const ValueTable t = make_table(0x7C, 2, 15);
  return t;
}
inline const ValueTable& e2m1_table() {  // 1-2-1 bias 1, codes 0..7: {0, .5, 1, 1.5, 2, 3, 4, 6}
  static const ValueTable t = make_table(8, 1, 1);
  return t;
}

// Index of the table value nearest to a (exact), ties to the even index; size() stands for
// `beyond` (overflow). Every comparison, with the midpoint of two neighbours included, is exact.
inline size_t round_to_table(Dyadic a, const ValueTable& t) {
  const std::vector<Dyadic>& v = t.values;
  const size_t idx =
      size_t(std::upper_bound(v.begin(), v.end(), a, [](Dyadic x, Dyadic y) { return compare(x, y) < 0; }) -
             v.begin()) - 1;
  if (compare(a, v[idx]) == 0) return idx;
  const int c = compare(a, midpoint(v[idx], t.next(idx)));
  if (c < 0) return idx;
  if (c > 0) return idx + 1;
  return idx % 2 == 0 ? idx : idx + 1;
}

// ---------------------------------------------------------------------------------------------
// Conversions from binary32 and decoders

inline uint16_t bf16_round(float x) {
  const uint32_t u = f32_to_bits(x);
  if (nan_bits(u)) return kNanBf16;
  // inf is code 0x7F80, the index of `beyond`; so is overflow.
  const size_t mag = inf_bits(u) ? 0x7F80 : round_to_table(magnitude_bits(u), bf16_table());
  return uint16_t((neg_bits(u) ? 0x8000u : 0u) | uint32_t(mag));
}

inline float bf16_value(uint16_t b) {
  const bool neg = b >= 0x8000;
  const uint32_t mag = b % 0x8000u;
  if (mag > 0x7F80) return quiet_nan();
  if (mag == 0x7F80) return with_sign(infinity(), neg);
  return with_sign(bf16_table().value(mag), neg);
}

inline uint8_t e4m3_encode_sat(float x) {
  const uint32_t u = f32_to_bits(x);
  if (nan_bits(u)) return kNanE4m3;
  size_t mag = inf_bits(u) ? 0x7E : round_to_table(magnitude_bits(u), e4m3_table());
  if (mag > 0x7E) mag = 0x7E;  // rounded past 448 (or inf): saturate
  return uint8_t((neg_bits(u) ? 0x80u : 0u) | uint32_t(mag));
}

inline float e4m3_decode(uint8_t c) {
  const uint32_t mag = c % 0x80u;
  if (mag == 0x7F) return quiet_nan();
  return with_sign(e4m3_table().value(mag), c >= 0x80);
}

inline uint8_t e5m2_encode(float x, bool saturate) {
  const uint32_t u = f32_to_bits(x);
  if (nan_bits(u)) return kNanE5m2;
  size_t mag = inf_bits(u) ? 0x7C : round_to_table(magnitude_bits(u), e5m2_table());
  if (mag >= 0x7C) mag = saturate ? 0x7B : 0x7C;  // overflow and inf: inf, or 57344 when saturating
  return uint8_t((neg_bits(u) ? 0x80u : 0u) | uint32_t(mag));
}

inline float e5m2_decode(uint8_t c) {
  const uint32_t mag = c % 0x80u;
  if (mag > 0x7C) return quiet_nan();
  if (mag == 0x7C) return with_sign(infinity(), c >= 0x80);
  return with_sign(e5m2_table().value(mag), c >= 0x80);
}

// 4-bit code, sign in bit 3. e2m1 has no NaN code: a NaN takes the largest code here (the
// conversion tests do not compare NaN inputs); the QDQ rules handle NaN before encoding
// (e2m1_sat_value below).
inline uint8_t e2m1_encode_sat(float x) {
  const uint32_t u = f32_to_bits(x);
  if (nan_bits(u)) return uint8_t((neg_bits(u) ? 8u : 0u) | 7u);
  size_t mag = inf_bits(u) ? 7 : round_to_table(magnitude_bits(u), e2m1_table());
  if (mag > 7) mag = 7;
  return uint8_t((neg_bits(u) ? 8u : 0u) | uint32_t(mag));
}

inline float e2m1_decode(uint8_t c) { return with_sign(e2m1_table().value(c % 8u), (c % 16u) >= 8); }

inline float ue8m0_decode(uint8_t c) {
  if (c == 0xFF) return quiet_nan();
  return pow2_f32(int(c) - 127);
}

// Round to the nearest integer, ties to even, then clamp to [-127, 127]. NaN gives 0.
inline int8_t int8_encode_sat(float v) {
  const uint32_t u = f32_to_bits(v);
  if (nan_bits(u)) return 0;
  const int sign = neg_bits(u) ? -1 : 1;
  if (inf_bits(u)) return int8_t(sign * 127);
  const Dyadic d = magnitude_bits(u);
  if (compare(d, {127, 0}) >= 0) return int8_t(sign * 127);
  uint64_t n = 0;
  if (d.e >= 0) {
    n = d.m << d.e;  // an integer below 127
  } else if (-d.e < 63) {
    const int shift = -d.e;
    n = d.m >> shift;
    const uint64_t rem = d.m & ((uint64_t(1) << shift) - 1);
    const uint64_t half = uint64_t(1) << (shift - 1);
    if (rem > half || (rem == half && n % 2 == 1)) n += 1;
  }  // else |v| < 2^24 * 2^-63: rounds to 0
  return int8_t(sign * int(n));
}

// ---------------------------------------------------------------------------------------------
// Binary32 arithmetic, RN ties-to-even, exact in integers

inline float mul_rn(float a, float b) {
  const uint32_t ua = f32_to_bits(a), ub = f32_to_bits(b);
  if (nan_bits(ua) || nan_bits(ub)) return quiet_nan();
  const bool neg = neg_bits(ua) != neg_bits(ub);
  if (inf_bits(ua) || inf_bits(ub)) {
    if (zero_bits(ua) || zero_bits(ub)) return quiet_nan();
    return with_sign(infinity(), neg);
  }
  const Dyadic x = magnitude_bits(ua), y = magnitude_bits(ub);
  // The exact product: at most 48 bits.
  return f32_from_bits(round_to_f32_bits(neg, u128(x.m) * u128(y.m), x.e + y.e, false));
}

inline float div_rn(float a, float b) {
  const uint32_t ua = f32_to_bits(a), ub = f32_to_bits(b);
  if (nan_bits(ua) || nan_bits(ub)) return quiet_nan();
  const bool neg = neg_bits(ua) != neg_bits(ub);
  if (inf_bits(ua)) return inf_bits(ub) ? quiet_nan() : with_sign(infinity(), neg);
  if (inf_bits(ub)) return with_sign(0.0f, neg);
  if (zero_bits(ub)) return zero_bits(ua) ? quiet_nan() : with_sign(infinity(), neg);
  if (zero_bits(ua)) return with_sign(0.0f, neg);
  const Dyadic x = magnitude_bits(ua), y = magnitude_bits(ub);
  // x.m * 2^64 / y.m: a quotient of at least 41 bits (x.m >= 1, y.m < 2^24), so the rounding
  // position lies at least 17 bits below its top, and the remainder is the sticky bit.
  const u128 num = u128(x.m) << 64;
  const u128 quot = num / y.m;
  const u128 rem = num % y.m;
  return f32_from_bits(round_to_f32_bits(neg, quot, x.e - y.e - 64, rem != 0));
}

// RN of the exact (-1)^neg_p * p + (-1)^neg_c * c for non-negative dyadics p and c (either may be
// 0), with IEEE's zero signs (an exact zero is +0, or -0 when both terms are -0 or zero of the same
// negative sign). When one term lies more than 62 bits below the other's top bit it cannot move the
// result by a quantum; it is replaced by one unit 3 bits below the larger term's 61-bit normalised
// significand, which lies on the same side of every rounding boundary.
inline float signed_sum_rn(bool neg_p, Dyadic p, bool neg_c, Dyadic c) {
  if (p.m == 0 && c.m == 0) return with_sign(0.0f, neg_p && neg_c);
  if (p.m == 0) return f32_from_bits(round_to_f32_bits(neg_c, c.m, c.e, false));
  if (c.m == 0) return f32_from_bits(round_to_f32_bits(neg_p, p.m, p.e, false));
  const int top_p = p.e + bit_length(p.m), top_c = c.e + bit_length(c.m);
  const bool p_big = top_p >= top_c;
  Dyadic big = p_big ? p : c, small = p_big ? c : p;
  const bool neg_big = p_big ? neg_p : neg_c, neg_small = p_big ? neg_c : neg_p;
  if (std::max(top_p, top_c) - std::min(top_p, top_c) > 62) {
    const int up = 61 - bit_length(big.m);
    u128 m = u128(big.m) << up << 3;
    m = neg_small == neg_big ? m + 1 : m - 1;
    return f32_from_bits(round_to_f32_bits(neg_big, m, big.e - up - 3, false));
  }
  const int k = std::min(big.e, small.e);
  const u128 a = u128(big.m) << (big.e - k), b = u128(small.m) << (small.e - k);
  if (neg_big == neg_small) return f32_from_bits(round_to_f32_bits(neg_big, a + b, k, false));
  if (a == b) return 0.0f;
  return f32_from_bits(round_to_f32_bits(a > b ? neg_big : neg_small, a > b ? a - b : b - a, k, false));
}

// RN(a * b + c) with one rounding; NaN, inf and zero signs as IEEE fma.
inline float fma_rn(float a, float b, float c) {
  const uint32_t ua = f32_to_bits(a), ub = f32_to_bits(b), uc = f32_to_bits(c);
  if (nan_bits(ua) || nan_bits(ub) || nan_bits(uc)) return quiet_nan();
  const bool neg_p = neg_bits(ua) != neg_bits(ub);
  if (inf_bits(ua) || inf_bits(ub)) {
    if (zero_bits(ua) || zero_bits(ub)) return quiet_nan();
    if (inf_bits(uc) && neg_bits(uc) != neg_p) return quiet_nan();
    return with_sign(infinity(), neg_p);
  }
  if (inf_bits(uc)) return c;
  const Dyadic x = magnitude_bits(ua), y = magnitude_bits(ub);
  const Dyadic prod{x.m * y.m, x.e + y.e};  // at most 48 bits
  return signed_sum_rn(neg_p, prod, neg_bits(uc), magnitude_bits(uc));
}
inline float add_rn(float a, float b) { return fma_rn(a, 1.0f, b); }

// floor(x), exactly, from the bits.
inline float floor_f32(float x) {
  const uint32_t u = f32_to_bits(x);
  if (nan_bits(u) || inf_bits(u) || zero_bits(u)) return x;
  const Dyadic d = magnitude_bits(u);
  if (d.e >= 0) return x;  // an integer already
  const int shift = -d.e;
  const uint64_t whole = shift >= 64 ? 0 : d.m >> shift;
  const bool frac = shift >= 64 ? true : (d.m & ((uint64_t(1) << shift) - 1)) != 0;
  if (!neg_bits(u)) return whole == 0 ? 0.0f : to_f32({whole, 0});
  const uint64_t mag = whole + (frac ? 1 : 0);  // -1.5 -> -2; -0.5 -> -1
  return with_sign(to_f32({mag, 0}), true);
}

// Smallest e with 2^e >= r, for finite r > 0, by search.
inline int ceil_log2(float r) {
  const Dyadic d = magnitude(r);
  int e = -149;
  while (compare({1, e}, d) < 0) ++e;
  return e;
}

// ---------------------------------------------------------------------------------------------
inline bool is_nan(float x) { return nan_bits(f32_to_bits(x)); }
inline bool is_inf(float x) { return inf_bits(f32_to_bits(x)); }
inline bool is_finite(float x) { return !nan_bits(f32_to_bits(x)) && !inf_bits(f32_to_bits(x)); }
inline bool sign_bit(float x) { return neg_bits(f32_to_bits(x)); }
inline float abs_f32(float x) { return f32_from_bits(f32_to_bits(x) & ~kSignBit); }

// QDQ element rules (docs/numerics.md). Each returns the dequantized binary32 value before the output
// rounding to the tensor's dtype.

inline float e4m3_sat_value(float x) { return e4m3_decode(e4m3_encode_sat(x)); }  // NaN: NaN
// e2m1 of NaN is NaN (only reachable through a NaN scale: nvfp4 with amax = inf).
inline float e2m1_sat_value(float x) { return is_nan(x) ? quiet_nan() : e2m1_decode(e2m1_encode_sat(x)); }

struct Fp8Scales {
  float s;
  float si;
};

// amax = inf: s = 0 and si = inf, so every element is e4m3(x * 0) * inf = NaN.
inline Fp8Scales fp8_scales(float amax) {
  float a = amax;
  if (a <= 0x1p-24f) a = 1.0f;
  const float s = div_rn(448.0f, a);
  return {s, div_rn(1.0f, s)};  // si = 1/s, not a/448
}

inline float fp8_qdq(float x, Fp8Scales p) {
  if (is_nan(x)) return quiet_nan();
  return mul_rn(e4m3_sat_value(mul_rn(x, p.s)), p.si);
}

// Global scale gs = amax * fp32(1/2688); `by_division` gives amax / 2688 instead (the rule the
// spec rejects; tests use it to show the two differ).
inline float nvfp4_global_scale(float amax, bool by_division = false) {
  float gs = by_division ? div_rn(amax, 2688.0f) : mul_rn(amax, div_rn(1.0f, 2688.0f));
  if (gs <= 0.0f) gs = 1e-12f;
  return gs;
}

// With gs = inf (amax = inf) the scale is NaN: t = bmax / inf = 0 gives 0 * inf, and a block
// holding inf gives t = inf / inf = NaN, which min(t, 448) keeps (and e4m3_sat(NaN) is NaN).
inline float nvfp4_block_scale(float bmax, float gs) {
  float t = div_rn(bmax, mul_rn(6.0f, gs));
  if (t > 448.0f) t = 448.0f;  // min(t, 448); NaN stays NaN
  float scale = mul_rn(e4m3_sat_value(t), gs);
  if (scale < 1e-5f) scale = 1.0f;
  return scale;
}

inline float nvfp4_qdq(float x, float scale) {
  if (is_nan(x)) return quiet_nan();
  const float q = e2m1_sat_value(div_rn(abs_f32(x), scale));
  if (q == 0) return 0.0f;  // +0 whatever the sign of x
  return with_sign(mul_rn(q, scale), sign_bit(x));
}

// Block exponent of mxfp8 (elem_max 448) and mxfp4 (6). A quotient r that underflows to 0 (a
// block of tiny fp32 subnormals) is ceil(log2(0)) = -inf, clamped to -127.
inline int mx_block_exponent(float bmax, float elem_max) {
  if (bmax == 0 || !is_finite(bmax)) return 0;
  const float r = div_rn(bmax, elem_max);
  const int e = r == 0 ? -127 : ceil_log2(r);
  return std::clamp(e, -127, 127);
}

inline float mx_qdq(float x, int e, bool fp4) {
  if (is_nan(x)) return quiet_nan();
  const float scaled = mul_rn(abs_f32(x), pow2_f32(-e));  // 2^-e is a binary32 for |e| <= 127
  const float q = fp4 ? e2m1_sat_value(scaled) : e4m3_sat_value(scaled);
  return with_sign(mul_rn(q, pow2_f32(e)), sign_bit(x));
}

// The amax < 2^-24 rule is for tiny amax only: amax = inf gives s = 0, q = rint(x * 0) (0, or 0
// for the NaN of inf * 0) and y = 0 / 0 = NaN.
inline float int8_qdq(float x, float amax) {
  if (is_nan(x)) return quiet_nan();
  if (amax < 0x1p-24f) return 0.0f;
  const float s = div_rn(127.0f, amax);
  const float v = mul_rn(x, s);
  const int q = int8_encode_sat(v);
  // q is a binary32 value (docs/numerics.md): a zero keeps the sign of x * s, so y = -0.0 for a
  // negative x that rounds to zero.
  return div_rn(q == 0 ? with_sign(0.0f, sign_bit(v)) : float(q), s);
}

// ---------------------------------------------------------------------------------------------
// The expert-parallel libraries' block FP8 (1 x 128 per row; amax floored at 1e-4).

inline float fp8_block_amax(float bmax) { return bmax > 1e-4f ? bmax : 1e-4f; }
inline float inv_e4m3_max() { return div_rn(1.0f, 448.0f); }  // the kernels' RN(1/448)

// s = 448 / a, si = a * RN(1/448).
inline Fp8Scales fp8_block128_scales(float bmax) {
  const float a = fp8_block_amax(bmax);
  return {div_rn(448.0f, a), mul_rn(a, inv_e4m3_max())};
}
// The power-of-two scale's exponent e = ceil(log2(a * RN(1/448))); nullopt for an infinite a (the
// ue8m0 NaN code: the block is NaN).
inline bool fp8_block128_ue8m0_exponent(float bmax, int& e) {
  const float a = fp8_block_amax(bmax);
  if (!is_finite(a)) return false;
  e = ceil_log2(mul_rn(a, inv_e4m3_max()));
  return true;
}

// ---------------------------------------------------------------------------------------------
// log2, exp2 and LogFMT-10: the algorithms of numerics.h (their polynomials are the definition),
// each binary32 operation done exactly in integers by the functions above.

inline float exp2_poly(float f) {
  const float c[] = {0x1.444p-13f, 0x1.5f48cp-10f, 0x1.3b2a1cp-7f, 0x1.c6aeccp-5f, 0x1.ebfbep-3f, 0x1.62e43p-1f, 1.0f};
  float p = c[0];
  for (int i = 1; i < 7; ++i) p = fma_rn(p, f, c[i]);
  return p;
}
inline float exp2_f32(float y) {
  if (is_nan(y)) return quiet_nan();
  if (y >= 128.0f) return infinity();
  if (y < -151.0f) return 0.0f;
  const float magic = to_f32({3, 22});  // 1.5 * 2^23
  const float n = add_rn(add_rn(y, magic), with_sign(magic, true));
  const float p = exp2_poly(add_rn(y, with_sign(n, !sign_bit(n))));
  const int ni = int(n);  // an integer value in [-151, 128]
  if (ni < -126) return mul_rn(mul_rn(p, pow2_f32(ni + 64)), pow2_f32(-64));
  if (ni > 127) return mul_rn(mul_rn(p, pow2_f32(ni - 1)), 2.0f);
  return mul_rn(p, pow2_f32(ni));
}
inline float log2_1p_unit(float f) {
  const float c[] = {0x1.08e414p-8f, -0x1.962fbep-6f, 0x1.2362eap-4f, -0x1.0e0966p-3f, 0x1.8116c4p-3f,
                     -0x1.e388p-3f,  0x1.26d30ap-2f,  -0x1.714836p-2f, 0x1.ec704p-2f,  -0x1.715476p-1f};
  float r = c[0];
  for (int i = 1; i < 10; ++i) r = fma_rn(r, f, c[i]);
  const float t = fma_rn(f, r, 0x1.4ae0cp-26f);
  return fma_rn(f, 0x1.715476p+0f, mul_rn(f, t));
}
// x = 2^E * m with m in [1, 2), found by comparing with powers of two.
inline float log2_f32(float x) {
  const uint32_t u = f32_to_bits(x);
  if (nan_bits(u) || (neg_bits(u) && !zero_bits(u))) return quiet_nan();
  if (zero_bits(u)) return with_sign(infinity(), true);
  if (inf_bits(u)) return x;
  const Dyadic d = magnitude_bits(u);
  int e = -149;
  while (compare({1, e + 1}, d) <= 0) ++e;  // 2^e <= x < 2^(e + 1)
  const float m = to_f32({d.m, d.e - e});    // x / 2^e, exactly: in [1, 2)
  const float f = add_rn(m, -1.0f);
  const float ef = e < 0 ? with_sign(to_f32({uint64_t(-e), 0}), true) : (e == 0 ? 0.0f : to_f32({uint64_t(e), 0}));
  return add_rn(ef, log2_1p_unit(f));
}

struct LogFmt {
  float log_amin, step, step_inv, fused;
  bool ok;
};
inline LogFmt logfmt_block(float amax, float amin) {
  LogFmt b;
  const float log_amax = log2_f32(amax);
  const float clip = add_rn(log_amax, -32.0f);
  float log_amin = clip;
  if (amin != 0) {
    const float l = log2_f32(amin);
    if (l > clip) log_amin = l;
  }
  b.ok = log_amax < 0 && log_amin < log_amax;
  b.log_amin = log_amin;
  b.step = div_rn(add_rn(log_amax, with_sign(log_amin, !sign_bit(log_amin))), 510.0f);
  b.step_inv = div_rn(1.0f, b.step);
  const float l = log2_f32(mul_rn(add_rn(1.0f, exp2_f32(b.step)), 0.5f));
  const float rounding = fma_rn(with_sign(l, !sign_bit(l)), b.step_inv, 2.0f);
  b.fused = fma_rn(with_sign(log_amin, !sign_bit(log_amin)), b.step_inv, rounding);
  return b;
}
inline float logfmt_qdq(float x, const LogFmt& b) {
  if (is_nan(x)) return quiet_nan();
  const float t = fma_rn(log2_f32(abs_f32(x)), b.step_inv, b.fused);
  float k = 0;
  if (t >= 1.0f) {
    k = floor_f32(t);
    if (k > 511.0f) k = 511.0f;
  }
  if (k == 0) return with_sign(0.0f, sign_bit(x));
  return with_sign(exp2_f32(fma_rn(add_rn(k, -1.0f), b.step, b.log_amin)), sign_bit(x));
}
// One row: values rounded to bf16; blocks of 128; groups of 8 blocks when the row length is a
// multiple of 1024, else 4; a group is cast when each of its blocks is, else its bf16 values stay.
inline void logfmt_row(const std::vector<float>& x, int64_t begin, int64_t cols, std::vector<float>& y) {
  std::vector<float> v(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) v[size_t(c)] = bf16_value(bf16_round(x[size_t(begin + c)]));
  const int64_t group = (cols % 1024 == 0 ? 8 : 4) * 128;
  for (int64_t g = 0; g < cols; g += group) {
    std::vector<LogFmt> blocks;
    bool cast = true;
    for (int64_t b = g; b < std::min(cols, g + group); b += 128) {
      float amax = 0, amin = infinity();
      for (int64_t c = b; c < std::min({cols, g + group, b + 128}); ++c) {
        if (is_nan(v[size_t(c)])) continue;
        const float a = abs_f32(v[size_t(c)]);
        if (a > amax) amax = a;
        if (a < amin) amin = a;
      }
      blocks.push_back(logfmt_block(amax, amin));
      cast = cast && blocks.back().ok;
    }
    for (int64_t c = g; c < std::min(cols, g + group); ++c)
      y[size_t(begin + c)] = cast ? logfmt_qdq(v[size_t(c)], blocks[size_t((c - g) / 128)]) : v[size_t(c)];
  }
}

// ---------------------------------------------------------------------------------------------
// Tensors: row-major [rows, cols], blocks along cols, a short final block uses what it has.

// The formats are the library's own names (moefq/qdq.h); only the rules here are independent.
using Fmt = Format;
inline bool is_peer(Fmt f) { return f >= Fmt::kFp8Cast; }
inline int64_t peer_block(Fmt f) {
  return f == Fmt::kFp8Cast || f == Fmt::kFp8CastNan ? 1 : (f == Fmt::kFp4Block16FlashInfer ? 16 : 128);
}

// One element of a peer format from its block's maximum (NaN ignored, +-inf counts).
inline float peer_elem(Fmt f, float x, float bmax) {
  if (is_nan(x)) return quiet_nan();
  const float inv448 = div_rn(1.0f, 448.0f);
  switch (f) {
    case Fmt::kFp8Cast: return e4m3_sat_value(x);
    case Fmt::kFp8CastNan: return abs_f32(x) > 448.0f ? quiet_nan() : e4m3_sat_value(x);
    case Fmt::kFp8Block128Ue8m0NoFloor: {
      if (!is_finite(bmax)) return quiet_nan();
      // The fork's fast_log2_ceil: the exact ceil(log2) of a normal product, -126 for a subnormal
      // one, -127 for zero.
      const float r = mul_rn(bmax, inv448);
      const int e = r == 0.0f ? -127 : (r < 0x1p-126f ? -126 : ceil_log2(r));
      return mx_qdq(x, e, false);
    }
    case Fmt::kFp8Block128Mori:
      if (!(bmax > 448.0f)) return e4m3_sat_value(x);
      return fp8_qdq(x, {div_rn(448.0f, bmax), mul_rn(bmax, inv448)});
    case Fmt::kFp4Block128Mori: {
      const float sc = bmax > 0.0f ? div_rn(6.0f, bmax) : 0.0f;
      const float si = bmax > 0.0f ? div_rn(bmax, 6.0f) : 1.0f;
      return with_sign(mul_rn(e2m1_sat_value(mul_rn(abs_f32(x), sc)), si), sign_bit(x));
    }
    case Fmt::kFp8Block128DeepGemm: {
      const float sf = div_rn(bmax > 1e-4f ? bmax : 1e-4f, 448.0f);
      return mul_rn(e4m3_sat_value(mul_rn(x, div_rn(1.0f, sf))), sf);
    }
    case Fmt::kFp8Block128Vllm: {
      const float sf = div_rn(bmax > 1e-10f ? bmax : 1e-10f, 448.0f);
      return mul_rn(e4m3_sat_value(div_rn(x, sf)), sf);
    }
    case Fmt::kFp4Block16FlashInfer: {
      // The block maximum as bf16 (a), d = a * RN(1/6); into e2m1 by enc = RN(1/d) (1/0 and 1/
      // subnormal d read as FLT_MAX, the flush of rcp.approx.ftz) times min(d * 1e30, 1).
      const float a = bf16_value(bf16_round(bmax));
      const float d = mul_rn(a, div_rn(1.0f, 6.0f));
      const float rcp = d < 0x1p-126f ? kFltMax : div_rn(1.0f, d);
      const float m = mul_rn(d, 1e30f);
      const float enc = mul_rn(rcp, m < 1.0f ? m : 1.0f);
      return with_sign(mul_rn(e2m1_sat_value(mul_rn(abs_f32(x), enc)), d), sign_bit(x));
    }
    default: return quiet_nan();
  }
}

inline float amax_of(const std::vector<float>& x) {
  float m = 0;
  for (float v : x)
    if (!is_nan(v) && abs_f32(v) > m) m = abs_f32(v);
  return m;
}

// max |x| over x[begin, end), NaN ignored; inf_as_max counts +-inf as the largest finite float.
inline float block_max(const std::vector<float>& x, int64_t begin, int64_t end, bool inf_as_max) {
  float m = 0;
  for (int64_t i = begin; i < end; ++i) {
    if (is_nan(x[i])) continue;
    const float a = (inf_as_max && is_inf(x[i])) ? kFltMax : abs_f32(x[i]);
    if (a > m) m = a;
  }
  return m;
}

// nvfp4 with a given global scale (so a test can feed either global-scale rule).
inline std::vector<float> nvfp4_values(const std::vector<float>& x, int64_t rows, int64_t cols, float gs) {
  std::vector<float> y(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols; b += 16) {
      const int64_t begin = r * cols + b;
      const int64_t end = r * cols + std::min<int64_t>(b + 16, cols);
      const float scale = nvfp4_block_scale(block_max(x, begin, end, false), gs);
      for (int64_t i = begin; i < end; ++i) y[i] = nvfp4_qdq(x[i], scale);
    }
  return y;
}

// y = QDQ_f(x) in binary32, before rounding to the output dtype. amax is ignored by mx formats.
inline std::vector<float> qdq_values(Fmt f, const std::vector<float>& x, int64_t rows, int64_t cols,
                                     float amax) {
  std::vector<float> y(x.size());
  switch (f) {
    case Fmt::kFp8: {
      const Fp8Scales p = fp8_scales(amax);
      for (size_t i = 0; i < x.size(); ++i) y[i] = fp8_qdq(x[i], p);
      return y;
    }
    case Fmt::kNvfp4:
      return nvfp4_values(x, rows, cols, nvfp4_global_scale(amax));
    case Fmt::kMxfp8:
    case Fmt::kMxfp4: {
      const bool fp4 = f == Fmt::kMxfp4;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < cols; b += 32) {
          const int64_t begin = r * cols + b;
          const int64_t end = r * cols + std::min<int64_t>(b + 32, cols);
          const int e = mx_block_exponent(block_max(x, begin, end, true), fp4 ? 6.0f : 448.0f);
          for (int64_t i = begin; i < end; ++i) y[i] = mx_qdq(x[i], e, fp4);
        }
      return y;
    }
    case Fmt::kInt8:
      for (size_t i = 0; i < x.size(); ++i) y[i] = int8_qdq(x[i], amax);
      return y;
    case Fmt::kFp8Block128:
    case Fmt::kFp8Block128Ue8m0:
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < cols; b += 128) {
          const int64_t begin = r * cols + b;
          const int64_t end = r * cols + std::min<int64_t>(b + 128, cols);
          const float bmax = block_max(x, begin, end, false);
          int e = 0;
          const bool finite = fp8_block128_ue8m0_exponent(bmax, e);
          for (int64_t i = begin; i < end; ++i) {
            if (f == Fmt::kFp8Block128) y[i] = fp8_qdq(x[i], fp8_block128_scales(bmax));
            else y[i] = finite ? mx_qdq(x[i], e, false) : quiet_nan();
          }
        }
      return y;
    case Fmt::kLogfmt10:
      for (int64_t r = 0; r < rows; ++r) logfmt_row(x, r * cols, cols, y);
      return y;
    default: {
      const int64_t block = peer_block(f);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < cols; b += block) {
          const int64_t begin = r * cols + b, end = r * cols + std::min(cols, b + block);
          const float bmax = block_max(x, begin, end, false);
          for (int64_t i = begin; i < end; ++i) y[size_t(i)] = peer_elem(f, x[size_t(i)], bmax);
        }
      return y;
    }
  }
  return y;
}

// Output storage: bf16 rounds, fp32 keeps the value; NaN becomes canonical either way.
inline uint16_t store_bf16(float v) { return bf16_round(v); }
inline uint32_t store_f32(float v) { return is_nan(v) ? kNanF32 : f32_to_bits(v); }

inline std::vector<float> bf16_values(const std::vector<uint16_t>& x) {
  std::vector<float> v(x.size());
  for (size_t i = 0; i < x.size(); ++i) v[i] = bf16_value(x[i]);
  return v;
}

inline std::vector<float> f32_values(const std::vector<uint32_t>& x) {
  std::vector<float> v(x.size());
  for (size_t i = 0; i < x.size(); ++i) v[i] = f32_from_bits(x[i]);
  return v;
}

inline std::vector<uint16_t> qdq_bf16(Fmt f, const std::vector<uint16_t>& x, int64_t rows, int64_t cols,
                                      float amax) {
  const std::vector<float> y = qdq_values(f, bf16_values(x), rows, cols, amax);
  std::vector<uint16_t> out(y.size());
  for (size_t i = 0; i < y.size(); ++i) out[i] = store_bf16(y[i]);
  return out;
}

inline std::vector<uint32_t> qdq_f32(Fmt f, const std::vector<uint32_t>& x, int64_t rows, int64_t cols,
                                     float amax) {
  const std::vector<float> y = qdq_values(f, f32_values(x), rows, cols, amax);
  std::vector<uint32_t> out(y.size());
  for (size_t i = 0; i < y.size(); ++i) out[i] = store_f32(y[i]);
  return out;
}

// e4m3 staging, 1 x 128 blocks: x [rows, cols] bf16 -> x8 [rows, cols] e4m3 codes and
// scales [rows, ceil(cols / 128)] fp32 (sf, the dequantization scale).
struct Staged {
  std::vector<uint8_t> x8;
  std::vector<float> scales;
};

inline Staged stage_e4m3(const std::vector<uint16_t>& x_bits, int64_t rows, int64_t cols) {
  const std::vector<float> x = bf16_values(x_bits);
  const int64_t num_blocks = (cols + 127) / 128;
  Staged s{std::vector<uint8_t>(x.size()), std::vector<float>(size_t(rows * num_blocks))};
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t begin = r * cols + b * 128;
      const int64_t end = r * cols + std::min<int64_t>((b + 1) * 128, cols);
      const float bmax = block_max(x, begin, end, false);
      const float amax = bmax > 1e-4f ? bmax : 1e-4f;
      const float sf = div_rn(amax, 448.0f);
      const float inv = div_rn(1.0f, sf);
      for (int64_t i = begin; i < end; ++i) s.x8[i] = e4m3_encode_sat(mul_rn(x[i], inv));
      s.scales[r * num_blocks + b] = sf;
    }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Reporting: counts bit-pattern mismatches and describes the first one.

class Mismatches {
 public:
  explicit Mismatches(std::string what) : what_(std::move(what)) {}

  // in_digits / out_digits: hex digits to print for the input and output patterns.
  void add(uint64_t input, uint64_t expected, uint64_t actual, int in_digits, int out_digits,
           const std::string& where = "") {
    if (expected == actual) return;
    if (count_++ > 0) return;
    char buf[160];
    std::snprintf(buf, sizeof(buf), "input 0x%0*llx, expected 0x%0*llx, actual 0x%0*llx", in_digits,
                  (unsigned long long)input, out_digits, (unsigned long long)expected, out_digits,
                  (unsigned long long)actual);
    first_ = (where.empty() ? std::string() : where + ": ") + buf;
  }
  int64_t count() const { return count_; }
  std::string report() const {
    if (count_ == 0) return what_ + ": no mismatch";
    return what_ + ": " + std::to_string(count_) + " mismatches; first at " + first_;
  }

 private:
  std::string what_;
  int64_t count_ = 0;
  std::string first_;
};

}  // namespace moefq::slow
