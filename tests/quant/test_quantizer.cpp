// Quantizer: spec validation, max calibration (collect, cross-replica MAX, finish), QDQ against
// the CPU reference, and the calibration file (exact round trip, errors, atomic writes).
#include "moefq/quantizer.h"
#include "moefq/calibration_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moefq/errors.h"
#include "moefq/qdq.h"
#include "test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;

constexpr const char* kCombine = "layers.0.mlp.experts.combine_quantizer";
constexpr const char* kDispatch = "layers.0.mlp.experts.dispatch_quantizer";

QuantSpec make_spec(Format f, AmaxSource src = AmaxSource::kCalibrated, float constant = 0.0f) {
  QuantSpec s;
  s.format = f;
  s.amax_source = src;
  s.constant_amax = constant;
  return s;
}

bf16 to_bf16(float f) { return bf16{bf16_round(f)}; }

uint32_t bits_of(float f) { return f32_bits(f); }

// Runs fn, expects a moefq::Error of kind bad input whose message contains every part.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> parts,
                  ErrorKind kind = ErrorKind::kBadInput) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const std::string& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message lacks '" << p << "': " << e.what();
    return;
  }
  ADD_FAILURE() << "no moefq::Error thrown";
}

// Normal data with a few large outliers, both signs; deterministic.
std::vector<float> make_data(int64_t n, uint32_t seed, float outlier = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.5f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  if (outlier != 0.0f && n > 7) {
    v[size_t(n / 3)] = -outlier;
    v[size_t(n / 7)] = outlier * 0.75f;
  }
  return v;
}

float true_max_abs(const std::vector<float>& v) {
  float m = 0.0f;
  for (float f : v) m = std::max(m, std::fabs(f));
  return m;
}

// A fresh directory per test, removed at the end.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("moefq_test_quantizer_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

