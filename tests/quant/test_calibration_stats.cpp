// The calibration methods beyond max (calibration_stats.h), each against a direct computation on
// the raw data: percentile by sorting, mse by QDQ of every element for every candidate, the clipped
// fraction and the QDQ error by counting and summing; the parser of --calibration; logfmt10's cast
// groups against qdq_ref's own output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "moefq/calibration_stats.h"
#include "moefq/errors.h"
#include "moefq/qdq.h"
#include "moefq/wire_bytes.h"

namespace moefq {
namespace {

// Heavy-tailed bf16 data: a Gaussian body and a few large outliers, so the methods differ.
std::vector<bf16> sample(size_t n, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> body(0.0f, 1.0f);
  std::uniform_real_distribution<float> tail(20.0f, 200.0f);
  std::vector<bf16> x(n);
  for (size_t i = 0; i < n; ++i) {
    const float v = i % 997 == 0 ? tail(g) * (i % 2 ? -1.0f : 1.0f) : body(g);
    x[i] = bf16{bf16_round(v)};
  }
  return x;
}

std::vector<float> sorted_abs(const std::vector<bf16>& x) {
  std::vector<float> a;
  for (bf16 v : x) a.push_back(std::fabs(to_f32(v)));
  std::sort(a.begin(), a.end());
  return a;
}

// sum (qdq(x) - x)^2 over the raw data, the whole array through qdq_ref at once.
double direct_error(const std::vector<bf16>& x, Format f, float amax) {
  std::vector<float> in(x.size()), out(x.size());
  for (size_t i = 0; i < x.size(); ++i) in[i] = to_f32(x[i]);
  qdq_ref(f, in.data(), out.data(), 1, int64_t(in.size()), amax);
  double s = 0;
  for (size_t i = 0; i < in.size(); ++i) s += (double(out[i]) - in[i]) * (double(out[i]) - in[i]);
  return s;
}

AbsHistogram histogram_of(const std::vector<bf16>& x) {
  AbsHistogram h;
  // In pieces, and merged: the result may not depend on how the data arrived.
  AbsHistogram part;
  part.add(x.data(), int64_t(x.size() / 3));
  h.add(x.data() + x.size() / 3, int64_t(x.size() - x.size() / 3));
  h.merge(part);
  return h;
}

TEST(CalibrationStats, MaxAndPercentileAreTheNearestRankOfTheSortedData) {
  const std::vector<bf16> x = sample(50000, 1);
  const std::vector<float> a = sorted_abs(x);
  const AbsHistogram h = histogram_of(x);
  ASSERT_EQ(h.total(), x.size());
  EXPECT_EQ(h.max(), a.back());
  EXPECT_EQ(derive_amax(h, CalibrationMethod{}, Format::kFp8, "t").amax, a.back());
  for (double p : {50.0, 99.0, 99.9, 99.99, 99.999, 100.0}) {
    SCOPED_TRACE(p);
    CalibrationMethod m;
    m.kind = CalibrationMethod::Kind::kPercentile;
    m.percentile = p;
    const size_t rank = size_t(std::ceil(p / 100.0 * double(a.size())));
    const DerivedAmax d = derive_amax(h, m, Format::kFp8, "t");
    EXPECT_EQ(d.amax, a[rank - 1]);
    // Clipped: the elements strictly above the amax, counted.
    const size_t above = size_t(a.end() - std::upper_bound(a.begin(), a.end(), d.amax));
    EXPECT_EQ(d.clipped_fraction, double(above) / double(a.size()));
    ASSERT_TRUE(d.rel_error.has_value());
    double ref = 0;
    for (float v : a) ref += double(v) * v;
    EXPECT_NEAR(*d.rel_error, std::sqrt(direct_error(x, Format::kFp8, d.amax) / ref), 1e-12);
  }
}

TEST(CalibrationStats, MseIsTheCandidateWithTheLeastQdqErrorOnTheRawData) {
  const std::vector<bf16> x = sample(20000, 2);
  const AbsHistogram h = histogram_of(x);
  CalibrationMethod m;
  m.kind = CalibrationMethod::Kind::kMse;
  const std::vector<double> mult = m.mse_multipliers();
  ASSERT_EQ(mult.size(), 39u);  // Model Optimizer's default: ceil((4 - 0.25) / 0.1) + 1
  EXPECT_EQ(mult.front(), 0.25);
  EXPECT_DOUBLE_EQ(mult.back(), 4.0);
  for (Format f : {Format::kFp8, Format::kInt8}) {
    SCOPED_TRACE(format_name(f));
    float best_amax = 0;
    double best = INFINITY;
    for (double k : mult) {
      const float a = float(double(h.max()) * k);
      const double e = direct_error(x, f, a);
      if (e < best) {
        best = e;
        best_amax = a;
      }
    }
    const DerivedAmax d = derive_amax(h, m, f, "t");
    // The same candidate, or one whose error is the same up to the order of the sums.
    const bool candidate = std::any_of(mult.begin(), mult.end(), [&](double k) { return float(double(h.max()) * k) == d.amax; });
    EXPECT_TRUE(candidate) << d.amax;
    EXPECT_LE(direct_error(x, f, d.amax), best * (1 + 1e-9)) << d.amax << " vs " << best_amax;
    if (f == Format::kInt8) {
      EXPECT_EQ(d.amax, best_amax);
      EXPECT_LT(d.amax, h.max()) << "int8's uniform grid: the outliers make clipping pay on this data";
      EXPECT_GT(d.clipped_fraction, 0.0);
    }
  }
  // nvfp4's error depends on its blocks: without them (or with none holding data) refused, naming
  // the alternatives.
  const Nvfp4Blocks empty;
  for (const Nvfp4Blocks* b : {static_cast<const Nvfp4Blocks*>(nullptr), &empty}) {
    try {
      (void)derive_amax(h, m, Format::kNvfp4, "layer 0 combine", b);
      FAIL() << "mse on nvfp4 without blocks must be refused";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kBadInput);
      EXPECT_NE(std::string(e.what()).find("use max or percentile"), std::string::npos) << e.what();
    }
  }
}

// Rows of nvfp4 blocks at very different scales: most rows Gaussian at 1e-2 .. 1, a few blocks with
// outliers up to 500, a short last block (H = 200: 12 blocks of 16 and one of 8), zeros.
std::vector<bf16> block_rows(int64_t rows, int64_t H, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> body(0.0f, 1.0f);
  std::uniform_real_distribution<float> scale(-2.0f, 0.0f), tail(50.0f, 500.0f);
  std::vector<bf16> x(size_t(rows * H));
  for (int64_t r = 0; r < rows; ++r) {
    const float s = std::pow(10.0f, scale(g));
    for (int64_t c = 0; c < H; ++c) {
      float v = body(g) * s;
      if ((r * H + c) % 1999 == 0) v = tail(g) * (c % 2 ? -1.0f : 1.0f);
      if ((r * H + c) % 37 == 0) v = 0.0f;
      x[size_t(r * H + c)] = bf16{bf16_round(v)};
    }
  }
  return x;
}

// sum (qdq(x) - x)^2 of nvfp4 over rows of H, through qdq_ref on the rows as they are.
double direct_nvfp4_error(const std::vector<bf16>& x, int64_t H, float amax) {
  std::vector<float> in(x.size()), out(x.size());
  for (size_t i = 0; i < x.size(); ++i) in[i] = to_f32(x[i]);
  qdq_ref(Format::kNvfp4, in.data(), out.data(), int64_t(x.size()) / H, H, amax);
  double s = 0;
  for (size_t i = 0; i < in.size(); ++i) s += (double(out[i]) - in[i]) * (double(out[i]) - in[i]);
  return s;
}

// nvfp4's mse: the block pairs give qdq_ref's error of every candidate (up to the order of the sums),
// and the amax is the brute-force search's: every candidate through qdq_ref on the raw rows.
TEST(CalibrationStats, Nvfp4MseIsTheBruteForceSearchOverTheRowsBlocks) {
  const int64_t H = 200, rows = 300;
  const std::vector<bf16> x = block_rows(rows, H, 5);
  AbsHistogram h;
  h.add(x.data(), int64_t(x.size()));
  const Nvfp4Blocks blocks(x.data(), nullptr, rows, H);
  EXPECT_EQ(blocks.num_rows(), uint64_t(rows));
  EXPECT_EQ(blocks.num_elements(), x.size());
  EXPECT_LT(blocks.num_pairs(), x.size()) << "pairs repeat: the reduction counts them";
  CalibrationMethod m;
  m.kind = CalibrationMethod::Kind::kMse;
  float best_amax = 0;
  double best = INFINITY, ref = 0;
  for (bf16 v : x) ref += double(to_f32(v)) * to_f32(v);
  EXPECT_NEAR(blocks.sum_squares(), ref, 1e-12 * ref);
  for (double k : m.mse_multipliers()) {
    const float a = float(double(h.max()) * k);
    const double e = direct_nvfp4_error(x, H, a);
    EXPECT_NEAR(blocks.qdq_squared_error(a), e, 1e-12 * e) << "amax " << a;
    if (e < best) {
      best = e;
      best_amax = a;
    }
  }
  const DerivedAmax d = derive_amax(h, m, Format::kNvfp4, "t", &blocks);
  EXPECT_EQ(d.amax, best_amax);
  EXPECT_NE(d.amax, h.max()) << "this data's outliers make another amax than the max pay";
  ASSERT_TRUE(d.rel_error.has_value());
  EXPECT_NEAR(*d.rel_error, std::sqrt(best / ref), 1e-12);
  EXPECT_EQ(d.clipped_fraction, h.clipped_fraction(d.amax));
  // max and percentile with the blocks: the same amax as without, and the error on the rows.
  const DerivedAmax dm = derive_amax(h, CalibrationMethod{}, Format::kNvfp4, "t", &blocks);
  EXPECT_EQ(dm.amax, h.max());
  ASSERT_TRUE(dm.rel_error.has_value());
  EXPECT_NEAR(*dm.rel_error, std::sqrt(direct_nvfp4_error(x, H, h.max()) / ref), 1e-12);
  EXPECT_FALSE(derive_amax(h, CalibrationMethod{}, Format::kNvfp4, "t").rel_error.has_value());
}

// Rows marked invalid are left out, and the order the rows come in changes nothing.
TEST(CalibrationStats, Nvfp4BlocksCountOnlyValidRowsInAnyOrder) {
  const int64_t H = 64, rows = 40;
  const std::vector<bf16> x = block_rows(rows, H, 6);
  std::vector<uint8_t> valid(size_t(rows), 1);
  std::vector<bf16> kept, reversed(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    std::copy(x.begin() + r * H, x.begin() + (r + 1) * H, reversed.begin() + (rows - 1 - r) * H);
    if (r % 3 == 0) {
      valid[size_t(r)] = 0;
      continue;
    }
    kept.insert(kept.end(), x.begin() + r * H, x.begin() + (r + 1) * H);
  }
  const Nvfp4Blocks part(x.data(), valid.data(), rows, H), direct(kept.data(), nullptr, int64_t(kept.size()) / H, H);
  EXPECT_EQ(part.num_rows(), uint64_t(kept.size() / H));
  EXPECT_EQ(part.num_elements(), kept.size());
  const Nvfp4Blocks all(x.data(), nullptr, rows, H), back(reversed.data(), nullptr, rows, H);
  for (float a : {0.5f, 3.0f, 700.0f}) {
    EXPECT_EQ(part.qdq_squared_error(a), direct.qdq_squared_error(a));
    EXPECT_EQ(all.qdq_squared_error(a), back.qdq_squared_error(a)) << "bit for bit, whatever the order";
    EXPECT_NE(part.qdq_squared_error(a), all.qdq_squared_error(a));
  }
}

// The row sample: a bijection of the positions onto the slots, keeping exactly min(N, S) rows, all
// of them when they fit; a multiplier that divides N is passed over; N >= 2^32 is refused.
TEST(CalibrationStats, SampleRowsKeepABoundedSpreadOfThePositions) {
  for (const auto& [n, cols, max_elements] : {std::tuple<uint64_t, int64_t, int64_t>{1000, 10, 1 << 20},
                                              {1000, 10, 1000}, {4096, 256, 8 * 256}, {7, 100, 1}, {1, 8, 8}}) {
    SCOPED_TRACE(std::to_string(n) + " positions, " + std::to_string(max_elements / cols) + " rows");
    const SampleRows s = SampleRows::plan(n, cols, max_elements);
    EXPECT_EQ(s.num_slots, std::min<uint64_t>(n, std::max<int64_t>(1, max_elements / cols)));
    std::vector<int> hits(size_t(s.num_slots), 0);
    uint64_t kept = 0, first_half = 0;
    for (uint64_t p = 0; p < n; ++p) {
      const int64_t j = s.slot(p);
      if (j < 0) continue;
      ASSERT_LT(uint64_t(j), s.num_slots);
      ++hits[size_t(j)];
      ++kept;
      first_half += p < n / 2 ? 1u : 0u;
    }
    EXPECT_EQ(kept, s.num_slots);
    EXPECT_EQ(std::count(hits.begin(), hits.end(), 1), int64_t(s.num_slots));
    // Spread: a sample of 8 of 4096 rows is not the first 8.
    if (s.num_slots >= 8 && s.num_slots < n) {
      EXPECT_GT(first_half, 0u);
      EXPECT_LT(first_half, kept);
    }
  }
  EXPECT_NE(SampleRows::plan(2654435761ull, 16).multiplier, 2654435761ull);
  EXPECT_NE(SampleRows::plan(2654435761ull, 16).multiplier % 2654435761ull, 0u);
  EXPECT_THROW((void)SampleRows::plan(uint64_t(1) << 32, 16), Error);
}

TEST(CalibrationStats, Fp32DataIsCountedAsBf16AndNonFiniteApart) {
  const float v[] = {1.0f, -1.00390625f /* 1 + 2^-8: a tie, to even (1.0) */, 3.4e38f, NAN, -INFINITY, 0.0f};
  AbsHistogram h;
  h.add(v, 6);
  EXPECT_EQ(h.total(), 3u);  // 3.4e38 rounds to inf as bf16 (its max is 3.39e38)
  EXPECT_EQ(h.nonfinite(), 3u);
  EXPECT_EQ(h.count(0x3F80), 2u);
  EXPECT_EQ(h.count(0), 1u);
}

TEST(CalibrationStats, MethodsParseAndBadOnesAreNamed) {
  EXPECT_EQ(parse_calibration_method("max", "--calibration").kind, CalibrationMethod::Kind::kMax);
  const CalibrationMethod p = parse_calibration_method("percentile", "--calibration");
  EXPECT_EQ(p.kind, CalibrationMethod::Kind::kPercentile);
  EXPECT_EQ(p.percentile, 99.99);
  EXPECT_EQ(parse_calibration_method("percentile:99.999", "x").percentile, 99.999);
  EXPECT_EQ(parse_calibration_method("percentile:99.999", "x").name(), "percentile 99.999");
  EXPECT_EQ(parse_calibration_method("percentile:99.999", "x").short_name(), "p99.999");
  EXPECT_EQ(parse_calibration_method("mse", "x").name(), "mse");
  const auto list = parse_calibration_methods("max,percentile:99.9,mse", "--calibration");
  ASSERT_EQ(list.size(), 3u);
  for (const char* bad : {"", "min", "percentile:", "percentile:abc", "percentile:0", "percentile:100.5",
                          "percentile99", "max,", "max,max", "mse,percentile,percentile:99.99"}) {
    SCOPED_TRACE(bad);
    try {
      (void)parse_calibration_methods(bad, "--calibration");
      FAIL();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kBadInput);
      EXPECT_EQ(std::string(e.what()).rfind("--calibration", 0), 0u) << e.what();
    }
  }
}

