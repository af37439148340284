// Tensor QDQ (include/moefq/qdq.h: qdq_ref, amax_ref, stage_e4m3_ref) against the slow reference
// (slow_ref.h), bit for bit, for every format and both dtypes: random data with outlier channels
// and every special value, all 65,536 bf16 patterns, random binary32 patterns, values the formats
// represent exactly, short final blocks, and amax values from 0 to FLT_MAX.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
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

struct Shape {
  int64_t rows, cols;
};

// Short final blocks for every block size (16, 32, 128), odd row counts, a row of one element.
constexpr Shape kShapes[] = {{1, 1},  {1, 7},  {3, 7},   {5, 33},  {7, 100}, {2, 16},
                             {4, 32}, {9, 48}, {9, 128}, {3, 129}, {3, 7168 + 5}};

const float kAmaxes[] = {0.0f,   1e-30f, 1e-40f,  0x1p-24f, 0x1.fffffep-25f, 0x1.000002p-24f, -3.0f,
                         1e-5f,  0.37f,  1.0f,    6.0f,     127.0f,          448.0f,          2688.0f,
                         1e4f,   1e30f,  3e38f,   FLT_MAX};

// The formats that scale each block from its own data ignore the amax argument.
bool ignores_amax(Format f) { return !format_has_global_amax(f); }

std::string label(Format f, const char* dtype, const std::string& data, Shape s, float amax) {
  char buf[200];
  std::snprintf(buf, sizeof(buf), "%s %s %s [%lld x %lld] amax %a (%g)", format_name(f), dtype, data.c_str(),
                (long long)s.rows, (long long)s.cols, double(amax), double(amax));
  return buf;
}

std::string hex_float(float v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%a", double(v));
  return buf;
}

std::string at(int64_t i, int64_t cols) {
  return "row " + std::to_string(i / cols) + " col " + std::to_string(i % cols);
}

// qdq_ref on a bf16 tensor (bit patterns) against the slow reference.
void expect_bf16_qdq(Format f, const std::vector<uint16_t>& x, Shape s, float amax, const std::string& data) {
  std::vector<bf16> xi(x.size()), yi(x.size());
  for (size_t i = 0; i < x.size(); ++i) xi[i].bits = x[i];
  qdq_ref(f, xi.data(), yi.data(), s.rows, s.cols, amax);
  const std::vector<uint16_t> want = slow::qdq_bf16(f, x, s.rows, s.cols, amax);
  Mismatches m(label(f, "bf16", data, s, amax));
  for (size_t i = 0; i < x.size(); ++i)
    if (want[i] != yi[i].bits) m.add(x[i], want[i], yi[i].bits, 4, 4, at(int64_t(i), s.cols));
  EXPECT_EQ(m.count(), 0) << m.report();
}

// qdq_ref on an fp32 tensor (bit patterns) against the slow reference.
void expect_f32_qdq(Format f, const std::vector<uint32_t>& x, Shape s, float amax, const std::string& data) {
  std::vector<float> xi(x.size()), yi(x.size());
  for (size_t i = 0; i < x.size(); ++i) xi[i] = f32_from_bits(x[i]);
  qdq_ref(f, xi.data(), yi.data(), s.rows, s.cols, amax);
  const std::vector<uint32_t> want = slow::qdq_f32(f, x, s.rows, s.cols, amax);
  Mismatches m(label(f, "fp32", data, s, amax));
  for (size_t i = 0; i < x.size(); ++i)
    if (want[i] != f32_to_bits(yi[i])) m.add(x[i], want[i], f32_to_bits(yi[i]), 8, 8, at(int64_t(i), s.cols));
  EXPECT_EQ(m.count(), 0) << m.report();
}

// The amax values a test runs a format with: the list above for the formats with a global amax;
// two for the others, which ignore it.
std::vector<float> amaxes_for(Format f) {
  if (ignores_amax(f)) return {1.0f, 0.0f};
  return std::vector<float>(std::begin(kAmaxes), std::end(kAmaxes));
}

// ---------------------------------------------------------------------------------------------
// Data

