// `moefq bench gemm`: the grouped expert GEMMs (engine/cuda/grouped_gemm.cuh) on MoE shapes, against
// cuBLASLt's FP8 GEMM of the same total M x N x K and against the time to read the touched
// experts' weights once from HBM, both measured in the same run. CUDA builds only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefq::bench {

struct GemmBenchOptions {
  std::vector<int64_t> tokens = {1, 128, 512, 4096};  // tokens per rank; rows = tokens * top_k
  int64_t hidden = 7168, inter = 2048;                // deepseek-v3
  int64_t experts = 32;                               // local experts = groups
  int64_t top_k = 8;
  int reps = 20;                // timed graph replays; the median is reported
  int launches_per_graph = 4;
  uint64_t seed = 1;
  std::string weights = "e4m3";  // "e4m3" (run_bench_gemm) or "bf16" (run_bench_gemm_bf16)
  std::string json;             // write the results here too
};

// Per token count: gate/up GEMM + SwiGLU epilogue and down GEMM + store epilogue with e4m3
// weights (rows spread over the experts by random top-k routing), time, TFLOPS, the ratio to
// cuBLASLt FP8 (e4m3 x e4m3 -> bf16, TN) of the same total shape, and the ratio to the touched
// experts' weight bytes over the measured device copy bandwidth; one correctness check per case
// against the CPU reference (engine/gemm_cpu.h). Returns 0, or 1 when a check failed.
int run_bench_gemm(const GemmBenchOptions& options);

// The same two GEMMs with bf16 weights and bf16 activations (staging none), against cuBLASLt's
// bf16 GEMM on the same operands (one strided-batched call, each expert's own weights), the
// ratio printed beside its target (>= 0.85); one check of the last row against fp64 sums of the
// same operands. Returns 0, or 1 when a check failed.
int run_bench_gemm_bf16(const GemmBenchOptions& options);

}  // namespace moefq::bench
