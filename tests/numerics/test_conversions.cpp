// Every scalar conversion of include/moefq/numerics.h against the slow reference (slow_ref.h), bit
// for bit: all 65,536 bf16 bit patterns as binary32 inputs, every code of every decoder, binary32
// inputs on and next to every rounding boundary, and the named cases of docs/numerics.md.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "moefq/numerics.h"
#include "numerics/slow_ref.h"

namespace moefq {
namespace {

using slow::f32_from_bits;
using slow::f32_to_bits;
using slow::Mismatches;

// A conversion from binary32 to a code, under test and in the slow reference.
struct Conversion {
  const char* name;
  std::function<uint32_t(float)> actual;
  std::function<uint32_t(float)> expected;
  int out_digits;
  bool defined_for_nan;
};

const std::vector<Conversion>& conversions() {
  static const std::vector<Conversion> list = {
      {"bf16_round", [](float x) { return uint32_t(bf16_round(x)); },
       [](float x) { return uint32_t(slow::bf16_round(x)); }, 4, true},
      {"bf16_round_sw", [](float x) { return uint32_t(bf16_round_sw(x)); },
       [](float x) { return uint32_t(slow::bf16_round(x)); }, 4, true},
      {"e4m3_encode_sat", [](float x) { return uint32_t(e4m3_encode_sat(x)); },
       [](float x) { return uint32_t(slow::e4m3_encode_sat(x)); }, 2, true},
      {"e4m3_encode_sat_sw", [](float x) { return uint32_t(e4m3_encode_sat_sw(x)); },
       [](float x) { return uint32_t(slow::e4m3_encode_sat(x)); }, 2, true},
      {"e5m2_encode", [](float x) { return uint32_t(e5m2_encode(x, false)); },
       [](float x) { return uint32_t(slow::e5m2_encode(x, false)); }, 2, true},
      {"e5m2_encode_satfinite", [](float x) { return uint32_t(e5m2_encode(x, true)); },
       [](float x) { return uint32_t(slow::e5m2_encode(x, true)); }, 2, true},
      // e2m1 has no NaN: NaN handling is a QDQ rule, so NaN inputs are not compared here.
      {"e2m1_encode_sat", [](float x) { return uint32_t(e2m1_encode_sat(x)); },
       [](float x) { return uint32_t(slow::e2m1_encode_sat(x)); }, 1, false},
      {"int8_encode_sat", [](float x) { return uint32_t(uint8_t(int8_encode_sat(x))); },
       [](float x) { return uint32_t(uint8_t(slow::int8_encode_sat(x))); }, 2, true},
  };
  return list;
}

// Runs every conversion over `inputs` (binary32 bit patterns); one failure per conversion.
void expect_conversions_match(const std::vector<uint32_t>& inputs, const std::string& set_name) {
  for (const Conversion& conv : conversions()) {
    Mismatches m(std::string(conv.name) + " on " + set_name);
    for (uint32_t bits : inputs) {
      const float x = f32_from_bits(bits);
      if (!conv.defined_for_nan && std::isnan(x)) continue;
      m.add(bits, conv.expected(x), conv.actual(x), 8, conv.out_digits);
    }
    EXPECT_EQ(m.count(), 0) << m.report();
  }
}

std::vector<uint32_t> all_bf16_patterns_as_f32() {
  std::vector<uint32_t> v;
  for (uint32_t b = 0; b < 0x10000; ++b) v.push_back(b << 16);
  return v;
}

// For every bf16 high half: the low halves at and next to the rounding tie, plus random ones.
std::vector<uint32_t> bf16_tie_sweep() {
  std::mt19937 rng(20240611);
  std::vector<uint32_t> v;
  for (uint32_t hi = 0; hi < 0x10000; ++hi) {
    for (uint32_t lo : {0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) v.push_back(hi << 16 | lo);
    for (int i = 0; i < 3; ++i) v.push_back(hi << 16 | (rng() & 0xFFFFu));
  }
  return v;
}

void push_with_neighbours(std::vector<uint32_t>& v, float x) {
  for (float s : {x, -x}) {
    v.push_back(f32_to_bits(s));
    v.push_back(f32_to_bits(std::nextafter(s, 0.0f)));
    v.push_back(f32_to_bits(std::nextafter(s, s < 0 ? -INFINITY : INFINITY)));
  }
}

// Each value of the table, each midpoint of neighbours (including the one between the largest
// value and the overflow value), and their binary32 neighbours, with both signs.
std::vector<uint32_t> boundary_sweep(const slow::ValueTable& t) {
  std::vector<uint32_t> v;
  for (size_t i = 0; i < t.size(); ++i) {
    push_with_neighbours(v, t.value(i));
    // One bit more than the format: a binary32 (2^128 - 2^119 for bf16's last one).
    push_with_neighbours(v, slow::to_f32(slow::midpoint(t.values[i], t.next(i))));
  }
  // bf16's `beyond` is 2^128, past binary32: FLT_MAX and inf stand for it.
  if (slow::compare(t.beyond, {1, 128}) < 0) push_with_neighbours(v, slow::to_f32(t.beyond));
  push_with_neighbours(v, slow::kFltMax);
  return v;
}

std::vector<uint32_t> int8_boundary_sweep() {
  std::vector<uint32_t> v;
  for (int k = -130; k <= 130; ++k) {
    push_with_neighbours(v, float(k));
    push_with_neighbours(v, float(k) + 0.5f);
  }
  return v;
}

TEST(Conversions, AllBf16PatternsMatchSlowReference) {
  expect_conversions_match(all_bf16_patterns_as_f32(), "all bf16 patterns");
}

TEST(Conversions, Bf16TiesAndNearTiesMatchSlowReference) {
  expect_conversions_match(bf16_tie_sweep(), "bf16 tie sweep");
}

TEST(Conversions, E4m3BoundariesMatchSlowReference) {
  expect_conversions_match(boundary_sweep(slow::e4m3_table()), "e4m3 boundaries");
}

TEST(Conversions, E5m2BoundariesMatchSlowReference) {
  expect_conversions_match(boundary_sweep(slow::e5m2_table()), "e5m2 boundaries");
}

TEST(Conversions, E2m1BoundariesMatchSlowReference) {
  expect_conversions_match(boundary_sweep(slow::e2m1_table()), "e2m1 boundaries");
}

TEST(Conversions, Int8BoundariesMatchSlowReference) {
  expect_conversions_match(int8_boundary_sweep(), "int8 boundaries");
}

// Random binary32 patterns (every exponent, NaN payloads, subnormals).
TEST(Conversions, RandomF32PatternsMatchSlowReference) {
  std::mt19937 rng(7);
  std::vector<uint32_t> v(1 << 18);
  for (uint32_t& u : v) u = rng();
  expect_conversions_match(v, "random binary32");
}

// ---------------------------------------------------------------------------------------------
// Decoders: every code.

void expect_decoder_matches(const char* name, int num_codes, float (*actual)(uint8_t),
                            float (*expected)(uint8_t)) {
  Mismatches m(name);
  for (int c = 0; c < num_codes; ++c)
    m.add(uint32_t(c), f32_to_bits(expected(uint8_t(c))), f32_to_bits(actual(uint8_t(c))), 2, 8);
  EXPECT_EQ(m.count(), 0) << m.report();
}

TEST(Decoders, EveryCodeMatchesSlowReference) {
  expect_decoder_matches("e4m3_decode", 256, e4m3_decode, slow::e4m3_decode);
  expect_decoder_matches("e5m2_decode", 256, e5m2_decode, slow::e5m2_decode);
  expect_decoder_matches("e2m1_decode", 16, e2m1_decode, slow::e2m1_decode);
  expect_decoder_matches("ue8m0_decode", 256, ue8m0_decode, slow::ue8m0_decode);
}

// Round trip: every non-NaN code decodes to a value that encodes back to the same code.
TEST(Decoders, EncodeOfDecodeIsIdentity) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(e4m3_encode_sat(e4m3_decode(uint8_t(c))), c) << "e4m3 code " << c;
  }
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) > 0x7C) continue;
    EXPECT_EQ(e5m2_encode(e5m2_decode(uint8_t(c)), false), c) << "e5m2 code " << c;
  }
  for (int c = 0; c < 16; ++c) EXPECT_EQ(e2m1_encode_sat(e2m1_decode(uint8_t(c))), c) << "e2m1 code " << c;
}

