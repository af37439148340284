// A typed device allocation (cudaMalloc), freed on destruction; copies to and from host vectors.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "cuda_base/cuda_check.h"

namespace moefq::cuda {

// A cudaMemcpy from pageable host memory returns once the bytes are staged, before their DMA has
// landed, and a cudaMemset returns before it ran; both go to the legacy default stream, which the
// engine's and the eval's non-blocking streams are not ordered after. Waiting for the legacy
// stream lands them, so a kernel queued afterwards on any stream reads the new bytes.
inline void land_host_copies() { MOEFQ_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy)); }

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count) MOEFQ_CUDA_CHECK(cudaMalloc(&ptr_, count * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(count_, o.count_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }

  T* get() const { return ptr_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  // The bytes are on the device when upload returns, for work on any stream (see land_host_copies).
  void upload(const std::vector<T>& host) {
    MOEFQ_ASSERT(host.size() == count_, "DeviceBuffer::upload: size mismatch");
    if (!count_) return;
    MOEFQ_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice));
    land_host_copies();
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_) MOEFQ_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

}  // namespace moefq::cuda
