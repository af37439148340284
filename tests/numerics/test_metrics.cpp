#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moefq/metrics.h"

namespace moefq {
namespace {

TEST(Metrics, IdenticalTensors) {
  const std::vector<float> r = {1, -2, 3.5f, 0};
  const ErrorMetrics m = compute_metrics(r.data(), r.data(), 4);
  EXPECT_EQ(m.rel_l2, 0.0);
  EXPECT_DOUBLE_EQ(m.cosine, 1.0);
  EXPECT_EQ(m.calc_diff, 0.0);
  EXPECT_EQ(m.max_abs, 0.0);
  EXPECT_TRUE(std::isinf(m.snr_db));
  EXPECT_EQ(m.count, 4);
}

TEST(Metrics, KnownValues) {
  const std::vector<float> r = {3, 4}, y = {3, 3};
  const ErrorMetrics m = compute_metrics(y.data(), r.data(), 2);
  EXPECT_DOUBLE_EQ(m.rel_l2, 1.0 / 5.0);
  EXPECT_DOUBLE_EQ(m.cosine, 21.0 / (5.0 * std::sqrt(18.0)));
  // y' = {4, 4}, r' = {4, 5}
  EXPECT_DOUBLE_EQ(m.calc_diff, 1.0 - 2.0 * (16.0 + 20.0) / (16.0 + 16.0 + 16.0 + 25.0));
  EXPECT_DOUBLE_EQ(m.max_abs, 1.0);
  EXPECT_DOUBLE_EQ(m.snr_db, 10.0 * std::log10(25.0));
}

TEST(Metrics, NonFiniteReferenceSkippedNonFiniteOutputPoisons) {
  const std::vector<float> r = {1, NAN, 2}, y = {1, 5, 2};
  ErrorMetrics m = compute_metrics(y.data(), r.data(), 3);
  EXPECT_EQ(m.skipped_nonfinite, 1);
  EXPECT_EQ(m.count, 2);
  EXPECT_EQ(m.rel_l2, 0.0);
  const std::vector<float> y2 = {1, 5, INFINITY};
  m = compute_metrics(y2.data(), r.data(), 3);
  EXPECT_FALSE(std::isfinite(m.rel_l2));
  EXPECT_FALSE(std::isfinite(m.max_abs));
}

// Nothing compared (every reference position NaN or inf, or no positions): NaN figures, not the
// 0 / 1 of a perfect match.
TEST(Metrics, NothingComparedIsNanNotPerfect) {
  const std::vector<float> r = {NAN, INFINITY, -INFINITY}, y = {1, 2, 3};
  for (const int64_t n : {int64_t(3), int64_t(0)}) {
    const ErrorMetrics m = compute_metrics(y.data(), r.data(), n);
    EXPECT_EQ(m.count, 0);
    EXPECT_EQ(m.skipped_nonfinite, n);
    EXPECT_TRUE(std::isnan(m.rel_l2)) << n;
    EXPECT_TRUE(std::isnan(m.cosine)) << n;
    EXPECT_TRUE(std::isnan(m.calc_diff)) << n;
    EXPECT_TRUE(std::isnan(m.snr_db)) << n;
    EXPECT_TRUE(std::isnan(m.max_abs)) << n;
  }
}

// docs/numerics.md: a non-finite output where the reference is finite makes the metrics non-finite.
// Every metric, not only rel_l2: NaN sums would turn calc_diff into 0 and snr_db into +inf (a
// perfect score) through comparisons that are false for NaN.
TEST(Metrics, NonFiniteOutputMakesEveryMetricNan) {
  const std::vector<float> r = {1, -2, 3, 4};
  for (const std::vector<float>& y : {std::vector<float>(4, NAN), std::vector<float>{1, NAN, 3, 4},
                                      std::vector<float>{1, -2, INFINITY, 4}, std::vector<float>{-INFINITY, -2, 3, 4}}) {
    const ErrorMetrics m = compute_metrics(y.data(), r.data(), 4);
    EXPECT_TRUE(std::isnan(m.rel_l2));
    EXPECT_TRUE(std::isnan(m.cosine));
    EXPECT_TRUE(std::isnan(m.calc_diff));
    EXPECT_TRUE(std::isnan(m.snr_db));
    EXPECT_TRUE(std::isnan(m.max_abs));
    EXPECT_EQ(m.count, 4);
  }
  // The bf16 overload, on a whole tensor of NaN (what a dynamic amax over data holding inf gives).
  std::vector<bf16> rb(8), yb(8);
  for (int i = 0; i < 8; ++i) {
    rb[size_t(i)].bits = bf16_round(float(i + 1));
    yb[size_t(i)].bits = 0x7FC0;
  }
  const ErrorMetrics m = compute_metrics(yb.data(), rb.data(), 8);
  EXPECT_TRUE(std::isnan(m.calc_diff));
  EXPECT_TRUE(std::isnan(m.snr_db));
  EXPECT_TRUE(std::isnan(m.cosine));
}

TEST(Metrics, Bf16Overload) {
  std::vector<bf16> r(3), y(3);
  r[0].bits = bf16_round(1.0f);
  r[1].bits = bf16_round(2.0f);
  r[2].bits = bf16_round(-1.0f);
  y = r;
  y[1].bits = bf16_round(2.5f);
  const ErrorMetrics m = compute_metrics(y.data(), r.data(), 3);
  EXPECT_DOUBLE_EQ(m.max_abs, 0.5);
  EXPECT_DOUBLE_EQ(m.rel_l2, 0.5 / std::sqrt(6.0));
}

}  // namespace
}  // namespace moefq