int count_entries(const fs::path& dir) {
  int n = 0;
  for (auto it = fs::directory_iterator(dir); it != fs::directory_iterator(); ++it) ++n;
  return n;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// ---------------------------------------------------------------------------------------------
// Construction

TEST(Quantizer, DescribeNamesTheFormatItsBlocksAndTheAmax) {
  EXPECT_EQ(make_spec(Format::kNvfp4).describe(), "nvfp4 (e2m1, block 16, e4m3 scales), amax calibrated");
  EXPECT_EQ(make_spec(Format::kFp8, AmaxSource::kConstant, 448.0f).describe(),
            "fp8 (e4m3, per tensor), amax constant 448");
  EXPECT_EQ(make_spec(Format::kInt8, AmaxSource::kConstant, 0.1f).describe(),
            "int8 (int8, per tensor), amax constant 0.1");
  EXPECT_EQ(make_spec(Format::kMxfp8).describe(), "mxfp8 (e4m3, block 32, ue8m0 scales)");
}

TEST(Quantizer, InvalidSpecsRaiseNamingTheQuantizer) {
  QuantSpec wrong_block = make_spec(Format::kNvfp4);
  wrong_block.block_size = 32;
  expect_error([&] { Quantizer(kCombine, wrong_block); }, {kCombine, "16"});
  QuantSpec fp8_block = make_spec(Format::kFp8);
  fp8_block.block_size = 16;
  expect_error([&] { Quantizer(kCombine, fp8_block); }, {kCombine, "per-tensor"});
  for (float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    expect_error([&] { Quantizer(kDispatch, make_spec(Format::kFp8, AmaxSource::kConstant, bad)); },
                 {kDispatch, "constant_amax"});
  }
  // The valid ones construct and report what they were given.
  QuantSpec own_block = make_spec(Format::kNvfp4);
  own_block.block_size = 16;
  Quantizer q(kCombine, own_block, false);
  EXPECT_EQ(q.name(), kCombine);
  EXPECT_EQ(q.spec(), own_block);
  EXPECT_FALSE(q.enabled());
  q.set_enabled(true);
  EXPECT_TRUE(q.enabled());
}

// ---------------------------------------------------------------------------------------------
// Calibration

TEST(Calibration, MaxEqualsTrueMaxOverSeveralCollects) {
  Quantizer q(kCombine, make_spec(Format::kNvfp4));
  q.start_calibration();
  EXPECT_TRUE(q.calibrating());
  const std::vector<float> a = make_data(1000, 1, 37.25f);  // largest |x| is negative
  const std::vector<float> b = make_data(513, 2);
  const std::vector<float> c = make_data(64, 3, 20.0f);
  const std::vector<bf16> bb = test::to_bf16(b);
  q.collect(a.data(), int64_t(a.size()));
  q.collect(bb.data(), int64_t(bb.size()));
  q.collect(c.data(), int64_t(c.size()));
  float expected = std::max(true_max_abs(a), true_max_abs(c));
  for (bf16 x : bb) expected = std::max(expected, std::fabs(to_f32(x)));
  EXPECT_EQ(expected, 37.25f);
  EXPECT_EQ(q.collected_max(), expected);
  EXPECT_FALSE(q.has_amax());  // not stored before finish
  q.finish_calibration();
  EXPECT_FALSE(q.calibrating());
  ASSERT_TRUE(q.amax().has_value());
  EXPECT_EQ(bits_of(*q.amax()), bits_of(expected));
}

TEST(Calibration, BothSignsAndBf16MaxCount) {
  Quantizer q(kCombine, make_spec(Format::kFp8));
  q.start_calibration();
  const std::vector<bf16> x = {to_bf16(-0.0f), to_bf16(3.0f), to_bf16(-1e30f), to_bf16(2.0f)};
  q.collect(x.data(), int64_t(x.size()));
  q.finish_calibration();
  EXPECT_EQ(*q.amax(), to_f32(to_bf16(1e30f)));
}

TEST(Calibration, NanAndInfRaiseNamingTheQuantizer) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (float bad : {nan, inf, -inf}) {
    Quantizer q(kCombine, make_spec(Format::kNvfp4));
    q.start_calibration();
    const std::vector<float> ok = {1.0f, -2.0f};
    q.collect(ok.data(), 2);
    std::vector<float> x = {0.5f, 100.0f, 7.0f, bad, 1.0f};
    expect_error([&] { q.collect(x.data(), int64_t(x.size())); },
                 {kCombine, ": calibration data contains NaN/inf at element 3"});
    // The bad call collected nothing: 100 was not folded in.
    EXPECT_EQ(q.collected_max(), 2.0f);
    const std::vector<bf16> xb = test::to_bf16(x);
    expect_error([&] { q.collect(xb.data(), int64_t(xb.size())); },
                 {kCombine, "NaN/inf at element 3"});
    expect_error([&] { q.collect_max(bad); }, {kCombine, "NaN/inf"});
    EXPECT_EQ(q.collected_max(), 2.0f);
  }
}

TEST(Calibration, NoDataRaisesNamingTheQuantizer) {
  Quantizer q(kCombine, make_spec(Format::kFp8));
  q.start_calibration();
  q.collect(static_cast<const float*>(nullptr), 0);  // an empty batch sees nothing
  EXPECT_FALSE(q.seen_data());
  expect_error([&] { q.finish_calibration(); }, {std::string("no calibration data reached ") + kCombine});
  EXPECT_TRUE(q.calibrating());
  EXPECT_FALSE(q.has_amax());
}

TEST(Calibration, ZerosOnlyGiveAmaxZero) {
  Quantizer q(kCombine, make_spec(Format::kInt8));
  q.start_calibration();
  const std::vector<bf16> z = {to_bf16(0.0f), to_bf16(-0.0f), to_bf16(0.0f)};
  q.collect(z.data(), int64_t(z.size()));
  EXPECT_TRUE(q.seen_data());
  q.finish_calibration();
  ASSERT_TRUE(q.amax().has_value());
  EXPECT_EQ(bits_of(*q.amax()), 0u);  // +0, not -0
}

TEST(Calibration, CollectMaxFromElsewhere) {
  Quantizer q(kDispatch, make_spec(Format::kFp8));
  q.start_calibration();
  q.collect_max(5.5f);
  q.collect_max(0.25f);
  expect_error([&] { q.collect_max(-1.0f); }, {kDispatch, "negative"});
  q.finish_calibration();
  EXPECT_EQ(*q.amax(), 5.5f);
}