// The slow reference's own tables agree with the format table of docs/numerics.md.
TEST(Decoders, SlowTablesMatchTheSpecTable) {
  EXPECT_EQ(slow::e4m3_table().value(0x7E), 448.0f);
  EXPECT_EQ(slow::e4m3_table().value(1), 0x1p-9f);
  EXPECT_EQ(slow::e5m2_table().value(0x7B), 57344.0f);
  EXPECT_EQ(slow::e5m2_table().value(1), 0x1p-16f);
  EXPECT_EQ(slow::bf16_table().value(1), 0x1p-133f);
  EXPECT_EQ(slow::bf16_table().value(0x7F7F), 0x1.FEp127f);
  const float e2m1[] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(slow::e2m1_table().value(size_t(c)), e2m1[c]);
  EXPECT_EQ(slow::ue8m0_decode(0xFE), 0x1p127f);
  EXPECT_EQ(slow::ue8m0_decode(0), 0x1p-127f);
}

// ---------------------------------------------------------------------------------------------
// Named cases of docs/numerics.md.

TEST(Conversions, E2m1TiesGoToTheEvenCode) {
  const struct {
    float in, out;
  } kCases[] = {{0.25f, 0}, {0.75f, 1}, {1.25f, 1}, {1.75f, 2}, {2.5f, 2}, {3.5f, 4}, {5.0f, 4},
                {5.0000005f, 6}, {6.0f, 6}, {7.0f, 6}, {1e30f, 6}, {INFINITY, 6}, {0.2499f, 0},
                {0.2501f, 0.5f}};
  for (const auto& c : kCases)
    for (float sign : {1.0f, -1.0f}) {
      const float x = sign * c.in;
      const float want = sign * c.out;
      EXPECT_EQ(f32_to_bits(e2m1_decode(e2m1_encode_sat(x))), f32_to_bits(want)) << "x = " << x;
      EXPECT_EQ(f32_to_bits(slow::e2m1_decode(slow::e2m1_encode_sat(x))), f32_to_bits(want))
          << "slow reference, x = " << x;
    }
}

