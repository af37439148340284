// The GPU as code without CUDA types sees it: device and stream queries of the CUDA library
// (moefq_cuda; callers build them under MOEFQ_HAS_CUDA). A stream is a cudaStream_t passed as a
// void* (nullptr: the legacy default stream), as Python's torch.cuda.Stream.cuda_stream gives it.
// The bottom floor of the CUDA half (src/cuda_base): every CUDA layer may use it.
#pragma once

#include <cstddef>
#include <string>

namespace moefq::cuda {

// A cudaStream_t.
using Stream = void*;

// Number of usable CUDA devices; 0 when there is no driver or no GPU (never throws).
int device_count();
// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB), driver 13.0" of the current device.
std::string device_description();
// The calling thread's current device.
int current_device();

// Makes `device` current for a scope (the caller's tensors may live on another device than the
// current one); restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0, device_ = 0;
};

// Whether `stream` is being captured into a CUDA graph (work queued on it then runs at replay).
bool stream_capturing(Stream stream);

// Copies `bytes` from device memory to host memory in order on `stream` and waits for it.
void copy_to_host(void* host, const void* device, size_t bytes, Stream stream);

// A mark at the end of the work queued on a stream so far (a CUDA event without timing): another
// stream can wait for it on the GPU. Created on the current device.
class StreamMark {
 public:
  StreamMark();
  ~StreamMark();
  StreamMark(const StreamMark&) = delete;
  StreamMark& operator=(const StreamMark&) = delete;

  void record(Stream stream);          // marks the end of what `stream` holds now
  void wait(Stream stream) const;      // work queued on `stream` from now on waits for the mark

 private:
  void* event_ = nullptr;  // cudaEvent_t
};

}  // namespace moefq::cuda