// [rows, cols] binary32 bit patterns like LLM activations: a heavy-tailed body, a few outlier
// columns scaled by 100..1000, scattered specials (NaN with payloads and signs, +-inf, +-0,
// binary32 and bf16 subnormals, FLT_MAX, the smallest normal) and, per row, one block of a special
// kind: all zero, all NaN, only subnormals, inf among NaN, one tiny value among zeros.
std::vector<uint32_t> stress_f32(Shape s, uint64_t seed, bool with_inf = true) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uniform(0.02f, 1.0f);
  const int64_t n = s.rows * s.cols;
  std::vector<float> col_scale(size_t(s.cols), 1.0f);
  const float kOutlier[] = {100.0f, 300.0f, 1000.0f};
  for (int64_t c = 0; c < s.cols / 40 + 1; ++c) col_scale[rng() % uint64_t(s.cols)] = kOutlier[rng() % 3];
  std::vector<uint32_t> x(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    x[size_t(i)] = f32_to_bits(normal(rng) / uniform(rng) * col_scale[size_t(i % s.cols)]);
  auto special = [&]() -> uint32_t {
    switch (rng() % 12) {
      case 0: return 0x7FC00000u;
      case 1: return 0xFFC00000u;
      case 2: return 0x7F800001u | uint32_t(rng() & 0x3FFFFFu);  // signalling NaN, payload
      case 3: return with_inf ? 0x7F800000u : 0x3F800000u;
      case 4: return with_inf ? 0xFF800000u : 0xBF800000u;
      case 5: return 0x00000000u;
      case 6: return 0x80000000u;
      case 7: return uint32_t(rng() & 0x807FFFFFu) | 1u;          // binary32 subnormal
      case 8: return (uint32_t(rng() & 0x807Fu) | 1u) << 16;       // bf16 subnormal
      // +-FLT_MAX (rounds to bf16 inf), or without inf the largest bf16
      case 9: return uint32_t(rng() & 0x80000000u) | (with_inf ? 0x7F7FFFFFu : 0x7F7F0000u);
      case 10: return uint32_t(rng() & 0x80000000u) | 0x00800000u; // smallest normal
      default: return f32_to_bits(std::ldexp(normal(rng), int(rng() % 200) - 100));
    }
  };
  for (int64_t k = 0; k < n / 30 + 1; ++k) x[rng() % uint64_t(n)] = special();
  for (int64_t r = 0; r < s.rows; ++r) {
    const int64_t len = (r % 2 == 0) ? 16 : 32;
    const int64_t c0 = int64_t(rng() % uint64_t(s.cols)) / len * len;
    const int kind = int(r % 5);
    for (int64_t c = c0; c < std::min(s.cols, c0 + len); ++c) {
      uint32_t& v = x[size_t(r * s.cols + c)];
      switch (kind) {
        case 0: v = (rng() & 1) ? 0x80000000u : 0u; break;
        case 1: v = (rng() & 1) ? 0x7FC00000u : 0xFFC00001u; break;
        case 2: v = uint32_t(rng() & 0x807FFFFFu); break;
        case 3: v = (c == c0 && with_inf) ? 0xFF800000u : 0x7FC00000u; break;
        default: v = (c == c0) ? 0x00000001u : 0u; break;
      }
    }
  }
  return x;
}

// The same kind of data as bf16 patterns (rounded by the slow reference), with bf16 NaN patterns
// of both signs and payloads injected directly.
std::vector<uint16_t> stress_bf16(Shape s, uint64_t seed, bool with_inf = true) {
  const std::vector<uint32_t> f = stress_f32(s, seed, with_inf);
  std::vector<uint16_t> x(f.size());
  std::mt19937 rng(uint32_t(seed) + 1);
  for (size_t i = 0; i < f.size(); ++i) x[i] = slow::bf16_round(f32_from_bits(f[i]));
  for (size_t k = 0; k < f.size() / 64 + 1; ++k) {
    const uint16_t kNans[] = {0x7F81, 0xFFC0, 0x7FFF, 0xFF80 | 0x23};
    x[rng() % f.size()] = kNans[rng() % 4];
  }
  return x;
}

std::vector<uint16_t> all_bf16_patterns() {
  std::vector<uint16_t> v(0x10000);
  std::iota(v.begin(), v.end(), uint16_t(0));
  return v;
}

std::vector<uint32_t> widen(const std::vector<uint16_t>& b) {
  std::vector<uint32_t> v(b.size());
  for (size_t i = 0; i < b.size(); ++i) v[i] = uint32_t(b[i]) << 16;
  return v;
}

// ---------------------------------------------------------------------------------------------
// Per-format suites

class QdqExhaustive : public ::testing::TestWithParam<Format> {};

