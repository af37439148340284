// The grouped expert GEMMs of the CUDA engine (docs/engine.md, steps 1-4 of a routed row) on Hopper
// tensor cores, with the two fused epilogues. Groups are experts; their row counts live on the
// device, so a launch needs no host synchronisation and can be captured in a CUDA graph.
//
// Numerics (docs/engine.md): A is e4m3 with one fp32 scale per 128 elements of k (1x128), or bf16
// (staging none: no scale, i.e. 1); B is e4m3 with one fp32 scale per 128x128 block, or bf16 (no
// scale). For each 128-block b of k the partial dot product is accumulated in fp32 and added to
// the fp32 result as fma(partial, a_scale[row][b] * b_scale[n / 128][b], result), blocks
// ascending. Only the order of the additions inside a block may differ from the CPU reference
// (engine/gemm_cpu.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moefq/numerics.h"
#include "moefq/weights.h"

namespace moefq::cuda {

// G groups sharing one shape: group g multiplies its rows of A ([rows_g, k]) by B_g^T, where
// B_g is [n, k] row-major (an expert's gate_up [2I, H] or down [H, I]); n and k multiples of 128.
// Group g's rows are the global rows row_offset[g] .. row_offset[g] + counts[g] - 1 of A and of
// every per-row epilogue array. counts and row_offset are read on the device.
struct GroupedGemmArgs {
  int num_groups = 0;                 // G
  int64_t max_total_rows = 0;         // upper bound of sum(counts), for the launch shape
  int64_t n = 0, k = 0;
  const int32_t* counts = nullptr;      // device [G]
  const int32_t* row_offset = nullptr;  // device [G]
  // A: e4m3 or bf16 (a_format), row r at element r * lda of a (lda % 16 == 0).
  WeightFormat a_format = WeightFormat::kE4m3;
  const uint8_t* a = nullptr;
  int64_t lda = 0;
  const float* a_scale = nullptr;       // e4m3 A: fp32 [k / 128] per row, row r at a_scale + r * lda_scale
  int64_t lda_scale = 0;
  WeightFormat b_format = WeightFormat::kE4m3;
  // Either b, or b_all below (then the loads without bulk tensor copies read group g at b_all + g * n * k).
  const void* const* b = nullptr;       // device array [G] of device pointers to [n, k] e4m3 or bf16
  const float* const* b_scale = nullptr;  // device array [G] of [n / 128, k / 128] fp32 (e4m3 only)
  // Rows per tile: 64 or 128; 0 picks 64 when max_total_rows / G <= 64 or when 128-row tiles
  // would be fewer than the GPU's SMs.
  int tile_rows = 0;
  // Optional, for bulk tensor (TMA) loads: every group's B in one allocation, group g's [n, k] at
  // b_all + g * n * k elements (its scales likewise at b_scale_all + g * (n / 128) * (k / 128)),
  // and the number of rows allocated at a (so a tensor map can bound A). Null / 0: unknown.
  const void* b_all = nullptr;
  const float* b_scale_all = nullptr;
  int64_t a_rows = 0;
  // Launched as a programmatic dependent of the stream's previous kernel (cuda_base/pdl.cuh): set it
  // only where that operation is a kernel.
  bool pdl = false;
};

// GEMM 1 (gate/up, n = 2I: gate = columns [0, I), up = columns [I, 2I)) with the SwiGLU epilogue:
//   g = bf16(acc[gate i]), u = bf16(acc[up i]); clamp (optional): g = min(g, c), u = clamp(u, -c, c);
//   h = silu_f32(g) * u * row_weight[row] (mul_rn, mul_rn); h re-staged to e4m3 with 1x128 scales
//   (stage_scale / stage_encode of numerics.h, bit-identical to stage_e4m3_ref on the row's h)
//   when A is e4m3, or rounded once to bf16 into h16 when A is bf16 (staging none: the down GEMM
//   takes bf16 h).
struct SwigluEpilogue {
  const float* row_weight = nullptr;  // device [rows]: the router weight of each row (1 for shared)
  bool has_clamp = false;
  float clamp = 0.0f;
  uint8_t* h8 = nullptr;              // e4m3 A: e4m3 [rows, I], row r at h8 + r * ldh bytes
  bf16* h16 = nullptr;                // bf16 A: bf16 [rows, I], row r at h16 + r * ldh elements
  int64_t ldh = 0;
  float* h_scale = nullptr;           // e4m3 A: fp32 [rows, I / 128], row r at h_scale + r * ldh_scale
  int64_t ldh_scale = 0;
};

// GEMM 2 (down, n = H) with the store epilogue: row r's result, rounded once to bf16, is written
// to row_out[r] ([n] bf16; 16-byte aligned), e.g. the token rank's combine row.
struct StoreEpilogue {
  bf16* const* row_out = nullptr;  // device [rows] of device pointers
};

// Launches (no host synchronisation, graph-capturable). Rows past a group's count are never read
// (zero fill) nor written; columns are written in full for every row of every group. h rows are
// written with 8-byte stores (ldh % 8 == 0), output rows with 16-byte stores.
void launch_gemm_swiglu(const GroupedGemmArgs& args, const SwigluEpilogue& epi, cudaStream_t stream);
void launch_gemm_store(const GroupedGemmArgs& args, const StoreEpilogue& epi, cudaStream_t stream);

// One-time setup of the kernels on the current device (shared-memory limits, SM count). The
// launchers call it themselves on first use; call it once before capturing a graph so that no
// cudaFuncSetAttribute happens during capture. Idempotent, thread-safe.
void prepare_grouped_gemm();

}  // namespace moefq::cuda
