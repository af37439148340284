// The compute ceiling the GPU benchmarks report their figures against: cuBLASLt's FP8 GEMM
// (e4m3 x e4m3, fp32 accumulation, bf16 out, the TN layout FP8 needs), measured in the same run.
#pragma once

#include <cstdint>

namespace moefq::bench {

// Median time in microseconds of one cuBLASLt FP8 GEMM D[m, n] = A[m, k] * B[n, k]^T (row-major
// A, B, D), with cuBLASLt's heuristic's first algorithm. `a` and `b` (device, e4m3): the operands
// to multiply, so that a ceiling runs on the same data as the kernel it is compared with (the
// tensor cores' power, and with it the clock under the power limit, depends on the data); null:
// constant operands (every a 1.0, every b 0.5), which run at a higher clock than any real GEMM.
double cublaslt_fp8_gemm_us(int64_t m, int64_t n, int64_t k, const uint8_t* a = nullptr, const uint8_t* b = nullptr);

}  // namespace moefq::bench
