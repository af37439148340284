#include "moefq/cuda_device.h"

#include <cuda_runtime.h>

#include "cuda_base/cuda_check.h"

namespace moefq::cuda {
namespace {

cudaStream_t as_cuda(Stream s) { return static_cast<cudaStream_t>(s); }

}  // namespace

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

int current_device() {
  int dev = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  return dev;
}

DeviceGuard::DeviceGuard(int device) : device_(device) {
  MOEFQ_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device_) MOEFQ_CUDA_CHECK(cudaSetDevice(device_));
}

DeviceGuard::~DeviceGuard() {
  if (previous_ != device_) cudaSetDevice(previous_);
}

bool stream_capturing(Stream stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MOEFQ_CUDA_CHECK(cudaStreamIsCapturing(as_cuda(stream), &capturing));
  return capturing != cudaStreamCaptureStatusNone;
}

void copy_to_host(void* host, const void* device, size_t bytes, Stream stream) {
  if (bytes == 0) return;
  MOEFQ_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, as_cuda(stream)));
  MOEFQ_CUDA_CHECK(cudaStreamSynchronize(as_cuda(stream)));
}

StreamMark::StreamMark() {
  cudaEvent_t e = nullptr;
  MOEFQ_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  event_ = e;
}

StreamMark::~StreamMark() {
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

void StreamMark::record(Stream stream) {
  MOEFQ_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), as_cuda(stream)));
}

void StreamMark::wait(Stream stream) const {
  MOEFQ_CUDA_CHECK(cudaStreamWaitEvent(as_cuda(stream), static_cast<cudaEvent_t>(event_), 0));
}

}  // namespace moefq::cuda