TEST(Conversions, E4m3SaturatesAt448) {
  for (float mag : {448.0f, 449.0f, 463.99997f, 464.0f, 480.0f, 1e9f, 3.4e38f, INFINITY})
    for (float sign : {1.0f, -1.0f}) {
      const float x = sign * mag;
      const uint8_t want = sign > 0 ? 0x7E : 0xFE;  // +-448
      EXPECT_EQ(e4m3_encode_sat(x), want) << "x = " << x;
      EXPECT_EQ(e4m3_encode_sat_sw(x), want) << "x = " << x;
      EXPECT_EQ(slow::e4m3_encode_sat(x), want) << "slow reference, x = " << x;
    }
  EXPECT_EQ(e4m3_decode(0x7E), 448.0f);
  EXPECT_EQ(e4m3_encode_sat(std::nanf("")), 0x7F);
  EXPECT_EQ(e4m3_encode_sat(-std::nanf("")), 0x7F);  // canonical: sign dropped
  EXPECT_EQ(e4m3_encode_sat(0x1p-10f), 0x00);        // tie between 0 and 2^-9: even code
  EXPECT_EQ(e4m3_encode_sat(0x1.8p-9f), 0x02);       // tie between codes 1 and 2
  EXPECT_EQ(e4m3_encode_sat(-0.0f), 0x80);
}

TEST(Conversions, E5m2OverflowsToInfOrSaturates) {
  const struct {
    float in;
    uint8_t rn, sat;
  } kCases[] = {{57344.0f, 0x7B, 0x7B}, {61439.996f, 0x7B, 0x7B}, {61440.0f, 0x7C, 0x7B},
                {1e9f, 0x7C, 0x7B},     {INFINITY, 0x7C, 0x7B},    {0x1p-17f, 0x00, 0x00}};
  for (const auto& c : kCases) {
    EXPECT_EQ(e5m2_encode(c.in, false), c.rn) << "x = " << c.in;
    EXPECT_EQ(e5m2_encode(c.in, true), c.sat) << "x = " << c.in;
    EXPECT_EQ(e5m2_encode(-c.in, false), c.rn | 0x80) << "x = " << -c.in;
    EXPECT_EQ(e5m2_encode(-c.in, true), c.sat | 0x80) << "x = " << -c.in;
  }
  EXPECT_EQ(e5m2_encode(-std::nanf(""), false), 0x7F);
}

