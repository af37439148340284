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
