// binary32 bit access and the arithmetic every rule is written in (mul_rn, add_rn, div_rn, fma_rn:
// single RN operations, never contracted), and the combine's weighted add. Part of
// moefq/numerics.h, whose invariants every function here keeps.
#pragma once

#include <cstdint>
#include <cstring>

#include "moefq/numerics/formats.h"
#include "moefq/numerics/host_device.h"

namespace moefq {

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

// The combine's weighting `after` (docs/fake_quant.md): a routed row's value v enters the fp32 sum
// as acc = fma(v, w, acc), one rounding, as DeepEP's low-latency combine accumulates (nvcc
// contracts its `accum += decoded * weight`). The CPU engine, the fake quantizer's re-sum and the
// CUDA combine all call this.
MOEFQ_HD float weighted_add(float acc, float v, float w) { return fma_rn(v, w, acc); }

}  // namespace moefq
