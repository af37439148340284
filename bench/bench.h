// Benchmark programs run by `moefq bench ...` (CUDA builds only). No CUDA types here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefq::bench {

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

}  // namespace moefq::bench
