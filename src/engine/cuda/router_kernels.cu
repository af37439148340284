// The MoE router on the GPU (router_kernels.cuh). Two kernels:
//  1. router_logits_kernel: a tiled fp32 "GEMM" x [n, H] . gate [E, H]^T in the documented order
//     (router.h): the 8 lanes of a logit (h mod 8) live in 8 consecutive threads, each adding its
//     products in ascending h with __fmul_rn / __fadd_rn (no FMA); xor-1, -2, -4 shuffles then
//     combine them as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) (IEEE addition is commutative, so every
//     thread of the 8 holds the same bits). The epilogue applies the elementwise score function
//     and stores the scores token-minor, [E][n_pad].
//  2. router_select_kernel: one thread per token runs router_rules::route_scores, the very code
//     the CPU router runs (softmax, groups, top-k, weights).
#include "engine/cuda/router_kernels.cuh"

#include "cuda_base/cuda_check.h"
#include "engine/router_rules.h"

namespace moefq::cuda {
namespace {

using router_rules::Rules;

// Logit tiles: a block computes kBM tokens x kBN experts, stepping through H by kBK. Each of its
// 32 thread groups (8 threads, one per lane h mod 8) owns a kTM x kTN sub-tile.
constexpr int kThreads = 256;
constexpr int kBM = 64, kBN = 32, kBK = 64;
constexpr int kTM = 8, kTN = 8;
constexpr int kLanes = router_rules::kLogitLanes;
static_assert(kThreads / kLanes == (kBM / kTM) * (kBN / kTN), "one thread group per sub-tile");
static_assert(kBK % kLanes == 0 && kTN == kLanes, "the epilogue gives each lane one expert column");
// Shared tiles are h-major ([kBK][kB* + 4]): a thread reads kTM (kTN) consecutive floats of one h
// as float4s; the +4 padding puts the 8 lanes' rows on distinct banks (8 x 4 words = 32 banks).
constexpr int kXStride = kBM + 4, kGStride = kBN + 4;
constexpr int kSelectThreads = 32;
constexpr int64_t kTokenPad = kBM;  // the scores' token stride is a multiple of this

int64_t padded_tokens(int64_t n) { return (n + kTokenPad - 1) / kTokenPad * kTokenPad; }

__global__ void __launch_bounds__(kThreads, 2)
    router_logits_kernel(const bf16* __restrict__ x, const float* __restrict__ gate, int64_t num_tokens,
                         int64_t num_experts, int64_t hidden, ScoringFunc scoring, float* __restrict__ scores,
                         int64_t n_pad) {
  __shared__ __align__(16) float xs[kBK * kXStride];  // [h][token], x as fp32 (exact)
  __shared__ __align__(16) float gs[kBK * kGStride];  // [h][expert]
  const int tid = int(threadIdx.x);
  const int lane = tid & (kLanes - 1);   // this thread's logit lane: h = lane mod 8
  const int group = tid / kLanes;        // 0..31
  const int gm = group % (kBM / kTM);    // token sub-tile
  const int gn = group / (kBM / kTM);    // expert sub-tile
  const int64_t t0 = int64_t(blockIdx.y) * kBM, e0 = int64_t(blockIdx.x) * kBN;

  // Global -> registers: x as 2 chunks of 8 bf16 per thread (token c % 64, h (c / 64) * 8), gate
  // as 2 float4 per thread (expert c % 32, h (c / 32) * 4). Rows past the end load zeros (their
  // results are never stored); H is a multiple of kBK (MoeConfig: a multiple of 128).
  uint4 xr[2];
  float4 gr[2];
  auto load = [&](int64_t k0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int c = tid + r * kThreads;
      const int64_t t = t0 + (c % kBM);
      xr[r] = t < num_tokens ? __ldg(reinterpret_cast<const uint4*>(x + t * hidden + k0 + (c / kBM) * 8))
                             : make_uint4(0, 0, 0, 0);
      const int64_t e = e0 + (c % kBN);
      gr[r] = e < num_experts ? __ldg(reinterpret_cast<const float4*>(gate + e * hidden + k0 + (c / kBN) * 4))
                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  };
  auto store = [&]() {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int c = tid + r * kThreads;
      const int m = c % kBM, h = (c / kBM) * 8;
      const uint32_t w[4] = {xr[r].x, xr[r].y, xr[r].z, xr[r].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        xs[(h + 2 * i) * kXStride + m] = bf16_to_f32(uint16_t(w[i] & 0xFFFFu));
        xs[(h + 2 * i + 1) * kXStride + m] = bf16_to_f32(uint16_t(w[i] >> 16));
      }
      const int n = c % kBN, hg = (c / kBN) * 4;
      gs[(hg + 0) * kGStride + n] = gr[r].x;
      gs[(hg + 1) * kGStride + n] = gr[r].y;
      gs[(hg + 2) * kGStride + n] = gr[r].z;
      gs[(hg + 3) * kGStride + n] = gr[r].w;
    }
  };

  float acc[kTM][kTN];
#pragma unroll
  for (int i = 0; i < kTM; ++i)
#pragma unroll
    for (int j = 0; j < kTN; ++j) acc[i][j] = 0.0f;