TEST(Calibration, RestartClearsTheCollectedMaxAndKeepsTheOldAmaxUntilFinish) {
  Quantizer q(kCombine, make_spec(Format::kFp8));
  q.start_calibration();
  q.collect_max(9.0f);
  q.finish_calibration();
  q.start_calibration();
  EXPECT_FALSE(q.seen_data());
  EXPECT_EQ(q.collected_max(), 0.0f);
  EXPECT_EQ(*q.amax(), 9.0f);
  q.collect_max(2.0f);
  q.finish_calibration();
  EXPECT_EQ(*q.amax(), 2.0f);
  q.reset();
  EXPECT_FALSE(q.has_amax());
  EXPECT_FALSE(q.calibrating());
  const std::vector<float> x = {1.0f};
  std::vector<float> y(1);
  expect_error([&] { q.qdq(x.data(), y.data(), 1, 1); },
               {std::string(kCombine) + ": not calibrated; run calibration or load a calibration file"});
}

TEST(Calibration, ReduceAcrossReplicasWhereSomeSawNothing) {
  std::vector<Quantizer> ranks;
  for (int r = 0; r < 4; ++r) ranks.emplace_back(kCombine, make_spec(Format::kNvfp4));
  for (Quantizer& q : ranks) q.start_calibration();
  // Ranks 0 and 2 see nothing; ranks 1 and 3 see different data.
  const std::vector<float> d1 = make_data(300, 11, 12.5f), d3 = make_data(300, 13, 48.0f);
  ranks[1].collect(d1.data(), int64_t(d1.size()));
  ranks[3].collect(d3.data(), int64_t(d3.size()));
  EXPECT_EQ(ranks[1].collected_max(), true_max_abs(d1));
  const float global = std::max(true_max_abs(d1), true_max_abs(d3));
  EXPECT_EQ(global, 48.0f);
  std::vector<Quantizer*> ptrs;
  for (Quantizer& q : ranks) ptrs.push_back(&q);
  reduce_calibration_max(ptrs);
  for (Quantizer& q : ranks) {
    EXPECT_TRUE(q.seen_data());
    q.finish_calibration();
    ASSERT_TRUE(q.amax().has_value());
    EXPECT_EQ(bits_of(*q.amax()), bits_of(global));
  }
}

TEST(Calibration, ReduceWhereNoReplicaSawDataFailsAtFinish) {
  std::vector<Quantizer> ranks;
  for (int r = 0; r < 4; ++r) ranks.emplace_back(kCombine, make_spec(Format::kFp8));
  std::vector<Quantizer*> ptrs;
  for (Quantizer& q : ranks) {
    q.start_calibration();
    ptrs.push_back(&q);
  }
  reduce_calibration_max(ptrs);
  for (Quantizer& q : ranks) {
    EXPECT_FALSE(q.seen_data());
    expect_error([&] { q.finish_calibration(); }, {"no calibration data reached", kCombine});
  }
}

TEST(Calibration, ReduceRejectsReplicasOfDifferentQuantizers) {
  Quantizer a(kCombine, make_spec(Format::kFp8)), b(kDispatch, make_spec(Format::kFp8));
  a.start_calibration();
  b.start_calibration();
  std::vector<Quantizer*> ptrs = {&a, &b};
  expect_error([&] { reduce_calibration_max(ptrs); }, {kCombine, kDispatch}, ErrorKind::kInternal);
}

TEST(Calibration, QuantizersWithoutACalibratedAmaxNeedNoData) {
  Quantizer mx(kCombine, make_spec(Format::kMxfp4));
  Quantizer constant(kCombine, make_spec(Format::kNvfp4, AmaxSource::kConstant, 2688.0f));
  Quantizer dynamic(kDispatch, make_spec(Format::kFp8, AmaxSource::kDynamic));
  Quantizer disabled(kDispatch, make_spec(Format::kFp8), false);
  for (Quantizer* q : {&mx, &constant, &dynamic, &disabled}) {
    q->start_calibration();
    EXPECT_NO_THROW(q->finish_calibration()) << q->name();
    EXPECT_FALSE(q->calibrating());
  }
  EXPECT_FALSE(mx.needs_calibration());
  EXPECT_FALSE(mx.has_amax());
  EXPECT_EQ(*constant.amax(), 2688.0f);
  EXPECT_FALSE(dynamic.has_amax());
  EXPECT_TRUE(disabled.needs_calibration());
  EXPECT_FALSE(disabled.has_amax());
}