TEST_P(QdqExhaustive, StressTensorsBf16) {
  const Format f = GetParam();
  uint64_t seed = 100;
  for (Shape s : kShapes) {
    const std::vector<uint16_t> x = stress_bf16(s, seed++);
    for (float amax : amaxes_for(f)) expect_bf16_qdq(f, x, s, amax, "stress");
  }
}

TEST_P(QdqExhaustive, StressTensorsF32) {
  const Format f = GetParam();
  uint64_t seed = 200;
  for (Shape s : kShapes) {
    const std::vector<uint32_t> x = stress_f32(s, seed++);
    for (float amax : amaxes_for(f)) expect_f32_qdq(f, x, s, amax, "stress");
  }
}

// The dynamic amax: amax_ref is max |x| over non-NaN elements; QDQ with it on finite data.
TEST_P(QdqExhaustive, DynamicAmax) {
  const Format f = GetParam();
  uint64_t seed = 300;
  for (Shape s : kShapes) {
    const std::vector<uint32_t> xf = stress_f32(s, seed++, /*with_inf=*/false);
    const std::vector<uint16_t> xb = stress_bf16(s, seed++, /*with_inf=*/false);
    std::vector<float> vf(xf.size());
    std::vector<bf16> vb(xb.size());
    for (size_t i = 0; i < xf.size(); ++i) vf[i] = f32_from_bits(xf[i]);
    for (size_t i = 0; i < xb.size(); ++i) vb[i].bits = xb[i];
    const float af = slow::amax_of(slow::f32_values(xf));
    const float ab = slow::amax_of(slow::bf16_values(xb));
    ASSERT_EQ(f32_to_bits(amax_ref(vf.data(), int64_t(vf.size()))), f32_to_bits(af));
    ASSERT_EQ(f32_to_bits(amax_ref(vb.data(), int64_t(vb.size()))), f32_to_bits(ab));
    expect_f32_qdq(f, xf, s, af, "stress, dynamic amax");
    expect_bf16_qdq(f, xb, s, ab, "stress, dynamic amax");
  }
}

// amax = +inf, which is what the dynamic amax is for a tensor holding +-inf. docs/numerics.md's
// arithmetic taken literally (IEEE, NaN propagating through min(t, 448), e4m3_sat and e2m1) gives
// NaN for every element: fp8 s = 448/inf = 0 and si = 1/0 = inf, so y = e4m3(x * 0) * inf = 0 * inf
// (NaN * inf for x = +-inf); nvfp4 gs = inf, so each block's scale is e4m3(bmax / inf) * inf =
// 0 * inf (inf / inf for a block holding inf); int8 s = 127/inf = 0, so y = rint(x * 0) / 0 = 0 / 0
// (the amax < 2^-24 rule is for tiny amax only). So every output element is the canonical NaN.
// The formats without a global amax ignore it, inf included: the same output as with amax = 1.
TEST_P(QdqExhaustive, InfiniteAmax) {
  const Format f = GetParam();
  uint64_t seed = 500;
  for (Shape s : {Shape{1, 1}, Shape{3, 7}, Shape{7, 100}, Shape{3, 7168 + 5}}) {
    const std::vector<uint32_t> xf = stress_f32(s, seed++);
    const std::vector<uint16_t> xb = stress_bf16(s, seed++);
    std::vector<float> vf(xf.size()), yf(xf.size());
    std::vector<bf16> vb(xb.size()), yb(xb.size());
    for (size_t i = 0; i < xf.size(); ++i) vf[i] = f32_from_bits(xf[i]);
    for (size_t i = 0; i < xb.size(); ++i) vb[i].bits = xb[i];
    qdq_ref(f, vf.data(), yf.data(), s.rows, s.cols, INFINITY);
    qdq_ref(f, vb.data(), yb.data(), s.rows, s.cols, INFINITY);
    std::vector<uint32_t> want_f(xf.size(), slow::kNanF32);
    std::vector<uint16_t> want_b(xb.size(), slow::kNanBf16);
    if (ignores_amax(f)) {
      want_f = slow::qdq_f32(f, xf, s.rows, s.cols, 1.0f);
      want_b = slow::qdq_bf16(f, xb, s.rows, s.cols, 1.0f);
    }
    Mismatches mf(label(f, "fp32", "stress", s, INFINITY) + (ignores_amax(f) ? " (as amax 1)" : " (all NaN)"));
    Mismatches mb(label(f, "bf16", "stress", s, INFINITY) + (ignores_amax(f) ? " (as amax 1)" : " (all NaN)"));
    for (size_t i = 0; i < xf.size(); ++i) mf.add(xf[i], want_f[i], f32_to_bits(yf[i]), 8, 8, at(int64_t(i), s.cols));
    for (size_t i = 0; i < xb.size(); ++i) mb.add(xb[i], want_b[i], yb[i].bits, 4, 4, at(int64_t(i), s.cols));
    EXPECT_EQ(mf.count(), 0) << mf.report();
    EXPECT_EQ(mb.count(), 0) << mb.report();
    // The slow reference reaches the same by its own arithmetic.
    EXPECT_EQ(slow::qdq_f32(f, xf, s.rows, s.cols, INFINITY), want_f) << format_name(f);
    EXPECT_EQ(slow::qdq_bf16(f, xb, s.rows, s.cols, INFINITY), want_b) << format_name(f);
    expect_f32_qdq(f, xf, s, INFINITY, "stress");
    expect_bf16_qdq(f, xb, s, INFINITY, "stress");
  }
}

