// The per-format rules of the QDQ kernels (docs/numerics.md), shared by every kernel that QDQs rows on
// the device (qdq_kernels.cu, combine_kernels.cu), so each rule is written once. All numerics come
// from moefq/numerics.h (the combine's sum-exact element rules included). Rule<F>'s constructor may
// fill a per-CTA table in shared memory with the CTA's first 128 threads: kernels launch at least
// 128 threads and __syncthreads() after it.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

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

// The combine's unit: one 16-byte chunk of a bf16 row as 4 words of bf16x2 (lo = even element).
constexpr int kCombineElems = 8;
using CombineWords = uint32_t[4];

// A routed value added to the combine's fp32 sum: combine_weighting after adds it times the slot's
// router weight as one fma (numerics.h weighted_add), before adds it as it is.
template <bool kWeighted>
__device__ __forceinline__ float accumulate(float acc, float weight, float v) {
  if constexpr (kWeighted) return weighted_add(acc, v, weight);
  return add_rn(acc, v);
}

// The chunk's 8 bf16 as fp32 (exact): lo = w << 16, hi = w with the low half cleared.
__device__ __forceinline__ void unpack(const CombineWords& w, float (&v)[kCombineElems]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = f32_from_bits(w[i] << 16);
    v[2 * i + 1] = f32_from_bits(w[i] & 0xFFFF0000u);
  }
}
// Each value rounded to bf16 as the CPU quantizer stores it, kept as fp32: one conversion per
// value, whose packed form with a zero low half is the fp32 bit pattern itself (no unpack).
__device__ __forceinline__ void round_to_bf16(float (&v)[kCombineElems]) {
#pragma unroll
  for (int i = 0; i < kCombineElems; ++i) v[i] = f32_from_bits(bf16x2_round(0.0f, v[i]));
}

// Bits 0-14 of the result: the max |x| over a block of the combine's rows as a bf16 (sign bit and
// bits 16-31 unspecified; NaN only when every element is NaN), for a block spanning kLanes
// consecutive lanes' chunks. The chunk is reduced as packed words (one bf16x2_max_abs per word),
// then across the lanes, then the two halves.
template <int kLanes>
__device__ __forceinline__ uint32_t combine_block_max_bits(const CombineWords& w) {
  static_assert(kLanes >= 1 && kLanes <= 32 && (32 % kLanes) == 0);
  uint32_t m = bf16x2_max_abs(bf16x2_max_abs(w[0], w[1]), bf16x2_max_abs(w[2], w[3]));
#pragma unroll
  for (int o = 1; o < kLanes; o <<= 1) m = bf16x2_max_abs(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  return bf16x2_max_abs(m, __byte_perm(m, 0u, 0x1032u));
}
// The same maximum as fp32, with an all-NaN block giving 0 (the fmaxf reduction from 0 of the
// scalar kernels, which the block rules were written for).
template <int kLanes>
__device__ __forceinline__ float combine_block_max(const CombineWords& w) {
  return max_ignore_nan(0.0f, abs_mod(f32_from_bits(combine_block_max_bits<kLanes>(w) << 16)));
}

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
  // The combine's chunk (numerics.h, "Sum-exact element rules"): the 8 values its fp32 sum adds,
  // each the value of the CPU quantizer's bf16 result. kLanes: lanes per block (none here).
  template <int kLanes>
  __device__ void combine_chunk(const CombineWords& w, float (&v)[kCombineElems]) const {
    unpack(w, v);
#pragma unroll
    for (int i = 0; i < kCombineElems; ++i) v[i] = fp8_qdq_sum(v[i], p);
    round_to_bf16(v);
  }
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
  // One (uniform) branch per chunk: the sum-exact path wherever int8_qdq_recip applies.
  template <int kLanes>
  __device__ void combine_chunk(const CombineWords& w, float (&v)[kCombineElems]) const {
    unpack(w, v);
    if (recip && !p.zero) {
#pragma unroll
      for (int i = 0; i < kCombineElems; ++i) v[i] = int8_qdq_sum(v[i], p, rcp);
    } else {
#pragma unroll
      for (int i = 0; i < kCombineElems; ++i) v[i] = int8_qdq(v[i], p);
    }
    round_to_bf16(v);
  }
};

