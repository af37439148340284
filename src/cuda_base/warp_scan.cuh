// The warp scan behind the kernels' small prefix sums: the dispatch's list positions, the plan's
// pool offsets and the grouped GEMM's tile list. Device code only.
#pragma once

namespace moefq::cuda {

// The sum of v over lanes 0 .. lane of the warp, inclusive; every lane of the warp calls it.
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

}  // namespace moefq::cuda