// ---------------------------------------------------------------------------------------------
// amax

TEST(Amax, SetAmaxValidates) {
  Quantizer q(kCombine, make_spec(Format::kFp8));
  for (float bad : {-1.0f, std::numeric_limits<float>::infinity(),
                    std::numeric_limits<float>::quiet_NaN()}) {
    expect_error([&] { q.set_amax(bad); }, {kCombine, "amax must be a finite number >= 0"});
    EXPECT_FALSE(q.has_amax());
  }
  q.set_amax(0.0f);
  EXPECT_EQ(*q.amax(), 0.0f);
  q.set_amax(1e-45f);
  EXPECT_EQ(bits_of(*q.amax()), 1u);
  Quantizer constant(kCombine, make_spec(Format::kFp8, AmaxSource::kConstant, 10.0f));
  expect_error([&] { constant.set_amax(3.0f); }, {kCombine, "calibrated"});
  EXPECT_EQ(*constant.amax(), 10.0f);
}

// ---------------------------------------------------------------------------------------------
// QDQ

TEST(Qdq, DisabledAndCalibratingCopyBitForBit) {
  // Values a QDQ would change: NaN payloads, -0, subnormals, inf, large and tiny numbers.
  std::vector<float> xf = make_data(96, 5, 1000.0f);
  xf[0] = f32_from_bits(0x7FC01234u);  // NaN with a payload: a QDQ would canonicalise it
  xf[1] = -0.0f;
  xf[2] = 1e-40f;
  xf[3] = -std::numeric_limits<float>::infinity();
  std::vector<bf16> xb = test::to_bf16(xf);
  xb[0].bits = 0x7FA1;  // non-canonical bf16 NaN
  xb[4].bits = 0x0001;  // bf16 subnormal

  Quantizer disabled(kCombine, make_spec(Format::kNvfp4, AmaxSource::kConstant, 2688.0f), false);
  Quantizer calibrating(kCombine, make_spec(Format::kFp8));
  calibrating.set_amax(1.0f);  // an amax is there, yet calibration must not quantize
  calibrating.start_calibration();
  for (const Quantizer* q : {&disabled, &calibrating}) {
    std::vector<float> yf(xf.size());
    std::vector<bf16> yb(xb.size());
    q->qdq(xf.data(), yf.data(), 3, 32);
    q->qdq(xb.data(), yb.data(), 3, 32);
    EXPECT_TRUE(test::bytes_equal(xf, yf));
    EXPECT_TRUE(test::bytes_equal(xb, yb));
    std::vector<bf16> inplace = xb;
    q->qdq(inplace.data(), inplace.data(), 3, 32);
    EXPECT_TRUE(test::bytes_equal(xb, inplace));
  }
  // The same data does change under an enabled, finished quantizer: the copy test can fail.
  disabled.set_enabled(true);
  std::vector<bf16> yb(xb.size());
  disabled.qdq(xb.data(), yb.data(), 3, 32);
  EXPECT_FALSE(test::bytes_equal(xb, yb));
}