// All 65,536 bf16 patterns as one tensor, in several block layouts (consecutive patterns, so
// blocks hold inf next to NaN, subnormals next to zeros), plus a shuffled copy.
TEST_P(QdqExhaustive, AllBf16PatternsBf16) {
  const Format f = GetParam();
  const std::vector<uint16_t> all = all_bf16_patterns();
  std::vector<uint16_t> shuffled = all;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(3));
  const std::vector<float> amaxes = ignores_amax(f) ? std::vector<float>{1.0f}
                                             : std::vector<float>{1e-30f, 1.0f, 448.0f, 2688.0f, 3e38f};
  for (float amax : amaxes) {
    expect_bf16_qdq(f, all, {4096, 16}, amax, "all bf16 patterns");
    expect_bf16_qdq(f, all, {512, 128}, amax, "all bf16 patterns");
    expect_bf16_qdq(f, shuffled, {2048, 32}, amax, "all bf16 patterns, shuffled");
    expect_bf16_qdq(f, std::vector<uint16_t>(all.begin(), all.begin() + 655 * 100), {655, 100}, amax,
                    "all bf16 patterns");
  }
}

TEST_P(QdqExhaustive, AllBf16PatternsF32) {
  const Format f = GetParam();
  const std::vector<uint32_t> all = widen(all_bf16_patterns());
  std::vector<uint32_t> shuffled = all;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(4));
  const std::vector<float> amaxes = ignores_amax(f) ? std::vector<float>{1.0f}
                                             : std::vector<float>{1e-30f, 1.0f, 448.0f, 2688.0f, 3e38f};
  for (float amax : amaxes) {
    expect_f32_qdq(f, all, {4096, 16}, amax, "all bf16 patterns");
    expect_f32_qdq(f, shuffled, {2048, 32}, amax, "all bf16 patterns, shuffled");
    expect_f32_qdq(f, std::vector<uint32_t>(all.begin(), all.begin() + 655 * 100), {655, 100}, amax,
                   "all bf16 patterns");
  }
}

// Uniformly random binary32 patterns: every exponent, NaN payloads, binary32 subnormals.
TEST_P(QdqExhaustive, RandomF32Patterns) {
  const Format f = GetParam();
  std::mt19937 rng(9);
  std::vector<uint32_t> x(1 << 16);
  for (uint32_t& u : x) u = rng();
  for (float amax : {1.0f, 2688.0f, 1e30f, FLT_MAX}) {
    expect_f32_qdq(f, x, {2048, 32}, amax, "random binary32");
    expect_f32_qdq(f, x, {512, 128}, amax, "random binary32");
    if (ignores_amax(f)) break;
  }
}

// y may alias x.
TEST_P(QdqExhaustive, InPlaceEqualsOutOfPlace) {
  const Format f = GetParam();
  const Shape s{5, 133};
  const std::vector<uint16_t> xb = stress_bf16(s, 77);
  std::vector<bf16> in(xb.size()), out(xb.size());
  for (size_t i = 0; i < xb.size(); ++i) in[i].bits = xb[i];
  qdq_ref(f, in.data(), out.data(), s.rows, s.cols, 3.5f);
  qdq_ref(f, in.data(), in.data(), s.rows, s.cols, 3.5f);
  Mismatches m(std::string(format_name(f)) + " in place");
  for (size_t i = 0; i < xb.size(); ++i) m.add(xb[i], out[i].bits, in[i].bits, 4, 4, at(int64_t(i), s.cols));
  EXPECT_EQ(m.count(), 0) << m.report();
}

