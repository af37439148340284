// The CUDA library's public face (moefq_cuda, built when nvcc is found; callers build their uses
// under MOEFQ_HAS_CUDA), for code without CUDA types: the Python binding, the CLI, the benchmarks.
// Device pointers are plain pointers, streams void* (cuda_device.h). Every operation here is
// bit-identical to its CPU reference (qdq.h, combine_qdq.h, router.h). Implemented at the floor of
// the fake-quantized layer (src/fakequant/cuda/cuda_api.cu); the layers below use their own headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "moefq/cuda_device.h"
#include "moefq/moe_config.h"
#include "moefq/numerics.h"
#include "moefq/qdq.h"

namespace moefq::cuda {

// Registers the CUDA implementation of the fake-quantized layer as FakeQuantMoe::make's factory
// for LayerDevice::kCuda (fake_quant_moe.h). Idempotent.
void register_cuda_backends();

// QDQ of a host tensor on the GPU: upload, amax (max |x| on the device when amax is nullopt),
// QDQ, download. x, y: [rows, cols] host tensors of dtype dt. Returns the amax used.
float qdq_host_tensor(Format f, DType dt, const void* x, void* y, int64_t rows, int64_t cols,
                      std::optional<float> amax);

// y = QDQ_f(x) on device tensors, enqueued on `stream` (no synchronisation, no allocation:
// capturable in a CUDA graph). x, y: [rows, cols] of dtype dt (y may alias x). d_amax: device
// [1] fp32, the global amax of fp8, nvfp4 and int8 (may be null for mxfp8/mxfp4); with dynamic it
// is first overwritten with max |x| over the non-NaN elements.
void qdq_device(Format f, DType dt, const void* x, void* y, int64_t rows, int64_t cols, float* d_amax, bool dynamic,
                Stream stream);

// The combine quantizer (QDQ of each active routed row, then the re-sum) on device tensors; the
// device form of combine_qdq_ref (combine_qdq.h).
struct DeviceCombineRows {
  const bf16* rows = nullptr;  // device [top_k, num_tokens, hidden] bf16, 16-byte aligned
  int64_t top_k = 0;           // K, 1..32
  int64_t num_tokens = 0, hidden = 0;  // hidden: a multiple of 32
  const int32_t* topk_idx = nullptr;   // device [num_tokens, K]; a negative id marks an inactive slot
  const bf16* shared = nullptr;        // device [num_tokens, H] bf16 added last, unquantized; null: none
  // combine_weighting after: device [num_tokens, K] fp32 router weights; null: before (the rows
  // are already weighted).
  const float* topk_weights = nullptr;
};
// y: device [num_tokens, H] bf16, not overlapping the rows. format nullopt: the plain re-sum.
// d_amax: device [1] fp32 for fp8, nvfp4 and int8. Enqueued on `stream`; capturable.
void combine_qdq_resum(const DeviceCombineRows& rows, std::optional<Format> format, const float* d_amax, bf16* y,
                       Stream stream);

// A layer's router on the current device, equal to route() (router.h) byte for byte.
class DeviceRouter {
 public:
  // gate: [E, H] fp32; bias: [E] fp32 (the noaux_tc correction bias) or empty.
  DeviceRouter(const MoeConfig& cfg, const std::vector<float>& gate, const std::vector<float>& bias);
  ~DeviceRouter();
  DeviceRouter(const DeviceRouter&) = delete;
  DeviceRouter& operator=(const DeviceRouter&) = delete;

  // Bytes of device workspace route() needs for num_tokens tokens (it holds nothing between calls).
  size_t workspace_bytes(int64_t num_tokens) const;
  // x: device [num_tokens, H] bf16; workspace: workspace_bytes(num_tokens) device bytes; outputs:
  // device topk_idx [num_tokens, K] int32, topk_weights [num_tokens, K] fp32. Enqueued on `stream`.
  void route(const bf16* x, int64_t num_tokens, void* workspace, int32_t* topk_idx, float* topk_weights,
             Stream stream) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moefq::cuda
