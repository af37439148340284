// The expert-parallel libraries' wire formats (numerics.h): fp8_block128, fp8_block128_ue8m0 and
// logfmt10, against the slow reference on data that exercises them (LogFMT casts only blocks below
// 1), on values they keep exactly, on their scale rules, and against a float emulation of DeepEP's
// LogFMT kernel (how often its approximate logarithms would give another bf16 than ours).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "moefq/numerics.h"
#include "moefq/qdq.h"
#include "numerics/slow_ref.h"

namespace moefq {
namespace {

using slow::f32_from_bits;
using slow::f32_to_bits;
using slow::Mismatches;

// Rows like combine rows: per block of 128 a normal body times 2^u (u uniform in [lo, hi]), a few
// outliers x 20; with `specials`, scattered zeros, bf16 subnormals, NaN, a whole zero block per
// row, and (rarely) an inf.
std::vector<float> combine_like(int64_t rows, int64_t cols, uint64_t seed, int lo, int hi, bool specials) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < cols; b += 128) {
      const int u = lo + int(rng() % uint64_t(hi - lo + 1));
      for (int64_t c = b; c < std::min(cols, b + 128); ++c) {
        float v = std::ldexp(normal(rng), u);
        if (rng() % 200 == 0) v *= 20.0f;
        x[size_t(r * cols + c)] = v;
      }
    }
  if (specials) {
    for (int64_t k = 0; k < rows * cols / 50 + 1; ++k) {
      float& v = x[rng() % x.size()];
      switch (rng() % 6) {
        case 0: v = 0.0f; break;
        case 1: v = -0.0f; break;
        case 2: v = f32_from_bits(uint32_t(rng() % 0x7Fu + 1) << 16); break;  // bf16 subnormal
        case 3: v = std::nanf(""); break;
        case 4: v = (rng() % 8 == 0) ? INFINITY : -1e-30f; break;
        default: v = std::ldexp(1.0f, -100 - int(rng() % 30)); break;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = int64_t(rng() % uint64_t((cols + 127) / 128)) * 128;
      for (int64_t c = b; c < std::min(cols, b + 128); ++c) x[size_t(r * cols + c)] = 0.0f;
    }
  }
  return x;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = slow::bf16_round(x[i]);
  return b;
}

std::string shape_label(Format f, const char* dtype, int64_t rows, int64_t cols, const std::string& what) {
  return std::string(format_name(f)) + " " + dtype + " [" + std::to_string(rows) + " x " + std::to_string(cols) +
         "] " + what;
}

// qdq_ref against the slow reference, bf16 and fp32; returns the fraction of bf16 elements changed.
double expect_matches_slow(Format f, const std::vector<float>& x, int64_t rows, int64_t cols, const std::string& what) {
  const std::vector<uint16_t> xb = to_bf16(x);
  std::vector<bf16> in(x.size()), out(x.size());
  for (size_t i = 0; i < x.size(); ++i) in[i].bits = xb[i];
  qdq_ref(f, in.data(), out.data(), rows, cols, 0.0f);
  const std::vector<uint16_t> want = slow::qdq_bf16(f, xb, rows, cols, 0.0f);
  Mismatches mb(shape_label(f, "bf16", rows, cols, what));
  int64_t changed = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    mb.add(xb[i], want[i], out[i].bits, 4, 4, "element " + std::to_string(i));
    changed += out[i].bits != xb[i];
  }
  EXPECT_EQ(mb.count(), 0) << mb.report();

  std::vector<uint32_t> xf(x.size());
  for (size_t i = 0; i < x.size(); ++i) xf[i] = f32_to_bits(x[i]);
  std::vector<float> yf(x.size());
  qdq_ref(f, x.data(), yf.data(), rows, cols, 0.0f);
  const std::vector<uint32_t> wantf = slow::qdq_f32(f, xf, rows, cols, 0.0f);
  Mismatches mf(shape_label(f, "fp32", rows, cols, what));
  for (size_t i = 0; i < x.size(); ++i) mf.add(xf[i], wantf[i], f32_to_bits(yf[i]), 8, 8, "element " + std::to_string(i));
  EXPECT_EQ(mf.count(), 0) << mf.report();
  return double(changed) / double(x.size());
}

constexpr Format kWireFormats[] = {Format::kFp8Block128, Format::kFp8Block128Ue8m0, Format::kLogfmt10};

