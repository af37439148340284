// Benchmark programs run by `moefq bench ...`. No CUDA types here; without CUDA the GPU ones fail
// with a message (bench/gpu_stubs.cpp).
#pragma once

#include <cstdint>
#include <ctime>
#include <optional>
#include <string>
#include <vector>

#include "moefq/weights.h"

namespace moefq::bench {

// Today's date (UTC), YYYY-MM-DD: the `date` of every benchmark's JSON.
inline std::string today() {
  const std::time_t now = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&now));
  return buf;
}

struct QdqBenchOptions {
  std::vector<int64_t> rows = {128, 4096, 32768};
  int64_t cols = 7168;
  std::vector<std::string> formats;  // empty: all, plus staging and dynamic-amax fp8
  int launches_per_graph = 20;
  int reps = 15;
  std::string json;  // write the results here too
};

// QDQ kernels on [rows, cols] bf16: time, GB/s (read + write) and the ratio to a device-to-device
// copy of the same bytes measured in the same run; one correctness check per case against the CPU
// reference. Returns 0, or 1 when a check failed.
int run_bench_qdq(const QdqBenchOptions& options);

struct EngineCpuBenchOptions {
  std::string preset = "tiny";
  int64_t ranks = 4, tokens = 256;
  WeightFormat format = WeightFormat::kE4m3;
  std::optional<Staging> staging;  // nullopt: default_staging of the preset
  int threads = 0;  // 0: all hardware threads
  int reps = 5;
  std::string json;
};

// One layer call of the CPU engine on synthetic weights and activations, routed by the router:
// median wall time of `reps` calls after one warm-up call.
int run_bench_engine_cpu(const EngineCpuBenchOptions& options);

struct EvalBenchOptions {
  std::string preset = "deepseek-v3";
  std::string layers = "0-19";
  int64_t ranks = 8, tokens = 256;
  int calib_batches = 2, eval_batches = 2;
  std::string device = "auto";
  std::optional<Staging> staging;  // nullopt: as the model is served (EvalOptions::staging)
  std::string json;
};

// The main job's pipeline (`moefq eval` with the default sweep) timed per layer and stage: weights
// generated or loaded with the activations and routing, calibration, the reference, the recipes'
// forwards and the metrics; the wall time of the whole run and of its first layer.
int run_bench_eval(const EvalBenchOptions& options);

}  // namespace moefq::bench
