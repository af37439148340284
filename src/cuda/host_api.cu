#include "cuda/host_api.h"

#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "cuda/qdq_kernels.cuh"

namespace moefq::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the "no device" status
    return 0;
  }
  return n;
}

std::string device_description() {
  int dev = 0, driver = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  MOEFQ_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  MOEFQ_CUDA_CHECK(cudaDriverGetVersion(&driver));
  return detail::concat(static_cast<const char*>(p.name), " (sm_", p.major, p.minor, ", ", p.multiProcessorCount,
                        " SMs, ", double(p.totalGlobalMem) / double(1ull << 30), " GiB), CUDA driver ", driver / 1000,
                        ".", (driver % 1000) / 10);
}

float qdq_host_tensor(Format f, DType dt, const void* x, void* y, int64_t rows, int64_t cols,
                      std::optional<float> amax) {
  const size_t bytes = size_t(rows * cols) * (dt == DType::kBF16 ? 2 : 4);
  DeviceBuffer<uint8_t> dx(bytes), dy(bytes);
  DeviceBuffer<float> damax(std::vector<float>{amax.value_or(0.0f)});
  if (bytes) MOEFQ_CUDA_CHECK(cudaMemcpy(dx.get(), x, bytes, cudaMemcpyHostToDevice));
  if (!amax) launch_amax(dt, dx.get(), rows * cols, damax.get(), nullptr);
  launch_qdq(f, dt, dx.get(), dy.get(), rows, cols, damax.get(), nullptr);
  if (bytes) MOEFQ_CUDA_CHECK(cudaMemcpy(y, dy.get(), bytes, cudaMemcpyDeviceToHost));
  return damax.download()[0];
}

}  // namespace moefq::cuda