// Rows of 1024 multiples (cast groups of 8 blocks), of 512 multiples and others (groups of 4, a
// short last group), short final blocks; magnitudes from 2^-20 to 2^-1 (most LogFMT blocks cast)
// and up to 2^3 (some groups kept as bf16).
TEST(WireFormats, CombineLikeRowsAgainstTheSlowReference) {
  struct Case {
    int64_t rows, cols;
    int lo, hi;
  };
  const Case cases[] = {{3, 1024, -14, -6}, {2, 2560, -20, -7}, {3, 7168, -12, -6}, {4, 1536, -10, -6},
                        {5, 700, -10, 3},   {4, 129, -6, -1},   {2, 7168 + 5, -9, 0}, {6, 256, -2, 3}};
  uint64_t seed = 1;
  for (Format f : kWireFormats)
    for (const Case& c : cases)
      for (bool specials : {false, true}) {
        const double changed = expect_matches_slow(f, combine_like(c.rows, c.cols, seed++, c.lo, c.hi, specials), c.rows,
                                                   c.cols, specials ? "combine-like, specials" : "combine-like");
        // The data must exercise the format: a LogFMT case whose groups all stayed bf16 tests nothing
        // (a block of zeros, one >= 1 or an inf keeps its whole group bf16, so only the clean small
        // cases are sure to cast; most bf16 values change in a cast block, most in any fp8 block).
        if (f != Format::kLogfmt10 || (c.hi <= -6 && !specials)) {
          EXPECT_GT(changed, specials ? 0.25 : 0.5) << format_name(f) << " " << c.cols;  // zero blocks change nothing
        }
      }
}

// ---------------------------------------------------------------------------------------------
// fp8_block128 and fp8_block128_ue8m0

// A block whose maximum is 448 * 2^k (k >= -22, so above the 1e-4 floor) has s = 2^-k and si =
// 448 * 2^k * RN(1/448) = 2^k exactly (448 * RN(1/448) = 1 + 2^-24.4 rounds to 1): e4m3 values
// times 2^k come back unchanged in both formats.
TEST(WireFormats, Fp8BlocksKeepBlockScaledE4m3Values) {
  std::mt19937_64 rng(3);
  for (Format f : {Format::kFp8Block128, Format::kFp8Block128Ue8m0}) {
    const int64_t rows = 7, cols = 128 * 3 + 50;
    std::vector<float> x(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < cols; b += 128) {
        const int k = -22 + int(rng() % 40);
        for (int64_t c = b; c < std::min(cols, b + 128); ++c) {
          float v = slow::e4m3_decode(uint8_t(rng() % 256));
          if (std::isnan(v)) v = 0.5f;
          if (c == b) v = (rng() & 1) ? -448.0f : 448.0f;
          x[size_t(r * cols + c)] = std::ldexp(v, k);
        }
      }
    std::vector<float> y(x.size());
    qdq_ref(f, x.data(), y.data(), rows, cols, 0.0f);
    Mismatches m(std::string(format_name(f)) + " identity on e4m3 values * 2^k");
    for (size_t i = 0; i < x.size(); ++i) m.add(f32_to_bits(x[i]), f32_to_bits(x[i]), f32_to_bits(y[i]), 8, 8);
    EXPECT_EQ(m.count(), 0) << m.report();
    expect_matches_slow(f, x, rows, cols, "block-scaled e4m3 values");
  }
}

// The scale is a * RN(1/448), as DeepEP's and DeepGEMM's kernels compute it, not a / 448 (DeepEP's
// Python helper): they differ for some bf16 amax, and the decoded values with them.
TEST(WireFormats, Fp8Block128ScaleIsAmaxTimesRoundedReciprocal) {
  int differing = 0;
  for (uint32_t b = 0x3880; b < 0x7F80; ++b) {  // bf16 amax from 2^-14 up
    const float a = slow::bf16_value(uint16_t(b));
    const Fp8Params p = fp8_block128_params(a);
    ASSERT_EQ(f32_bits(p.si), f32_to_bits(slow::mul_rn(slow::fp8_block_amax(a), slow::inv_e4m3_max())));
    ASSERT_EQ(f32_bits(p.s), f32_to_bits(slow::div_rn(448.0f, slow::fp8_block_amax(a))));
    differing += f32_bits(p.si) != f32_to_bits(slow::div_rn(slow::fp8_block_amax(a), 448.0f));
  }
  EXPECT_GT(differing, 0) << "a * RN(1/448) and a / 448 never differ on bf16 amax: the test tells nothing";
  std::printf("fp8_block128: a * RN(1/448) != a / 448 for %d of the bf16 amax values >= 2^-14\n", differing);
  // Below the floor, and for a block of zeros or NaN, the scale is that of 1e-4.
  EXPECT_EQ(f32_bits(fp8_block128_params(0.0f).si), f32_bits(fp8_block128_params(1e-4f).si));
  EXPECT_EQ(f32_bits(fp8_block128_params(3e-5f).s), f32_to_bits(slow::div_rn(448.0f, 1e-4f)));
}

