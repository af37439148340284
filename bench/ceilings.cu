#include "bench/ceilings.cuh"

#include <cublasLt.h>

#include <cmath>
#include <cstdio>

#include "bench/bench_cuda_util.cuh"
#include "bench/bench_memory.h"
#include "cuda_base/device_buffer.h"
#include "moefq/errors.h"

namespace moefq::bench {
namespace {

#define MOEFQ_CUBLAS_CHECK(call)                                                           \
  do {                                                                                     \
    const cublasStatus_t st_ = (call);                                                     \
    MOEFQ_ASSERT(st_ == CUBLAS_STATUS_SUCCESS, #call, " failed with cuBLAS status ", int(st_)); \
  } while (0)

}  // namespace

namespace {

// One cuBLASLt GEMM of `type` operands (e4m3 or bf16; fp32 accumulation, bf16 out), timed as
// cublaslt_fp8_gemm_us describes; constant operands only for e4m3.
double lt_gemm_us(int64_t m, int64_t n, int64_t k, const uint8_t* a_in, const uint8_t* b_in, int batch,
                  cudaDataType_t type) {
  using cuda::DeviceBuffer;
  const bool fp8 = type == CUDA_R_8F_E4M3;
  const char* kind = fp8 ? "FP8" : "BF16";
  MOEFQ_ASSERT(batch >= 1, "cuBLASLt ceiling: batch must be positive");
  // Sized as the benchmarks' memory plans count them.
  const CublasltCeilingSizes sz =
      cublaslt_ceiling_sizes(m, n, k, a_in != nullptr, b_in != nullptr, batch, fp8 ? 1 : 2);
  DeviceBuffer<uint8_t> a_const(size_t(sz.a_const)), b_const(size_t(sz.b_const));
  DeviceBuffer<uint16_t> d(size_t(sz.d));
  // Constant operands: e4m3 1.0 and 0.5; bf16 0x3F3F (0.746) in both, a value a byte fill makes.
  if (!a_in) MOEFQ_CUDA_CHECK(cudaMemset(a_const.get(), fp8 ? 0x38 : 0x3F, a_const.bytes()));
  if (!b_in) MOEFQ_CUDA_CHECK(cudaMemset(b_const.get(), fp8 ? 0x30 : 0x3F, b_const.bytes()));
  const uint8_t* a = a_in ? a_in : a_const.get();
  const uint8_t* b = b_in ? b_in : b_const.get();
  DeviceBuffer<uint8_t> workspace(size_t(sz.workspace));
  cublasLtHandle_t lt;
  MOEFQ_CUBLAS_CHECK(cublasLtCreate(&lt));
  // Column-major view: D^T [n, m] = B [n, k] (stored k x n, op T) * A^T [k, m] (stored k x m).
  cublasLtMatmulDesc_t op;
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t t = CUBLAS_OP_T, nop = CUBLAS_OP_N;
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nop, sizeof nop));
  cublasLtMatrixLayout_t la, lb, lc;
  MOEFQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, type, uint64_t(k), uint64_t(n), k));
  MOEFQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, type, uint64_t(k), uint64_t(m), k));
  MOEFQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, uint64_t(n), uint64_t(m), n));
  if (batch > 1) {
    // Strided batch: instance i multiplies A rows [i m, (i + 1) m) by B rows [i n, (i + 1) n).
    const auto batched = [&](cublasLtMatrixLayout_t l, int64_t stride) {
      MOEFQ_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch));
      MOEFQ_CUBLAS_CHECK(
          cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
    };
    batched(la, n * k);
    batched(lb, m * k);
    batched(lc, m * n);
  }
  cublasLtMatmulPreference_t pref;
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = workspace.bytes();
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &found);
  const bool offered = hs == CUBLAS_STATUS_SUCCESS && found > 0;
  // A batched ceiling that this cuBLASLt does not offer is reported as missing (NaN), not fatal:
  // the benchmark's own figures stand without it.
  MOEFQ_ASSERT(batch > 1 || offered, "cuBLASLt has no ", kind, " GEMM algorithm for ", m, " x ", n, " x ", k,
               " (status ", int(hs), ")");
  if (!offered)
    std::fprintf(stderr, "cuBLASLt offers no batched %s GEMM for %d x %lld x %lld x %lld (status %d): no ceiling\n",
                 kind, batch, (long long)m, (long long)n, (long long)k, int(hs));
  const float alpha = 1.0f, beta = 0.0f;
  const double us = !offered ? std::nan("") : median_us(
      [&](int, cudaStream_t s) {
        MOEFQ_CUBLAS_CHECK(cublasLtMatmul(lt, op, &alpha, b, la, a, lb, &beta, d.get(), lc, d.get(), lc,
                                          &heur.algo, workspace.get(), ws, s));
      },
      5, 7);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  return us;
}

}  // namespace

double cublaslt_fp8_gemm_us(int64_t m, int64_t n, int64_t k, const uint8_t* a, const uint8_t* b, int batch) {
  return lt_gemm_us(m, n, k, a, b, batch, CUDA_R_8F_E4M3);
}

double cublaslt_bf16_gemm_us(int64_t m, int64_t n, int64_t k, const void* a, const void* b, int batch) {
  return lt_gemm_us(m, n, k, static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b), batch, CUDA_R_16BF);
}

}  // namespace moefq::bench
