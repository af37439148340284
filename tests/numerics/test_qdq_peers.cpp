// The other peers' wire formats (numerics.h PeerRule, docs/numerics.md): fp8_cast, fp8_cast_nan,
// fp8_block128_ue8m0_nofloor, fp8_block128_mori, fp4_block128_mori, fp8_block128_deepgemm,
// fp8_block128_vllm and fp4_block16_flashinfer, against a scalar reference written here on slow_ref.h's integer arithmetic
// (it shares nothing with numerics.h), on every bf16 pattern, on rows whose block maxima sweep the
// range, on fp32 data, and on the edges each peer's rule decides: maxima below 1e-4 and above 448,
// zero blocks, NaN, +-inf and subnormals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "moefq/numerics.h"
#include "moefq/qdq.h"
#include "numerics/slow_ref.h"

namespace moefq {
namespace {

namespace s = slow;

constexpr Format kPeerFormats[] = {Format::kFp8Cast,         Format::kFp8CastNan,          Format::kFp8Block128Ue8m0NoFloor,
                                   Format::kFp8Block128Mori, Format::kFp4Block128Mori,    Format::kFp8Block128DeepGemm,
                                   Format::kFp8Block128Vllm, Format::kFp4Block16FlashInfer};

// The reference: slow_ref.h's qdq_values (peer_elem per element from the block's maximum).
std::vector<float> ref_values(Format f, const std::vector<float>& x, int64_t rows, int64_t cols) {
  EXPECT_TRUE(s::is_peer(f)) << "not a peer format";
  return s::qdq_values(f, x, rows, cols, 0.0f);
}

// qdq_ref on bf16 input against the reference: the first mismatch, or "".
std::string check_bf16(Format f, const std::vector<uint16_t>& bits, int64_t rows, int64_t cols) {
  std::vector<bf16> x(bits.size()), y(bits.size());
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) {
    x[i].bits = bits[i];
    v[i] = s::bf16_value(bits[i]);
  }
  qdq_ref(f, x.data(), y.data(), rows, cols, 0.0f);
  const std::vector<float> want = ref_values(f, v, rows, cols);
  for (size_t i = 0; i < bits.size(); ++i)
    if (y[i].bits != s::store_bf16(want[i]))
      return std::string(format_name(f)) + " element " + std::to_string(i) + ": x bits " + std::to_string(bits[i]) +
             ", got " + std::to_string(y[i].bits) + ", want " + std::to_string(s::store_bf16(want[i]));
  return "";
}

std::string check_f32(Format f, const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<float> y(v.size());
  qdq_ref(f, v.data(), y.data(), rows, cols, 0.0f);
  const std::vector<float> want = ref_values(f, v, rows, cols);
  for (size_t i = 0; i < v.size(); ++i)
    if (s::f32_to_bits(y[i]) != s::store_f32(want[i]))
      return std::string(format_name(f)) + " fp32 element " + std::to_string(i) + ": x " + std::to_string(v[i]);
  return "";
}

// Every bf16 pattern, each in a block with several different maxima: the patterns in ascending
// order (blocks of one binade), shuffled (mixed blocks), and scaled so that each block's maximum
// lands below 1e-4, near 448 and above it.
TEST(PeerFormats, EveryBf16PatternAgainstTheReference) {
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = uint16_t(i);
  std::vector<uint16_t> shuffled = all;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937_64(7));
  for (Format f : kPeerFormats) {
    EXPECT_EQ(check_bf16(f, all, 512, 128), "");
    EXPECT_EQ(check_bf16(f, shuffled, 512, 128), "");
    EXPECT_EQ(check_bf16(f, shuffled, 256, 256), "");
    EXPECT_EQ(check_bf16(f, shuffled, 1, 65536), "");
  }
}

