// The other expert-parallel libraries' wire formats as QDQ rules: PeerRule, its block size,
// peer_params and peer_qdq. Part of moefq/numerics.h.
#pragma once

#include <cstdint>

#include "moefq/numerics/qdq_rules.h"

namespace moefq {

// ---------------------------------------------------------------------------------------------
// The other peers' wire formats (docs/numerics.md, "Wire formats of the expert-parallel
// libraries"). Each is a per-element rule with per-block parameters {s, si} computed from the
// block's max |x| over its non-NaN elements (+inf counts); the CPU reference and the CUDA kernels
// call peer_params<R> and peer_qdq<R>, so both compute the same bits.
enum class PeerRule : uint8_t {
  kFp8Cast,         // e4m3, no scale, saturating at +-448 (MoRI's FP8 direct cast, saturating)
  kFp8CastNan,      // e4m3, no scale, |x| > 448 and inf become NaN (MoRI's main path, OCP targets)
  kUe8m0NoFloor,    // the SGLang DeepGEMM fork's FP8 Mega-MoE combine: ue8m0 per 128, amax from 0
  kMoriFp8Block,    // MoRI's FP8 blockwise combine: a block is scaled only when its max > 448
  kMoriFp4Block,    // MoRI's FP4 blockwise combine: e2m1, an fp32 scale bmax / 6 per block
  kDeepGemmBlock,   // DeepGEMM's per_token_cast_to_fp8: sf = max(bmax, 1e-4) / 448, x * (1 / sf)
  kVllmBlock,       // vLLM's per-token-group FP8 quant: sf = max(bmax, 1e-10) / 448, x / sf
  kFlashInferFp4,   // FlashInfer's Mega-MoE nvfp4 combine (16e2m1xbf16): e2m1 per 16, the bf16 bmax
};
struct PeerParams {
  float s;   // into the element format (a multiplier; kVllmBlock: the divisor sf)
  float si;  // back (the dequantization scale)
};
inline constexpr int kPeerBlock = 128;  // the blocked peer rules' block, but for kFlashInferFp4
inline constexpr int kFlashInferFp4Block = 16;
inline constexpr float kVllmAmaxFloor = 1e-10f;
inline constexpr float kInvE2m1Max = 1.0f / 6.0f;  // RN(1/6)
inline constexpr float kFltMin = 1.17549435082228750797e-38f;  // 2^-126, the smallest normal

// Channels per block of a peer rule; 0 for the unscaled casts (no block).
constexpr int peer_block_size(PeerRule r) {
  return r == PeerRule::kFp8Cast || r == PeerRule::kFp8CastNan ? 0
         : r == PeerRule::kFlashInferFp4                       ? kFlashInferFp4Block
                                                               : kPeerBlock;
}

// ceil(log2(r)) as the fork's fast_log2_ceil reads it from the bits: biased exponent - 127, plus 1
// when the mantissa field is not zero. Exact for normal r; a subnormal r gives -126 (exponent field
// 0 with a mantissa), and 0 gives -127.
MOEFQ_HD int ceil_log2_bits(float r) {
  const uint32_t u = f32_bits(r) & 0x7FFFFFFFu;
  return int(u >> 23) - 127 + ((u & 0x7FFFFFu) != 0u ? 1 : 0);
}

template <PeerRule R>
MOEFQ_HD PeerParams peer_params(float bmax) {
  if constexpr (R == PeerRule::kFp8Cast || R == PeerRule::kFp8CastNan) {
    return {1.0f, 1.0f};
  } else if constexpr (R == PeerRule::kUe8m0NoFloor) {
    // e = ceil(log2(bmax * RN(1/448))) in [-127, 120] for finite bmax; s = 2^-e, si = 2^e. A
    // block holding +-inf gets a NaN scale (every element NaN), as fp8_block128_ue8m0.
    if (!is_finite(bmax)) return {0.0f, canonical_nan_f32()};
    const int e = ceil_log2_bits(mul_rn(bmax, kInvE4m3Max));
    return {exp2i(-e), exp2i(e)};
  } else if constexpr (R == PeerRule::kMoriFp8Block) {
    // Unscaled (a plain saturating cast) unless bmax > 448; then s = 448 / bmax (a division) and
    // si = bmax * RN(1/448). An infinite bmax gives s = 0, si = inf: every element NaN.
    if (!(bmax > kE4m3Max)) return {1.0f, 1.0f};
    return {div_rn(kE4m3Max, bmax), mul_rn(bmax, kInvE4m3Max)};
  } else if constexpr (R == PeerRule::kMoriFp4Block) {
    // s = 6 / bmax and si = bmax / 6, two divisions; a zero block s = 0, si = 1. An infinite bmax
    // gives s = 0, si = inf: every element NaN.
    if (!(bmax > 0.0f)) return {0.0f, 1.0f};
    return {div_rn(kE2m1Max, bmax), div_rn(bmax, kE2m1Max)};
  } else if constexpr (R == PeerRule::kFlashInferFp4) {
    // The wire carries the block's maximum as bf16 (a, exact for bf16 rows); d = a * RN(1/6) is the
    // dequantization scale (si). Into e2m1: enc = rcp(d) (moefq: RN(1/d); the peer's rcp.approx.ftz
    // reads a subnormal or zero d as 0 and gives inf, capped at FLT_MAX), times the peer's mask
    // min(d * 1e30, 1), which makes a zero block's enc 0 and shrinks it for d < 1e-30. An infinite
    // bmax gives enc = 0, d = inf: every element NaN.
    const float d = mul_rn(bf16_to_f32(bf16_round(bmax)), kInvE2m1Max);
    const float r = d < kFltMin ? kFltMax : div_rn(1.0f, d);
    const float mask = mul_rn(d, 1e30f);
    return {mul_rn(r, mask < 1.0f ? mask : 1.0f), d};
  } else if constexpr (R == PeerRule::kDeepGemmBlock) {
    const float sf = div_rn(bmax > kFp8BlockAmaxFloor ? bmax : kFp8BlockAmaxFloor, kE4m3Max);
    return {div_rn(1.0f, sf), sf};
  } else {
    const float sf = div_rn(bmax > kVllmAmaxFloor ? bmax : kVllmAmaxFloor, kE4m3Max);
    return {sf, sf};
  }
}

// The dequantized value of x (binary32; the caller rounds it to the tensor's dtype). NaN x gives
// NaN; the sign of zero is kept.
template <PeerRule R>
MOEFQ_HD float peer_qdq(float x, PeerParams p) {
  if (is_nan(x)) return canonical_nan_f32();
  if constexpr (R == PeerRule::kFp8CastNan) {
    if (abs_f32(x) > kE4m3Max) return canonical_nan_f32();  // inf too
  }
  if constexpr (R == PeerRule::kMoriFp4Block || R == PeerRule::kFlashInferFp4) {
    // e2m1 of |x| * s, ties to the even code, saturating at 6; inf * 0 (an infinite block) is NaN.
    const float q = e2m1_round_sat(mul_rn(abs_f32(x), p.s));
    return copysign_f32(mul_rn(q, p.si), x);
  }
  const float v = R == PeerRule::kVllmBlock ? div_rn(x, p.s) : mul_rn(x, p.s);
  // Checked decode: inf * 0 (an infinite block) is NaN and must stay NaN.
  return mul_rn(e4m3_decode(e4m3_encode_sat(v)), p.si);
}

}  // namespace moefq