INSTANTIATE_TEST_SUITE_P(AllFormats, QdqExhaustive, ::testing::ValuesIn(kAllFormats),
                         [](const ::testing::TestParamInfo<Format>& info) {
                           return std::string(format_name(info.param));
                         });

// ---------------------------------------------------------------------------------------------
// Values a format represents exactly come back unchanged (checked against x itself, not only
// against the slow reference).

void expect_identity_bf16(Format f, const std::vector<float>& x, Shape s, float amax, const char* what) {
  std::vector<uint16_t> xb(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    xb[i] = slow::bf16_round(x[i]);
    ASSERT_EQ(f32_to_bits(slow::bf16_value(xb[i])), f32_to_bits(x[i])) << what << ": not a bf16 value";
  }
  std::vector<bf16> in(x.size()), out(x.size());
  for (size_t i = 0; i < x.size(); ++i) in[i].bits = xb[i];
  qdq_ref(f, in.data(), out.data(), s.rows, s.cols, amax);
  Mismatches m(label(f, "bf16", what, s, amax) + " (identity)");
  for (size_t i = 0; i < x.size(); ++i) m.add(xb[i], xb[i], out[i].bits, 4, 4, at(int64_t(i), s.cols));
  EXPECT_EQ(m.count(), 0) << m.report();
  expect_bf16_qdq(f, xb, s, amax, what);
}

void expect_identity_f32(Format f, const std::vector<float>& x, Shape s, float amax, const char* what) {
  std::vector<float> out(x.size());
  qdq_ref(f, x.data(), out.data(), s.rows, s.cols, amax);
  std::vector<uint32_t> bits(x.size());
  Mismatches m(label(f, "fp32", what, s, amax) + " (identity)");
  for (size_t i = 0; i < x.size(); ++i) {
    bits[i] = f32_to_bits(x[i]);
    m.add(bits[i], bits[i], f32_to_bits(out[i]), 8, 8, at(int64_t(i), s.cols));
  }
  EXPECT_EQ(m.count(), 0) << m.report();
  expect_f32_qdq(f, bits, s, amax, what);
}

std::vector<float> e4m3_finite_values() {
  std::vector<float> v;
  for (int c = 0; c < 256; ++c)
    if ((c & 0x7F) != 0x7F) v.push_back(slow::e4m3_decode(uint8_t(c)));
  return v;
}

TEST(QdqExactValues, Fp8KeepsE4m3Values) {
  const std::vector<float> base = e4m3_finite_values();  // 254 values, +-0 included
  for (int k : {0, -20, -3, 5, 30}) {
    std::vector<float> x;
    for (float v : base) x.push_back(std::ldexp(v, k));
    const float amax = std::ldexp(448.0f, k);  // s = 2^-k, si = 2^k: both exact
    expect_identity_bf16(Format::kFp8, x, {2, 127}, amax, "e4m3 values * 2^k");
    expect_identity_f32(Format::kFp8, x, {2, 127}, amax, "e4m3 values * 2^k");
  }
}

TEST(QdqExactValues, Int8KeepsIntegers) {
  for (int k : {0, -10, 12}) {
    std::vector<float> x;
    for (int q = -127; q <= 127; ++q) x.push_back(std::ldexp(float(q), k));
    const float amax = std::ldexp(127.0f, k);
    expect_identity_bf16(Format::kInt8, x, {5, 51}, amax, "integers * 2^k");
    expect_identity_f32(Format::kInt8, x, {5, 51}, amax, "integers * 2^k");
  }
}

