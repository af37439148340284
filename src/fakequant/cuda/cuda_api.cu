// The public face of include/moefq/cuda.h over the kernels' launchers (register_cuda_backends is
// in cuda_fake_quant.cu, beside the layer it registers).
#include "moefq/cuda.h"

#include <cuda_runtime.h>

#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "engine/cuda/combine_kernels.cuh"
#include "engine/cuda/router_kernels.cuh"
#include "quant/cuda/qdq_kernels.cuh"

namespace moefq::cuda {

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

void qdq_device(Format f, DType dt, const void* x, void* y, int64_t rows, int64_t cols, float* d_amax, bool dynamic,
                Stream stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dynamic) {
    MOEFQ_CUDA_CHECK(cudaMemsetAsync(d_amax, 0, sizeof(float), s));
    launch_amax(dt, x, rows * cols, d_amax, s);
  }
  launch_qdq(f, dt, x, y, rows, cols, d_amax, s);
}

void combine_qdq_resum(const DeviceCombineRows& rows, std::optional<Format> format, const float* d_amax, bf16* y,
                       Stream stream) {
  CombineRows r;
  r.buffer = reinterpret_cast<const uint8_t*>(rows.rows);
  r.combine_offset = 0;
  r.max_tokens = rows.num_tokens;
  r.top_k = rows.top_k;
  r.hidden = rows.hidden;
  r.fused_shared = rows.shared != nullptr;
  r.shared = rows.shared;
  r.topk_idx = rows.topk_idx;
  r.topk_weights = rows.topk_weights;
  r.num_tokens = rows.num_tokens;
  launch_combine_qdq(r, format.has_value(), format.value_or(Format::kFp8), d_amax, CombineCheck{}, y,
                     static_cast<cudaStream_t>(stream));
}

struct DeviceRouter::Impl {
  MoeConfig cfg;
  DeviceBuffer<float> gate, bias;  // bias: empty (null) without one
};

DeviceRouter::DeviceRouter(const MoeConfig& cfg, const std::vector<float>& gate, const std::vector<float>& bias)
    : impl_(std::make_unique<Impl>()) {
  impl_->cfg = cfg;
  impl_->gate = DeviceBuffer<float>(gate);
  if (!bias.empty()) impl_->bias = DeviceBuffer<float>(bias);
}

DeviceRouter::~DeviceRouter() = default;

size_t DeviceRouter::workspace_bytes(int64_t num_tokens) const { return route_workspace_bytes(impl_->cfg, num_tokens); }

void DeviceRouter::route(const bf16* x, int64_t num_tokens, void* workspace, int32_t* topk_idx, float* topk_weights,
                         Stream stream) const {
  launch_route(impl_->cfg, x, num_tokens, impl_->gate.get(), impl_->bias.get(), nullptr, workspace, topk_idx,
               topk_weights, static_cast<cudaStream_t>(stream));
}

}  // namespace moefq::cuda
