// Timing helpers shared by the GPU benchmarks: CUDA-graph timing, the copy-bandwidth ceiling and
// the date stamp of a report.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <string>
#include <random>
#include <vector>

#include "bench/bench.h"
#include "cuda_base/cuda_check.h"

namespace moefq::bench {

// A timed case: `prepare` (may be empty) runs before the case's graph is captured; the graph holds
// `per_graph` calls of `launch(i, stream)`, i = 0, 1, ... (rotating over input sets through i).
struct TimedCase {
  std::function<void()> prepare;
  std::function<void(int, cudaStream_t)> launch;
};

// A second stream for work beside a stream's own, inside a graph capture too: fork(s) makes the
// side stream wait for what s has so far, join(s) makes s wait for what the side stream has.
struct SideStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t forked = nullptr, joined = nullptr;
  SideStream() {
    MOEFQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    MOEFQ_CUDA_CHECK(cudaEventCreateWithFlags(&forked, cudaEventDisableTiming));
    MOEFQ_CUDA_CHECK(cudaEventCreateWithFlags(&joined, cudaEventDisableTiming));
  }
  ~SideStream() {
    cudaEventDestroy(joined);
    cudaEventDestroy(forked);
    cudaStreamDestroy(stream);
  }
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  void fork(cudaStream_t s) {
    MOEFQ_CUDA_CHECK(cudaEventRecord(forked, s));
    MOEFQ_CUDA_CHECK(cudaStreamWaitEvent(stream, forked, 0));
  }
  void join(cudaStream_t s) {
    MOEFQ_CUDA_CHECK(cudaEventRecord(joined, stream));
    MOEFQ_CUDA_CHECK(cudaStreamWaitEvent(s, joined, 0));
  }
};

// Median time of one call of each case's launch in microseconds: every case's graph is captured
// first, then replayed round-robin `reps` times after a warm-up (replay r of every case before
// replay r + 1 of any), so slow drifts of clock or temperature affect every case alike.
inline std::vector<double> interleaved_median_us(const std::vector<TimedCase>& cases, int per_graph, int reps) {
  cudaStream_t s;
  MOEFQ_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<cudaGraphExec_t> execs;
  for (const TimedCase& c : cases) {
    if (c.prepare) c.prepare();
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOEFQ_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < per_graph; ++i) c.launch(i, s);
    MOEFQ_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOEFQ_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    MOEFQ_CUDA_CHECK(cudaGraphDestroy(graph));
    execs.push_back(exec);
  }
  cudaEvent_t a, b;
  MOEFQ_CUDA_CHECK(cudaEventCreate(&a));
  MOEFQ_CUDA_CHECK(cudaEventCreate(&b));
  for (cudaGraphExec_t e : execs)
    for (int w = 0; w < 3; ++w) MOEFQ_CUDA_CHECK(cudaGraphLaunch(e, s));
  std::vector<std::vector<double>> t(execs.size());
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < execs.size(); ++i) {
      MOEFQ_CUDA_CHECK(cudaEventRecord(a, s));
      MOEFQ_CUDA_CHECK(cudaGraphLaunch(execs[i], s));
      MOEFQ_CUDA_CHECK(cudaEventRecord(b, s));
      MOEFQ_CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      MOEFQ_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      t[i].push_back(1000.0 * ms / per_graph);
    }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
  cudaStreamDestroy(s);
  std::vector<double> medians;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    medians.push_back(v[v.size() / 2]);
  }
  return medians;
}

// Median time of one call of `launch(i)` in microseconds (one case of the above).
inline double median_us(const std::function<void(int, cudaStream_t)>& launch, int per_graph, int reps) {
  return interleaved_median_us({TimedCase{nullptr, launch}}, per_graph, reps)[0];
}

// The same for launches that do not rotate over input sets.
inline double median_us(const std::function<void(cudaStream_t)>& launch, int per_graph, int reps) {
  return median_us([&](int, cudaStream_t s) { launch(s); }, per_graph, reps);
}
// The benches' synthetic operands: a per-index hash (a 64-bit finalizer) and a triangular (roughly
// bell-shaped) value in (-1, 1), the sum of two uniforms taken from it.
__device__ __forceinline__ uint32_t bench_mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}
__device__ __forceinline__ uint32_t bench_hash(int64_t i, uint64_t seed) {
  return bench_mix(uint64_t(i) * 0x9E3779B97F4A7C15ull + seed);
}
__device__ __forceinline__ float bench_triangular(int64_t i, uint64_t seed) {
  const uint32_t h = bench_hash(i, seed);
  return (float(h & 0xFFFF) + float(h >> 16)) / 65536.0f - 1.0f;
}

// Rows of a grouped GEMM spread over the local experts with a mild skew, as real routers show:
// expert e weighted by 1 / (1 + e / experts).
inline std::vector<int32_t> route_counts(int64_t rows, int64_t experts, std::mt19937_64& rng) {
  std::vector<int32_t> c(static_cast<size_t>(experts), 0);
  std::vector<double> w(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) w[size_t(e)] = 1.0 / (1.0 + double(e) / double(experts));
  std::discrete_distribution<int> pick(w.begin(), w.end());
  for (int64_t r = 0; r < rows; ++r) ++c[size_t(pick(rng))];
  return c;
}

// Each group's first row (the exclusive prefix sum of the counts) and how many groups have rows.
struct GroupOffsets {
  std::vector<int32_t> offsets;
  int64_t touched = 0;
};
inline GroupOffsets group_offsets(const std::vector<int32_t>& counts) {
  GroupOffsets g;
  int64_t off = 0;
  for (const int32_t c : counts) {
    g.offsets.push_back(int32_t(off));
    off += c;
    g.touched += c > 0;
  }
  return g;
}


// A plain 16-byte-per-thread grid-stride copy.
static __global__ void copy16_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

// Device-to-device copy bandwidth in GB/s (read + write bytes), copying `bytes` (a multiple of 16)
// between two allocations: the better of cudaMemcpyAsync and a plain 16-byte copy kernel (for
// large copies the latter is faster on the H200), so the memory ceiling every bandwidth figure is
// compared with never flatters it. (bench_memory.h's copy_ceiling_device_bytes counts the two.)
inline double copy_gbs(size_t bytes, int per_graph = 10, int reps = 11) {
  void *a = nullptr, *b = nullptr;
  MOEFQ_CUDA_CHECK(cudaMalloc(&a, bytes));
  MOEFQ_CUDA_CHECK(cudaMalloc(&b, bytes));
  MOEFQ_CUDA_CHECK(cudaMemset(a, 1, bytes));
  MOEFQ_CUDA_CHECK(cudaMemset(b, 2, bytes));
  int dev = 0, sms = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const std::vector<double> us = interleaved_median_us(
      {TimedCase{nullptr,
                 [&](int i, cudaStream_t s) {
                   MOEFQ_CUDA_CHECK(cudaMemcpyAsync(i % 2 ? a : b, i % 2 ? b : a, bytes, cudaMemcpyDeviceToDevice, s));
                 }},
       TimedCase{nullptr,
                 [&](int i, cudaStream_t s) {
                   copy16_kernel<<<sms * 8, 512, 0, s>>>(static_cast<const uint4*>(i % 2 ? b : a),
                                                         static_cast<uint4*>(i % 2 ? a : b), int64_t(bytes / 16));
                   MOEFQ_CUDA_CHECK_LAUNCH();
                 }}},
      per_graph, reps);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / std::min(us[0], us[1]) * 1e-3;
}

}  // namespace moefq::bench