TEST(Qdq, EnabledMatchesReferenceWithTheRightAmax) {
  const std::vector<float> xf = make_data(4 * 80, 7, 300.0f);
  const std::vector<bf16> xb = test::to_bf16(xf);
  const int64_t rows = 4, cols = 80;
  for (Format f : {Format::kFp8, Format::kNvfp4, Format::kInt8}) {
    SCOPED_TRACE(format_name(f));
    Quantizer calibrated(kCombine, make_spec(f));
    calibrated.start_calibration();
    const std::vector<float> calib = make_data(200, 9, 150.0f);  // amax 150, not the data's 300
    calibrated.collect(calib.data(), int64_t(calib.size()));
    calibrated.finish_calibration();
    Quantizer constant(kCombine, make_spec(f, AmaxSource::kConstant, 2688.0f));
    Quantizer dynamic(kDispatch, make_spec(f, AmaxSource::kDynamic));

    const float dyn_f = amax_ref(xf.data(), int64_t(xf.size()));
    const float dyn_b = amax_ref(xb.data(), int64_t(xb.size()));
    EXPECT_EQ(calibrated.resolve_amax(xf.data(), int64_t(xf.size())), 150.0f);
    EXPECT_EQ(constant.resolve_amax(xb.data(), int64_t(xb.size())), 2688.0f);
    EXPECT_EQ(dynamic.resolve_amax(xf.data(), int64_t(xf.size())), dyn_f);
    EXPECT_EQ(dyn_f, 300.0f);

    const std::pair<const Quantizer*, float> cases[] = {
        {&calibrated, 150.0f}, {&constant, 2688.0f}, {&dynamic, -1.0f}};
    for (const auto& [q, amax] : cases) {
      SCOPED_TRACE(amax_source_name(q->spec().amax_source));
      std::vector<float> ef(xf.size()), af(xf.size());
      std::vector<bf16> eb(xb.size()), ab(xb.size());
      qdq_ref(f, xf.data(), ef.data(), rows, cols, amax < 0 ? dyn_f : amax);
      qdq_ref(f, xb.data(), eb.data(), rows, cols, amax < 0 ? dyn_b : amax);
      q->qdq(xf.data(), af.data(), rows, cols);
      q->qdq(xb.data(), ab.data(), rows, cols);
      EXPECT_TRUE(test::bytes_equal(ef, af));
      EXPECT_TRUE(test::bytes_equal(eb, ab));
      EXPECT_FALSE(test::bytes_equal(xb, ab));  // QDQ did something
    }
    // The amax matters: a calibrated quantizer does not behave like the dynamic one here.
    std::vector<bf16> cal_out(xb.size()), dyn_out(xb.size());
    calibrated.qdq(xb.data(), cal_out.data(), rows, cols);
    dynamic.qdq(xb.data(), dyn_out.data(), rows, cols);
    EXPECT_FALSE(test::bytes_equal(cal_out, dyn_out));
  }
}

// Heavy-tailed data with NaN, +-inf, +-0 and subnormals: still exactly the reference.
TEST(Qdq, EnabledMatchesReferenceOnSpecialValues) {
  const int64_t rows = 6, cols = 96;
  const std::vector<float> xf = test::activations(rows, cols, 42);
  const std::vector<bf16> xb = test::to_bf16(xf);
  for (Format f : kAllFormats) {
    SCOPED_TRACE(format_name(f));
    Quantizer calibrated(kCombine, make_spec(f));
    if (calibrated.needs_calibration()) calibrated.set_amax(64.0f);
    Quantizer constant(kCombine, make_spec(f, AmaxSource::kConstant, 2688.0f));
    Quantizer dynamic(kDispatch, make_spec(f, AmaxSource::kDynamic));
    const bool global = format_has_global_amax(f);
    const std::pair<const Quantizer*, float> cases[] = {
        {&calibrated, global ? 64.0f : 0.0f},
        {&constant, global ? 2688.0f : 0.0f},
        {&dynamic, global ? amax_ref(xb.data(), rows * cols) : 0.0f}};
    for (const auto& [q, amax] : cases) {
      SCOPED_TRACE(amax_source_name(q->spec().amax_source));
      std::vector<bf16> expected(xb.size()), actual(xb.size());
      qdq_ref(f, xb.data(), expected.data(), rows, cols, amax);
      q->qdq(xb.data(), actual.data(), rows, cols);
      EXPECT_TRUE(test::bytes_equal(expected, actual));
      std::vector<bf16> inplace = xb;  // y may alias x
      q->qdq(inplace.data(), inplace.data(), rows, cols);
      EXPECT_TRUE(test::bytes_equal(expected, inplace));
    }
  }
}

TEST(Qdq, UncalibratedRaises) {
  Quantizer q(kCombine, make_spec(Format::kNvfp4));
  const std::vector<bf16> x = test::to_bf16(make_data(32, 1));
  std::vector<bf16> y(x.size());
  expect_error([&] { q.qdq(x.data(), y.data(), 1, 32); },
               {std::string(kCombine) + ": not calibrated; run calibration or load a calibration file"});
  expect_error([&] { q.resolve_amax(x.data(), 32); }, {kCombine, "not calibrated"});
}

