// Helpers of the CUDA engine and fake-quant suites: a test::Problem's tensors on the device, the
// DeviceBatch views of them, downloads, and SKIP_WITHOUT_GPU() for tests that need a device.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "cuda_base/cuda_check.h"
#include "engine/cuda/cuda_engine.cuh"
#include "cuda_base/device_buffer.h"
#include "moefq/qdq.h"
#include "gpu_test.h"
#include "moe_test_util.h"


namespace moefq::test {

// The problem's inputs in device memory (sized for max_tokens per rank, so new inputs of up to
// that many tokens can be copied into the same buffers, as a CUDA graph needs), and outputs.
struct DeviceProblem {
  int64_t R = 0, H = 0, K = 0;
  std::vector<int64_t> n;
  std::vector<cuda::DeviceBuffer<bf16>> x, y;
  std::vector<cuda::DeviceBuffer<int32_t>> idx;
  std::vector<cuda::DeviceBuffer<float>> wt;

  DeviceProblem(const Problem& p, int64_t max_tokens) : R(p.R), H(p.H), K(p.K), n(p.n) {
    for (int64_t r = 0; r < R; ++r) {
      x.emplace_back(size_t(max_tokens * H));
      y.emplace_back(size_t(max_tokens * H));
      idx.emplace_back(size_t(max_tokens * K));
      wt.emplace_back(size_t(max_tokens * K));
    }
    load(p);
  }
  // Copies the problem's inputs into the buffers (same R, at most max_tokens per rank) and
  // clears the outputs.
  void load(const Problem& p) {
    n = p.n;
    for (size_t r = 0; r < size_t(R); ++r) {
      MOEFQ_CUDA_CHECK(cudaMemcpy(x[r].get(), p.x[r].data(), p.x[r].size() * 2, cudaMemcpyHostToDevice));
      MOEFQ_CUDA_CHECK(cudaMemcpy(idx[r].get(), p.idx[r].data(), p.idx[r].size() * 4, cudaMemcpyHostToDevice));
      MOEFQ_CUDA_CHECK(cudaMemcpy(wt[r].get(), p.wt[r].data(), p.wt[r].size() * 4, cudaMemcpyHostToDevice));
      MOEFQ_CUDA_CHECK(cudaMemset(y[r].get(), 0xff, y[r].bytes()));
    }
  }
  std::vector<cuda::DeviceBatch> batches() {
    std::vector<cuda::DeviceBatch> b;
    for (size_t r = 0; r < size_t(R); ++r) b.push_back({x[r].get(), n[r], idx[r].get(), wt[r].get(), y[r].get()});
    return b;
  }
  std::vector<std::vector<bf16>> outputs() const {
    std::vector<std::vector<bf16>> out;
    for (size_t r = 0; r < size_t(R); ++r) {
      out.emplace_back(size_t(n[r] * H));
      MOEFQ_CUDA_CHECK(cudaMemcpy(out.back().data(), y[r].get(), out.back().size() * 2, cudaMemcpyDeviceToHost));
    }
    return out;
  }
};

// A rank's symmetric buffer, copied to the host.
inline std::vector<uint8_t> download_buffer(const cuda::CudaEngine& e, int64_t rank) {
  std::vector<uint8_t> b(e.layout().total_bytes());
  MOEFQ_CUDA_CHECK(cudaMemcpy(b.data(), e.buffer(rank), b.size(), cudaMemcpyDeviceToHost));
  return b;
}

// docs/engine.md's combine of the rows in a downloaded buffer: the re-sum the layout check computes.
inline std::vector<bf16> resum_rows(const BufferLayout& l, const std::vector<uint8_t>& buf, const Problem& p, int64_t r,
                                    bool fused) {
  return qdq_resum(buf.data(), l.combine_offset(), l.shape().max_tokens, fused, p, r, std::nullopt, 0.0f);
}

}  // namespace moefq::test
