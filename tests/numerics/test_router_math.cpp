// The router's portable scoring functions (numerics.h: sqrt_rn, log1p_f32, sigmoid_f32,
// softplus_f32), which the CPU and CUDA routers share, against long double over a sample of every
// binary32 (a prime stride through all 2^32 patterns), plus their special values.
#include <gtest/gtest.h>

#include <cmath>

#include "moefq/numerics.h"

namespace moefq {
namespace {

// A prime stride through all 2^32 bit patterns: every sign, exponent and mantissa region is hit.
constexpr uint64_t kStride = 61;
// For the functions that call exp in long double, a sparser prime stride over |x| < 110 (beyond it
// the results are 0, 1 or x, checked as special values): a few seconds on a small CPU.
constexpr uint64_t kExpStride = 127;

// |got - want| in units of the last place of want's binary32 neighbourhood (the spacing of
// binary32 values at |want|, subnormal spacing included).
double ulp_error(float got, long double want) {
  if (want == 0) return got == 0 ? 0 : INFINITY;
  const float w = float(want);
  const float a = std::fabs(w);
  double ulp = double(std::nextafter(a, INFINITY)) - double(a);
  if (ulp == 0) ulp = 1.401298464324817e-45;
  return double(std::fabs((long double)got - want) / (long double)ulp);
}

struct Worst {
  double ulp = 0;
  float at = 0;
  void add(double e, float x) {
    if (!(e <= ulp)) {  // a NaN error counts as the worst
      ulp = std::isnan(e) ? INFINITY : e;
      at = x;
    }
  }
};

TEST(RouterMath, SqrtIsCorrectlyRounded) {
  int64_t mismatches = 0;
  for (uint64_t u = 0; u < (1ull << 31); u += kStride / 2) {  // non-negative x only
    const float x = f32_from_bits(uint32_t(u));
    if (is_nan(x)) continue;
    // sqrt in double then rounded is correctly rounded for binary32 inputs (53 >= 2 * 24 + 2).
    const float want = float(std::sqrt(double(x)));
    mismatches += f32_bits(sqrt_rn(x)) != f32_bits(want);
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_EQ(f32_bits(sqrt_rn(-0.0f)), 0x80000000u);
  EXPECT_EQ(f32_bits(sqrt_rn(0.0f)), 0u);
  EXPECT_EQ(sqrt_rn(INFINITY), INFINITY);
  EXPECT_EQ(sqrt_rn(4.0f), 2.0f);
  EXPECT_EQ(sqrt_rn(1.401298464324817e-45f), float(std::sqrt(1.401298464324817e-45)));
  for (float bad : {-1.0f, -1e-45f, -INFINITY, NAN, -NAN})
    EXPECT_EQ(f32_bits(sqrt_rn(bad)), kCanonicalNanF32) << bad;
}

TEST(RouterMath, Log1pWithinOneUlp) {
  Worst worst;
  int64_t checked = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += kStride) {
    const float x = f32_from_bits(uint32_t(u));
    if (!is_finite(x) || !(x > -1.0f)) continue;
    worst.add(ulp_error(log1p_f32(x), std::log1p((long double)x)), x);
    ++checked;
  }
  EXPECT_GT(checked, 30000000);
  EXPECT_LE(worst.ulp, 1.0) << "at x = " << worst.at;  // measured 0.82
  RecordProperty("max_ulp", std::to_string(worst.ulp));
}

TEST(RouterMath, Log1pSpecialValues) {
  EXPECT_EQ(f32_bits(log1p_f32(0.0f)), 0u);
  EXPECT_EQ(f32_bits(log1p_f32(-0.0f)), 0x80000000u);
  EXPECT_EQ(log1p_f32(1e-30f), 1e-30f);  // |x| < 2^-24: x itself
  EXPECT_EQ(log1p_f32(-1.0f), -INFINITY);
  EXPECT_EQ(log1p_f32(INFINITY), INFINITY);
  for (float bad : {-1.0000001f, -2.0f, -INFINITY, NAN})
    EXPECT_EQ(f32_bits(log1p_f32(bad)), kCanonicalNanF32) << bad;
  // The largest finite input (k = 128 after the reduction) stays finite.
  EXPECT_LE(ulp_error(log1p_f32(kFltMax), std::log1p((long double)kFltMax)), 1.0);
  // Every branch of the argument reduction: 1 + x below sqrt(2)/2, in [sqrt(2)/2, sqrt(2)),
  // above; and k >= 25, where the correction c is dropped.
  for (float x : {-0.5f, -0.2929f, -0.29f, 0.41f, 0.4143f, 1.0f, 3.0f, 1e7f, 3.4e7f, 1e8f, 1e20f}) {
    EXPECT_LE(ulp_error(log1p_f32(x), std::log1p((long double)x)), 1.0) << x;
  }
}

TEST(RouterMath, SigmoidWithinThreeUlp) {
  Worst worst;
  for (uint64_t u = 0; u < (1ull << 32); u += kExpStride) {
    const float x = f32_from_bits(uint32_t(u));
    if (!(std::fabs(x) < 110.0f)) continue;
    const long double want = 1.0L / (1.0L + std::exp(-(long double)x));
    worst.add(ulp_error(sigmoid_f32(x), want), x);
  }
  // Subnormal results (x < -87.3) included: exp(x) keeps its precision there.
  EXPECT_LE(worst.ulp, 3.0) << "at x = " << worst.at;  // measured 2.31
  RecordProperty("max_ulp", std::to_string(worst.ulp));
}

TEST(RouterMath, SigmoidSpecialValues) {
  EXPECT_EQ(sigmoid_f32(0.0f), 0.5f);
  EXPECT_EQ(sigmoid_f32(-0.0f), 0.5f);
  EXPECT_EQ(sigmoid_f32(INFINITY), 1.0f);
  EXPECT_EQ(f32_bits(sigmoid_f32(-INFINITY)), 0u);
  EXPECT_EQ(sigmoid_f32(100.0f), 1.0f);
  EXPECT_EQ(sigmoid_f32(1e30f), 1.0f);
  EXPECT_EQ(f32_bits(sigmoid_f32(-1e30f)), 0u);
  EXPECT_GT(sigmoid_f32(-100.0f), 0.0f);  // subnormal, not flushed
  EXPECT_EQ(f32_bits(sigmoid_f32(-200.0f)), 0u);
  EXPECT_EQ(f32_bits(sigmoid_f32(NAN)), kCanonicalNanF32);
  EXPECT_EQ(f32_bits(sigmoid_f32(-NAN)), kCanonicalNanF32);
}

TEST(RouterMath, SoftplusAndItsSquareRootWithinTwoUlp) {
  Worst sp, sq;
  for (uint64_t u = 0; u < (1ull << 32); u += kExpStride) {
    const float x = f32_from_bits(uint32_t(u));
    // Results below the normal range (x < -87.3) have subnormal precision, so the square root
    // of such a result is only as good as its few bits; those are checked separately below.
    if (!(x >= -87.0f && x < 110.0f)) continue;
    const long double want = x > 20.0f ? (long double)x : std::log1p(std::exp((long double)x));
    const float got = softplus_f32(x);
    sp.add(ulp_error(got, want), x);
    sq.add(ulp_error(sqrt_rn(got), std::sqrt(want)), x);
  }
  EXPECT_LE(sp.ulp, 2.0) << "softplus at x = " << sp.at;  // measured 1.61
  EXPECT_LE(sq.ulp, 2.0) << "sqrt(softplus) at x = " << sq.at;
  RecordProperty("softplus_max_ulp", std::to_string(sp.ulp));
  RecordProperty("sqrt_softplus_max_ulp", std::to_string(sq.ulp));
  // Below: the result is exp(x) to within its subnormal rounding.
  for (float x : {-90.0f, -100.0f, -103.0f})
    EXPECT_LE(std::fabs(double(softplus_f32(x)) - std::exp(double(x))), 1.5e-45) << x;
  // The threshold: above 20, l itself (which is also the correctly rounded softplus there).
  EXPECT_EQ(softplus_f32(20.5f), 20.5f);
  EXPECT_EQ(softplus_f32(1e30f), 1e30f);
  EXPECT_EQ(sqrt_rn(softplus_f32(1e30f)), 1e15f);
  EXPECT_EQ(softplus_f32(INFINITY), INFINITY);
  EXPECT_EQ(f32_bits(softplus_f32(-INFINITY)), 0u);
  EXPECT_EQ(f32_bits(softplus_f32(NAN)), kCanonicalNanF32);
  EXPECT_EQ(f32_bits(sqrt_rn(softplus_f32(NAN))), kCanonicalNanF32);
}

}  // namespace
}  // namespace moefq