// The ue8m0 scale 2^e is the smallest power of two >= a * RN(1/448), e in [-22, 120] for finite a;
// an infinite a gives the NaN code and a NaN block.
TEST(WireFormats, Ue8m0ScaleIsTheNextPowerOfTwo) {
  for (uint32_t b = 0; b < 0x7F80; ++b) {
    const float a = slow::bf16_value(uint16_t(b));
    const MxScale s = fp8_block128_ue8m0_scale(a);
    const float r = slow::mul_rn(slow::fp8_block_amax(a), slow::inv_e4m3_max());
    const int e = slow::ceil_log2(r);
    ASSERT_EQ(s.from_elem, slow::pow2_f32(e)) << std::hex << b;
    ASSERT_EQ(s.to_elem, slow::pow2_f32(-e)) << std::hex << b;
    ASSERT_GE(e, kFp8BlockUe8m0MinExp);
    ASSERT_LE(e, 120);
  }
  EXPECT_EQ(fp8_block128_ue8m0_scale(0.0f).from_elem, exp2i(kFp8BlockUe8m0MinExp));
  std::vector<float> x = {1.0f, -2.0f, INFINITY, 0.0f};
  std::vector<float> y(x.size());
  qdq_ref(Format::kFp8Block128Ue8m0, x.data(), y.data(), 1, 4, 0.0f);
  for (float v : y) EXPECT_TRUE(std::isnan(v));
  qdq_ref(Format::kFp8Block128, x.data(), y.data(), 1, 4, 0.0f);
  for (float v : y) EXPECT_TRUE(std::isnan(v));
}

// ---------------------------------------------------------------------------------------------
// logfmt10

// One block of amax >= 1 keeps its whole cast group as bf16: the row's 8 blocks when the row is a
// multiple of 1024, its 4 blocks (512 channels) otherwise.
TEST(WireFormats, LogFmtCastGroups) {
  for (int64_t cols : {1024, 1536}) {
    std::vector<float> x = combine_like(1, cols, 11, -9, -6, false);
    x[size_t(3 * 128 + 5)] = 1.5f;  // block 3: in group 0 either way
    const std::vector<uint16_t> xb = to_bf16(x);
    std::vector<bf16> in(x.size()), out(x.size());
    for (size_t i = 0; i < x.size(); ++i) in[i].bits = xb[i];
    qdq_ref(Format::kLogfmt10, in.data(), out.data(), 1, cols, 0.0f);
    const int64_t group = cols % 1024 == 0 ? 1024 : 512;
    int64_t changed_in_group = 0, changed_after = 0;
    for (int64_t c = 0; c < cols; ++c) {
      (c < group ? changed_in_group : changed_after) += out[size_t(c)].bits != xb[size_t(c)];
    }
    EXPECT_EQ(changed_in_group, 0) << cols << ": the group holding a block >= 1 must stay bf16";
    if (cols > group) {
      EXPECT_GT(changed_after, (cols - group) / 2) << cols << ": the other groups are cast";
    }
    expect_matches_slow(Format::kLogfmt10, x, 1, cols, "a block >= 1");
  }
  // amin == amax (a constant block) cannot be cast; nor can a zero block (log2(0) = -inf).
  for (float v : {0.25f, 0.0f}) {
    std::vector<float> x(1024, v), y(1024);
    qdq_ref(Format::kLogfmt10, x.data(), y.data(), 1, 1024, 0.0f);
    EXPECT_EQ(y, x) << v;
  }
}

// Codes: below 1 (NaN and -inf included) zero, then the integer part, capped at the 9-bit field's 511.
TEST(WireFormats, LogFmtCodes) {
  EXPECT_EQ(logfmt_code(0.999f), 0.0f);
  EXPECT_EQ(logfmt_code(-INFINITY), 0.0f);
  EXPECT_EQ(logfmt_code(std::nanf("")), 0.0f);
  EXPECT_EQ(logfmt_code(1.0f), 1.0f);
  EXPECT_EQ(logfmt_code(17.99f), 17.0f);
  EXPECT_EQ(logfmt_code(511.7f), 511.0f);
  EXPECT_EQ(logfmt_code(512.0f), 511.0f);
  EXPECT_EQ(logfmt_code(1e30f), 511.0f);
}

