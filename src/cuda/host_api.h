// The CUDA backend as seen from CPU-only code (the CLI): no CUDA types in this header.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "moefq/qdq.h"

namespace moefq::cuda {

// Number of usable CUDA devices; 0 when there is no driver or no GPU (never throws).
int device_count();
// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB), driver 13.0" of the current device.
std::string device_description();

// Registers the CUDA expert back-ends ("mega_moe_cuda": the CUDA engine behind the host-tensor
// ExpertBackend interface) with the registry of expert_backend.h. Idempotent. Defined with the
// back-ends, in cuda_backend.cu.
void register_cuda_backends();

// QDQ of a host tensor on the GPU: upload, amax (max |x| on the device when amax is nullopt),
// QDQ, download. x, y: [rows, cols] host tensors of dtype dt. Returns the amax used.
float qdq_host_tensor(Format f, DType dt, const void* x, void* y, int64_t rows, int64_t cols,
                      std::optional<float> amax);

}  // namespace moefq::cuda
