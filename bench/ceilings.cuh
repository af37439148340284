// The compute ceiling the GPU benchmarks report their figures against: cuBLASLt's FP8 GEMM
// (e4m3 x e4m3, fp32 accumulation, bf16 out, the TN layout FP8 needs), measured in the same run.
#pragma once

#include <cstdint>

namespace moefq::bench {

// Median time in microseconds of one cuBLASLt FP8 GEMM D[m, n] = A[m, k] * B[n, k]^T (row-major
// A, B, D), with cuBLASLt's heuristic's first algorithm.
double cublaslt_fp8_gemm_us(int64_t m, int64_t n, int64_t k);

}  // namespace moefq::bench