// docs/numerics.md: q = rint(x * s) is a binary32 value, so a negative x that rounds to zero gives
// y = -0.0 (Model Optimizer's int8 kernel does the same), a positive one +0.0; bf16 and fp32.
TEST(QdqExactValues, Int8ZeroKeepsTheSignOfX) {
  const float amax = 127.0f;  // s = 1
  const std::vector<float> x = {-0.0f, -0.25f, -0.5f, 0.0f, 0.25f, 0.5f, -1e-30f, 1e-30f};
  const std::vector<uint16_t> want_bf16 = {0x8000, 0x8000, 0x8000, 0, 0, 0, 0x8000, 0};
  std::vector<bf16> xb(x.size()), yb(x.size());
  for (size_t i = 0; i < x.size(); ++i) xb[i].bits = bf16_round(x[i]);
  qdq_ref(Format::kInt8, xb.data(), yb.data(), 1, int64_t(x.size()), amax);
  std::vector<float> yf(x.size());
  qdq_ref(Format::kInt8, x.data(), yf.data(), 1, int64_t(x.size()), amax);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(yb[i].bits, want_bf16[i]) << "x = " << x[i];
    EXPECT_EQ(f32_bits(yf[i]), want_bf16[i] == 0 ? 0u : 0x80000000u) << "x = " << x[i];
  }
  // The reciprocal path (the kernels' int8_qdq_recip) agrees on the sign.
  const Int8Params p = int8_params(amax);
  EXPECT_EQ(f32_bits(int8_qdq_recip(-0.25f, p, div_rn(1.0f, p.s))), 0x80000000u);
}

// Rows of blocks of 32 (a short final block of 4): each block holds +-elem_max * 2^k and other
// values of the element format times 2^k, so its exponent is k and nothing is rounded.
std::vector<float> mx_exact_blocks(bool fp4, Shape s, int k_lo, int k_hi, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> x(size_t(s.rows * s.cols));
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t b = 0; b < s.cols; b += 32) {
      const int k = k_lo + int(rng() % uint64_t(k_hi - k_lo + 1));
      for (int64_t c = b; c < std::min(s.cols, b + 32); ++c) {
        float v = fp4 ? slow::e2m1_decode(uint8_t(rng() % 16)) : slow::e4m3_decode(uint8_t(rng() % 256));
        if (std::isnan(v)) v = 1.0f;
        if (c == b) v = (rng() & 1) ? -(fp4 ? 6.0f : 448.0f) : (fp4 ? 6.0f : 448.0f);
        x[size_t(r * s.cols + c)] = std::ldexp(v, k);
      }
    }
  return x;
}

TEST(QdqExactValues, MxKeepsBlockScaledElementValues) {
  const Shape s{9, 100};
  expect_identity_bf16(Format::kMxfp8, mx_exact_blocks(false, s, -100, 100, 1), s, 0.0f, "e4m3 values * 2^k");
  expect_identity_f32(Format::kMxfp8, mx_exact_blocks(false, s, -127, 119, 2), s, 0.0f, "e4m3 values * 2^k");
  expect_identity_bf16(Format::kMxfp4, mx_exact_blocks(true, s, -120, 120, 3), s, 0.0f, "e2m1 values * 2^k");
  expect_identity_f32(Format::kMxfp4, mx_exact_blocks(true, s, -127, 125, 4), s, 0.0f, "e2m1 values * 2^k");
}

// With a global scale of exactly 1, a block whose max is 6m (m an e4m3 value) gets scale m, and
// its e2m1 values times m come back unchanged, except -0, which nvfp4 turns into +0.
TEST(QdqExactValues, Nvfp4KeepsBlockScaledElementValues) {
  // 2688 * fp32(1/2688) need not be 1: look within 200 ulps for an amax whose is.
  float unit_amax = 0;
  float a = 2688.0f;
  for (int i = 0; i < 200; ++i) a = std::nextafter(a, 0.0f);
  for (int i = 0; i < 400 && unit_amax == 0; ++i, a = std::nextafter(a, INFINITY))
    if (slow::nvfp4_global_scale(a) == 1.0f) unit_amax = a;
  ASSERT_NE(unit_amax, 0.0f) << "no amax near 2688 gives a global scale of exactly 1";
  ASSERT_EQ(nvfp4_global_scale(unit_amax), 1.0f);
  const Shape s{6, 16 * 5 + 7};
  std::mt19937_64 rng(5);
  std::vector<float> x(size_t(s.rows * s.cols));
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t b = 0; b < s.cols; b += 16) {
      float m = slow::e4m3_decode(uint8_t(8 + rng() % 0x76));  // e4m3 value >= 2^-6: scale >= 1e-5
      for (int64_t c = b; c < std::min(s.cols, b + 16); ++c) {
        float v = slow::e2m1_decode(uint8_t(rng() % 16));
        if (c == b) v = (rng() & 1) ? -6.0f : 6.0f;
        if (v == 0) v = 0.0f;  // -0 comes back as +0: keep the identity check to +0
        x[size_t(r * s.cols + c)] = v * m;
      }
    }
  expect_identity_bf16(Format::kNvfp4, x, s, unit_amax, "e2m1 values * e4m3 block scale");
  expect_identity_f32(Format::kNvfp4, x, s, unit_amax, "e2m1 values * e4m3 block scale");
}

