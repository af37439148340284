// exp_f32 / silu_f32: the engine's own exp (identical on CPU and GPU) against long double.
#include <gtest/gtest.h>

#include <cmath>

#include "moefq/numerics.h"

namespace moefq {
namespace {

double ulp_error(float got, long double want) {
  if (want == 0) return got == 0 ? 0 : INFINITY;
  const float w = float(want);
  const double ulp = std::fabs(double(std::nextafter(w, INFINITY)) - double(w));
  return std::fabs(double(got) - double(want)) / (ulp > 0 ? ulp : 1e-45);
}

TEST(Exp, WithinFourUlpOverTheWholeRange) {
  double worst = 0;
  for (uint64_t u = 0; u < (1ull << 32); u += 997) {
    const float x = f32_from_bits(uint32_t(u));
    if (!is_finite(x) || x > 88.7f || x < -87.0f) continue;
    worst = std::max(worst, ulp_error(exp_f32(x), std::exp((long double)x)));
  }
  EXPECT_LE(worst, 4.0);
}

TEST(Exp, SpecialValues) {
  EXPECT_EQ(exp_f32(0.0f), 1.0f);
  EXPECT_EQ(exp_f32(-0.0f), 1.0f);
  EXPECT_TRUE(std::isinf(exp_f32(89.0f)));
  EXPECT_TRUE(std::isinf(exp_f32(INFINITY)));
  EXPECT_EQ(exp_f32(-INFINITY), 0.0f);
  EXPECT_EQ(exp_f32(-200.0f), 0.0f);
  EXPECT_TRUE(is_nan(exp_f32(NAN)));
  // subnormal results are reached
  const float tiny = exp_f32(-100.0f);
  EXPECT_GT(tiny, 0.0f);
  EXPECT_LT(tiny, 1.1754944e-38f);
  EXPECT_LE(ulp_error(tiny, std::exp(-100.0L)), 4.0);
}

TEST(Silu, MatchesDefinition) {
  for (float g : {-80.0f, -10.0f, -1.0f, -0.0f, 0.0f, 0.5f, 1.0f, 3.0f, 10.0f, 100.0f}) {
    const long double want = (long double)g / (1.0L + std::exp(-(long double)g));
    EXPECT_LE(ulp_error(silu_f32(g), want), 6.0) << g;
  }
  // exp(-g) overflows binary32 for g < -88.7, so the fp32 formula gives -0 there.
  EXPECT_EQ(f32_bits(silu_f32(-100.0f)), 0x80000000u);
  EXPECT_EQ(silu_f32(-1000.0f), -0.0f);
  EXPECT_EQ(silu_f32(1000.0f), 1000.0f);
}

}  // namespace
}  // namespace moefq