  load(0);
  store();
  __syncthreads();
  for (int64_t k0 = 0; k0 < hidden; k0 += kBK) {
    const bool more = k0 + kBK < hidden;
    if (more) load(k0 + kBK);  // in flight while this tile is computed
#pragma unroll
    for (int kk = 0; kk < kBK / kLanes; ++kk) {
      const int h = kk * kLanes + lane;  // ascending h of this lane
      const float4 xa = *reinterpret_cast<const float4*>(&xs[h * kXStride + gm * kTM]);
      const float4 xb = *reinterpret_cast<const float4*>(&xs[h * kXStride + gm * kTM + 4]);
      const float4 ga = *reinterpret_cast<const float4*>(&gs[h * kGStride + gn * kTN]);
      const float4 gb = *reinterpret_cast<const float4*>(&gs[h * kGStride + gn * kTN + 4]);
      const float xv[kTM] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
      const float gv[kTN] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
#pragma unroll
      for (int i = 0; i < kTM; ++i)
#pragma unroll
        for (int j = 0; j < kTN; ++j) acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(xv[i], gv[j]));
    }
    __syncthreads();  // everyone is done reading this tile
    if (more) {
      store();
      __syncthreads();
    }
  }

  // Lane combination (every thread of the group ends with the same bits), then thread `lane`
  // keeps expert column j = lane of its sub-tile.
  float col[kTM];
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
#pragma unroll
    for (int j = 0; j < kTN; ++j) {
      float v = acc[i][j];
      v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, 1));  // l0+l1, l2+l3, ...
      v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, 2));  // (l0+l1)+(l2+l3), ...
      v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, 4));  // ((..)+(..))+((..)+(..))
      acc[i][j] = v;
    }
    col[i] = acc[i][0];
#pragma unroll
    for (int j = 1; j < kTN; ++j) col[i] = lane == j ? acc[i][j] : col[i];
  }
  const int64_t e = e0 + gn * kTN + lane;
  if (e < num_experts) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) col[i] = router_rules::score_elementwise(scoring, col[i]);
    // Tokens t0 + gm*8 .. +8: inside n_pad (a multiple of kBM), 32-byte aligned.
    float4* out = reinterpret_cast<float4*>(scores + e * n_pad + t0 + gm * kTM);
    out[0] = make_float4(col[0], col[1], col[2], col[3]);
    out[1] = make_float4(col[4], col[5], col[6], col[7]);
  }
}

// One thread per token: the shared rules, on the token's column of the token-minor scores.
__global__ void __launch_bounds__(kSelectThreads)
    router_select_kernel(Rules rules, float* scores, float* group_scores, int64_t n_pad, const float* bias,
                         const uint8_t* padding, int64_t num_tokens, int32_t* topk_idx, float* topk_weights) {
  const int64_t t = int64_t(blockIdx.x) * kSelectThreads + threadIdx.x;
  if (t >= num_tokens) return;
  int32_t* idx = topk_idx + t * rules.top_k;
  float* w = topk_weights + t * rules.top_k;
  if (padding != nullptr && padding[t] != 0) {
    router_rules::padding_slots(rules.top_k, idx, w);
    return;
  }
  router_rules::route_scores(rules, scores + t, n_pad, bias, group_scores != nullptr ? group_scores + t : nullptr,
                             n_pad, idx, w);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

size_t route_workspace_bytes(const MoeConfig& cfg, int64_t num_tokens) {
  MOEFQ_CHECK(num_tokens >= 0, "route_workspace_bytes: num_tokens = ", num_tokens, " must not be negative");
  const int64_t rows = cfg.num_experts + (cfg.n_group > 1 ? cfg.n_group : 0);
  return size_t(rows) * size_t(padded_tokens(num_tokens)) * sizeof(float);
}

void launch_route(const MoeConfig& cfg, const bf16* x, int64_t num_tokens, const float* gate, const float* bias,
                  const uint8_t* padding, void* workspace, int32_t* topk_idx, float* topk_weights,
                  cudaStream_t stream) {
  cfg.validate();
  MOEFQ_CHECK(num_tokens >= 0, "launch_route: num_tokens = ", num_tokens, " must not be negative");
  if (num_tokens == 0) return;
  const int64_t H = cfg.hidden, E = cfg.num_experts, n_pad = padded_tokens(num_tokens);
  MOEFQ_CHECK(H % kBK == 0, "launch_route: hidden = ", H, " must be a multiple of ", kBK);
  MOEFQ_CHECK(x != nullptr && gate != nullptr && workspace != nullptr && topk_idx != nullptr &&
                  topk_weights != nullptr,
              "launch_route: x, gate, workspace, topk_idx and topk_weights must be device pointers, not null");
  MOEFQ_CHECK(aligned16(x) && aligned16(gate) && aligned16(workspace),
              "launch_route: x, gate and workspace must be 16-byte aligned (x ", static_cast<const void*>(x),
              ", gate ", static_cast<const void*>(gate), ", workspace ", workspace, ")");
  MOEFQ_CHECK(n_pad / kBM <= 65535, "launch_route: num_tokens = ", num_tokens, " exceeds ", 65535 * kBM,
              " tokens per call");

  float* scores = static_cast<float*>(workspace);
  float* group_scores = cfg.n_group > 1 ? scores + E * n_pad : nullptr;
  const dim3 grid(unsigned((E + kBN - 1) / kBN), unsigned(n_pad / kBM));
  router_logits_kernel<<<grid, kThreads, 0, stream>>>(x, gate, num_tokens, E, H, cfg.scoring, scores, n_pad);
  MOEFQ_CUDA_CHECK_LAUNCH();
  const unsigned blocks = unsigned((num_tokens + kSelectThreads - 1) / kSelectThreads);
  router_select_kernel<<<blocks, kSelectThreads, 0, stream>>>(router_rules::make_rules(cfg), scores, group_scores,
                                                              n_pad, cfg.noaux_tc ? bias : nullptr, padding,
                                                              num_tokens, topk_idx, topk_weights);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

}  // namespace moefq::cuda