// Rows whose blocks are a normal body times 2^u for u from -140 to 20, with NaN, +-inf, zeros,
// subnormals and zero blocks scattered; bf16 and fp32; rows of 7168 and a short final block.
TEST(PeerFormats, ScaledRowsWithSpecials) {
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int64_t cols : {int64_t(7168), int64_t(300)}) {
    const int64_t rows = 24;
    std::vector<float> x(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < cols; b += 128) {
        const int u = int(rng() % 161) - 140;
        for (int64_t c = b; c < std::min(cols, b + 128); ++c) x[size_t(r * cols + c)] = std::ldexp(normal(rng), u);
      }
    for (size_t k = 0; k < x.size() / 40; ++k) {
      float& v = x[rng() % x.size()];
      switch (rng() % 7) {
        case 0: v = 0.0f; break;
        case 1: v = -0.0f; break;
        case 2: v = std::nanf(""); break;
        case 3: v = rng() % 4 == 0 ? -INFINITY : INFINITY; break;
        case 4: v = s::f32_from_bits(uint32_t(rng() % 0x7FFFFF + 1)); break;  // fp32 subnormal
        case 5: v = 449.0f + float(rng() % 100); break;
        default: v = 5e-5f; break;
      }
    }
    for (int64_t r = 0; r < rows; r += 3)
      for (int64_t c = 0; c < std::min<int64_t>(cols, 128); ++c) x[size_t(r * cols + c)] = 0.0f;
    std::vector<uint16_t> bits(x.size());
    std::vector<float> rounded(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      bits[i] = s::bf16_round(x[i]);
      rounded[i] = s::bf16_value(bits[i]);
    }
    for (Format f : kPeerFormats) {
      SCOPED_TRACE(cols);
      EXPECT_EQ(check_bf16(f, bits, rows, cols), "");
      EXPECT_EQ(check_f32(f, x, rows, cols), "");
      EXPECT_EQ(check_f32(f, rounded, rows, cols), "");
    }
  }
}

float qdq1(Format f, std::vector<float> block, size_t i) {
  std::vector<float> y(block.size());
  qdq_ref(f, block.data(), y.data(), 1, int64_t(block.size()), 0.0f);
  return y[i];
}

// The direct casts: 448 and what rounds to it stay, beyond is 448 (saturating) or NaN.
TEST(PeerFormats, DirectCastsAtTheEdgeOfTheRange) {
  for (float v : {448.0f, 449.0f, 464.0f, 1e30f, INFINITY}) {
    EXPECT_EQ(qdq1(Format::kFp8Cast, {v}, 0), 448.0f) << v;
    EXPECT_EQ(qdq1(Format::kFp8Cast, {-v}, 0), -448.0f) << v;
    if (v > 448.0f) {
      EXPECT_TRUE(std::isnan(qdq1(Format::kFp8CastNan, {v}, 0))) << v;
      EXPECT_TRUE(std::isnan(qdq1(Format::kFp8CastNan, {-v}, 0))) << v;
    }
  }
  EXPECT_EQ(qdq1(Format::kFp8CastNan, {448.0f}, 0), 448.0f);
  EXPECT_EQ(qdq1(Format::kFp8Cast, {0.3f}, 0), 0.3125f);               // 1.25 * 2^-2
  EXPECT_EQ(qdq1(Format::kFp8Cast, {std::ldexp(1.0f, -10)}, 0), 0.0f);  // below half the smallest subnormal 2^-9
  EXPECT_EQ(qdq1(Format::kFp8Cast, {std::ldexp(3.0f, -11)}, 0), std::ldexp(1.0f, -9));
  EXPECT_TRUE(std::signbit(qdq1(Format::kFp8Cast, {-1e-6f}, 0)));  // -0 keeps its sign
  EXPECT_TRUE(std::isnan(qdq1(Format::kFp8Cast, {std::nanf("")}, 0)));
}

// The SGLang fork's rule keeps blocks whose maximum is below 1e-4 (fp8_block128_ue8m0 floors it),
// and equals fp8_block128_ue8m0 above the floor.
TEST(PeerFormats, Ue8m0WithoutTheFloorKeepsTinyBlocks) {
  std::vector<float> x(128);
  for (int i = 0; i < 128; ++i) x[size_t(i)] = std::ldexp(float(i + 1), -40);  // max 2^-33
  std::vector<float> nofloor(128), floored(128);
  qdq_ref(Format::kFp8Block128Ue8m0NoFloor, x.data(), nofloor.data(), 1, 128, 0.0f);
  qdq_ref(Format::kFp8Block128Ue8m0, x.data(), floored.data(), 1, 128, 0.0f);
  // e = ceil(log2(2^-33 / 448)) = -41: the maximum 2^-33 is 256 * 2^-41, exact, and so is 2^-40.
  EXPECT_EQ(nofloor[127], std::ldexp(1.0f, -33));
  EXPECT_EQ(nofloor[0], std::ldexp(1.0f, -40));
  EXPECT_EQ(floored[0], 0.0f);  // the floored scale 2^-22 flushes 2^-40 (below 2^-9 * 2^-22 / 2)
  for (float& v : x) v *= 1e20f;
  qdq_ref(Format::kFp8Block128Ue8m0NoFloor, x.data(), nofloor.data(), 1, 128, 0.0f);
  qdq_ref(Format::kFp8Block128Ue8m0, x.data(), floored.data(), 1, 128, 0.0f);
  EXPECT_EQ(nofloor, floored);
  // A zero block stays zero (e = -127); a block with inf is NaN.
  EXPECT_EQ(qdq1(Format::kFp8Block128Ue8m0NoFloor, {0.0f, -0.0f}, 1), 0.0f);
  EXPECT_TRUE(std::isnan(qdq1(Format::kFp8Block128Ue8m0NoFloor, {1.0f, INFINITY}, 0)));
}