// In a cast block every element is decoded from the grid 2^(log_amin + j * step): amax and amin
// come back within the grid's accuracy, every value within half a grid step plus a bf16 rounding,
// and signs (zero's included) are kept.
TEST(WireFormats, LogFmtGrid) {
  std::vector<float> x = combine_like(4, 1024, 21, -7, -2, false);
  x[7] = -0.0f;
  x[9] = 0.0f;
  std::vector<float> y(x.size());
  qdq_ref(Format::kLogfmt10, x.data(), y.data(), 4, 1024, 0.0f);
  for (size_t i = 0; i < x.size(); ++i) {
    const float xb = slow::bf16_value(slow::bf16_round(x[i]));
    ASSERT_EQ(std::signbit(y[i]), std::signbit(xb)) << i;
    if (xb == 0.0f) {
      EXPECT_EQ(y[i], 0.0f);
      continue;
    }
    if (y[i] == 0.0f) continue;  // below the grid's first midpoint (32 binades under amax at most)
    EXPECT_LE(std::fabs(double(y[i]) / double(xb) - 1.0), 0.025) << i;  // half of 2^(32/510) - 1, and more
  }
  // The block maximum decodes to within 2^-20 of itself (code 511 is log_amax up to roundings).
  for (int64_t b = 0; b < 4 * 1024; b += 128) {
    size_t arg = size_t(b);
    for (int64_t c = b; c < b + 128; ++c)
      if (std::fabs(slow::bf16_value(slow::bf16_round(x[size_t(c)]))) > std::fabs(slow::bf16_value(slow::bf16_round(x[arg]))))
        arg = size_t(c);
    const double want = std::fabs(double(slow::bf16_value(slow::bf16_round(x[arg]))));
    EXPECT_LE(std::fabs(std::fabs(double(y[arg])) / want - 1.0), 0x1p-20) << "block at " << b;
  }
}

// A straightforward float emulation of DeepEP's kernel (its formulas with nvcc's contractions, the
// C library's log2f / exp2f standing in for lg2.approx / ex2.approx, the code read by
// __float2uint_rd) decoded and rounded to bf16, against moefq's rule: how often they differ, and by
// how much. NaN-free data (DeepEP turns NaN into 0 where moefq keeps it).
TEST(WireFormats, LogFmtAgainstAFloatEmulationOfDeepEP) {
  const int64_t rows = 64, cols = 7168;
  const std::vector<float> x = combine_like(rows, cols, 31, -10, -6, false);
  std::vector<float> mine(x.size());
  qdq_ref(Format::kLogfmt10, x.data(), mine.data(), rows, cols, 0.0f);
  int64_t differ = 0, cast = 0, far = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < cols; g += 1024) {
      float lamin[8], step[8], step_inv[8], fused[8];
      bool ok = true;
      for (int b = 0; b < 8; ++b) {
        float amax = 0, amin = INFINITY;
        for (int64_t c = g + b * 128; c < g + (b + 1) * 128; ++c) {
          const float a = std::fabs(slow::bf16_value(slow::bf16_round(x[size_t(r * cols + c)])));
          amax = std::max(amax, a);
          amin = std::min(amin, a);
        }
        const float lamax = std::log2(amax);
        lamin[b] = std::fmax(std::log2(amin), lamax - 32.0f);
        ok = ok && lamax < 0 && lamin[b] < lamax;
        step[b] = (lamax - lamin[b]) / 510.0f;
        step_inv[b] = 1.0f / step[b];
        const float rounding = std::fma(-std::log2((1.0f + std::exp2(step[b])) * 0.5f), step_inv[b], 2.0f);
        fused[b] = std::fma(-lamin[b], step_inv[b], rounding);
      }
      for (int64_t c = g; c < g + 1024; ++c) {
        const size_t i = size_t(r * cols + c);
        const float xb = slow::bf16_value(slow::bf16_round(x[i]));
        float theirs = xb;
        if (ok) {
          const int b = int((c - g) / 128);
          const float t = std::fmax(std::fma(std::log2(std::fabs(xb)), step_inv[b], fused[b]), 0.0f);
          const uint32_t code = uint32_t(std::floor(t));
          const float mag = code == 0 ? 0.0f : std::exp2(std::fma(float(code - 1), step[b], lamin[b]));
          theirs = std::signbit(xb) ? -mag : mag;
          ++cast;
        }
        const uint16_t a = slow::bf16_round(theirs), m = slow::bf16_round(mine[i]);
        if (a != m) {
          ++differ;
          // A difference is one code (a grid step, at most 4.4%) or one bf16 rounding.
          far += std::fabs(double(slow::bf16_value(a)) / double(slow::bf16_value(m)) - 1.0) > 0.045;
        }
      }
    }
  std::printf("logfmt10 vs float emulation of DeepEP: %lld of %lld cast elements differ in bf16 (%.4f%%)\n",
              (long long)differ, (long long)cast, 100.0 * double(differ) / double(cast));
  EXPECT_GT(cast, rows * cols / 2) << "the data must be mostly cast";
  EXPECT_LT(double(differ), 0.01 * double(cast));
  EXPECT_EQ(far, 0);
}

}  // namespace
}  // namespace moefq
