// The GPU benchmarks in a build without CUDA: each fails with a message that says so.
#ifndef MOEFQ_HAS_CUDA
#include "bench/bench.h"
#include "bench/bench_combine.h"
#include "bench/bench_gemm.h"
#include "bench/bench_moe.h"
#include "moefq/errors.h"

namespace moefq::bench {
namespace {

[[noreturn]] void no_cuda(const char* name) {
  MOEFQ_FAIL(ErrorKind::kBadInput, "moefq bench ", name, ": this moefq was built without CUDA (no nvcc was found)");
}

}  // namespace

int run_bench_qdq(const QdqBenchOptions&) { no_cuda("qdq"); }
int run_bench_moe(const MoeBenchOptions& o) {
  check_moe_bench_options(o);  // as the CUDA build does, before it looks for a device
  no_cuda("moe");
}
int run_bench_moe_ranks(const MoeBenchOptions&) { no_cuda("moe"); }
int run_bench_combine(const CombineBenchOptions&) { no_cuda("combine"); }
int run_bench_gemm(const GemmBenchOptions&) { no_cuda("gemm"); }
int run_bench_gemm_bf16(const GemmBenchOptions&) { no_cuda("gemm"); }

}  // namespace moefq::bench
#endif
