// log2_f32 / exp2_f32 (numerics.h, LogFMT's logarithms): the same bits as the slow reference's
// integer-exact evaluation of the same algorithm on every input tried, and their accuracy against
// long double.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <random>

#include "moefq/numerics.h"
#include "numerics/slow_ref.h"

namespace moefq {
namespace {

double ulp_error(float got, long double want) {
  const float w = float(want);
  const double ulp = std::fabs(double(std::nextafter(w, INFINITY)) - double(w));
  return std::fabs(double(got) - double(want)) / (ulp > 0 ? ulp : 1e-45);
}

// Every exponent and a dense sample of every binade: all binary32 with a stride, the powers of
// two and their neighbours, the bf16 values.
std::vector<uint32_t> inputs() {
  std::vector<uint32_t> v;
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) v.push_back(uint32_t(u));
  for (uint32_t e = 0; e < 256; ++e)
    for (uint32_t d : {0u, 1u, 2u, 0x7FFFFFu, 0x7FFFFEu, 0x400000u})
      for (uint32_t s : {0u, 0x80000000u}) v.push_back(s | (e << 23) | d);
  for (uint32_t b = 0; b < 0x10000; ++b) v.push_back(b << 16);
  return v;
}

TEST(Log2Exp2, SameBitsAsTheSlowReference) {
  int64_t mismatches = 0;
  uint32_t first = 0;
  for (uint32_t u : inputs()) {
    const float x = f32_from_bits(u);
    const uint32_t l = f32_bits(log2_f32(x)), ls = slow::f32_to_bits(slow::log2_f32(x));
    const uint32_t e = f32_bits(exp2_f32(x)), es = slow::f32_to_bits(slow::exp2_f32(x));
    const bool nan_l = is_nan(f32_from_bits(l)) && is_nan(f32_from_bits(ls));
    const bool nan_e = is_nan(f32_from_bits(e)) && is_nan(f32_from_bits(es));
    if ((l != ls && !nan_l) || (e != es && !nan_e)) {
      if (mismatches++ == 0) first = u;
    }
  }
  EXPECT_EQ(mismatches, 0) << "first input 0x" << std::hex << first;
}

// The floor and the magic-number rounding used by the kernels, against the slow ones.
TEST(Log2Exp2, FloorAndRoundMagic) {
  for (uint32_t u : inputs()) {
    const float x = f32_from_bits(u);
    if (is_nan(x)) continue;
    ASSERT_EQ(f32_bits(floor_f32(x)), slow::f32_to_bits(slow::floor_f32(x))) << std::hexfloat << x;
    if (std::fabs(x) < 4194304.0f) {
      ASSERT_EQ(round_magic(x), std::nearbyint(x)) << std::hexfloat << x;
    }
  }
}

// exp2 within 1 ulp wherever the result is normal; subnormal results within one subnormal step.
TEST(Log2Exp2, Exp2WithinOneUlp) {
  double worst = 0;
  float at = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += 257) {
    const float y = f32_from_bits(uint32_t(u));
    if (!is_finite(y) || y >= 128.0f || y < -126.0f) continue;
    const double err = ulp_error(exp2_f32(y), std::exp2((long double)y));
    if (err > worst) worst = err, at = y;
  }
  EXPECT_LE(worst, 1.0) << "at " << std::hexfloat << at;
  for (float y = -150.0f; y < -126.0f; y += 0.0625f) {
    const long double want = std::exp2((long double)y);
    EXPECT_LE(std::fabs((long double)exp2_f32(y) - want), 0x1p-149L) << y;
  }
}