// logfmt10 casts a group only when each of its blocks can be (amax < 1, amin < amax): the count
// matches what qdq_ref did (an uncast group comes back unchanged), and the bytes follow.
TEST(WireBytes, Logfmt10CastGroupsAreWhatQdqRefCast) {
  const int64_t cols = 2048;  // groups of 8 blocks: 2 per row
  std::mt19937 g(3);
  std::uniform_real_distribution<float> u(0.01f, 0.5f);
  std::vector<bf16> x(size_t(4 * cols));
  for (bf16& v : x) v = bf16{bf16_round(u(g))};
  x[size_t(0 * cols + 3 * 128 + 5)] = bf16{bf16_round(2.0f)};  // row 0, group 0: amax >= 1
  for (int64_t c = 1024 + 256; c < 1024 + 384; ++c) x[size_t(2 * cols + c)] = bf16{bf16_round(0.25f)};  // amin == amax
  const CastGroups cg = logfmt10_cast_groups(x.data(), 4, cols);
  EXPECT_EQ(cg.total, 8u);
  EXPECT_EQ(cg.cast, 6u);
  std::vector<bf16> y(x.size());
  qdq_ref(Format::kLogfmt10, x.data(), y.data(), 4, cols, 0.0f);
  uint64_t unchanged = 0;
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t g0 = 0; g0 < cols; g0 += 1024) {
      bool same = true;
      for (int64_t c = g0; c < g0 + 1024; ++c) same = same && x[size_t(r * cols + c)].bits == y[size_t(r * cols + c)].bits;
      unchanged += same ? 1u : 0u;
    }
  EXPECT_EQ(unchanged, cg.total - cg.cast);
  EXPECT_EQ(logfmt10_bytes_per_row(cols, 1.0), wire_bytes_per_row(Format::kLogfmt10, cols));
  EXPECT_EQ(logfmt10_bytes_per_row(cols, 0.0), 2.0 * cols);
  EXPECT_EQ(logfmt10_bytes_per_row(cols, 0.75), 0.75 * (2560 + 64) + 0.25 * 4096);
}

}  // namespace
}  // namespace moefq
