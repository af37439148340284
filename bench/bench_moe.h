// moefq bench moe: the whole fake-quantized MoE layer on the GPU (CUDA builds only).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moefq/cpu_engine.h"

namespace moefq::bench {

struct MoeBenchOptions {
  std::vector<std::string> presets = {"deepseek-v3"};
  int64_t ep = 8;  // the expert-parallel degree whose per-GPU shape runs: E / ep local experts
  std::vector<int64_t> tokens = {8, 128, 512, 1024, 4096, 8192};  // tokens per rank
  std::vector<std::string> configs;                  // quantizer configurations; empty: all
  int calls_per_graph = 3, reps = 7;
  std::string json;
  bool real_ranks = false;  // run_bench_moe_ranks: this process is one rank of ep (the job's size)
  // The layer timed: staging e4m3 (e4m3 weights, e4m3 activations: the FP8 Mega-MoE layer) or none
  // (bf16 weights and activations: the layer of a bf16 model); nullopt: each preset's
  // default_staging.
  std::optional<Staging> staging;
};

// The staging of a preset's run, the weight format that goes with it (e4m3 / bf16), and the
// engine options of its layer (bench_memory.cpp, in every build).
Staging moe_bench_staging(const MoeBenchOptions& options, const MoeConfig& config);
WeightFormat moe_bench_weight_format(Staging staging);
EngineOptions moe_bench_engine_options(Staging staging, bool fuse_shared);

// Layer time (CUDA graph replays, configurations interleaved) of one EP rank's MoE layer, routed
// experts and the shared expert, for each preset, token count and quantizer configuration, with
// TFLOPS, weight GB/s, the roofline floor from the same run's ceilings (device copy bandwidth,
// cuBLASLt FP8 GEMM rate), and each configuration's overhead over the unquantized layer: the time
// of the quantizers' own kernels, and the end-to-end difference. Beside the unquantized rows:
// TFLOPS as DeepGEMM counts them (routed rows only), DeepGEMM's published SM90 Mega-MoE per-rank
// time for the same preset and tokens, and this project's target, where there are such figures.
int run_bench_moe(const MoeBenchOptions& options);

// One real rank of EP = the job's WORLD_SIZE, one process per GPU under `moefq launch` (NCCL
// builds only): the unquantized layer with the shared expert fused, tokens routed over every
// rank's experts, for each preset and token count per rank. Per rank: layer time (CUDA graph
// replays with the two cross-rank barriers inside), bytes sent to peers over NVLink and their rate
// beside the measured all-to-all store rate, and the time of the same per-GPU work on this GPU
// alone (E/ep local experts, no peers), which gives the scaling. Rank 0 prints the table (the
// slowest rank's figures) and writes the JSON.
int run_bench_moe_ranks(const MoeBenchOptions& options);

// The options run_bench_moe checks before it touches a device, in every build (bench_memory.cpp):
// known configurations, token counts, presets that split into --ep ranks. Bad input otherwise.
void check_moe_bench_options(const MoeBenchOptions& options);

// The quantizer configurations run_bench_moe knows, in its order (in every build: the CLI's help
// lists them).
inline std::vector<std::string> moe_bench_configs() {
  return {"none",       "dispatch-fp8",   "combine-fp8", "both-fp8", "dispatch-nvfp4", "combine-nvfp4",
          "both-nvfp4", "both-nvfp4-gs1", "both-mxfp8"};
}

}  // namespace moefq::bench
