// exp, SiLU, sqrt, log1p, sigmoid, softplus, floor, exp2 and log2 in explicit binary32 operations,
// so the CPU and the kernels compute the same bits where library functions differ between them.
// Part of moefq/numerics.h.
#pragma once

#include <cstdint>

#include "moefq/numerics/binary32.h"

namespace moefq {

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

}  // namespace moefq
