// Fake quantization (QDQ) of whole tensors on the CPU: the reference every other backend is
// compared with bit for bit. Tensors are row-major [rows, cols]; blocks run along cols and never
// cross a row; a short final block uses the elements it has. Output keeps the input's dtype.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "moefq/numerics.h"

namespace moefq {

// The formats of docs/numerics.md, and those the expert-parallel libraries put on the wire
// (docs/numerics.md): fp8_block128 (e4m3, fp32 scale per 128 channels), fp8_block128_ue8m0 (its
// scale a power of two) and logfmt10 (DeepEP's 10-bit log format, bf16 where a group cannot be cast),
// then the other peers' rules (numerics.h PeerRule): fp8_cast and fp8_cast_nan (MoRI's FP8 direct
// cast, saturating or NaN beyond 448), fp8_block128_ue8m0_nofloor (the SGLang DeepGEMM fork's FP8
// Mega-MoE combine), fp8_block128_mori and fp4_block128_mori (MoRI's blockwise combine options),
// fp8_block128_deepgemm (DeepGEMM's per_token_cast_to_fp8), fp8_block128_vllm (vLLM's
// per-token-group FP8 quantization) and fp4_block16_flashinfer (FlashInfer's Mega-MoE nvfp4 combine).
enum class Format {
  kFp8,
  kNvfp4,
  kMxfp8,
  kMxfp4,
  kInt8,
  kFp8Block128,
  kFp8Block128Ue8m0,
  kLogfmt10,
  kFp8Cast,
  kFp8CastNan,
  kFp8Block128Ue8m0NoFloor,
  kFp8Block128Mori,
  kFp4Block128Mori,
  kFp8Block128DeepGemm,
  kFp8Block128Vllm,
  kFp4Block16FlashInfer,
};
inline constexpr Format kAllFormats[] = {Format::kFp8,
                                         Format::kNvfp4,
                                         Format::kMxfp8,
                                         Format::kMxfp4,
                                         Format::kInt8,
                                         Format::kFp8Block128,
                                         Format::kFp8Block128Ue8m0,
                                         Format::kLogfmt10,
                                         Format::kFp8Cast,
                                         Format::kFp8CastNan,
                                         Format::kFp8Block128Ue8m0NoFloor,
                                         Format::kFp8Block128Mori,
                                         Format::kFp4Block128Mori,
                                         Format::kFp8Block128DeepGemm,
                                         Format::kFp8Block128Vllm,
                                         Format::kFp4Block16FlashInfer};

// The numerics.h rule of a peer format (fp8_cast ... fp4_block16_flashinfer); nullopt for the others.
constexpr std::optional<PeerRule> peer_rule(Format f) {
  switch (f) {
    case Format::kFp8Cast: return PeerRule::kFp8Cast;
    case Format::kFp8CastNan: return PeerRule::kFp8CastNan;
    case Format::kFp8Block128Ue8m0NoFloor: return PeerRule::kUe8m0NoFloor;
    case Format::kFp8Block128Mori: return PeerRule::kMoriFp8Block;
    case Format::kFp4Block128Mori: return PeerRule::kMoriFp4Block;
    case Format::kFp8Block128DeepGemm: return PeerRule::kDeepGemmBlock;
    case Format::kFp8Block128Vllm: return PeerRule::kVllmBlock;
    case Format::kFp4Block16FlashInfer: return PeerRule::kFlashInferFp4;
    default: return std::nullopt;
  }
}

const char* format_name(Format f);
// The name of each format ("fp8", ..., "logfmt10", "fp8_cast", ..., "fp4_block16_flashinfer") to it;
// nullopt for anything else.
std::optional<Format> parse_format(std::string_view name);
// "fp8|nvfp4|...|fp4_block16_flashinfer", for messages.
std::string format_choices();
// Elements per block along the last dimension; 0 for the per-tensor formats.
int format_block_size(Format f);
// Whether the format has a global (per-tensor) amax: fp8, nvfp4, int8. The others scale each block
// from its own data.
bool format_has_global_amax(Format f);

// Bytes one row of `cols` elements occupies on the wire in format f, its scales included; nullopt
// is the unquantized bf16 row (2 * cols), the reference the savings are measured against. A short
// final block carries a whole scale; 4-bit elements round up to whole bytes.
//   fp8, int8: cols (the one per-tensor scale is amortised over the tensor: counted as 0);
//   nvfp4:     cols / 2 + cols / 16 (an e4m3 scale per block of 16);
//   mxfp8:     cols + cols / 32     (a ue8m0 scale per block of 32);
//   mxfp4:     cols / 2 + cols / 32;
//   fp8_block128:       cols + 4 * cols / 128 (an fp32 scale per block of 128);
//   fp8_block128_ue8m0: cols + cols / 128     (a ue8m0 scale per block of 128);
//   logfmt10:  10 * cols / 8 + 4 * cols / 128 (bf16 amax and amin per block of 128), the size when
//              every group is cast, as DeepEP counts it; a group sent as bf16 takes 2 bytes per
//              element instead;
//   fp8_cast, fp8_cast_nan:     cols (no scale);
//   fp8_block128_ue8m0_nofloor: cols + cols / 128;
//   fp8_block128_mori, fp8_block128_deepgemm, fp8_block128_vllm: cols + 4 * cols / 128;
//   fp4_block128_mori:          cols / 2 + 4 * cols / 128 (an fp32 scale per block of 128);
//   fp4_block16_flashinfer:     cols / 2 + 2 * cols / 16  (a bf16 block maximum per block of 16).
double wire_bytes_per_row(std::optional<Format> f, int64_t cols);

enum class DType { kBF16, kF32 };

// max |x| over the non-NaN elements (+inf counts), 0 for an empty tensor: the "dynamic" amax.
float amax_ref(const bf16* x, int64_t n);
float amax_ref(const float* x, int64_t n);

// y = QDQ_f(x) with the given global amax (ignored by the formats without one). x, y: [rows, cols].
// y may alias x. logfmt10 works on bf16 values: an fp32 tensor is rounded to bf16 first.
void qdq_ref(Format f, const bf16* x, bf16* y, int64_t rows, int64_t cols, float amax);
void qdq_ref(Format f, const float* x, float* y, int64_t rows, int64_t cols, float amax);

// The engine's e4m3 staging cast (docs/numerics.md). x: [rows, cols] bf16; x8: [rows, cols] e4m3;
// scales: [rows, ceil(cols / 128)] fp32 (the dequantization scale sf of each 1 x 128 block).
void stage_e4m3_ref(const bf16* x, uint8_t* x8, float* scales, int64_t rows, int64_t cols);
// The same for fp32 input (the engine re-stages the SwiGLU output h this way).
void stage_e4m3_ref(const float* x, uint8_t* x8, float* scales, int64_t rows, int64_t cols);

}  // namespace moefq