// fp8's inverse scale is si = RN(1 / RN(448 / a)), not RN(a / 448): for amax 10000 they differ, and
// -0.171875 (an e4m3 value) * si is 0xc0758926, where a/448 would give 0xc0758924. (A slow
// reference that once computed the latter under one compiler is why slow_ref.h's arithmetic is
// integer-only.)
TEST(QdqExactValues, Fp8InverseScaleIsReciprocalOfScale) {
  const float amax = 10000.0f;
  const slow::Fp8Scales p = slow::fp8_scales(amax);
  EXPECT_EQ(f32_to_bits(p.s), 0x3d378034u);  // RN(448 / 10000) = 0.0448000009...
  EXPECT_NE(f32_to_bits(p.si), f32_to_bits(slow::div_rn(amax, 448.0f)));
  const float x = f32_from_bits(0xc06de22fu);
  EXPECT_EQ(slow::e4m3_sat_value(slow::mul_rn(x, p.s)), -0.171875f);
  EXPECT_EQ(f32_to_bits(slow::fp8_qdq(x, p)), 0xc0758926u);
  EXPECT_EQ(f32_to_bits(slow::mul_rn(-0.171875f, slow::div_rn(amax, 448.0f))), 0xc0758924u);
  float y = 0;
  qdq_ref(Format::kFp8, &x, &y, 1, 1, amax);
  EXPECT_EQ(f32_to_bits(y), 0xc0758926u);
}

// nvfp4 zeros: every q == 0 element becomes +0, NaN stays NaN, +-inf becomes +-6 * scale.
TEST(QdqExactValues, Nvfp4ZerosAreUnsignedAndInfSaturates) {
  const std::vector<float> x = {-0.0f, 0.0f, -1e-3f, 1.0f, -INFINITY, INFINITY, std::nanf(""), -2.0f};
  std::vector<float> y(x.size());
  qdq_ref(Format::kNvfp4, x.data(), y.data(), 1, int64_t(x.size()), 2688.0f);
  EXPECT_EQ(f32_to_bits(y[0]), 0u);
  EXPECT_EQ(f32_to_bits(y[1]), 0u);
  EXPECT_EQ(f32_to_bits(y[2]), 0u);
  EXPECT_EQ(f32_to_bits(y[6]), slow::kNanF32);
  EXPECT_EQ(y[5], -y[4]);
  const float scale = slow::nvfp4_block_scale(INFINITY, slow::nvfp4_global_scale(2688.0f));
  EXPECT_EQ(y[5], slow::mul_rn(6.0f, scale));
}

// ---------------------------------------------------------------------------------------------
// nvfp4 global scale: amax * fp32(1/2688), not amax / 2688.

TEST(QdqNvfp4, GlobalScaleIsReciprocalMultiply) {
  std::vector<float> differing;
  std::mt19937 rng(17);
  std::vector<float> candidates;
  for (uint32_t b = 0x0080; b < 0x7F80; ++b) candidates.push_back(f32_from_bits(b << 16));
  for (int i = 0; i < 20000; ++i) candidates.push_back(f32_from_bits(0x00800000u + rng() % (0x7F000000u)));
  for (float a : candidates)
    if (slow::nvfp4_global_scale(a) != slow::nvfp4_global_scale(a, /*by_division=*/true)) differing.push_back(a);
  ASSERT_GT(differing.size(), 100u) << "expected some amax where the two global scale rules differ";

  int distinguishing = 0;
  Mismatches m("nvfp4 with amax where amax * fp32(1/2688) != amax / 2688");
  for (size_t k = 0; k < differing.size(); k += std::max<size_t>(1, differing.size() / 400)) {
    const float a = differing[k];
    EXPECT_EQ(f32_to_bits(nvfp4_global_scale(a)), f32_to_bits(slow::nvfp4_global_scale(a))) << "amax " << a;
    std::vector<float> x(16);
    for (int j = 0; j < 16; ++j) x[size_t(j)] = slow::div_rn(slow::mul_rn(a, float(j + 1)), 16.0f);
    const std::vector<float> by_mul = slow::nvfp4_values(x, 1, 16, slow::nvfp4_global_scale(a));
    const std::vector<float> by_div = slow::nvfp4_values(x, 1, 16, slow::nvfp4_global_scale(a, true));
    std::vector<float> y(16);
    qdq_ref(Format::kNvfp4, x.data(), y.data(), 1, 16, a);
    bool differs = false;
    for (int j = 0; j < 16; ++j) {
      differs |= slow::store_f32(by_mul[size_t(j)]) != slow::store_f32(by_div[size_t(j)]);
      m.add(f32_to_bits(x[size_t(j)]), slow::store_f32(by_mul[size_t(j)]), f32_to_bits(y[size_t(j)]), 8, 8,
            "amax " + hex_float(a));
    }
    distinguishing += differs;
  }
  EXPECT_EQ(m.count(), 0) << m.report();
  EXPECT_GT(distinguishing, 0) << "no tensor told the two global scale rules apart";
}

