// The benchmarks' clock sampler (bench/gpu_telemetry.h): its summary of a window from an injected
// reader, and that a GPU NVML cannot open leaves it unavailable without hanging.
#include "bench/gpu_telemetry.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace moefq::bench {
namespace {

TEST(GpuTelemetry, ClockLimitText) {
  EXPECT_EQ(clock_limit_text(0), "none");
  EXPECT_EQ(clock_limit_text(0x1), "none");  // idle is no limit
  EXPECT_EQ(clock_limit_text(0x2), "none");  // nor the applications-clocks setting
  EXPECT_EQ(clock_limit_text(0x4), "power cap");
  EXPECT_EQ(clock_limit_text(0x4 | 0x20 | 0x80), "power cap,thermal,power brake");
  EXPECT_EQ(clock_limit_text(0x8 | 0x40), "hw slowdown,hw thermal");
}

// Readings 1000, 1100, 1200, ... MHz; every third one idle; every fifth one failing.
TEST(GpuTelemetry, SummaryOfBusySamples) {
  std::atomic<int> calls{0};
  GpuTelemetry t(
      [&calls](TelemetrySample& s) {
        const int i = calls++;
        if (i % 5 == 4) return false;
        s.sm_mhz = 1000u + 100u * unsigned(i % 3);
        s.power_mw = 500000u;
        s.reasons = i % 3 == 2 ? 0x1 : (i % 3 == 1 ? 0x4 : 0x0);
        return true;
      },
      100);
  ASSERT_TRUE(t.available());
  t.start();
  while (calls.load() < 60) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const TelemetrySummary s = t.stop();
  const int n = calls.load();
  int busy = 0;
  double mhz = 0;
  for (int i = 0; i < n; ++i)
    if (i % 5 != 4 && i % 3 != 2) {
      ++busy;
      mhz += 1000 + 100 * (i % 3);
    }
  EXPECT_EQ(s.samples, busy);
  EXPECT_DOUBLE_EQ(s.sm_mhz, mhz / busy);
  EXPECT_DOUBLE_EQ(s.power_w, 500.0);
  EXPECT_EQ(s.reasons, 0x4u);  // the idle samples' bit is not in it
  // A second window starts from nothing: at most the readings taken in it; stop() without start()
  // changes nothing.
  t.start();
  const TelemetrySummary s2 = t.stop();
  EXPECT_LE(s2.samples, calls.load() - n);
  EXPECT_EQ(t.stop().samples, s2.samples);
}

TEST(GpuTelemetry, UnknownGpuIsUnavailable) {
  GpuTelemetry t("ffff:ff:ff.7");
  EXPECT_FALSE(t.available());
  t.start();
  const TelemetrySummary s = t.stop();
  EXPECT_EQ(s.samples, 0);
  EXPECT_EQ(s.sm_mhz, 0.0);
}

}  // namespace
}  // namespace moefq::bench