TEST(Conversions, Bf16KeepsInfAndCanonicalizesNan) {
  EXPECT_EQ(bf16_round(INFINITY), 0x7F80);
  EXPECT_EQ(bf16_round(-INFINITY), 0xFF80);
  EXPECT_EQ(bf16_round(f32_from_bits(0x7F7FFFFF)), 0x7F80);  // FLT_MAX rounds up to inf
  EXPECT_EQ(bf16_round(f32_from_bits(0x7F7F7FFF)), 0x7F7F);
  EXPECT_EQ(bf16_round(f32_from_bits(0xFFC00001)), 0x7FFF);
  EXPECT_EQ(bf16_round(f32_from_bits(0x7F800001)), 0x7FFF);  // signalling NaN stays NaN
  EXPECT_EQ(bf16_round(f32_from_bits(0x3F808000)), 0x3F80);  // tie, even
  EXPECT_EQ(bf16_round(f32_from_bits(0x3F818000)), 0x3F82);  // tie, odd: up
}

// ---------------------------------------------------------------------------------------------
// docs/numerics.md's binary32 arithmetic (RN multiply and divide, rint, ceil(log2)) and the slow
// reference's versions of it, against each other and against the host's IEEE operations.

std::vector<float> arithmetic_operands() {
  std::vector<float> v = {0.0f, -0.0f, INFINITY, -INFINITY, std::nanf(""), 1.0f, 3.0f, 448.0f, 2688.0f,
                          6.0f, 127.0f, 0x1p-149f, 0x1p-126f, 0x1.fffffcp-127f, 3.4028235e38f, 1e-12f,
                          1e-5f, 0x1p-24f};
  std::mt19937 rng(11);
  for (int i = 0; i < 3000; ++i) v.push_back(f32_from_bits(rng()));
  for (int i = 0; i < 1000; ++i) v.push_back(f32_from_bits(rng() & 0x807FFFFFu));  // subnormals
  return v;
}

TEST(Arithmetic, MulAndDivMatchSlowReferenceAndHost) {
  const std::vector<float> ops = arithmetic_operands();
  Mismatches mul_impl("mul_rn"), div_impl("div_rn"), mul_host("slow mul_rn vs host"),
      div_host("slow div_rn vs host");
  auto canon = [](float v) { return std::isnan(v) ? slow::kNanF32 : f32_to_bits(v); };
  for (size_t i = 0; i < ops.size(); ++i)
    for (size_t j = i % 7; j < ops.size(); j += 7) {
      const float a = ops[i], b = ops[j];
      const uint64_t in = uint64_t(f32_to_bits(a)) << 32 | f32_to_bits(b);
      const uint32_t m = canon(slow::mul_rn(a, b)), d = canon(slow::div_rn(a, b));
      mul_impl.add(in, m, canon(mul_rn(a, b)), 16, 8);
      div_impl.add(in, d, canon(div_rn(a, b)), 16, 8);
      volatile float va = a, vb = b;  // host SSE arithmetic is IEEE RN
      mul_host.add(in, m, canon(va * vb), 16, 8);
      div_host.add(in, d, canon(va / vb), 16, 8);
    }
  EXPECT_EQ(mul_impl.count(), 0) << mul_impl.report();
  EXPECT_EQ(div_impl.count(), 0) << div_impl.report();
  EXPECT_EQ(mul_host.count(), 0) << mul_host.report();
  EXPECT_EQ(div_host.count(), 0) << div_host.report();
}