struct Nvfp4Block {
  float scale, rcp;
  bool clamp;
};
template <>
struct Rule<Format::kNvfp4> {
  static constexpr int kBlock = kNvfp4Block;
  // Every block scale the tensor can have and its RN reciprocal ({scale, rcp}, one 8-byte load), by
  // e4m3 code: two divisions per CTA instead of one per block.
  struct Shared {
    float2 entry[128];
  };
  float gs, rcp6;
  const Shared& table;
  __device__ Rule(const float* amax, Shared& sh)
      : gs(nvfp4_global_scale(*amax)), rcp6(div_rn(1.0f, mul_rn(6.0f, gs))), table(sh) {
    if (threadIdx.x < 128) {
      const float scale = nvfp4_scale_from_code(uint8_t(threadIdx.x), gs);
      sh.entry[threadIdx.x] = make_float2(scale, div_rn(1.0f, scale));
    }
  }
  __device__ float reduce(float m, float x) const { return max_ignore_nan(m, abs_f32(x)); }
  __device__ Nvfp4Block block_param(float bmax) const {
    const uint8_t sf = nvfp4_block_code_recip(bmax, gs, rcp6);  // 0..0x7F (bmax >= 0)
    const float2 e = table.entry[sf];
    return {e.x, e.y, nvfp4_block_needs_clamp(bmax, e.y)};
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
  // The combine's element rules (numerics.h, "Sum-exact element rules"), each exact wherever it is
  // taken: tame where every block is tame, clamped for any block, unclamped where no block needs
  // the clamp.
  enum class SumRule { kTame, kClamped, kUnclamped };
  template <SumRule kR>
  __device__ static float sum_elem(float x, float scale, float rcp) {
    if constexpr (kR == SumRule::kTame) return nvfp4_qdq_sum_tame(x, scale, rcp);
    if constexpr (kR == SumRule::kClamped) return nvfp4_qdq_sum_clamped(x, scale, rcp);
    return nvfp4_qdq_sum_unclamped(x, scale, rcp);
  }
  // Calls f with the rule for the warp (uniform branches, no divergence) from this lane's blocks:
  // tame when all of the warp's are, else clamped when any needs the clamp, else unclamped.
  template <typename F>
  __device__ static void with_warp_rule(bool tame, bool clamp, F&& f) {
    if (__all_sync(0xFFFFFFFFu, tame))
      f(std::integral_constant<SumRule, SumRule::kTame>{});
    else if (__any_sync(0xFFFFFFFFu, clamp))
      f(std::integral_constant<SumRule, SumRule::kClamped>{});
    else
      f(std::integral_constant<SumRule, SumRule::kUnclamped>{});
  }
  // The combine's chunk, the element rule chosen per warp.
  template <int kLanes>
  __device__ void combine_chunk(const CombineWords& w, float (&v)[kCombineElems]) const {
    unpack(w, v);
    const float bmax = combine_block_max<kLanes>(w);
    const Nvfp4Block b = block_param(bmax);
    with_warp_rule(nvfp4_block_is_tame(bmax, b.rcp), b.clamp, [&](auto rule) {
#pragma unroll
      for (int i = 0; i < kCombineElems; ++i) v[i] = sum_elem<decltype(rule)::value>(v[i], b.scale, b.rcp);
    });
    round_to_bf16(v);
  }
  // The chunks of two routed rows a and b of a token (the combine's slots k and k + 1) at once, with
  // the same values as combine_chunk on each. A block is 16 elements, 8 in each of two lanes: the
  // even lane finishes row a's block maximum and scale, the odd lane row b's, and they swap the
  // results, so a lane does the per-block work (maximum, scale code, table, tame test; about 35
  // instructions) once for two rows. The element rule is chosen per warp for both rows together.
  __device__ void combine_chunk_pair(const CombineWords& wa, const CombineWords& wb, float (&va)[kCombineElems],
                                     float (&vb)[kCombineElems]) const {
    static_assert(kBlock == 2 * kCombineElems, "two lanes per block");
    constexpr unsigned kAll = 0xFFFFFFFFu;
    const bool odd = threadIdx.x & 1u;
    const uint32_t ma = bf16x2_max_abs(bf16x2_max_abs(wa[0], wa[1]), bf16x2_max_abs(wa[2], wa[3]));
    const uint32_t mb = bf16x2_max_abs(bf16x2_max_abs(wb[0], wb[1]), bf16x2_max_abs(wb[2], wb[3]));
    uint32_t m = bf16x2_max_abs(odd ? mb : ma, __shfl_xor_sync(kAll, odd ? ma : mb, 1));
    m = bf16x2_max_abs(m, __byte_perm(m, 0u, 0x1032u));
    const float bmax = max_ignore_nan(0.0f, abs_mod(f32_from_bits(m << 16)));  // as combine_block_max
    const Nvfp4Block own = block_param(bmax);
    const float other_scale = __shfl_xor_sync(kAll, own.scale, 1), other_rcp = __shfl_xor_sync(kAll, own.rcp, 1);
    const float sa = odd ? other_scale : own.scale, ra = odd ? other_rcp : own.rcp;
    const float sb = odd ? own.scale : other_scale, rb = odd ? own.rcp : other_rcp;
    unpack(wa, va);
    unpack(wb, vb);
    with_warp_rule(nvfp4_block_is_tame(bmax, own.rcp), own.clamp, [&](auto rule) {
#pragma unroll
      for (int i = 0; i < kCombineElems; ++i) {
        va[i] = sum_elem<decltype(rule)::value>(va[i], sa, ra);
        vb[i] = sum_elem<decltype(rule)::value>(vb[i], sb, rb);
      }
    });
    round_to_bf16(va);
    round_to_bf16(vb);
  }
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
  // The combine's chunk: blocks that mx_packed_block accepts (all but zero, inf or NaN maxima and
  // extreme exponents) QDQ two elements per instruction on the packed words and only unpack the
  // results, which are bf16 values; the others take the scalar rules above.
  // The branch is per block (4 lanes); a warp diverges only where such a block occurs.
  template <int kLanes>
  __device__ void combine_chunk(const CombineWords& w, float (&v)[kCombineElems]) const {
    const uint32_t m = combine_block_max_bits<kLanes>(w);
    const MxPacked b = mx_packed_block<kFp8>(m);
    if (b.ok) {
      const CombineWords r = {mx_qdq_sum_unscaled_x2<kFp8>(w[0], b.floor2), mx_qdq_sum_unscaled_x2<kFp8>(w[1], b.floor2),
                              mx_qdq_sum_unscaled_x2<kFp8>(w[2], b.floor2), mx_qdq_sum_unscaled_x2<kFp8>(w[3], b.floor2)};
      unpack(r, v);
    } else {
      unpack(w, v);
      const SumScale s = sum_block_param(max_ignore_nan(0.0f, abs_mod(f32_from_bits(m << 16))));
      apply_chunk_sum(v, s);
      if (sum_needs_bf16_round(s)) round_to_bf16(v);
    }
  }
};
template <>
struct Rule<Format::kMxfp8> : MxRule<Format::kMxfp8> {
  using MxRule::MxRule;
};
template <>
struct Rule<Format::kMxfp4> : MxRule<Format::kMxfp4> {
  using MxRule::MxRule;
};

// fp8_block128 and fp8_block128_ue8m0: e4m3 elements, a scale per block of 128 from the block's
// own maximum (numerics.h), an fp32 scale or a power of two. The combine's chunk uses the
// sum-exact element rules, which hold for any block parameters.
template <bool kUe8m0>
struct Fp8BlockRule {
  static constexpr int kBlock = kFp8BlockSize;
  using Shared = NoShared;
  using Param = std::conditional_t<kUe8m0, MxScale, Fp8Params>;
  __device__ Fp8BlockRule(const float*, Shared&) {}
  __device__ float reduce(float m, float x) const { return max_ignore_nan(m, abs_f32(x)); }
  __device__ Param block_param(float bmax) const {
    if constexpr (kUe8m0) return fp8_block128_ue8m0_scale(bmax);
    else return fp8_block128_params(bmax);
  }
  __device__ float apply(float x, Param p) const {
    if constexpr (kUe8m0) return mxfp8_qdq(x, p);
    else return fp8_qdq(x, p);
  }
  // The combine's chunk. The ue8m0 scale is a power of two, so its blocks take mxfp8's packed rule
  // (two elements per instruction, results already bf16 values) wherever it applies.
  template <int kLanes>
  __device__ void combine_chunk(const CombineWords& w, float (&v)[kCombineElems]) const {
    const float bmax = combine_block_max<kLanes>(w);
    if constexpr (kUe8m0) {
      const MxPacked b = fp8_block128_ue8m0_packed(bmax);
      if (b.ok) {
        const CombineWords r = {mx_qdq_sum_unscaled_x2<true>(w[0], b.floor2), mx_qdq_sum_unscaled_x2<true>(w[1], b.floor2),
                                mx_qdq_sum_unscaled_x2<true>(w[2], b.floor2), mx_qdq_sum_unscaled_x2<true>(w[3], b.floor2)};
        unpack(r, v);
        return;
      }
    }
    unpack(w, v);
    const Param p = block_param(bmax);
#pragma unroll
    for (int i = 0; i < kCombineElems; ++i) {
      if constexpr (kUe8m0) v[i] = mxfp8_qdq_sum(v[i], p);
      else v[i] = fp8_qdq_sum(v[i], p);
    }
    round_to_bf16(v);
  }
};
template <>
struct Rule<Format::kFp8Block128> : Fp8BlockRule<false> {
  using Fp8BlockRule::Fp8BlockRule;
};
template <>
struct Rule<Format::kFp8Block128Ue8m0> : Fp8BlockRule<true> {
  using Fp8BlockRule::Fp8BlockRule;
};

// The other peers' rules (numerics.h PeerRule): blocks of 128 or 16 (single elements for the unscaled
// casts), the block's parameters from its maximum, each element by peer_qdq. The combine's chunk
// takes the sum-exact form of each element (peer_qdq_sum: no conversion instructions) and rounds
// the 8 values to bf16, as the CPU quantizer stores them.
template <PeerRule R>
struct PeerFormatRule {
  static constexpr int kBlock = peer_block_size(R);
  static constexpr bool kBlocked = kBlock > 0;
  using Shared = NoShared;
  __device__ PeerFormatRule(const float*, Shared&) {}
  __device__ float reduce(float m, float x) const { return max_ignore_nan(m, abs_f32(x)); }
  __device__ PeerParams block_param(float bmax) const { return peer_params<R>(bmax); }
  __device__ float apply(float x, PeerParams p) const { return peer_qdq<R>(x, p); }
  template <int kLanes>
  __device__ void combine_chunk(const CombineWords& w, float (&v)[kCombineElems]) const {
    float bmax = 0.0f;
    if constexpr (kBlocked) bmax = combine_block_max<kLanes>(w);
    const PeerParams p = block_param(bmax);
    unpack(w, v);
#pragma unroll
    for (int i = 0; i < kCombineElems; ++i) v[i] = peer_qdq_sum<R>(v[i], p);
    round_to_bf16(v);
  }
};
template <>
struct Rule<Format::kFp8Cast> : PeerFormatRule<PeerRule::kFp8Cast> {
  using PeerFormatRule::PeerFormatRule;
};
template <>
struct Rule<Format::kFp8CastNan> : PeerFormatRule<PeerRule::kFp8CastNan> {
  using PeerFormatRule::PeerFormatRule;
};
template <>
struct Rule<Format::kFp8Block128Ue8m0NoFloor> : PeerFormatRule<PeerRule::kUe8m0NoFloor> {
  using PeerFormatRule::PeerFormatRule;
};
template <>
struct Rule<Format::kFp8Block128Mori> : PeerFormatRule<PeerRule::kMoriFp8Block> {
  using PeerFormatRule::PeerFormatRule;
};
template <>
struct Rule<Format::kFp4Block128Mori> : PeerFormatRule<PeerRule::kMoriFp4Block> {
  using PeerFormatRule::PeerFormatRule;
};
template <>
struct Rule<Format::kFp8Block128DeepGemm> : PeerFormatRule<PeerRule::kDeepGemmBlock> {
  using PeerFormatRule::PeerFormatRule;
};
template <>
struct Rule<Format::kFp8Block128Vllm> : PeerFormatRule<PeerRule::kVllmBlock> {
  using PeerFormatRule::PeerFormatRule;
};
template <>
struct Rule<Format::kFp4Block16FlashInfer> : PeerFormatRule<PeerRule::kFlashInferFp4> {
  using PeerFormatRule::PeerFormatRule;
};

// logfmt10 in the combine (numerics.h): a block of 128 spans 16 lanes; a cast group (8 blocks when
// H is a multiple of 1024, else 4) spans 4 or 2 warps of the 128-thread CTA, which always starts on
// a group (CTAs cover 1024 channels of one token). The rule takes a batch of 8 routed slots at once
// (the kernel's slot batch; its active-slot mask is CTA-uniform):
// - each slot's block amax and amin of |x| (packed bf16x2 reductions) are reduced across the block's
//   16 lanes and scattered, so that lane l ends with slot rev3(l % 8)'s and computes that one
//   block's parameters (logfmt_block): once per two lanes instead of once per lane and slot;
// - whether each slot's group is cast is voted through shared memory with one barrier per batch
//   (a mask per warp). The masks are double-buffered: a thread writes ok[parity] only after the
//   barrier of the next batch, which every reader of the previous use has passed;
// - each element's log2 is read from a 128-entry table (log2_bf16_normal, numerics.h).
template <>
struct Rule<Format::kLogfmt10> {
  static constexpr int kBlock = kLogFmtBlock;
  static constexpr int kWarps = 4;
  static constexpr int kBatch = 8;
  struct Shared {
    float log2_mant[128];
    uint32_t ok[2][kWarps];
  };
  Shared& sh;
  int parity = 0;
  int group_warps = 4;  // warps per cast group
  bool in_row = true;   // lanes past the row's end vote to cast (their blocks are not the row's)
  __device__ Rule(const float*, Shared& s) : sh(s) {
    if (threadIdx.x < 128) s.log2_mant[threadIdx.x] = log2_1p_unit(float(threadIdx.x) * 0.0078125f);
  }
  // The row's length in 16-byte chunks and whether this thread's chunk is in it.
  __device__ void bind_row(int chunks_per_row, bool chunk_in_row) {
    group_warps = logfmt_group_blocks(int64_t(chunks_per_row) * kCombineElems) == 8 ? 4 : 2;
    in_row = chunk_in_row;
  }

