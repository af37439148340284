// The GPU's SM clock, board power and clock-limit reasons while a benchmark case runs, sampled on a
// background thread through NVML (loaded at run time, so that nothing links against it). Under
// the board's power limit the clock follows the work and the data, so a kernel's time against a
// ceiling's says little without the clocks both ran at.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace moefq::bench {

// One reading. `reasons`: NVML's clocks-event bit mask (1 idle, 4 software power cap, 8 hardware
// slowdown, 0x20 / 0x40 software / hardware thermal, 0x80 power brake, ...).
struct TelemetrySample {
  unsigned sm_mhz = 0;
  unsigned power_mw = 0;
  uint64_t reasons = 0;
};

// What the samples of one window say: mean SM clock and power over the samples taken while the
// GPU was busy (the idle bit clear), and every limit reason seen in them.
struct TelemetrySummary {
  int samples = 0;  // busy samples
  double sm_mhz = 0, power_w = 0;
  uint64_t reasons = 0;
};

// "power cap", "thermal", ... for the limit bits of `reasons` (idle and settings bits left out),
// comma-separated; "none" when no limit is set.
std::string clock_limit_text(uint64_t reasons);

class GpuTelemetry {
 public:
  using Reader = std::function<bool(TelemetrySample&)>;
  // The GPU with this PCI bus id (cudaDeviceGetPCIBusId's form) through NVML; unavailable when NVML
  // or the GPU cannot be opened.
  explicit GpuTelemetry(const std::string& pci_bus_id, int period_us = 2000);
  // Any reader (tests): false from it ends nothing, the sample is just not counted.
  GpuTelemetry(Reader reader, int period_us);
  ~GpuTelemetry();
  GpuTelemetry(const GpuTelemetry&) = delete;
  GpuTelemetry& operator=(const GpuTelemetry&) = delete;

  bool available() const { return static_cast<bool>(reader_); }
  // Starts sampling (a no-op when unavailable or already started).
  void start();
  // Stops sampling and summarises the window since start(); an empty summary when unavailable.
  TelemetrySummary stop();

 private:
  void add(const TelemetrySample& s);

  Reader reader_;
  int period_us_;
  void* nvml_ = nullptr;  // the library handle, closed at destruction
  int (*shutdown_)() = nullptr;  // nvmlShutdown, once NVML is initialised for a GPU it found
  std::thread thread_;
  std::atomic<bool> running_{false};
  std::mutex mu_;
  int samples_ = 0;
  double mhz_sum_ = 0, mw_sum_ = 0;
  uint64_t reasons_ = 0;
};

}  // namespace moefq::bench