// The slow reference's integer multiply and divide against the host's IEEE float * and / (SSE:
// RN ties-to-even, no FTZ/DAZ) on millions of operand pairs: uniformly random patterns, operands
// drawn near the subnormal, normal and overflow ranges with sparse significands, products and
// quotients steered onto exact ties and onto the overflow and underflow thresholds.
class PairSource {
 public:
  explicit PairSource(uint64_t seed) : rng_(seed) {}
  uint32_t bits() { return uint32_t(rng_()); }
  uint32_t below(uint32_t n) { return uint32_t(rng_() % n); }
  uint32_t sign() { return (rng_() & 1) ? 0x80000000u : 0u; }
  // A significand field with few bits set (products of such have exact ties), or a random one.
  uint32_t fraction() {
    switch (below(4)) {
      case 0: return bits() & 0x7FFFFFu;
      case 1: return 0;
      case 2: return (1u << below(23)) | (1u << below(23));
      default: return 0x7FFFFFu ^ (1u << below(23));  // all ones but one
    }
  }
  // Any exponent field, weighted to the ends of the range (subnormal, tiny normal, huge).
  uint32_t exponent() {
    switch (below(5)) {
      case 0: return 0;
      case 1: return below(24) + 1;
      case 2: return 254 - below(24);
      case 3: return 127 + below(40) - 20;
      default: return below(256);
    }
  }
  // (Each draw is its own statement: the operands come out the same under every compiler.)
  float edge() {
    const uint32_t s = sign();
    const uint32_t e = exponent();
    return f32_from_bits(s | e << 23 | fraction());
  }
  float finite_nonzero() {
    for (;;) {
      const float x = edge();
      if (std::isfinite(x) && x != 0) return x;
    }
  }

 private:
  std::mt19937_64 rng_;
};

// Whether r = RN(exact) came from a tie: exact lies halfway between r and the binary32 next to r
// on exact's side.
bool is_tie(float r, double exact) {
  if (!std::isfinite(r) || !std::isfinite(exact) || double(r) == exact || std::fabs(r) == slow::kFltMax)
    return false;
  const float other = std::nextafter(r, double(r) < exact ? INFINITY : -INFINITY);
  return exact - double(r) == double(other) - exact;
}

float with_random_sign(PairSource& src, float x) { return src.sign() ? -x : x; }