  // v[j] (one word per slot j) combined with op over the 16 lanes of the block: on return, lane l
  // holds the result of slot rev3(l % 8) (bits 0, 1, 2 of l give bits 2, 1, 0 of the slot). Each
  // step sends half of what a lane holds to its partner and keeps the other half: 8 shuffles.
  template <typename Op>
  __device__ static uint32_t reduce_scatter(const uint32_t (&v)[kBatch], Op op) {
    constexpr unsigned kAll = 0xFFFFFFFFu;
    const unsigned lane = threadIdx.x & 31u;
    uint32_t a[4], c[2];
    const bool b0 = lane & 1u, b1 = lane & 2u, b2 = lane & 4u;
#pragma unroll
    for (int i = 0; i < 4; ++i) a[i] = op(b0 ? v[i + 4] : v[i], __shfl_xor_sync(kAll, b0 ? v[i] : v[i + 4], 1));
#pragma unroll
    for (int i = 0; i < 2; ++i) c[i] = op(b1 ? a[i + 2] : a[i], __shfl_xor_sync(kAll, b1 ? a[i] : a[i + 2], 2));
    const uint32_t d = op(b2 ? c[1] : c[0], __shfl_xor_sync(kAll, b2 ? c[0] : c[1], 4));
    return op(d, __shfl_xor_sync(kAll, d, 8));
  }
  __device__ static int rev3(int j) { return ((j & 1) << 2) | (j & 2) | ((j >> 2) & 1); }

