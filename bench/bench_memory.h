// The memory plans of the GPU benchmarks (`moefq bench gemm`, `qdq`, `combine`, `moe`): the size of
// every buffer each micro-benchmark allocates comes from one function per benchmark that its
// allocation reads too (`bench moe`'s plan counts the engine's and the fake quantizer's buffers as
// they allocate them); the plan (eval's MemoryPlan) sums them for the largest size of a sweep, and
// the check_*_bench_memory functions refuse a run that does not fit (eval's require_memory_fits),
// before anything is allocated. No CUDA here.
#pragma once

#include <cstdint>
#include <string>

#include "bench/bench.h"
#include "bench/bench_combine.h"
#include "bench/bench_gemm.h"
#include "bench/bench_moe.h"
#include "moefq/eval.h"
#include "moefq/moe_config.h"

namespace moefq::bench {

// cudaMalloc takes the device's memory in 2 MiB pages (small allocations share one): the plans
// count every device buffer rounded up to whole pages, an upper bound.
inline constexpr int64_t kDevicePageBytes = int64_t(2) << 20;
int64_t device_allocation_bytes(int64_t bytes);

// The copy ceiling (copy_gbs, bench_cuda_util.cuh) copies `bytes` between two buffers of that size.
int64_t copy_ceiling_device_bytes(int64_t bytes);

// The buffers of one cuBLASLt FP8 ceiling (cublaslt_fp8_gemm_us, ceilings.cuh), which allocates
// from these and frees them before it returns.
struct CublasltCeilingSizes {
  int64_t a_const = 0;  // bytes of the [batch * m, k] constant operand; 0 where the caller gives A
  int64_t b_const = 0;  // bytes of the [batch * n, k] constant operand; 0 where the caller gives B
  int64_t d = 0;        // bf16 [batch * m, n] output
  int64_t workspace = int64_t(32) << 20;  // bytes
  int64_t device_bytes() const;
};
// elem_bytes: of the operands, 1 (e4m3) or 2 (bf16); a_const and b_const are then bytes.
CublasltCeilingSizes cublaslt_ceiling_sizes(int64_t m, int64_t n, int64_t k, bool a_given, bool b_given, int batch,
                                            int elem_bytes = 1);

// `moefq bench gemm`: cuBLASLt multiplies M padded to 16 rows; the grouped ceiling gives each of
// `groups` experts ceil(rows / groups) rows, padded so.
int64_t cublaslt_rows(int64_t rows);
int64_t cublaslt_group_rows(int64_t rows, int64_t groups);

// Element counts of the buffers `moefq bench gemm` allocates once, for its largest token count
// (bench_gemm.cu allocates from these).
struct GemmBenchSizes {
  int64_t max_rows = 0;  // the largest --tokens times --top-k
  // Activation rows: max_rows, or more where the cuBLASLt ceilings read padded rows of them.
  int64_t op_rows = 0;
  int64_t gate_up = 0, down = 0;                // e4m3 weights of every local expert [G, 2I, H], [G, H, I]
  int64_t gate_up_scales = 0, down_scales = 0;  // fp32 128 x 128 block scales of those
  int64_t x8 = 0, h8 = 0;                       // e4m3 [op_rows, H], [op_rows, I]
  int64_t x_scales = 0, h_scales = 0;           // fp32 [max_rows, H / 128], [max_rows, I / 128]
  int64_t row_weights = 0;                      // fp32 [max_rows]
  int64_t out = 0;                              // bf16 [max_rows, H]
  int64_t row_out = 0;                          // bf16* [max_rows] (host and device)
  int64_t groups = 0;  // G: four pointer arrays (host and device), counts and offsets (int32)
  int64_t copy_ceiling = int64_t(1) << 30;  // bytes the copy ceiling copies
};
GemmBenchSizes gemm_bench_sizes(const GemmBenchOptions& options);

// Host bytes of the gemm check of one output row against the CPU reference for a GEMM of n x k
// (one expert's e4m3 weights copied back and decoded to fp32, the row's activations, the
// reference row and the row read back).
int64_t gemm_check_host_bytes(int64_t n, int64_t k, const GemmBenchOptions& options);

// `moefq bench qdq` on one row count (its buffers live while that row count runs).
struct QdqBenchSizes {
  int64_t elems = 0;        // rows x cols
  int sets = 0;             // input and output sets rotated over, so that they do not fit in L2 together
  int64_t sample_rows = 0;  // distinct rows (the data repeats them; the check compares them)
  bool stage = false;       // the stage_e4m3 case runs: an e4m3 output and its scales per set too
};
QdqBenchSizes qdq_bench_sizes(const QdqBenchOptions& options, int64_t rows, int64_t l2_bytes);

// `moefq bench combine`: element counts of its buffers.
struct CombineBenchSizes {
  int64_t sample = 0;        // distinct tokens (later tokens repeat them)
  int64_t rows = 0;          // bf16 [K + 1][T][H], the routed rows and the shared slot
  int64_t routing = 0;       // [T, K]: int32 slot indices (twice: all active, ~10% off), fp32 weights
  int64_t y = 0;             // bf16 [T, H] (twice: the engine's output, the benchmarked one)
  int64_t copy_ceiling = 0;  // bytes the copy ceiling copies (half the all-active case's bytes moved)
};
CombineBenchSizes combine_bench_sizes(const CombineBenchOptions& options);

// The plans: device and host bytes by item for the largest size of the sweep, against the GPU's
// free memory (the query registered with set_device_memory_query) and the host's available memory.
MemoryPlan plan_gemm_bench_memory(const GemmBenchOptions& options);
MemoryPlan plan_qdq_bench_memory(const QdqBenchOptions& options, int64_t l2_bytes);
MemoryPlan plan_combine_bench_memory(const CombineBenchOptions& options);

// `moefq bench moe`: the preset as one rank of EP `ep` runs it, E / ep local experts with every
// token routed to K of them (bad input naming both where E does not split so).
MoeConfig moe_rank_config(const std::string& preset, int64_t ep);
// One preset's plan at the sweep's largest token count: the engine's expert weights, symmetric
// buffer and routing arrays, the shared expert's own rows (it runs unfused, on a second stream),
// the fake quantizer's, the benchmark's inputs and outputs, and what the ceilings (copy, cuBLASLt;
// they run and free their buffers before the layer is allocated) need beyond all that.
MemoryPlan plan_moe_bench_memory(const MoeBenchOptions& options, const std::string& preset);
// The same for one of `ranks` real ranks (run_bench_moe_ranks), of options.presets[preset_index]:
// the engine's buffer is a window of the communicator, which keeps the windows of the all-to-all
// ceiling and of the presets before it; a second engine runs the same per-GPU work alone. What
// NCCL itself takes is left to the headroom.
MemoryPlan plan_moe_ranks_bench_memory(const MoeBenchOptions& options, int64_t ranks, size_t preset_index);

// Each benchmark's plan checked: refused (bad input, exit 2) with the bytes needed and available,
// the options to shrink and the plan, when it needs more than kUsableFraction of the GPU's free
// memory or of the host's available memory (an unknown figure, 0, is not checked).
void check_gemm_bench_memory(const GemmBenchOptions& options);
void check_qdq_bench_memory(const QdqBenchOptions& options, int64_t l2_bytes);
void check_combine_bench_memory(const CombineBenchOptions& options);
// Every preset's plan (they run one after another, each freeing its layer); real_ranks > 0: the
// plan of one of that many real ranks.
void check_moe_bench_memory(const MoeBenchOptions& options, int64_t real_ranks = 0);

}  // namespace moefq::bench
