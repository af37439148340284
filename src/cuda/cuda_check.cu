#include "cuda/cuda_check.h"

namespace moefq::cuda {
int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" status
    return 0;
  }
  return n;
}
}  // namespace moefq::cuda