TEST(Arithmetic, SlowMulDivMatchHostOnMillionsOfPairs) {
  auto canon = [](float v) { return std::isnan(v) ? slow::kNanF32 : f32_to_bits(v); };
  Mismatches mul_host("slow mul_rn vs host *"), div_host("slow div_rn vs host /");
  int64_t pairs = 0, mul_ties = 0, div_ties = 0, overflows = 0, subnormal_results = 0;
  auto check = [&](float a, float b) {
    ++pairs;
    volatile float va = a, vb = b;
    const float hm = va * vb, hd = va / vb;
    const uint64_t in = uint64_t(f32_to_bits(a)) << 32 | f32_to_bits(b);
    mul_host.add(in, canon(hm), canon(slow::mul_rn(a, b)), 16, 8);
    div_host.add(in, canon(hd), canon(slow::div_rn(a, b)), 16, 8);
    // Statistics of what was covered, from exact double arithmetic (a product of two binary32 is
    // exact in double; so is a quotient by a power of two).
    mul_ties += is_tie(hm, double(a) * double(b));
    int exp_b = 0;
    if (std::isfinite(b) && b != 0 && std::frexp(std::fabs(b), &exp_b) == 0.5f)
      div_ties += is_tie(hd, double(a) / double(b));
    overflows += std::isinf(hm) && std::isfinite(a) && std::isfinite(b);
    overflows += std::isinf(hd) && std::isfinite(a) && std::isfinite(b) && b != 0;
    subnormal_results += (hm != 0 && std::fabs(hm) < 0x1p-126f) + (hd != 0 && std::fabs(hd) < 0x1p-126f);
  };

  PairSource src(20240612);
  // Uniformly random patterns: every class, NaN payloads included.
  for (int i = 0; i < 1000000; ++i) {
    const float a = f32_from_bits(src.bits());
    check(a, f32_from_bits(src.bits()));
  }
  // Operands from the ends of the exponent range with sparse or dense significands.
  for (int i = 0; i < 1000000; ++i) {
    const float a = src.edge();
    check(a, src.edge());
  }
  // Products steered onto ties: a significand times a small odd integer (times 2^k) leaves few
  // bits below the rounding position; in every exponent range, subnormal results included.
  for (int i = 0; i < 500000; ++i) {
    const float a = src.finite_nonzero();
    const float odd = float(2 * src.below(128) + 1);
    const float b = std::ldexp(odd, int(src.below(300)) - 160);
    check(a, with_random_sign(src, b));
  }
  // Products and quotients next to the overflow threshold and the subnormal and zero thresholds:
  // b is the host's threshold / a, moved a few ulps either way.
  const float kThresholds[] = {slow::kFltMax, 0x1p-126f, 0x1p-149f, 0x1p-148f, 0x1.8p-149f, 0x1p-127f};
  for (int i = 0; i < 500000; ++i) {
    const float a = src.finite_nonzero();
    const float t = kThresholds[src.below(6)];
    volatile float va = a, vt = t;
    float bm = std::fabs(vt / va), bd = std::fabs(va / vt);
    for (int k = int(src.below(7)) - 3; k != 0; k += k > 0 ? -1 : 1) {
      bm = std::nextafter(bm, k > 0 ? INFINITY : 0.0f);
      bd = std::nextafter(bd, k > 0 ? INFINITY : 0.0f);
    }
    check(a, with_random_sign(src, bm));  // a * b near t
    check(a, with_random_sign(src, bd));  // a / b near t
  }
  // Quotients by powers of two into the subnormal range: exact ties and their neighbours.
  for (int i = 0; i < 300000; ++i) {
    const uint32_t sign = src.sign();
    const uint32_t exponent = src.below(40);
    const float a = f32_from_bits(sign | exponent << 23 | src.fraction());
    const float b = std::ldexp(1.0f, int(src.below(60)) - 20);
    check(a, b);
    check(std::ldexp(float(src.below(1 << 12) + 1), -149), b);  // small integers times 2^-149
  }
  // Quotients of random operands close to each other, and of a random numerator by the specials.
  const float kSpecials[] = {0.0f, -0.0f, INFINITY, -INFINITY, std::nanf(""), 0x1p-149f, slow::kFltMax, 1.0f};
  for (int i = 0; i < 200000; ++i) {
    const float a = src.finite_nonzero();
    check(a, std::nextafter(a, src.below(2) ? INFINITY : 0.0f));
    check(a, kSpecials[src.below(8)]);
    const float special = kSpecials[src.below(8)];
    check(special, a);
  }

  EXPECT_EQ(mul_host.count(), 0) << mul_host.report();
  EXPECT_EQ(div_host.count(), 0) << div_host.report();
  EXPECT_GE(pairs, 3000000);
  EXPECT_GT(mul_ties, 10000) << "the operands did not reach products on a rounding tie";
  EXPECT_GT(div_ties, 5000) << "the operands did not reach quotients on a rounding tie";
  EXPECT_GT(overflows, 10000);
  EXPECT_GT(subnormal_results, 10000);
  std::printf("%lld pairs: %lld product ties, %lld quotient ties, %lld overflows, %lld subnormal results\n",
              (long long)pairs, (long long)mul_ties, (long long)div_ties, (long long)overflows,
              (long long)subnormal_results);
}

TEST(Arithmetic, RintAndCeilLog2MatchSlowReference) {
  Mismatches rint_m("rint_f32"), log_m("ceil_log2");
  std::mt19937 rng(5);
  std::vector<uint32_t> inputs = all_bf16_patterns_as_f32();
  for (int i = 0; i < 100000; ++i) inputs.push_back(rng());
  for (uint32_t bits : inputs) {
    const float x = f32_from_bits(bits);
    if (!std::isfinite(x)) continue;
    if (std::fabs(x) < 127.0f) {  // rint against the slow round-half-even of int8 (unclamped here)
      rint_m.add(bits, uint32_t(int32_t(slow::int8_encode_sat(x))), uint32_t(int32_t(rint_f32(x))), 8, 8);
    }
    if (x > 0) log_m.add(bits, uint32_t(slow::ceil_log2(x)), uint32_t(ceil_log2(x)), 8, 8);
  }
  EXPECT_EQ(rint_m.count(), 0) << rint_m.report();
  EXPECT_EQ(log_m.count(), 0) << log_m.report();
}

}  // namespace
}  // namespace moefq
