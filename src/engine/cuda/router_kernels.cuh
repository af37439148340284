// The MoE router on the GPU, bit-identical to moefq::route() (router.h): the same ids and the same
// weight bits for the same inputs. Logits in the documented lane order without FMA, then the
// shared per-token rules of engine/router_rules.h. No host synchronisation; capturable in a graph.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "moefq/moe_config.h"
#include "moefq/numerics.h"

namespace moefq::cuda {

// Bytes of device workspace launch_route needs for num_tokens tokens: the token-minor scores
// [E][round_up(num_tokens, 64)] fp32, plus the group scores [n_group][same] when n_group > 1.
// The workspace holds nothing between calls (no clearing needed).
size_t route_workspace_bytes(const MoeConfig& cfg, int64_t num_tokens);

// Routes num_tokens tokens; equal to route() byte for byte.
// x: [num_tokens, H] bf16 device, 16-byte aligned; gate: [E, H] fp32 device, 16-byte aligned;
// bias: [E] fp32 device or null (the noaux_tc correction bias; ignored unless cfg.noaux_tc; null =
// zero bias); padding: [num_tokens] uint8 device or null (non-zero = padding token: all slots -1,
// weights +0); workspace: route_workspace_bytes(cfg, num_tokens) bytes of device memory, 16-byte
// aligned. Outputs: topk_idx [num_tokens, K] int32, topk_weights [num_tokens, K] fp32 (device).
// Throws moefq::Error for a bad config or pointer; enqueues two kernels on stream, nothing else.
void launch_route(const MoeConfig& cfg, const bf16* x, int64_t num_tokens, const float* gate, const float* bias,
                  const uint8_t* padding, void* workspace, int32_t* topk_idx, float* topk_weights,
                  cudaStream_t stream);

}  // namespace moefq::cuda
