#include "bench/ceilings.cuh"

#include <cublasLt.h>

#include "bench/bench_cuda_util.cuh"
#include "cuda/device_buffer.h"
#include "moefq/errors.h"

namespace moefq::bench {
namespace {

#define MOEFQ_CUBLAS_CHECK(call)                                                           \
  do {                                                                                     \
    const cublasStatus_t st_ = (call);                                                     \
    MOEFQ_ASSERT(st_ == CUBLAS_STATUS_SUCCESS, #call, " failed with cuBLAS status ", int(st_)); \
  } while (0)

}  // namespace

double cublaslt_fp8_gemm_us(int64_t m, int64_t n, int64_t k, const uint8_t* a_in, const uint8_t* b_in) {
  using cuda::DeviceBuffer;
  DeviceBuffer<uint8_t> a_const(a_in ? 0 : size_t(m * k)), b_const(b_in ? 0 : size_t(n * k));
  DeviceBuffer<uint16_t> d(size_t(m * n));
  if (!a_in) MOEFQ_CUDA_CHECK(cudaMemset(a_const.get(), 0x38, a_const.bytes()));  // e4m3 1.0
  if (!b_in) MOEFQ_CUDA_CHECK(cudaMemset(b_const.get(), 0x30, b_const.bytes()));  // e4m3 0.5
  const uint8_t* a = a_in ? a_in : a_const.get();
  const uint8_t* b = b_in ? b_in : b_const.get();
  DeviceBuffer<uint8_t> workspace(size_t(32) << 20);
  cublasLtHandle_t lt;
  MOEFQ_CUBLAS_CHECK(cublasLtCreate(&lt));
  // Column-major view: D^T [n, m] = B [n, k] (stored k x n, op T) * A^T [k, m] (stored k x m).
  cublasLtMatmulDesc_t op;
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t t = CUBLAS_OP_T, nop = CUBLAS_OP_N;
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nop, sizeof nop));
  cublasLtMatrixLayout_t la, lb, lc;
  MOEFQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, uint64_t(k), uint64_t(n), k));
  MOEFQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, uint64_t(k), uint64_t(m), k));
  MOEFQ_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, uint64_t(n), uint64_t(m), n));
  cublasLtMatmulPreference_t pref;
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t ws = workspace.bytes();
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  MOEFQ_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &heur, &found));
  MOEFQ_ASSERT(found > 0, "cuBLASLt has no FP8 GEMM algorithm for ", m, " x ", n, " x ", k);
  const float alpha = 1.0f, beta = 0.0f;
  const double us = median_us(
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

}  // namespace moefq::bench
