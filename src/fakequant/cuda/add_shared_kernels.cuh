// The model's output on the GPU from the routed output and the separately run shared expert
// (FakeQuantMoe::add_shared's CUDA form): one fp32 sum, one bf16 rounding. A plain host launcher.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moefq/numerics.h"

namespace moefq::cuda {

// out = bf16(float(routed) + float(shared)) (one RN rounding, as the model adds them), or out =
// routed when shared is null. routed, shared, out: [n, H] bf16 (out may be routed).
void launch_add_shared(const bf16* routed, const bf16* shared, bf16* out, int64_t n, int64_t H, cudaStream_t stream);

}  // namespace moefq::cuda