// log2 within 2 ulp, except just below 1 (x in [0.5, 1)), where the result -1 + log2(m) loses its
// relative accuracy: there within 2^-23 absolute (2 ulp of the log2 of the significand, which is
// near 1; LogFMT compares logarithms on an absolute grid, and lg2.approx promises 2^-22.6 there).
TEST(Log2Exp2, Log2WithinTwoUlpOr2pow23Absolute) {
  double worst = 0, worst_abs = 0;
  float at = 0;
  for (uint64_t u = 1; u < 0x7F800000ull; u += 131) {
    const float x = f32_from_bits(uint32_t(u));
    const long double want = std::log2((long double)x);
    const float got = log2_f32(x);
    if (x >= 0.5f && x < 1.0f) {
      worst_abs = std::max(worst_abs, double(std::fabs((long double)got - want)));
    } else {
      const double err = ulp_error(got, want);
      if (err > worst) worst = err, at = x;
    }
  }
  EXPECT_LE(worst, 2.0) << "at " << std::hexfloat << at;
  EXPECT_LE(worst_abs, 0x1p-23);
  // Every bf16 value, and the whole of [1, 2).
  for (uint32_t b = 0x0001; b < 0x7F80; ++b) {
    const float x = bf16_to_f32(uint16_t(b));
    if (x >= 0.5f && x < 1.0f) continue;
    EXPECT_LE(ulp_error(log2_f32(x), std::log2((long double)x)), 2.0) << std::hexfloat << x;
  }
  for (uint32_t u = 0x3F800000u; u < 0x40000000u; ++u) {
    const float x = f32_from_bits(u);
    ASSERT_LE(ulp_error(log2_f32(x), std::log2((long double)x)), 2.0) << std::hexfloat << x;
  }
}

TEST(Log2Exp2, SpecialValues) {
  EXPECT_EQ(exp2_f32(0.0f), 1.0f);
  EXPECT_EQ(exp2_f32(-0.0f), 1.0f);
  for (int k = -149; k < 128; ++k) EXPECT_EQ(exp2_f32(float(k)), exp2i(k)) << k;  // powers of two exactly
  EXPECT_EQ(f32_bits(exp2_f32(128.0f)), 0x7F800000u);
  EXPECT_EQ(f32_bits(exp2_f32(INFINITY)), 0x7F800000u);
  EXPECT_EQ(f32_bits(exp2_f32(-INFINITY)), 0u);
  EXPECT_EQ(f32_bits(exp2_f32(-151.5f)), 0u);
  EXPECT_EQ(f32_bits(exp2_f32(NAN)), kCanonicalNanF32);
  for (int k = -149; k < 128; ++k) EXPECT_EQ(log2_f32(exp2i(k)), float(k)) << k;
  EXPECT_EQ(f32_bits(log2_f32(0.0f)), 0xFF800000u);
  EXPECT_EQ(f32_bits(log2_f32(-0.0f)), 0xFF800000u);
  EXPECT_EQ(f32_bits(log2_f32(INFINITY)), 0x7F800000u);
  EXPECT_EQ(f32_bits(log2_f32(-1.0f)), kCanonicalNanF32);
  EXPECT_EQ(f32_bits(log2_f32(NAN)), kCanonicalNanF32);
  EXPECT_EQ(f32_bits(log2_f32(FLT_TRUE_MIN)), f32_bits(-149.0f));
}

// log2 of a normal bf16 value is add_rn(float(E), table[j]) with table[j] = log2_1p_unit(j / 128):
// the same bits as log2_f32 (what a kernel could read from a 128-entry table).
TEST(Log2Exp2, Bf16LogarithmIsExponentPlusTable) {
  float table[128];
  for (int j = 0; j < 128; ++j) table[j] = log2_1p_unit(float(j) * 0.0078125f);
  for (uint32_t b = 0x0080; b < 0x7F80; ++b) {
    const float x = bf16_to_f32(uint16_t(b));
    const float e = float(int(b >> 7) - 127);
    ASSERT_EQ(f32_bits(log2_f32(x)), f32_bits(add_rn(e, table[b & 0x7Fu]))) << std::hex << b;
    ASSERT_EQ(f32_bits(log2_f32(x)), f32_bits(log2_bf16_normal(b, table))) << std::hex << b;
  }
}

// exp2_f32_normal is exp2_f32 wherever round(y) is in [-126, 127]: every y of [-126.5, 127.5) whose
// bits are a multiple of 61 apart (35 million, both signs), and the range's ends and half-integers.
TEST(Log2Exp2, NormalPathIsExp2) {
  const auto check = [](float y) { ASSERT_EQ(f32_bits(exp2_f32_normal(y)), f32_bits(exp2_f32(y))) << std::hexfloat << y; };
  for (uint32_t u = 0; u < 0x42FF0000u; u += 61) {
    check(f32_from_bits(u));
    if (f32_from_bits(u) <= 126.5f) check(-f32_from_bits(u));
  }
  for (int k = -252; k <= 254; ++k) {
    check(float(k) * 0.5f);
    check(std::nextafter(float(k) * 0.5f, 0.0f));
  }
  check(-126.5f);
  check(std::nextafter(127.5f, 0.0f));
}

}  // namespace
}  // namespace moefq
