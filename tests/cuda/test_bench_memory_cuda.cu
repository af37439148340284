// The GPU benchmarks' memory plans on a GPU (bench/bench_memory.h): a size just above what
// the GPU can hold is refused by the moefq binary (exit 2, before any work, nothing written), and
// each plan covers what its benchmark takes from the GPU, measured with cudaMemGetInfo sampled
// while the benchmark runs.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>

#include "bench/bench.h"
#include "bench/bench_combine.h"
#include "bench/bench_gemm.h"
#include "bench/bench_memory.h"
#include "bench/bench_moe.h"
#include "cli/moefq_binary.h"
#include "eval/layer_runner.h"
#include "gpu_test.h"

namespace moefq::bench {
namespace {

using test::describe, test::RunResult;

constexpr double kMiB = double(1 << 20);

int64_t l2_bytes() {
  int dev = 0, l2 = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFQ_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
  return l2;
}

// The smallest v in [lo, hi] whose plan needs more than `limit` bytes of GPU memory (the plans
// grow with v); 0 when even hi does not.
int64_t smallest_refused(int64_t lo, int64_t hi, double limit, const std::function<double(int64_t)>& need) {
  if (need(hi) <= limit) return 0;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (need(mid) > limit)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// The most GPU memory taken (free memory before, less the lowest seen) while `run` runs: a second
// thread reads cudaMemGetInfo as fast as it can meanwhile. The figure is the whole device's, so
// ctest runs these tests alone (RUN_SERIAL, tests/CMakeLists.txt).
double gpu_memory_taken(const std::function<void()>& run) {
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  size_t before = 0, total = 0;
  MOEFQ_CUDA_CHECK(cudaMemGetInfo(&before, &total));
  std::atomic<bool> done{false};
  std::atomic<size_t> lowest{before};
  std::thread sampler([&] {
    while (!done.load()) {
      size_t free = 0, t = 0;
      if (cudaMemGetInfo(&free, &t) == cudaSuccess && free < lowest.load()) lowest.store(free);
    }
  });
  struct Join {
    std::atomic<bool>& done;
    std::thread& t;
    ~Join() {
      done.store(true);
      t.join();
    }
  } join{done, sampler};
  run();
  return double(before) - double(lowest.load());
}

class BenchMemoryCuda : public test::WorkDirTest {
 protected:
  BenchMemoryCuda() : WorkDirTest("moefq_bench_memory_cuda_") {}

  // `moefq bench ARGS --json b.json`, to be refused before any work: exit 2 with the message
  // (naming `sizes`, the figures and the plan) first on stderr, nothing on stdout, no file.
  void expect_refused(const std::string& args, const std::string& sizes) {
    SCOPED_TRACE(args);
    const RunResult r = run_in_work("timeout 300 " + test::moefq_command(args + " --json b.json"));
    EXPECT_EQ(r.status, 2) << describe(r);
    EXPECT_EQ(r.err.rfind("moefq: error: " + sizes, 0), 0u) << describe(r);
    for (const char* s : {" of GPU memory, ", " available: use fewer ", "memory plan (GiB)"})
      EXPECT_NE(r.err.find(s), std::string::npos) << s << "\n" << describe(r);
    EXPECT_EQ(r.out, "") << describe(r);
    EXPECT_TRUE(listing().empty()) << describe(r);
  }
};

// Each benchmark at the smallest size (of one option, the others at their defaults) whose plan
// exceeds kUsableFraction of the GPU's whole memory, more than the binary is allowed of the free
// memory it sees, while the next smaller size's plan does not.
TEST_F(BenchMemoryCuda, SizeJustAboveTheGpuIsRefused) {
  SKIP_WITHOUT_GPU();
  size_t free = 0, total = 0;
  MOEFQ_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  const double limit = kUsableFraction * double(total);

  GemmBenchOptions g;
  const int64_t experts = smallest_refused(1, 4096, limit, [&](int64_t v) {
    g.experts = v;
    return plan_gemm_bench_memory(g).device_bytes;
  });
  ASSERT_GT(experts, 1) << "no --experts just above the GPU's memory";
  expect_refused("bench gemm --experts " + std::to_string(experts),
                 "moefq bench gemm: --tokens 4096 (the largest of the sweep) with --experts " + std::to_string(experts));

  QdqBenchOptions q;
  q.cols = 65536;
  const int64_t l2 = l2_bytes();
  const int64_t rows = smallest_refused(1, int64_t(1) << 20, limit, [&](int64_t v) {
    q.rows = {v};
    return plan_qdq_bench_memory(q, l2).device_bytes;
  });
  ASSERT_GT(rows, 1) << "no --rows just above the GPU's memory";
  expect_refused("bench qdq --cols 65536 --rows " + std::to_string(rows),
                 "moefq bench qdq: --rows " + std::to_string(rows) + " --cols 65536 needs ");

  CombineBenchOptions c;
  const int64_t tokens = smallest_refused(1, int64_t(1) << 20, limit, [&](int64_t v) {
    c.tokens = v;
    return plan_combine_bench_memory(c).device_bytes;
  });
  ASSERT_GT(tokens, 1) << "no --tokens just above the GPU's memory";
  expect_refused("bench combine --tokens " + std::to_string(tokens),
                 "moefq bench combine: --tokens " + std::to_string(tokens) + " --top-k 8 --hidden 7168 needs ");

  MoeBenchOptions m;
  const int64_t moe_tokens = smallest_refused(1, int64_t(1) << 20, limit, [&](int64_t v) {
    m.tokens = {v};
    return plan_moe_bench_memory(m, "deepseek-v3").device_bytes;
  });
  ASSERT_GT(moe_tokens, 1) << "no --tokens just above the GPU's memory";
  expect_refused("bench moe --tokens " + std::to_string(moe_tokens),
                 "moefq bench moe: --preset deepseek-v3 --ep 8 --tokens " + std::to_string(moe_tokens) + " needs ");
}

// Each plan is at least what its benchmark takes from the GPU at its peak (with 64 MiB for what
// the driver takes besides the buffers: graphs, cuBLASLt's handle), and not far above it. The
// second of two runs is measured: the first loads the kernels' code (lazy loading takes GPU
// memory the plans leave to the headroom).
TEST_F(BenchMemoryCuda, PlansCoverWhatTheBenchmarksTake) {
  SKIP_WITHOUT_GPU();
  register_cuda_layer_runner();
  GemmBenchOptions g;
  g.tokens = {1, 4096};
  g.reps = 2;
  QdqBenchOptions q;
  q.rows = {32768};
  q.reps = 2;
  q.launches_per_graph = 2;
  CombineBenchOptions c;
  c.reps = 2;
  c.launches_per_graph = 2;
  MoeBenchOptions m;
  m.tokens = {128, 4096};
  m.configs = {"both-fp8"};
  m.reps = 2;
  m.calls_per_graph = 1;
  // A model without a shared expert (its layer runs no side stream), bf16 weights, staging none.
  MoeBenchOptions mq = m;
  mq.presets = {"qwen3-30b-a3b"};
  mq.tokens = {128};
  const struct {
    const char* name;
    double plan;
    std::function<int()> run;
  } cases[] = {
      {"gemm", plan_gemm_bench_memory(g).device_bytes, [&] { return run_bench_gemm(g); }},
      {"qdq", plan_qdq_bench_memory(q, l2_bytes()).device_bytes, [&] { return run_bench_qdq(q); }},
      {"combine", plan_combine_bench_memory(c).device_bytes, [&] { return run_bench_combine(c); }},
      {"moe", plan_moe_bench_memory(m, "deepseek-v3").device_bytes, [&] { return run_bench_moe(m); }},
      {"moe qwen3", plan_moe_bench_memory(mq, "qwen3-30b-a3b").device_bytes, [&] { return run_bench_moe(mq); }},
  };
  for (const auto& k : cases) {
    SCOPED_TRACE(k.name);
    ASSERT_EQ(k.run(), 0) << "the first run's checks";
    int status = -1;
    const double taken = gpu_memory_taken([&] { status = k.run(); });
    EXPECT_EQ(status, 0);
    std::printf("bench %s: plan %.1f MiB, taken at the peak %.1f MiB\n", k.name, k.plan / kMiB, taken / kMiB);
    EXPECT_LE(taken, k.plan + 64 * kMiB) << "the plan is short of what the benchmark took";
    EXPECT_GE(taken, 0.9 * k.plan) << "the plan counts much more than the benchmark took";
  }
}

}  // namespace
}  // namespace moefq::bench