  // Adds the batch's active routed slots (bit j of `active`: raw[j] holds slot j's chunk; the
  // others are zero) to acc in slot order, QDQ'd where their group is cast; with kCheck the
  // unquantized values go into plain as well. kWeighted (combine_weighting after): each slot's
  // values are added times slot_weight(j) as one fma (accumulate; called once per active slot, by
  // the whole warp).
  template <bool kCheck, bool kWeighted = false, typename SlotWeight = float (*)(int)>
  __device__ void combine_batch(const int4 (&raw)[kBatch], uint32_t active, float (&acc)[kCombineElems],
                                float (&plain)[kCombineElems], const SlotWeight& slot_weight = nullptr) {
    constexpr unsigned kAll = 0xFFFFFFFFu;
    const int lane = int(threadIdx.x) & 31;
    uint32_t mx[kBatch], mn[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const uint32_t w[4] = {uint32_t(raw[j].x), uint32_t(raw[j].y), uint32_t(raw[j].z), uint32_t(raw[j].w)};
      mx[j] = bf16x2_max_abs(bf16x2_max_abs(w[0], w[1]), bf16x2_max_abs(w[2], w[3]));
      mn[j] = bf16x2_min_abs(bf16x2_min_abs(w[0], w[1]), bf16x2_min_abs(w[2], w[3]));
    }
    uint32_t amax = reduce_scatter(mx, [](uint32_t a, uint32_t b) { return bf16x2_max_abs(a, b); });
    uint32_t amin = reduce_scatter(mn, [](uint32_t a, uint32_t b) { return bf16x2_min_abs(a, b); });
    amax = bf16x2_max_abs(amax, __byte_perm(amax, 0u, 0x1032u)) & 0x7FFFu;
    amin = bf16x2_min_abs(amin, __byte_perm(amin, 0u, 0x1032u)) & 0x7FFFu;
    // Over the non-NaN elements: amax 0 and amin +inf for a block with none (NaN here).
    const LogFmtBlock own = logfmt_block(amax > 0x7F80u ? 0.0f : bf16_to_f32(uint16_t(amax)),
                                         bf16_to_f32(uint16_t(amin > 0x7F80u ? 0x7F80u : amin)));
    // Lanes j' and 16 + j' (j' = rev3(j)) hold slot j's two blocks of the warp.
    const uint32_t ok = __ballot_sync(kAll, own.ok || !in_row);
    uint32_t warp_mask = 0;
#pragma unroll
    for (int j = 0; j < kBatch; ++j) warp_mask |= ((ok >> rev3(j)) & (ok >> (16 + rev3(j))) & 1u) << j;
    const int warp = int(threadIdx.x) >> 5;
    if (lane == 0) sh.ok[parity][warp] = warp_mask;
    __syncthreads();
    const int first = warp / group_warps * group_warps;
    uint32_t cast = 0xFFu;
    for (int i = first; i < first + group_warps; ++i) cast &= sh.ok[parity][i];
    parity ^= 1;

    // The slots one after the other in a loop that is not unrolled, so the element code is there
    // once (unrolled over the slots, the kernel's code outgrew the instruction cache); the chunk
    // is picked from the registers by a select chain.
    const int base = lane & 16;
#pragma unroll 1
    for (int j = 0; j < kBatch; ++j) {
      if (!(active & (1u << j))) continue;
      int4 r = raw[0];
#pragma unroll
      for (int i = 1; i < kBatch; ++i) r = i == j ? raw[i] : r;
      const CombineWords w = {uint32_t(r.x), uint32_t(r.y), uint32_t(r.z), uint32_t(r.w)};
      float v[kCombineElems];
      unpack(w, v);
      float weight = 1.0f;
      if constexpr (kWeighted) weight = slot_weight(j);
      if constexpr (kCheck) {
#pragma unroll
        for (int i = 0; i < kCombineElems; ++i) plain[i] = accumulate<kWeighted>(plain[i], weight, v[i]);
      }
      if (cast & (1u << j)) {
        const int src = base | rev3(j);
        LogFmtBlock b;
        b.log_amin = __shfl_sync(kAll, own.log_amin, src);
        b.step = __shfl_sync(kAll, own.step, src);
        b.step_inv = __shfl_sync(kAll, own.step_inv, src);
        b.fused = __shfl_sync(kAll, own.fused, src);
        // A subnormal element (bf16 bits 1..0x7F in a half) or a grid reaching below 2^-126
        // anywhere in the warp takes the general path (uniform branch).
        bool tame = b.log_amin >= -126.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          tame = tame && ((w[i] & 0x7F80u) || !(w[i] & 0x7Fu)) && ((w[i] & 0x7F800000u) || !(w[i] & 0x7F0000u));
        if (__all_sync(kAll, tame)) {
#pragma unroll
          for (int i = 0; i < kCombineElems; ++i) v[i] = logfmt_qdq_table_normal(v[i], b, sh.log2_mant);
        } else {
#pragma unroll
          for (int i = 0; i < kCombineElems; ++i) v[i] = logfmt_qdq_table(v[i], b, sh.log2_mant);
        }
        round_to_bf16(v);
      }
#pragma unroll
      for (int i = 0; i < kCombineElems; ++i) acc[i] = accumulate<kWeighted>(acc[i], weight, v[i]);
    }
  }
};

}  // namespace moefq::cuda::rules
