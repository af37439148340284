// The GPU tests' common guard: GPU tests are built whenever nvcc is present and skip themselves when
// no CUDA device is visible (CI has none).
#pragma once

#include <gtest/gtest.h>

#include "moefq/cuda_device.h"

#define SKIP_WITHOUT_GPU() \
  if (::moefq::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"

#include <cuda_runtime.h>

#include "cuda_base/cuda_check.h"

namespace moefq::test {

// A CUDA graph of what enqueue(stream) launches, captured on a stream of its own (non-blocking,
// thread-local capture mode); launch() replays it there.
class CapturedGraph {
 public:
  template <typename F>
  explicit CapturedGraph(F&& enqueue) {
    MOEFQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MOEFQ_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    enqueue(stream_);
    MOEFQ_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph_));
    MOEFQ_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedGraph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
    cudaStreamDestroy(stream_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  void launch() const { MOEFQ_CUDA_CHECK(cudaGraphLaunch(exec_, stream_)); }
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace moefq::test
