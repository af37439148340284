// The kernels' shortcuts are exact: division by a per-block reciprocal (div_rn_recip) gives the
// correctly rounded quotient wherever the QDQ rules use it, and e2m1_round_sat equals the code
// path. Checked over every bf16 input and every block scale the rules can produce, and over every
// non-negative binary32 for e2m1.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "moefq/numerics.h"

namespace moefq {
namespace {

// Global scales of nvfp4 for a spread of amax values, including the constant 2688 (gs = 1).
std::vector<float> global_scales() {
  std::vector<float> gs;
  for (float amax : {2688.0f, 1.0f, 448.0f, 6.0f, 0.37f, 1234.5f, 3.3e38f, 1e-20f, 0.0f})
    gs.push_back(nvfp4_global_scale(amax));
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> log_amax(-30.0f, 120.0f);
  for (int i = 0; i < 8; ++i) gs.push_back(nvfp4_global_scale(std::exp2(log_amax(rng))));
  return gs;
}

TEST(Division, Nvfp4ReciprocalPathEqualsDivisionOnEveryBf16AndScale) {
  int64_t checked = 0, mismatches = 0;
  for (float gs : global_scales()) {
    for (int sf = 0; sf < 0x7F; ++sf) {  // every finite non-negative e4m3 block scale code
      float scale = mul_rn(e4m3_decode(uint8_t(sf)), gs);
      if (scale < 1e-5f) scale = 1.0f;
      const float rcp = div_rn(1.0f, scale);
      for (uint32_t b = 0; b < 65536; ++b) {
        const float x = bf16_to_f32(uint16_t(b));
        float want, got, unclamped;  // as stored (NaN canonical)
        store_out(&want, nvfp4_qdq(x, scale));
        store_out(&got, nvfp4_qdq_recip(x, scale, rcp));
        // Where a block with max |x| = |x| would skip the clamp, the unclamped path must agree.
        if (!nvfp4_block_needs_clamp(abs_f32(x), rcp)) {
          store_out(&unclamped, nvfp4_qdq_recip<false>(x, scale, rcp));
          if (f32_bits(unclamped) != f32_bits(want) && mismatches++ < 5)
            ADD_FAILURE() << "unclamped: x=0x" << std::hex << f32_bits(x) << " scale=0x" << f32_bits(scale);
        }
        ++checked;
        if (f32_bits(want) != f32_bits(got) && mismatches++ < 5)
          ADD_FAILURE() << "x=0x" << std::hex << f32_bits(x) << " scale=0x" << f32_bits(scale)
                        << " want 0x" << f32_bits(want) << " got 0x" << f32_bits(got);
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << checked;
}

// The combine's nvfp4 element rules (numerics.h, "Sum-exact element rules") where the combine takes
// them: the QDQ's value after the bf16 rounding, up to the sign of a zero and a NaN's payload (which
// an fp32 sum from +0 cannot see), on every bf16 x and block scale. Clamped on every x, unclamped
// where a block holding x needs no clamp, tame where such a block is tame. (The GPU test
// CombineCuda.SumExactRulesEqualTheQdqRulesOnEveryInput checks the device instructions.)
TEST(Division, Nvfp4SumRulesEqualQdqOnEveryBf16AndScale) {
  const auto value = [](float v) { return bf16_to_f32(bf16_round(v)); };
  const auto same_in_sum = [](float a, float b) { return is_nan(a) ? is_nan(b) : a == b; };
  int64_t mismatches = 0;
  for (float gs : global_scales()) {
    for (int sf = 0; sf <= 0x7F; ++sf) {  // the NaN code too
      const float scale = nvfp4_scale_from_code(uint8_t(sf), gs), rcp = div_rn(1.0f, scale);
      for (uint32_t b = 0; b < 65536; ++b) {
        const float x = bf16_to_f32(uint16_t(b)), want = value(nvfp4_qdq(x, scale)), bmax = abs_f32(x);
        const auto expect = [&](const char* rule, float got) {
          if (!same_in_sum(want, value(got)) && mismatches++ < 5)
            ADD_FAILURE() << rule << ": gs=" << gs << " code " << sf << " x=" << x << ": want " << want << " got " << got;
        };
        expect("clamped", nvfp4_qdq_sum_clamped(x, scale, rcp));
        if (!nvfp4_block_needs_clamp(bmax, rcp)) expect("unclamped", nvfp4_qdq_sum_unclamped(x, scale, rcp));
        if (nvfp4_block_is_tame(bmax, rcp)) expect("tame", nvfp4_qdq_sum_tame(x, scale, rcp));
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Division, Nvfp4ReciprocalPathEqualsDivisionOnRandomFp32) {
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits;
  int64_t mismatches = 0;
  for (float gs : global_scales()) {
    for (int i = 0; i < 400000; ++i) {
      float scale = mul_rn(e4m3_decode(uint8_t(bits(rng) % 0x7F)), gs);
      if (scale < 1e-5f) scale = 1.0f;
      // x near the e2m1 boundaries of this scale, and anywhere at all
      const float boundary[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 8.0f};
      float x = i % 2 ? f32_from_bits(bits(rng))
                      : f32_from_bits(f32_bits(mul_rn(boundary[bits(rng) % 8], scale)) + (bits(rng) % 9) - 4);
      const float rcp = div_rn(1.0f, scale);
      float want, got;
      store_out(&want, nvfp4_qdq(x, scale));
      store_out(&got, nvfp4_qdq_recip(x, scale, rcp));
      if (f32_bits(want) != f32_bits(got)) ++mismatches;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Division, Nvfp4BlockCodeReciprocalPathEqualsDivision) {
  std::vector<float> gss = global_scales();
  for (float amax : {1e-30f, 1e-38f, 3e-45f, 5e-39f, 1e38f}) gss.push_back(nvfp4_global_scale(amax));
  std::mt19937 rng(17);
  std::uniform_int_distribution<uint32_t> bits(0, 0x7F800000u);
  int64_t mismatches = 0;
  for (float gs : gss) {
    const float rcp6 = div_rn(1.0f, mul_rn(6.0f, gs));
    auto check = [&](float bmax) {
      if (nvfp4_block_code(bmax, gs) != nvfp4_block_code_recip(bmax, gs, rcp6) && mismatches++ < 5)
        ADD_FAILURE() << "gs=" << gs << " bmax=" << bmax;
    };
    for (uint32_t b = 0; b <= 0x7F80; ++b) check(bf16_to_f32(uint16_t(b)));  // every non-negative bf16
    for (int i = 0; i < 200000; ++i) check(f32_from_bits(bits(rng)));
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Division, Int8ReciprocalPathEqualsDivision) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> log_amax(-24.0f, 126.9f);
  int64_t mismatches = 0;
  for (int i = 0; i < 300; ++i) {
    const float amax = i == 0 ? 5.9604644775390625e-08f : std::exp2(log_amax(rng));
    const Int8Params p = int8_params(amax);
    const float rcp = div_rn(1.0f, p.s);
    for (uint32_t b = 0; b < 65536; b += (i < 20 ? 1 : 7)) {
      const float x = bf16_to_f32(uint16_t(b));
      if (f32_bits(int8_qdq(x, p)) != f32_bits(int8_qdq_recip(x, p, rcp)) && mismatches++ < 5)
        ADD_FAILURE() << "amax=" << amax << " x=" << x;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Division, E2m1RoundSatKeepsNan) { EXPECT_TRUE(is_nan(e2m1_round_sat(canonical_nan_f32()))); }

TEST(Division, E2m1RoundSatEqualsCodePathOnEveryNonNegativeFloat) {
  int64_t mismatches = 0;
  for (uint64_t u = 0; u <= 0x7F800000u; ++u) {  // +0 .. +inf
    const float v = f32_from_bits(uint32_t(u));
    if (f32_bits(e2m1_round_sat(v)) != f32_bits(e2m1_decode(e2m1_encode_sat(v))) && mismatches++ < 5)
      ADD_FAILURE() << "v=0x" << std::hex << u;
  }
  EXPECT_EQ(mismatches, 0);
}

}  // namespace
}  // namespace moefq
