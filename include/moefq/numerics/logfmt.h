// LogFMT-10, DeepEP's logarithmic combine format: block parameters, codes and QDQ, on the
// binary32 log2 / exp2 of elementary.h. Part of moefq/numerics.h.
#pragma once

#include <cstdint>

#include "moefq/numerics/elementary.h"

namespace moefq {

// ---------------------------------------------------------------------------------------------
// LogFMT-10 (DeepEP's low-latency combine, csrc/kernels/legacy/internode_ll.cu logfmt_encode and
// decode_and_accumulate): per block of 128 channels of a bf16 row, amax and amin of |x|; the
// block's magnitudes are coded on a log-uniform grid of 511 values from 2^log_amin to 2^log_amax
// (code 0 = zero), 9 bits plus a sign; a block is cast only when log2(amax) < 0 and log_amin <
// log2(amax), and only when every block of its cast group is (DeepEP's send unit: 1024 channels when
// the row length is a multiple of 1024, else 512); other groups are sent as bf16. DeepEP computes
// its logarithms with lg2.approx / ex2.approx; moefq uses log2_f32 / exp2_f32 in exactly the same
// formulas (its CPU and GPU agree bit for bit), and keeps NaN as NaN where DeepEP codes it as zero.
inline constexpr int kLogFmtBlock = 128;
inline constexpr int kLogFmtMaxCode = 511;       // 9-bit magnitude codes, 1..511 on the grid
inline constexpr float kLogFmtSteps = 510.0f;    // DeepEP's kNumValues - 2: steps from amin to amax
inline constexpr float kLogFmtMinClip = 32.0f;   // log_amin >= log_amax - 32
// Blocks per cast group for a row of `cols` elements (the last group may be short).
MOEFQ_HD int logfmt_group_blocks(int64_t cols) { return cols % 1024 == 0 ? 8 : 4; }

struct LogFmtBlock {
  float log_amin;  // the grid's first value is 2^log_amin (code 1)
  float step;      // log2 of the grid's ratio
  float step_inv;  // 1 / step
  float fused;     // the encoder's offset: code = floor(log2|x| * step_inv + fused)
  bool ok;         // the block alone could be cast
};
// From the block's amax and amin of |x| over its non-NaN elements (bf16 values; amax 0 and amin
// +inf for a block with none): DeepEP's formulas, in its order, with its contractions (fma where
// nvcc contracts a * b + c).
MOEFQ_HD LogFmtBlock logfmt_block(float amax, float amin) {
  LogFmtBlock b;
  const float log_amax = log2_f32(amax);
  const float clip = add_rn(log_amax, -kLogFmtMinClip);
  const float log_amin_raw = log2_f32(amin);  // -inf for 0, so the clip applies (fmaxf's rule)
  const float log_amin = log_amin_raw > clip ? log_amin_raw : clip;
  b.ok = log_amax < 0.0f && log_amin < log_amax;
  b.log_amin = log_amin;
  b.step = div_rn(add_rn(log_amax, -log_amin), kLogFmtSteps);
  b.step_inv = div_rn(1.0f, b.step);
  // rounding = 2 - log2((1 + 2^step) / 2) / step: codes change at the linear midpoints of the grid.
  const float rounding = fma_rn(-log2_f32(mul_rn(add_rn(1.0f, exp2_f32(b.step)), 0.5f)), b.step_inv, 2.0f);
  b.fused = fma_rn(-log_amin, b.step_inv, rounding);
  return b;
}
// The code of |x| (0..511) from t = log2|x| * step_inv + fused: below 1 is code 0 (zero), and codes
// are capped at 511 (the 9-bit field; reached only by rounding at amax).
MOEFQ_HD float logfmt_code(float t) {
  if (!(t >= 1.0f)) return 0.0f;
  const float k = floor_f32(t);
  return k < float(kLogFmtMaxCode) ? k : float(kLogFmtMaxCode);
}
// log2 of code k's grid value (k >= 1): (k - 1) * step + log_amin, in [log_amin, log_amax].
MOEFQ_HD float logfmt_grid_log2(float k, const LogFmtBlock& b) { return fma_rn(add_rn(k, -1.0f), b.step, b.log_amin); }
// The decoded magnitude of code k >= 1: 2^((k - 1) * step + log_amin).
MOEFQ_HD float logfmt_decode(float k, const LogFmtBlock& b) { return exp2_f32(logfmt_grid_log2(k, b)); }
// QDQ of one element x (a bf16 value) of a cast block, given l = log2_f32(|x|) (kernels read it from
// a table): NaN stays NaN, zero codes keep the sign.
MOEFQ_HD float logfmt_qdq_log2(float x, float l, const LogFmtBlock& b) {
  if (is_nan(x)) return canonical_nan_f32();
  const float k = logfmt_code(fma_rn(l, b.step_inv, b.fused));
  return copysign_f32(k == 0.0f ? 0.0f : logfmt_decode(k, b), x);
}
MOEFQ_HD float logfmt_qdq(float x, const LogFmtBlock& b) { return logfmt_qdq_log2(x, log2_f32(abs_f32(x)), b); }
// logfmt_qdq for a bf16 value x with log2 read from `table` (log2_bf16_normal's) where x is a
// normal bf16; subnormals, zeros and NaN take log2_f32.
MOEFQ_HD float logfmt_qdq_table(float x, const LogFmtBlock& b, const float* table) {
  const uint32_t mag = (f32_bits(x) >> 16) & 0x7FFFu;
  return logfmt_qdq_log2(x, mag - 0x80u < 0x7F00u ? log2_bf16_normal(mag, table) : log2_f32(abs_f32(x)), b);
}
// The same value without branches, for blocks with log_amin >= -126 and x normal, zero or NaN (not
// subnormal): the table's log2 for every element, exp2_f32_normal for the decode (grid values lie
// in [2^log_amin, 2^log_amax] with log_amax < 0, where it gives exp2_f32's bits), and zeros (code
// 0, or x = +-0, whose table value is not log2 0) and NaN chosen at the end.
MOEFQ_HD float logfmt_qdq_table_normal(float x, const LogFmtBlock& b, const float* table) {
  const uint32_t mag = (f32_bits(x) >> 16) & 0x7FFFu;
  const float k = logfmt_code(fma_rn(log2_bf16_normal(mag, table), b.step_inv, b.fused));
  const float r = exp2_f32_normal(logfmt_grid_log2(k, b));
  return mag > 0x7F80u ? canonical_nan_f32() : copysign_f32(k == 0.0f || mag == 0 ? 0.0f : r, x);
}

}  // namespace moefq
