// MOEFQ_HD, the qualifiers of every numerics function: host+device and force-inlined under nvcc,
// plain `inline` otherwise, so a CPU-only translation unit needs no CUDA header.
#pragma once

#if defined(__CUDACC__)
#define MOEFQ_HD __host__ __device__ __forceinline__
#else
#define MOEFQ_HD inline
#endif
