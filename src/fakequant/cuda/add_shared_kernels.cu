#include "fakequant/cuda/add_shared_kernels.cuh"

#include <algorithm>

#include "cuda_base/cuda_check.h"

namespace moefq::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void add_shared_kernel(const bf16* routed, const bf16* shared, bf16* out, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i].bits =
        shared ? bf16_round(add_rn(bf16_to_f32(routed[i].bits), bf16_to_f32(shared[i].bits))) : routed[i].bits;
}

}  // namespace

void launch_add_shared(const bf16* routed, const bf16* shared, bf16* out, int64_t n, int64_t H, cudaStream_t stream) {
  const int64_t total = n * H;
  if (total == 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535));
  add_shared_kernel<<<blocks, kThreads, 0, stream>>>(routed, shared, out, total);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

}  // namespace moefq::cuda