TEST(Qdq, MxFormatsNeedNoAmax) {
  const std::vector<bf16> x = test::to_bf16(make_data(2 * 96, 21, 500.0f));
  for (Format f : {Format::kMxfp8, Format::kMxfp4}) {
    SCOPED_TRACE(format_name(f));
    Quantizer q(kCombine, make_spec(f));  // amax source defaults to calibrated: irrelevant for mx
    EXPECT_FALSE(q.needs_calibration());
    EXPECT_FALSE(q.has_amax());
    EXPECT_EQ(q.resolve_amax(x.data(), int64_t(x.size())), 0.0f);
    std::vector<bf16> expected(x.size()), actual(x.size());
    qdq_ref(f, x.data(), expected.data(), 2, 96, 0.0f);
    q.qdq(x.data(), actual.data(), 2, 96);
    EXPECT_TRUE(test::bytes_equal(expected, actual));
    EXPECT_FALSE(test::bytes_equal(x, actual));
  }
}

// ---------------------------------------------------------------------------------------------
// Calibration file

TEST(CalibrationFile, SaveThenLoadIsExact) {
  TempDir dir;
  const std::string path = dir.file("calib.json");
  const float values[] = {0.1f, 3.4e38f, 1e-40f /* subnormal */, 0.0f, 12.5f};
  std::vector<Quantizer> saved;
  for (int i = 0; i < 5; ++i) {
    const Format f = i % 2 ? Format::kNvfp4 : Format::kFp8;
    saved.emplace_back("layers." + std::to_string(i) + ".mlp.experts.combine_quantizer",
                       make_spec(i == 4 ? Format::kInt8 : f));
    saved.back().set_amax(values[i]);
  }
  saved.emplace_back(kDispatch, make_spec(Format::kMxfp8));
  saved.emplace_back("layers.9.const", make_spec(Format::kNvfp4, AmaxSource::kConstant, 2688.0f));
  std::vector<const Quantizer*> cptrs;
  for (const Quantizer& q : saved) cptrs.push_back(&q);
  save_calibration(path, cptrs);

  const std::string text = read_text(path);
  EXPECT_NE(text.find("\"0x41480000\""), std::string::npos) << text;  // 12.5
  EXPECT_NE(text.find("\"version\": 2"), std::string::npos) << text;
  EXPECT_NE(text.find("\"nvfp4\""), std::string::npos) << text;

  std::vector<Quantizer> loaded;
  for (const Quantizer& q : saved) loaded.emplace_back(q.name(), q.spec());
  std::vector<Quantizer*> ptrs;
  for (Quantizer& q : loaded) ptrs.push_back(&q);
  load_calibration(path, ptrs);

  const std::vector<bf16> x = test::to_bf16(make_data(64, 4, 30.0f));
  const std::vector<float> xf = make_data(64, 5, 1e-39f);
  for (size_t i = 0; i < saved.size(); ++i) {
    SCOPED_TRACE(saved[i].name());
    ASSERT_EQ(saved[i].has_amax(), loaded[i].has_amax());
    if (saved[i].has_amax()) {
      EXPECT_EQ(bits_of(*saved[i].amax()), bits_of(*loaded[i].amax()));
    }
    std::vector<bf16> a(x.size()), b(x.size());
    saved[i].qdq(x.data(), a.data(), 2, 32);
    loaded[i].qdq(x.data(), b.data(), 2, 32);
    EXPECT_TRUE(test::bytes_equal(a, b));
    std::vector<float> af(xf.size()), bf(xf.size());
    saved[i].qdq(xf.data(), af.data(), 2, 32);
    loaded[i].qdq(xf.data(), bf.data(), 2, 32);
    EXPECT_TRUE(test::bytes_equal(af, bf));
  }
  EXPECT_EQ(bits_of(*loaded[2].amax()), bits_of(1e-40f));
  // No temporary file is left next to the output.
  EXPECT_EQ(count_entries(dir.path()), 1);
}

