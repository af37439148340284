// moefq bench moe: the whole fake-quantized MoE layer on the GPU (CUDA builds only).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefq::bench {

struct MoeBenchOptions {
  std::vector<std::string> presets = {"deepseek-v3"};
  int64_t ep = 8;  // the expert-parallel degree whose per-GPU shape runs: E / ep local experts
  std::vector<int64_t> tokens = {1, 128, 512, 4096};  // tokens per rank
  std::vector<std::string> configs;                  // quantizer configurations; empty: all
  int calls_per_graph = 3, reps = 7;
  std::string json;
};

// Layer time (CUDA graph replays, configurations interleaved) of one EP rank's MoE layer, routed
// experts and the shared expert, for each preset, token count and quantizer configuration, with
// TFLOPS, weight GB/s, the roofline floor from the same run's ceilings (device copy bandwidth,
// cuBLASLt FP8 GEMM rate), and each configuration's overhead over the unquantized layer: the time
// of the quantizers' own kernels, and the end-to-end difference.
int run_bench_moe(const MoeBenchOptions& options);

// The quantizer configurations run_bench_moe knows, in its order.
std::vector<std::string> moe_bench_configs();

}  // namespace moefq::bench