// MoRI's FP8 blockwise: unscaled (a plain cast, small values flushed) up to a maximum of 448,
// scaled above; its FP4: e2m1 times an fp32 scale max / 6.
TEST(PeerFormats, MoriBlockwise) {
  const std::vector<float> small = {448.0f, 0.001f, 3.3f};
  EXPECT_EQ(qdq1(Format::kFp8Block128Mori, small, 1), std::ldexp(1.0f, -9));  // rounds up to e4m3's smallest subnormal
  EXPECT_EQ(qdq1(Format::kFp8Block128Mori, small, 2), 3.25f);
  const std::vector<float> big = {896.0f, 1.0f};
  EXPECT_EQ(qdq1(Format::kFp8Block128Mori, big, 0), 896.0f);  // 448 * (896 * RN(1/448))
  EXPECT_EQ(qdq1(Format::kFp8Block128Mori, big, 1), 1.0f);
  EXPECT_TRUE(std::isnan(qdq1(Format::kFp8Block128Mori, {INFINITY, 1.0f}, 1)));
  EXPECT_EQ(qdq1(Format::kFp4Block128Mori, {6.0f, 2.5f, 0.2f}, 1), 2.0f);  // ties to the even code
  EXPECT_EQ(qdq1(Format::kFp4Block128Mori, {6.0f, 2.5f, 0.2f}, 2), 0.0f);
  EXPECT_EQ(qdq1(Format::kFp4Block128Mori, {12.0f, -5.0f}, 1), -4.0f);  // -2.5 -> -2, times 2
  EXPECT_EQ(qdq1(Format::kFp4Block128Mori, {0.0f, -0.0f}, 1), 0.0f);
  EXPECT_TRUE(std::isnan(qdq1(Format::kFp4Block128Mori, {INFINITY, 1.0f}, 1)));
}

// DeepGEMM's x * (1 / sf) and vLLM's x / sf differ by one e4m3 step on some elements; both keep
// the block maximum; DeepGEMM's is moefq's own e4m3 staging.
TEST(PeerFormats, DeepGemmAndVllmCastsDifferOnSomeElements) {
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t rows = 64, cols = 1024;
  std::vector<bf16> x(size_t(rows * cols)), dg(x.size()), vl(x.size());
  for (bf16& v : x) v.bits = bf16_round(normal(rng));
  qdq_ref(Format::kFp8Block128DeepGemm, x.data(), dg.data(), rows, cols, 0.0f);
  qdq_ref(Format::kFp8Block128Vllm, x.data(), vl.data(), rows, cols, 0.0f);
  int64_t differ = 0;
  for (size_t i = 0; i < x.size(); ++i) differ += dg[i].bits != vl[i].bits;
  EXPECT_GT(differ, 0);
  EXPECT_LT(differ, int64_t(x.size()) / 20);
  std::vector<uint8_t> x8(x.size());
  std::vector<float> sf(size_t(rows * cols / 128));
  stage_e4m3_ref(x.data(), x8.data(), sf.data(), rows, cols);
  for (int64_t i = 0; i < rows * cols; ++i)
    ASSERT_EQ(dg[size_t(i)].bits, bf16_round(stage_decode(x8[size_t(i)], sf[size_t(i / 128)]))) << i;
}