TEST(CalibrationFile, AmaxWithoutBitsIsReadAndDisagreementIsAnError) {
  TempDir dir;
  const std::string path = dir.file("calib.json");
  Quantizer q(kCombine, make_spec(Format::kFp8));
  std::vector<Quantizer*> ptrs = {&q};
  write_text(path, R"({"version": 1, "quantizers": {")" + std::string(kCombine) +
                       R"(": {"format": "fp8", "amax_source": "calibrated", "amax": 0.1}}})");
  load_calibration(path, ptrs);
  EXPECT_EQ(bits_of(*q.amax()), bits_of(0.1f));
  write_text(path, R"({"version": 1, "quantizers": {")" + std::string(kCombine) +
                       R"(": {"format": "fp8", "amax_source": "calibrated", "amax": 2.0,
                              "amax_bits": "0x41480000"}}})");
  expect_error([&] { load_calibration(path, ptrs); }, {path, kCombine, "disagree"});
  EXPECT_EQ(bits_of(*q.amax()), bits_of(0.1f));
}

class CalibrationFileErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.file("calib.json");
    Quantizer combine(kCombine, make_spec(Format::kNvfp4));
    Quantizer dispatch(kDispatch, make_spec(Format::kFp8));
    combine.set_amax(12.5f);
    dispatch.set_amax(3.0f);
    std::vector<const Quantizer*> ptrs = {&combine, &dispatch};
    save_calibration(path_, ptrs);
  }
  // Loads into fresh quantizers with the given specs; on error, checks nothing was applied.
  void expect_load_error(QuantSpec combine_spec, bool with_dispatch,
                         std::initializer_list<std::string> parts, const std::string& extra = "") {
    Quantizer combine(kCombine, combine_spec);
    Quantizer dispatch(kDispatch, make_spec(Format::kFp8));
    Quantizer other("layers.5.other_quantizer", make_spec(Format::kFp8));
    std::vector<Quantizer*> ptrs = {&combine};
    if (with_dispatch) ptrs.push_back(&dispatch);
    if (!extra.empty()) ptrs.push_back(&other);
    expect_error([&] { load_calibration(path_, ptrs); }, parts);
    for (const Quantizer* q : ptrs)
      EXPECT_FALSE(q->needs_calibration() && q->has_amax()) << q->name() << " changed";
  }
  TempDir dir_;
  std::string path_;
};

TEST_F(CalibrationFileErrors, MissingQuantizer) {
  expect_load_error(make_spec(Format::kNvfp4), true, {path_, "layers.5.other_quantizer"}, "other");
}

TEST_F(CalibrationFileErrors, FormatMismatch) {
  expect_load_error(make_spec(Format::kInt8), true, {path_, kCombine, "nvfp4", "int8"});
}

TEST_F(CalibrationFileErrors, UnknownQuantizer) {
  expect_load_error(make_spec(Format::kNvfp4), false, {path_, kDispatch, "not in this model"});
}

TEST_F(CalibrationFileErrors, MalformedJson) {
  std::string text = read_text(path_);
  write_text(path_, text.substr(0, text.size() / 2));
  expect_load_error(make_spec(Format::kNvfp4), true, {path_, "malformed JSON"});
}

TEST_F(CalibrationFileErrors, WrongTypes) {
  const std::string head = R"({"version": 1, "quantizers": {")" + std::string(kCombine) + "\": ";
  const std::pair<std::string, std::string> cases[] = {
      {head + R"({"format": "nvfp4", "amax_source": "calibrated", "amax": "12.5"}}})", "'amax'"},
      {head + R"({"format": 3, "amax_source": "calibrated", "amax": 12.5}}})", "'format'"},
      {head + R"({"format": "nvfp4", "amax_source": "calibrated", "amax_bits": "0x4148"}}})",
       "'amax_bits'"},
      {head + R"({"format": "nvfp4", "amax_source": "calibrated", "amax": -1}}})", "amax"},
      {head + R"({"format": "nvfp4", "amax_source": "calibrated", "amax": 1, "scale": 2}}})",
       "'scale'"},
      {head + R"([1, 2]}})", "object"},
      {R"({"version": "1", "quantizers": {}})", "'version'"},
      {R"({"version": 3, "quantizers": {}})", "version 3"},
      {R"({"version": 18446744073709551615, "quantizers": {}})", "version 18446744073709551615"},
      {R"({"version": 2, "quantizers": {}})", "'kind'"},
      {R"({"version": 1, "quantizers": []})", "'quantizers'"},
      {R"([])", "JSON object"},
  };
  for (const auto& [text, what] : cases) {
    SCOPED_TRACE(text);
    write_text(path_, text);
    expect_load_error(make_spec(Format::kNvfp4), false, {path_, what});
  }
}

