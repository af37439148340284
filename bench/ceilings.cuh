// The compute ceilings the GPU benchmarks report their figures against: cuBLASLt's FP8 GEMM
// (e4m3 x e4m3, fp32 accumulation, bf16 out, the TN layout FP8 needs) and its bf16 GEMM, measured
// in the same run.
#pragma once

#include <cstdint>

namespace moefq::bench {

// Median time in microseconds of one cuBLASLt FP8 GEMM D[m, n] = A[m, k] * B[n, k]^T (row-major
// A, B, D), with cuBLASLt's heuristic's first algorithm. `a` and `b` (device, e4m3): the operands
// to multiply, so that a ceiling runs on the same data as the kernel it is compared with (the
// tensor cores' power, and with it the clock under the power limit, depends on the data); null:
// constant operands (every a 1.0, every b 0.5), which run at a higher clock than any real GEMM.
// batch > 1: `batch` such GEMMs in one strided-batched call, instance i on A rows [i m, (i + 1) m)
// and B rows [i n, (i + 1) n): a grouped GEMM's ceiling with every group's own weights, read from
// memory as the grouped kernel reads them (equal rows per group); NaN where cuBLASLt offers no
// algorithm for the batch.
double cublaslt_fp8_gemm_us(int64_t m, int64_t n, int64_t k, const uint8_t* a = nullptr, const uint8_t* b = nullptr,
                            int batch = 1);
// The same with bf16 operands (bf16 x bf16, fp32 accumulation, bf16 out): the ceiling of the
// bf16-weight grouped GEMMs and layers with staging none. `a` and `b` (device, bf16) or null:
// constant operands (every element 0x3F3F, 0.746).
double cublaslt_bf16_gemm_us(int64_t m, int64_t n, int64_t k, const void* a, const void* b, int batch = 1);

}  // namespace moefq::bench
