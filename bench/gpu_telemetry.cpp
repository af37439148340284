#include "bench/gpu_telemetry.h"

#include <dlfcn.h>

#include <chrono>
#include <utility>

namespace moefq::bench {
namespace {

// NVML's limit reasons worth naming (nvml.h's nvmlClocksEventReason* bits).
constexpr struct {
  uint64_t bit;
  const char* name;
} kLimits[] = {
    {0x4, "power cap"}, {0x8, "hw slowdown"}, {0x20, "thermal"}, {0x40, "hw thermal"}, {0x80, "power brake"},
};
constexpr uint64_t kIdle = 0x1;
constexpr int kNvmlSuccess = 0;
constexpr int kNvmlClockSm = 1;

}  // namespace

std::string clock_limit_text(uint64_t reasons) {
  std::string s;
  for (const auto& l : kLimits) {
    if (!(reasons & l.bit)) continue;
    if (!s.empty()) s += ',';
    s += l.name;
  }
  return s.empty() ? "none" : s;
}

GpuTelemetry::GpuTelemetry(Reader reader, int period_us) : reader_(std::move(reader)), period_us_(period_us) {}

GpuTelemetry::GpuTelemetry(const std::string& pci_bus_id, int period_us) : period_us_(period_us) {
  // The C entry points of NVML (nvml.h, stable ABI); nvmlDevice_t is an opaque pointer and
  // nvmlReturn_t / nvmlClockType_t are ints.
  using InitFn = int (*)();
  using ByPciFn = int (*)(const char*, void**);
  using ClockFn = int (*)(void*, int, unsigned*);
  using PowerFn = int (*)(void*, unsigned*);
  using ReasonsFn = int (*)(void*, unsigned long long*);
  using ShutdownFn = int (*)();
  nvml_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!nvml_) return;
  const auto sym = [this](const char* name) { return dlsym(nvml_, name); };
  const auto init = reinterpret_cast<InitFn>(sym("nvmlInit_v2"));
  const auto by_pci = reinterpret_cast<ByPciFn>(sym("nvmlDeviceGetHandleByPciBusId_v2"));
  const auto clock = reinterpret_cast<ClockFn>(sym("nvmlDeviceGetClockInfo"));
  const auto power = reinterpret_cast<PowerFn>(sym("nvmlDeviceGetPowerUsage"));
  auto reasons = reinterpret_cast<ReasonsFn>(sym("nvmlDeviceGetCurrentClocksEventReasons"));
  if (!reasons) reasons = reinterpret_cast<ReasonsFn>(sym("nvmlDeviceGetCurrentClocksThrottleReasons"));
  const auto shutdown = reinterpret_cast<ShutdownFn>(sym("nvmlShutdown"));
  if (!init || !shutdown || !by_pci || !clock || !power || !reasons || init() != kNvmlSuccess) return;
  void* dev = nullptr;
  if (by_pci(pci_bus_id.c_str(), &dev) != kNvmlSuccess) {
    shutdown();  // NVML counts its initialisations: this one is not kept
    return;
  }
  reader_ = [dev, clock, power, reasons](TelemetrySample& s) {
    unsigned long long r = 0;
    if (clock(dev, kNvmlClockSm, &s.sm_mhz) != kNvmlSuccess || power(dev, &s.power_mw) != kNvmlSuccess ||
        reasons(dev, &r) != kNvmlSuccess)
      return false;
    s.reasons = r;
    return true;
  };
  shutdown_ = shutdown;  // initialised and kept: shut down at destruction
}

GpuTelemetry::~GpuTelemetry() {
  stop();
  if (shutdown_) shutdown_();
  if (nvml_) dlclose(nvml_);
}

void GpuTelemetry::add(const TelemetrySample& s) {
  if (s.reasons & kIdle) return;  // between launches or before the first: not the case's clock
  std::lock_guard<std::mutex> lock(mu_);
  ++samples_;
  mhz_sum_ += s.sm_mhz;
  mw_sum_ += s.power_mw;
  reasons_ |= s.reasons;
}

void GpuTelemetry::start() {
  if (!reader_ || running_.exchange(true)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    samples_ = 0;
    mhz_sum_ = mw_sum_ = 0;
    reasons_ = 0;
  }
  thread_ = std::thread([this] {
    while (running_.load()) {
      TelemetrySample s;
      if (reader_(s)) add(s);
      std::this_thread::sleep_for(std::chrono::microseconds(period_us_));
    }
  });
}

TelemetrySummary GpuTelemetry::stop() {
  if (running_.exchange(false) && thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  TelemetrySummary t;
  t.samples = samples_;
  if (samples_ > 0) {
    t.sm_mhz = mhz_sum_ / samples_;
    t.power_w = mw_sum_ / samples_ * 1e-3;
  }
  t.reasons = reasons_;
  return t;
}

}  // namespace moefq::bench