TEST_F(CalibrationFileErrors, EntryWithoutCalibratedAmax) {
  // Saved from a recipe where the combine quantizer was constant: not a calibration for it now.
  Quantizer constant(kCombine, make_spec(Format::kNvfp4, AmaxSource::kConstant, 2688.0f));
  std::vector<const Quantizer*> ptrs = {&constant};
  save_calibration(path_, ptrs);
  expect_load_error(make_spec(Format::kNvfp4), false, {path_, kCombine, "constant"});
}

TEST_F(CalibrationFileErrors, MissingFile) {
  fs::remove(path_);
  expect_load_error(make_spec(Format::kNvfp4), true, {path_, "no such file"});
}

// Read whole, so: a regular file of at most kMaxCalibrationFileBytes. A FIFO would block the open
// and /dev/zero would fill memory; both are refused by name at once.
TEST_F(CalibrationFileErrors, SpecialAndOversizedFiles) {
  fs::remove(path_);
  ASSERT_EQ(::mkfifo(path_.c_str(), 0600), 0);
  expect_load_error(make_spec(Format::kNvfp4), true, {path_, "is a FIFO (named pipe), not a regular file"});
  fs::remove(path_);
  fs::create_symlink("/dev/zero", path_);
  expect_load_error(make_spec(Format::kNvfp4), true, {path_, "is a character device"});
  fs::remove(path_);
  std::ofstream(path_).close();
  fs::resize_file(path_, kMaxCalibrationFileBytes + 1);
  expect_load_error(make_spec(Format::kNvfp4), true, {path_, "over the limit of 64.0 MiB"});
}

TEST_F(CalibrationFileErrors, LoadSucceedsWithTheMatchingSet) {
  // The fixture's file itself is good: the error tests fail for the reason they name.
  Quantizer combine(kCombine, make_spec(Format::kNvfp4));
  Quantizer dispatch(kDispatch, make_spec(Format::kFp8));
  std::vector<Quantizer*> ptrs = {&combine, &dispatch};
  load_calibration(path_, ptrs);
  EXPECT_EQ(*combine.amax(), 12.5f);
  EXPECT_EQ(*dispatch.amax(), 3.0f);
}

TEST(CalibrationFile, FailedSaveIntoMissingDirectoryLeavesNothing) {
  TempDir dir;
  const fs::path missing = dir.path() / "no_such_dir";
  const std::string path = (missing / "calib.json").string();
  Quantizer q(kCombine, make_spec(Format::kFp8));
  q.set_amax(1.0f);
  std::vector<const Quantizer*> ptrs = {&q};
  expect_error([&] { save_calibration(path, ptrs); }, {path, "cannot write"});
  EXPECT_FALSE(fs::exists(missing));
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(CalibrationFile, FailedSaveKeepsTheOldFile) {
  TempDir dir;
  const std::string path = dir.file("calib.json");
  write_text(path, "previous contents");
  Quantizer uncalibrated(kCombine, make_spec(Format::kFp8));
  std::vector<const Quantizer*> ptrs = {&uncalibrated};
  expect_error([&] { save_calibration(path, ptrs); }, {kCombine, "not calibrated"});
  EXPECT_EQ(read_text(path), "previous contents");
  EXPECT_EQ(count_entries(dir.path()), 1);
  // A directory in the way of the rename: the write fails and the temporary file is removed.
  const std::string dir_path = dir.file("is_a_dir");
  fs::create_directories(fs::path(dir_path) / "child");
  uncalibrated.set_amax(2.0f);
  expect_error([&] { save_calibration(dir_path, ptrs); }, {dir_path});
  EXPECT_EQ(count_entries(dir.path()), 2);  // calib.json and is_a_dir only
}

}  // namespace
}  // namespace moefq