// The combine kernels' sum-exact form of each rule equals the rule on every bf16 x, for block
// parameters from maxima across the range (tiny, below 1e-4, around 448, huge, inf), up to the sign
// of a zero and a NaN's payload, after the bf16 rounding the kernels apply.
template <PeerRule R>
std::string sum_form_mismatch() {
  const float maxima[] = {0.0f,   1e-38f, 3e-30f, 2e-5f, 9.99e-5f, 1e-4f,  0.37f,  1.0f, 6.0f,
                          447.9f, 448.0f, 449.0f, 464.0f, 1e4f,    3e38f, INFINITY};
  for (float bmax : maxima) {
    const PeerParams p = peer_params<R>(bmax);
    for (uint32_t b = 0; b < 65536; ++b) {
      const float x = bf16_to_f32(uint16_t(b));
      const uint16_t want = bf16_round(peer_qdq<R>(x, p)), got = bf16_round(peer_qdq_sum<R>(x, p));
      const bool same = want == got || ((want & 0x7FFF) == 0 && (got & 0x7FFF) == 0);
      if (!same)
        return "bmax " + std::to_string(bmax) + " x bits " + std::to_string(b) + ": " + std::to_string(want) +
               " vs " + std::to_string(got);
    }
  }
  return "";
}

TEST(PeerFormats, SumExactFormsEqualTheRules) {
  EXPECT_EQ(sum_form_mismatch<PeerRule::kFp8Cast>(), "");
  EXPECT_EQ(sum_form_mismatch<PeerRule::kFp8CastNan>(), "");
  EXPECT_EQ(sum_form_mismatch<PeerRule::kUe8m0NoFloor>(), "");
  EXPECT_EQ(sum_form_mismatch<PeerRule::kMoriFp8Block>(), "");
  EXPECT_EQ(sum_form_mismatch<PeerRule::kMoriFp4Block>(), "");
  EXPECT_EQ(sum_form_mismatch<PeerRule::kDeepGemmBlock>(), "");
  EXPECT_EQ(sum_form_mismatch<PeerRule::kVllmBlock>(), "");
  EXPECT_EQ(sum_form_mismatch<PeerRule::kFlashInferFp4>(), "");
}

TEST(PeerFormats, NamesBlocksAndWireBytes) {
  constexpr int64_t kH = 7168;
  for (Format f : kPeerFormats) {
    EXPECT_EQ(parse_format(format_name(f)), f);
    EXPECT_FALSE(format_has_global_amax(f));
    EXPECT_TRUE(peer_rule(f).has_value());
  }
  EXPECT_EQ(format_block_size(Format::kFp8Cast), 0);
  EXPECT_EQ(format_block_size(Format::kFp4Block128Mori), 128);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8Cast, kH), 7168.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8CastNan, kH), 7168.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8Block128Ue8m0NoFloor, kH), 7168.0 + 56.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8Block128Mori, kH), 7168.0 + 224.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp4Block128Mori, kH), 3584.0 + 224.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8Block128DeepGemm, kH), 7168.0 + 224.0);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp8Block128Vllm, 129), 129.0 + 8.0);
  EXPECT_EQ(format_block_size(Format::kFp4Block16FlashInfer), 16);
  EXPECT_EQ(wire_bytes_per_row(Format::kFp4Block16FlashInfer, kH), 3584.0 + 896.0);  // a bf16 per 16
  EXPECT_EQ(wire_bytes_per_row(Format::kFp4Block16FlashInfer, 129), 65.0 + 18.0);
}

