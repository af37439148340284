// The per-format rules of the QDQ kernels (numerics.md), shared by every kernel that QDQs rows on
// the device (qdq_kernels.cu, combine_kernels.cu), so each rule is written once. All numerics come
// from moefq/numerics.h (the combine's sum-exact element rules included). Rule<F>'s constructor may fill a per-CTA table in shared memory with the
// CTA's first 128 threads: kernels launch at least 128 threads and __syncthreads() after it.
#pragma once

#include <cuda_runtime.h>

#include "moefq/numerics.h"
#include "moefq/qdq.h"

namespace moefq::cuda::rules {

// 16 bytes of T: the unit every thread loads and stores.
template <typename T>
union Chunk {
  static constexpr int kN = 16 / int(sizeof(T));
  int4 raw;
  T v[kN];
};

// Per-format rule: the per-tensor parameters (from the device amax), the per-block reduction and
// parameter, and the element function. All numerics come from numerics.h. A rule may keep a
// per-tensor table in shared memory (Shared), filled by the CTA's first threads in the
// constructor; kernels call __syncthreads() after constructing the rule.
struct NoShared {};

template <Format F>
struct Rule;

template <>
struct Rule<Format::kFp8> {
  static constexpr int kBlock = 0;
  using Shared = NoShared;
  Fp8Params p;
  __device__ Rule(const float* amax, Shared&) : p(fp8_params(*amax)) {}
  __device__ float reduce(float m, float) const { return m; }
  __device__ int block_param(float) const { return 0; }
  __device__ float apply(float x, int) const { return fp8_qdq(x, p); }
  // The combine's sum-exact counterparts (numerics.h, "Sum-exact element rules").
  __device__ int sum_block_param(float) const { return 0; }
  __device__ float apply_sum(float x, int) const { return fp8_qdq_sum(x, p); }
  __device__ bool sum_needs_bf16_round(int) const { return true; }
};

template <>
struct Rule<Format::kInt8> {
  static constexpr int kBlock = 0;
  using Shared = NoShared;
  Int8Params p;
  float rcp;
  bool recip;  // q * rcp cannot overflow (int8_qdq_recip's condition)
  __device__ Rule(const float* amax, Shared&)
      : p(int8_params(*amax)), rcp(div_rn(1.0f, p.s)), recip(*amax < 1.7014118e38f) {}
  __device__ float reduce(float m, float) const { return m; }
  __device__ int block_param(float) const { return 0; }
  __device__ float apply(float x, int) const {
    return recip ? int8_qdq_recip(x, p, rcp) : int8_qdq(x, p);
  }
  __device__ int sum_block_param(float) const { return 0; }
  // One (uniform) branch per chunk: the sum-exact path wherever int8_qdq_recip applies.
  template <int kN>
  __device__ void apply_chunk_sum(float (&v)[kN], int) const {
    if (recip && !p.zero) {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = int8_qdq_sum(v[i], p, rcp);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = int8_qdq(v[i], p);
    }
  }
  __device__ bool sum_needs_bf16_round(int) const { return true; }
};

struct Nvfp4Block {
  float scale, rcp;
  bool clamp;
};
template <>
struct Rule<Format::kNvfp4> {
  static constexpr int kBlock = kNvfp4Block;
  // Every block scale the tensor can have, and its RN reciprocal, by e4m3 code: two divisions
  // per CTA instead of one per block.
  struct Shared {
    float scale[128], rcp[128];
  };
  float gs, rcp6;
  const Shared& table;
  __device__ Rule(const float* amax, Shared& sh)
      : gs(nvfp4_global_scale(*amax)), rcp6(div_rn(1.0f, mul_rn(6.0f, gs))), table(sh) {
    if (threadIdx.x < 128) {
      const float scale = nvfp4_scale_from_code(uint8_t(threadIdx.x), gs);
      sh.scale[threadIdx.x] = scale;
      sh.rcp[threadIdx.x] = div_rn(1.0f, scale);
    }
  }
  __device__ float reduce(float m, float x) const { return max_ignore_nan(m, abs_f32(x)); }
  __device__ Nvfp4Block block_param(float bmax) const {
    const uint8_t sf = nvfp4_block_code_recip(bmax, gs, rcp6);  // 0..0x7F (bmax >= 0)
    const float rcp = table.rcp[sf];
    return {table.scale[sf], rcp, nvfp4_block_needs_clamp(bmax, rcp)};
  }
  // The clamp is needed only in blocks with |x| far beyond the scale (data above the calibrated
  // amax, or inf).
  __device__ float apply(float x, Nvfp4Block b) const {
    return b.clamp ? nvfp4_qdq_recip<true>(x, b.scale, b.rcp) : nvfp4_qdq_recip<false>(x, b.scale, b.rcp);
  }
  // The same over a chunk, with the branch outside the element loop and uniform across the warp
  // (a warp with any saturating block takes the clamped path): no divergence.
  template <int kN>
  __device__ void apply_chunk(float (&v)[kN], Nvfp4Block b) const {
    if (__any_sync(0xFFFFFFFFu, b.clamp)) {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = nvfp4_qdq_recip<true>(v[i], b.scale, b.rcp);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = nvfp4_qdq_recip<false>(v[i], b.scale, b.rcp);
    }
  }
  __device__ Nvfp4Block sum_block_param(float bmax) const { return block_param(bmax); }
  template <int kN>
  __device__ void apply_chunk_sum(float (&v)[kN], Nvfp4Block b) const {
    if (__any_sync(0xFFFFFFFFu, b.clamp)) {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = nvfp4_qdq_sum<true>(v[i], b.scale, b.rcp);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = nvfp4_qdq_sum<false>(v[i], b.scale, b.rcp);
    }
  }
  __device__ bool sum_needs_bf16_round(Nvfp4Block) const { return true; }
};

// mxfp8 and mxfp4 differ only in the element format.
template <Format F>
struct MxRule {
  static constexpr int kBlock = kMxBlock;
  static constexpr bool kFp8 = F == Format::kMxfp8;
  using Shared = NoShared;
  __device__ MxRule(const float*, Shared&) {}
  __device__ float reduce(float m, float x) const { return max_ignore_nan(m, abs_f32(x)); }
  __device__ MxScale block_param(float bmax) const {
    return mx_scale(mx_block_exponent(bmax, kFp8 ? kE4m3Max : kE2m1Max));
  }
  __device__ float apply(float x, MxScale s) const { return kFp8 ? mxfp8_qdq(x, s) : mxfp4_qdq(x, s); }
  // For bf16 rows. A result q * 2^e (q an element value, 4 or 2 significant bits, a multiple of
  // 2^-9 or 2^-1) is a bf16 value unless it falls below bf16's subnormal step 2^-133, which only
  // mxfp8 with e < -124 can do: only there does the result need its bf16 rounding.
  struct SumScale {
    MxScale s;
    int e;
    MxBounds bounds;  // mx_qdq_sum_unscaled's, where mx_unscaled_ok(e)
  };
  __device__ SumScale sum_block_param(float bmax) const {
    const int e = mx_block_exponent_bf16<kFp8>(bmax);
    const MxScale s = mx_scale(e);
    return {s, e, mx_unscaled_bounds<kFp8>(s.from_elem)};
  }
  __device__ float apply_sum(float x, SumScale b) const {
    return kFp8 ? mxfp8_qdq_sum(x, b.s) : mxfp4_qdq_sum(x, b.s);
  }
  // Blocks outside mx_unscaled_ok (inf elements, huge or tiny scales) take the scaled rule.
  template <int kN>
  __device__ void apply_chunk_sum(float (&v)[kN], SumScale b) const {
    if (mx_unscaled_ok<kFp8>(b.e)) {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = mx_qdq_sum_unscaled<kFp8>(v[i], b.bounds);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) v[i] = apply_sum(v[i], b);
    }
  }
  __device__ bool sum_needs_bf16_round(SumScale b) const { return kFp8 && b.e < -124; }
};
template <>
struct Rule<Format::kMxfp8> : MxRule<Format::kMxfp8> {
  using MxRule::MxRule;
};
template <>
struct Rule<Format::kMxfp4> : MxRule<Format::kMxfp4> {
  using MxRule::MxRule;
};

// 16 bytes of outputs: bf16 pairs with one packed conversion each, fp32 as is (NaN canonical).
__device__ __forceinline__ int4 pack(const float (&v)[8]) {
  return make_int4(int(bf16x2_round(v[0], v[1])), int(bf16x2_round(v[2], v[3])),
                   int(bf16x2_round(v[4], v[5])), int(bf16x2_round(v[6], v[7])));
}
__device__ __forceinline__ int4 pack(const float (&v)[4]) {
  Chunk<float> out;
#pragma unroll
  for (int i = 0; i < 4; ++i) store_out(&out.v[i], v[i]);
  return out.raw;
}

}  // namespace moefq::cuda::rules
