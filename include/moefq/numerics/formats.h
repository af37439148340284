// The formats' constants: bf16 storage, the largest finite values and NaN codes of e4m3, e5m2,
// e2m1 and ue8m0, and the block sizes of the blocked formats. Part of moefq/numerics.h.
#pragma once

#include <cstdint>

namespace moefq {

// bf16 storage: the raw bits, so CPU headers need no CUDA type.
struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2);

inline constexpr float kE4m3Max = 448.0f;
inline constexpr float kE2m1Max = 6.0f;
inline constexpr float kE5m2Max = 57344.0f;
inline constexpr float kFltMax = 3.40282346638528859812e+38f;
inline constexpr uint32_t kCanonicalNanF32 = 0x7FFFFFFFu;
inline constexpr uint16_t kCanonicalNanBf16 = 0x7FFF;
inline constexpr uint8_t kE4m3Nan = 0x7F;
inline constexpr uint8_t kE5m2Nan = 0x7F;
inline constexpr uint8_t kUe8m0Nan = 0xFF;

inline constexpr int kNvfp4Block = 16;
inline constexpr int kMxBlock = 32;
inline constexpr int kStageBlock = 128;  // e4m3 staging: 1 x 128 blocks along H

}  // namespace moefq