// FlashInfer's Mega-MoE nvfp4 combine (16e2m1xbf16): e2m1 per 16 with d = bf16(bmax) * RN(1/6) and
// enc = RN(1/d) times min(d * 1e30, 1): the block maximum comes back exactly for these maxima, ties
// go to the even code, zero blocks stay zero, inf makes the block NaN, and blocks below 6e-30 are
// shrunk by the mask (the peer's arithmetic, reproduced).
TEST(PeerFormats, FlashInferFp4) {
  const Format f = Format::kFp4Block16FlashInfer;
  EXPECT_EQ(qdq1(f, {6.0f, 2.5f, 0.2f}, 0), 6.0f);  // d = RN(6 * RN(1/6)) = 1
  EXPECT_EQ(qdq1(f, {6.0f, 2.5f, 0.2f}, 1), 2.0f);
  EXPECT_EQ(qdq1(f, {6.0f, 2.5f, 0.2f}, 2), 0.0f);
  EXPECT_EQ(qdq1(f, {1.0f, -0.3f}, 0), 1.0f);  // enc = RN(1 / RN(1/6)) = 6
  EXPECT_EQ(qdq1(f, {1.0f, -0.3f}, 1), -s::mul_rn(2.0f, s::div_rn(1.0f, 6.0f)));  // -1.8 -> -2
  EXPECT_EQ(qdq1(f, {0.0f, -0.0f}, 1), 0.0f);
  EXPECT_TRUE(std::isnan(qdq1(f, {INFINITY, 1.0f}, 1)));
  EXPECT_TRUE(std::isnan(qdq1(f, {std::nanf(""), 1.0f}, 0)));
  EXPECT_EQ(qdq1(f, {std::nanf(""), 1.0f}, 1), 1.0f);  // NaN is left out of the maximum
  // Blocks of 16: the second block keeps its own scale.
  std::vector<float> two(32, 1e-3f);
  two[0] = 100.0f;
  std::vector<float> y(32);
  qdq_ref(f, two.data(), y.data(), 1, 32, 0.0f);
  EXPECT_EQ(y[1], 0.0f);
  EXPECT_NEAR(y[16], 1e-3f, 1e-3f / 8);
  // Below d = 1e-30 the mask shrinks enc: a block of maximum 6e-31 comes back well below it.
  const float tiny = qdq1(f, {6e-31f, 3e-31f}, 0);
  EXPECT_GT(tiny, 0.0f);
  EXPECT_LT(tiny, 6e-31f / 4);
}

// combine_weighting after adds each row as one fma (numerics.h weighted_add).
TEST(PeerFormats, WeightedAddIsOneFma) {
  const float x = 1.0f + std::ldexp(1.0f, -7), w = 1.0f + std::ldexp(1.0f, -20);
  const float acc = -s::mul_rn(x, w);  // -(1 + 2^-7 + 2^-20), the product rounded
  EXPECT_EQ(weighted_add(acc, x, w), std::ldexp(1.0f, -27));
  EXPECT_EQ(weighted_add(acc, x, w), s::fma_rn(x, w, acc));
}

}  // namespace
}  // namespace moefq

namespace moefq {
namespace {

// FlashInfer's Mega-MoE mxfp8 scale (docs/numerics.md): r = bmax * RN(1/448), converted to ue8m0
// rounding toward +inf (the exponent field, plus one when the mantissa is not zero). Emulated here
// with slow_ref.h's exact multiply: on every positive finite bf16 maximum whose scale is normal
// (bmax >= 448 x 2^-126), its exponent is mxfp8's, so the peer's mxfp8 combine is moefq's mxfp8 on
// bf16 rows. The same holds with the reciprocal one ulp below RN(1/448); one ulp above, it differs
// exactly on the maxima 1.75 x 2^k (bmax / 448 a power of two), which matters for TensorRT-LLM's
// rcp.approx(448) only if that is not RN(1/448).
TEST(PeerFormats, FlashInferMxfp8ScaleIsMxfp8s) {
  const float rn = s::div_rn(1.0f, 448.0f);
  ASSERT_EQ(s::f32_to_bits(rn), 0x3B124925u);
  const float recips[] = {rn, std::nextafter(rn, 0.0f), std::nextafter(rn, 1.0f)};
  const float smallest = s::mul_rn(448.0f, std::ldexp(1.0f, -126));
  int checked = 0;
  for (uint32_t b = 1; b < 0x7F80u; ++b) {
    const float bmax = s::bf16_value(uint16_t(b));
    if (bmax < smallest) continue;
    const bool pow2_ratio = (b & 0x7Fu) == 0x60u;  // bmax = 1.75 x 2^k
    for (const float r : recips) {
      const uint32_t u = s::f32_to_bits(s::mul_rn(bmax, r));
      const int e = int(u >> 23) - 127 + ((u & 0x7FFFFFu) != 0 ? 1 : 0);  // ue8m0, toward +inf
      const int want = mx_block_exponent(bmax, kE4m3Max) + (r > rn && pow2_ratio ? 1 : 0);
      ASSERT_EQ(e, want) << "bmax bits " << b << ", rcp bits " << s::f32_to_bits(r);
    }
    ++checked;
  }
  EXPECT_GT(checked, 30000);
  // bmax = 1.75 x 2^k gives bmax / 448 = 2^(k - 8) exactly; the product with RN(1/448) is 2^(k - 8)
  // (1 + 3 x 2^-26), which still rounds to that power of two.
  EXPECT_EQ(s::mul_rn(448.0f, rn), 1.0f);
}

}  // namespace
}  // namespace moefq