// ---------------------------------------------------------------------------------------------
// e4m3 staging (1 x 128 blocks, fp32 scales)

void expect_staging(const std::vector<uint16_t>& x, Shape s, const std::string& what) {
  std::vector<bf16> xi(x.size());
  for (size_t i = 0; i < x.size(); ++i) xi[i].bits = x[i];
  const int64_t num_blocks = (s.cols + 127) / 128;
  std::vector<uint8_t> x8(x.size());
  std::vector<float> scales(size_t(s.rows * num_blocks));
  stage_e4m3_ref(xi.data(), x8.data(), scales.data(), s.rows, s.cols);
  const slow::Staged want = slow::stage_e4m3(x, s.rows, s.cols);
  const std::string shape = " [" + std::to_string(s.rows) + " x " + std::to_string(s.cols) + "]";
  Mismatches mb("stage_e4m3_ref bytes, " + what + shape);
  for (size_t i = 0; i < x.size(); ++i)
    if (want.x8[i] != x8[i]) mb.add(x[i], want.x8[i], x8[i], 4, 2, at(int64_t(i), s.cols));
  Mismatches ms("stage_e4m3_ref scales, " + what + shape);
  for (size_t i = 0; i < scales.size(); ++i)
    ms.add(uint64_t(i), f32_to_bits(want.scales[i]), f32_to_bits(scales[i]), 4, 8,
           "row " + std::to_string(int64_t(i) / num_blocks) + " block " + std::to_string(int64_t(i) % num_blocks));
  EXPECT_EQ(mb.count(), 0) << mb.report();
  EXPECT_EQ(ms.count(), 0) << ms.report();
}

TEST(StageE4m3, StressTensors) {
  uint64_t seed = 400;
  for (Shape s : {Shape{1, 7}, Shape{3, 128}, Shape{5, 129}, Shape{7, 300}, Shape{3, 7168 + 5}}) {
    expect_staging(stress_bf16(s, seed++), s, "stress");
    expect_staging(stress_bf16(s, seed++, /*with_inf=*/false), s, "stress without inf");
  }
}

TEST(StageE4m3, AllBf16Patterns) {
  const std::vector<uint16_t> all = all_bf16_patterns();
  std::vector<uint16_t> shuffled = all;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(8));
  expect_staging(all, {512, 128}, "all bf16 patterns");
  expect_staging(shuffled, {512, 128}, "all bf16 patterns, shuffled");
  expect_staging(std::vector<uint16_t>(all.begin(), all.begin() + 200 * 300), {200, 300}, "all bf16 patterns");
}

// A block below 1e-4 uses amax 1e-4; a block of zeros or NaN too.
TEST(StageE4m3, SmallBlocksUseTheFloorAmax) {
  std::vector<uint16_t> x(256, 0);
  x[5] = slow::bf16_round(3e-5f);
  for (int i = 128; i < 256; ++i) x[size_t(i)] = 0x7FC0;
  expect_staging(x, {1, 256}, "tiny and NaN blocks");
  std::vector<bf16> xi(256);
  for (size_t i = 0; i < 256; ++i) xi[i].bits = x[i];
  std::vector<uint8_t> x8(256);
  float scales[2];
  stage_e4m3_ref(xi.data(), x8.data(), scales, 1, 256);
  EXPECT_EQ(scales[0], slow::div_rn(1e-4f, 448.0f));
  EXPECT_EQ(scales[1], slow::div_rn(1e-4f, 448.0f));
  EXPECT_EQ(x8[200], 0x7F);
}

}  // namespace
}  // namespace moefq
