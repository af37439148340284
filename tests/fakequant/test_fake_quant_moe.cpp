// FakeQuantMoe (docs/fake_quant.md) on the CPU back-ends: dispatch and combine quantization against
// independent re-computations (qdq_ref on the inputs, a re-sum of the QDQ'd combine rows), the
// configuration errors, the layout check (wrong offset, debug switch, padding-only warm-up), both
// back-ends bit-identical, max calibration across simulated ranks, and calibration files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "moefq/calibration_file.h"
#include "moefq/combine_qdq.h"
#include "moefq/errors.h"
#include "moefq/expert_backend.h"
#include "moefq/fake_quant_moe.h"
#include "moefq/qdq.h"
#include "moefq/quantizer.h"
#include "moefq/recipe.h"
#include "moefq/weights.h"
#include "moe_test_util.h"
#include "test_util.h"

namespace moefq {
namespace {

using test::host_forward, test::make_problem, test::Problem, test::random_routing, test::small_config,
    test::weights_for;

// ---------------------------------------------------------------------------------------------
// Configs, weights, routing and batches (small enough for a 2-core CPU in well under a second).

bool token_active(const std::vector<int32_t>& idx, int64_t t, int64_t K) {
  for (int64_t k = 0; k < K; ++k)
    if (idx[size_t(t * K + k)] >= 0) return true;
  return false;
}

std::unique_ptr<ExpertBackend> backend(const std::string& kind, const MoeConfig& c, int64_t R, int64_t T, bool fused,
                                       CombineWeighting w = CombineWeighting::kBefore) {
  return make_expert_backend(kind, c, R, T, weights_for(c, R), EngineOptions{fused, 2, w});
}

std::unique_ptr<FakeQuantMoe> make_fq(const std::string& kind, const MoeConfig& c, int64_t R, int64_t T, bool fused,
                                      CombineWeighting w = CombineWeighting::kBefore) {
  return std::make_unique<FakeQuantMoe>(backend(kind, c, R, T, fused, w), 0);
}

void configure(FakeQuantMoe& fq, const std::string& yaml) {
  fq.configure(apply_recipe(parse_recipe_text(yaml, "test.yaml"), fq.quantizer_names()));
}

// ---------------------------------------------------------------------------------------------
// Recipes.

const char* const kNone =
    "quant_cfg:\n"
    "  - quantizer_name: '*'\n"
    "    enable: false\n";
const char* const kDispatchFp8 =
    "quant_cfg:\n"
    "  - quantizer_name: '*dispatch_quantizer'\n"
    "    cfg: {num_bits: e4m3, constant_amax: 1000}\n";
constexpr float kDispatchAmax = 1000.0f;
const char* const kDispatchFp8Dynamic =
    "quant_cfg:\n"
    "  - quantizer_name: '*dispatch_quantizer'\n"
    "    cfg: {num_bits: e4m3, amax: dynamic}\n";
// The shipped unit (calibrated) with its amax overridden by a constant that makes the global
// scale 1.
const char* const kCombineNvfp4 =
    "$import: [moe_combine_nvfp4]\n"
    "quant_cfg:\n"
    "  - quantizer_name: '*combine_quantizer'\n"
    "    cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}, constant_amax: 2688}\n";
constexpr float kCombineAmax = 2688.0f;
const char* const kBoth =
    "$import: [moe_combine_nvfp4]\n"
    "quant_cfg:\n"
    "  - quantizer_name: '*dispatch_quantizer'\n"
    "    cfg: {num_bits: e4m3, constant_amax: 1000}\n"
    "  - quantizer_name: '*combine_quantizer'\n"
    "    cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}, constant_amax: 2688}\n";
// Max calibration of both, with the shipped units.
const char* const kCalibrateBoth = "$import: [moe_dispatch_fp8, moe_combine_nvfp4]\nalgorithm: max\n";

// ---------------------------------------------------------------------------------------------
// Independent expectations.

const bf16* row_at(const ExpertBackend& be, int64_t rank, int64_t slot, int64_t token) {
  const int64_t T = be.max_tokens(), H = be.config().hidden;
  const auto bytes = be.combine_bytes(rank);
  const size_t off = *be.combine_offset() + size_t((slot * T + token) * H) * 2;
  EXPECT_LE(off + size_t(H) * 2, bytes.size());
  return reinterpret_cast<const bf16*>(bytes.data() + off);
}

// The combine re-sum of docs/fake_quant.md over the back-end's rows (test::qdq_resum).
std::vector<bf16> expected_resum(const ExpertBackend& be, const Problem& p, int64_t r, Format f, float amax) {
  return test::qdq_resum(be.combine_bytes(r).data(), *be.combine_offset(), be.max_tokens(), be.fused_shared(), p, r, f,
                         amax, be.combine_weighting() == CombineWeighting::kAfter);
}

bool all_finite(const std::vector<std::vector<bf16>>& ys) {
  for (const auto& y : ys)
    for (const bf16& v : y)
      if (!is_finite(to_f32(v))) return false;
  return true;
}

bool any_differs(const std::vector<std::vector<bf16>>& a, const std::vector<std::vector<bf16>>& b) {
  for (size_t r = 0; r < a.size(); ++r)
    for (size_t i = 0; i < a[r].size(); ++i)
      if (a[r][i].bits != b[r][i].bits) return true;
  return false;
}

std::string lower(std::string s) {
  for (char& ch : s) ch = char(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

std::string hex16(uint16_t v) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "0x%04x", unsigned(v));
  return buf;
}

// Runs fn, expecting a moefq::Error whose message contains every one of `needles`; returns it.
template <typename Fn>
std::optional<Error> expect_error(Fn&& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const Error& e) {
    for (const auto& s : needles)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << "missing '" << s << "' in: " << e.what();
    return e;
  }
  ADD_FAILURE() << "no moefq::Error";
  return std::nullopt;
}

// Sets an environment variable for a scope.
struct ScopedEnv {
  std::string name;
  ScopedEnv(const char* n, const char* v) : name(n) { setenv(n, v, 1); }
  ~ScopedEnv() { unsetenv(name.c_str()); }
};

// ---------------------------------------------------------------------------------------------
// Test back-ends: mega_moe with its combine rows hidden, or reported one row (H * 2 bytes) off.

class TestBackend final : public ExpertBackend {
 public:
  enum class Mode { kNoRows, kShiftedRows };
  TestBackend(std::unique_ptr<ExpertBackend> inner, std::string kind, Mode mode)
      : inner_(std::move(inner)), kind_(std::move(kind)), mode_(mode) {}
  std::string kind() const override { return kind_; }
  const MoeConfig& config() const override { return inner_->config(); }
  int64_t num_ranks() const override { return inner_->num_ranks(); }
  int64_t max_tokens() const override { return inner_->max_tokens(); }
  bool fused_shared() const override { return inner_->fused_shared(); }
  void forward(std::span<const RankBatch> b) override { inner_->forward(b); }
  std::optional<size_t> combine_offset() const override {
    if (mode_ == Mode::kNoRows) return std::nullopt;
    return *inner_->combine_offset() + size_t(inner_->config().hidden) * 2;
  }
  std::span<const uint8_t> combine_bytes(int64_t rank) const override { return inner_->combine_bytes(rank); }
  void shared_expert(int64_t rank, const bf16* x, int64_t n, bf16* y) const override {
    inner_->shared_expert(rank, x, n, y);
  }

 private:
  std::unique_ptr<ExpertBackend> inner_;
  std::string kind_;
  Mode mode_;
};

void register_test_backends() {
  for (auto [kind, mode] : {std::pair{"test_no_combine_rows", TestBackend::Mode::kNoRows},
                            std::pair{"test_shifted_rows", TestBackend::Mode::kShiftedRows}}) {
    const std::string k = kind;
    const TestBackend::Mode m = mode;
    register_expert_backend(
        k, [k, m](const MoeConfig& c, int64_t R, int64_t T, const std::vector<LayerWeights>& w, EngineOptions o) {
          return std::unique_ptr<ExpertBackend>(new TestBackend(make_expert_backend("mega_moe", c, R, T, w, o), k, m));
        });
  }
}

// =============================================================================================
// dispatch and combine quantization, with and without a fused shared expert

TEST(FakeQuantMoe, DispatchQuantizationEqualsBackendOnQdqRefTokens) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 12;
  for (const std::string kind : {"mega_moe", "routed_experts"}) {
    for (const bool dynamic : {false, true}) {
      // Dynamic: the amax is per call over the tokens that are sent (those with an active routed
      // slot); padding tokens carry a huge value to prove they do not count.
      Problem p = make_problem(c, R, n, 100, 4);
      auto is_padding = [&](int64_t r, int64_t t) {
        for (int64_t k = 0; k < c.top_k; ++k)
          if (p.idx[size_t(r)][size_t(t * c.top_k + k)] >= 0) return false;
        return true;
      };
      for (int64_t r = 0; r < R; ++r)
        for (int64_t t = 0; t < n; ++t)
          if (is_padding(r, t)) p.x[size_t(r)][size_t(t * c.hidden)].bits = bf16_round(60000.0f);
      auto fq = make_fq(kind, c, R, n, /*fused=*/false);
      configure(*fq, dynamic ? kDispatchFp8Dynamic : kDispatchFp8);
      const auto x_before = p.x;
      const auto y = host_forward(*fq, p);
      for (int64_t r = 0; r < R; ++r)
        EXPECT_TRUE(test::bytes_equal(x_before[size_t(r)], p.x[size_t(r)]))
            << kind << ": caller's x modified, rank " << r;

      std::vector<std::vector<bf16>> xq(static_cast<size_t>(R));
      std::vector<float> amax_r;
      for (int64_t r = 0; r < R; ++r) {
        const auto& x = p.x[size_t(r)];
        float amax = kDispatchAmax;
        if (dynamic) {
          amax = 0.0f;
          for (int64_t t = 0; t < n; ++t)
            if (!is_padding(r, t)) amax = std::max(amax, amax_ref(x.data() + t * c.hidden, c.hidden));
          ASSERT_LT(amax, 60000.0f);
        }
        amax_r.push_back(amax);
        xq[size_t(r)].resize(x.size());
        qdq_ref(Format::kFp8, x.data(), xq[size_t(r)].data(), n, c.hidden, amax);
      }
      if (dynamic) {
        ASSERT_NE(amax_r[0], amax_r[1]) << "the ranks' data should give different per-rank amax";
      }
      auto ref = backend(kind, c, R, n, false);
      const auto want = host_forward(*ref, p, &xq);
      auto plain = backend(kind, c, R, n, false);
      const auto unquantized = host_forward(*plain, p);
      for (int64_t r = 0; r < R; ++r)
        EXPECT_TRUE(test::bytes_equal(want[size_t(r)], y[size_t(r)]))
            << kind << " dynamic=" << dynamic << " rank " << r;
      EXPECT_TRUE(any_differs(y, unquantized)) << kind << " dynamic=" << dynamic;
      EXPECT_TRUE(all_finite(y)) << kind << " dynamic=" << dynamic;
    }
  }
}

TEST(FakeQuantMoe, CombineQuantizationWithAndWithoutFusedSharedExpert) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 10;
  for (const std::string kind : {"mega_moe", "routed_experts"}) {
    for (const bool fused : {true, false}) {
      const Problem p = make_problem(c, R, n, 200, 3);
      auto fq = make_fq(kind, c, R, n, fused);
      ASSERT_EQ(fq->backend().fused_shared(), fused);
      configure(*fq, kCombineNvfp4);
      const auto y = host_forward(*fq, p);
      // The same back-end alone, same inputs and call history: its buffers are what the engine
      // wrote, so equal buffers prove the quantizer wrote nothing into them.
      auto ref = backend(kind, c, R, n, fused);
      const auto unquantized = host_forward(*ref, p);
      for (int64_t r = 0; r < R; ++r) {
        const auto a = ref->combine_bytes(r), b = fq->backend().combine_bytes(r);
        ASSERT_EQ(a.size(), b.size());
        EXPECT_TRUE(test::bytes_equal(a.data(), b.data(), a.size(), 1))
            << kind << " fused=" << fused << ": buffer of rank " << r << " modified";
        EXPECT_TRUE(test::bytes_equal(expected_resum(fq->backend(), p, r, Format::kNvfp4, kCombineAmax), y[size_t(r)]))
            << kind << " fused=" << fused << " rank " << r;
      }
      EXPECT_TRUE(any_differs(y, unquantized)) << kind << " fused=" << fused;
      EXPECT_TRUE(all_finite(y)) << kind << " fused=" << fused;
      EXPECT_TRUE(fq->layout_checked(0) && fq->layout_checked(1));
    }
  }
}

// =============================================================================================
// the raise paths

TEST(FakeQuantMoe, DispatchQuantizerWithFusedSharedExpertIsAConfigurationError) {
  const MoeConfig c = small_config();
  for (const std::string kind : {"mega_moe", "routed_experts"}) {
    auto fq = make_fq(kind, c, 2, 8, /*fused=*/true);
    const auto e =
        expect_error([&] { configure(*fq, kDispatchFp8); }, {FakeQuantMoe::dispatch_name(0), "unfused", "fuse_shared"});
    if (e) {
      EXPECT_EQ(e->kind(), ErrorKind::kBadInput);
    }
    // Nothing was applied: the layer still computes the unquantized output.
    const Problem p = make_problem(c, 2, 8, 300, 3);
    auto ref = backend(kind, c, 2, 8, true);
    const auto want = host_forward(*ref, p), got = host_forward(*fq, p);
    for (int64_t r = 0; r < 2; ++r) EXPECT_TRUE(test::bytes_equal(want[size_t(r)], got[size_t(r)])) << kind;
    EXPECT_FALSE(fq->dispatch_quantizer(0).enabled());
  }
}

TEST(FakeQuantMoe, DynamicCombineAmaxIsAConfigurationErrorExceptForMxFormats) {
  const MoeConfig c = small_config();
  auto fq = make_fq("mega_moe", c, 2, 8, true);
  for (const char* num_bits : {"e4m3", "8", "e2m1"}) {
    std::string cfg = std::string("{num_bits: ") + num_bits + ", amax: dynamic";
    if (std::string(num_bits) == "e2m1") cfg += ", block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}";
    cfg += "}";
    const std::string yaml = "quant_cfg:\n  - quantizer_name: '*combine_quantizer'\n    cfg: " + cfg + "\n";
    const auto e =
        expect_error([&] { configure(*fq, yaml); }, {FakeQuantMoe::combine_name(0), "constant_amax", "calibrate"});
    if (e) {
      EXPECT_EQ(e->kind(), ErrorKind::kBadInput) << num_bits;
    }
    EXPECT_FALSE(fq->combine_quantizer(0).enabled()) << num_bits;
  }
  // The dispatch quantizer may be dynamic (unfused shared expert).
  auto unfused = make_fq("mega_moe", c, 2, 8, false);
  EXPECT_NO_THROW(configure(*unfused, kDispatchFp8Dynamic));
  // Block-local formats have no global amax: accepted, and they run.
  const Problem p = make_problem(c, 2, 8, 301, 3);
  for (const char* unit : {"moe_combine_mxfp8", "moe_combine_mxfp4"}) {
    auto mx = make_fq("mega_moe", c, 2, 8, true);
    ASSERT_NO_THROW(configure(*mx, std::string("$import: [") + unit + "]\n")) << unit;
    EXPECT_TRUE(mx->combine_quantizer(1).enabled());
    EXPECT_FALSE(mx->combine_quantizer(1).has_amax());
    const auto y = host_forward(*mx, p);
    const Format f = std::string(unit) == "moe_combine_mxfp8" ? Format::kMxfp8 : Format::kMxfp4;
    for (int64_t r = 0; r < 2; ++r)
      EXPECT_TRUE(test::bytes_equal(expected_resum(mx->backend(), p, r, f, 0.0f), y[size_t(r)])) << unit;
  }
}

TEST(FakeQuantMoe, CombineQuantizerOnBackendWithoutCombineRowsIsAnError) {
  register_test_backends();
  const MoeConfig c = small_config();
  auto fq = make_fq("test_no_combine_rows", c, 2, 8, true);
  const auto e = expect_error([&] { configure(*fq, kCombineNvfp4); },
                              {FakeQuantMoe::combine_name(0), "test_no_combine_rows", "combine rows"});
  if (e) {
    EXPECT_EQ(e->kind(), ErrorKind::kBadInput);
  }
  // Dispatch-only needs no rows.
  auto unfused = make_fq("test_no_combine_rows", c, 2, 8, false);
  EXPECT_NO_THROW(configure(*unfused, kDispatchFp8));
}

TEST(FakeQuantMoe, UnknownBackendKindListsTheRegisteredKinds) {
  const MoeConfig c = small_config();
  const auto e =
      expect_error([&] { backend("no_such_kind", c, 2, 8, true); }, {"no_such_kind", "mega_moe", "routed_experts"});
  if (e) {
    EXPECT_EQ(e->kind(), ErrorKind::kBadInput);
  }
}

// A changed buffer layout: the rows read are one row off the engine's.
TEST(FakeQuantMoe, WrongCombineOffsetFailsTheLayoutCheck) {
  register_test_backends();
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 6, T = n + 1;  // T > n: the shifted reads stay inside the buffer
  const Problem p = make_problem(c, R, n, 400, 3);
  auto fq = make_fq("test_shifted_rows", c, R, T, true);
  configure(*fq, kCombineNvfp4);
  // Expected first mismatch on rank 0: the unquantized re-sum of the rows at the reported (wrong)
  // offset against the engine's output.
  auto ref = backend("mega_moe", c, R, T, true);
  const auto engine_y = host_forward(*ref, p);
  auto shifted = backend("test_shifted_rows", c, R, T, true);
  host_forward(*shifted, p);
  int64_t bad_t = -1, bad_h = -1;
  uint16_t want_engine = 0, want_resum = 0;
  for (int64_t t = 0; t < n && bad_t < 0; ++t)
    for (int64_t h = 0; h < c.hidden && bad_t < 0; ++h) {
      float acc = 0.0f;
      for (int64_t k = 0; k < c.top_k; ++k)
        if (p.idx[0][size_t(t * c.top_k + k)] >= 0) acc = acc + to_f32(row_at(*shifted, 0, k, t)[h]);
      acc = acc + to_f32(row_at(*shifted, 0, c.top_k, t)[h]);
      const uint16_t resum = bf16_round(acc), eng = engine_y[0][size_t(t * c.hidden + h)].bits;
      if (resum != eng) bad_t = t, bad_h = h, want_engine = eng, want_resum = resum;
    }
  ASSERT_GE(bad_t, 0) << "the shifted rows should not re-sum to the engine's output";
  try {
    host_forward(*fq, p);
    ADD_FAILURE() << "no layout check error for a combine offset one row off";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFailedCheck) << e.what();
    const std::string m = lower(e.what());
    for (const std::string& s : {std::string("rank 0"), "token " + std::to_string(bad_t),
                                 "element " + std::to_string(bad_h), hex16(want_engine), hex16(want_resum)})
      EXPECT_NE(m.find(s), std::string::npos) << "missing '" << s << "' in: " << e.what();
  }
  EXPECT_FALSE(fq->layout_checked(0));
}

TEST(FakeQuantMoe, DebugSwitchThatZeroesTheBufferFailsTheLayoutCheck) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 6;
  const Problem p = make_problem(c, R, n, 500, 3);
  auto ref = backend("mega_moe", c, R, n, true);
  const auto engine_y = host_forward(*ref, p);
  // Zeroed rows re-sum to +0: the first mismatch is rank 0's first non-+0 output element.
  int64_t first = -1;
  for (size_t i = 0; i < engine_y[0].size() && first < 0; ++i)
    if (engine_y[0][i].bits != 0) first = int64_t(i);
  ASSERT_GE(first, 0);
  auto fq = make_fq("mega_moe", c, R, n, true);
  configure(*fq, kCombineNvfp4);
  {
    ScopedEnv debug("MOEFQ_COMM_KERNEL_DEBUG", "1");
    try {
      host_forward(*fq, p);
      ADD_FAILURE() << "no layout check error with MOEFQ_COMM_KERNEL_DEBUG=1";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kFailedCheck) << e.what();
      const std::string m = lower(e.what());
      for (const std::string& s :
           {std::string("rank 0"), "token " + std::to_string(first / c.hidden),
            "element " + std::to_string(first % c.hidden), hex16(engine_y[0][size_t(first)].bits), hex16(0)})
        EXPECT_NE(m.find(s), std::string::npos) << "missing '" << s << "' in: " << e.what();
    }
  }
  // Without the switch the same layer passes the check.
  EXPECT_NO_THROW(host_forward(*fq, p));
  EXPECT_TRUE(fq->layout_checked(0) && fq->layout_checked(1));
}

// =============================================================================================
// both expert back-ends registered and bit-identical under the same recipe

TEST(FakeQuantMoe, BothBackendsRegisteredAndBitIdentical) {
  const auto kinds = expert_backend_kinds();
  ASSERT_NE(std::find(kinds.begin(), kinds.end(), "mega_moe"), kinds.end());
  ASSERT_NE(std::find(kinds.begin(), kinds.end(), "routed_experts"), kinds.end());
  const MoeConfig c = small_config();
  const int64_t N = 16;  // tokens in all, split over the ranks
  struct Case {
    const char* name;
    const char* recipe;
    bool fused;
  };
  const Case cases[] = {{"none", kNone, true},
                        {"none", kNone, false},
                        {"dispatch", kDispatchFp8, false},
                        {"combine", kCombineNvfp4, true},
                        {"combine", kCombineNvfp4, false},
                        {"both", kBoth, false}};
  for (const Case& cs : cases) {
    std::vector<bf16> first;  // R = 1's output, all tokens
    for (const int64_t R : {1, 4}) {
      // The same N tokens: one problem of N on one rank, cut into R pieces.
      const Problem whole = make_problem(c, 1, N, 600, 5);
      const Problem p = test::split_problem(whole, R);
      const int64_t per = N / R;
      std::vector<std::vector<bf16>> ys[2];
      int i = 0;
      for (const std::string kind : {"mega_moe", "routed_experts"}) {
        auto fq = make_fq(kind, c, R, per, cs.fused);
        configure(*fq, cs.recipe);
        ys[i++] = host_forward(*fq, p);
      }
      for (int64_t r = 0; r < R; ++r)
        EXPECT_TRUE(test::bytes_equal(ys[0][size_t(r)], ys[1][size_t(r)]))
            << cs.name << " fused=" << cs.fused << " R=" << R << " rank " << r;
      std::vector<bf16> all;
      for (const auto& y : ys[0]) all.insert(all.end(), y.begin(), y.end());
      if (R == 1)
        first = all;
      else
        EXPECT_TRUE(test::bytes_equal(first, all)) << cs.name << " fused=" << cs.fused << ": R=1 vs R=" << R;
    }
  }
}

// =============================================================================================
// the layout check waits for a call with routed rows

TEST(FakeQuantMoe, LayoutCheckWaitsForACallWithRoutedRows) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 6;
  auto fq = make_fq("mega_moe", c, R, n, true);
  configure(*fq, kCombineNvfp4);
  // Warm-up: padding only (rank 1 has no tokens at all), with the debug switch set; a check here
  // would fail, so passing proves there was none.
  Problem pad = make_problem(c, R, n, 700, 0, 0);
  pad.n[1] = 0;
  {
    ScopedEnv debug("MOEFQ_COMM_KERNEL_DEBUG", "1");
    EXPECT_NO_THROW(host_forward(*fq, pad));
    EXPECT_NO_THROW(host_forward(*fq, pad));
  }
  EXPECT_FALSE(fq->layout_checked(0));
  EXPECT_FALSE(fq->layout_checked(1));
  // Routed rows on rank 0 only: rank 0's buffer is checked, rank 1's (padding) is not.
  const Problem half = make_problem(c, R, n, 701, 3, 1);
  EXPECT_NO_THROW(host_forward(*fq, half));
  EXPECT_TRUE(fq->layout_checked(0));
  EXPECT_FALSE(fq->layout_checked(1));
  const Problem full = make_problem(c, R, n, 702, 3);
  EXPECT_NO_THROW(host_forward(*fq, full));
  EXPECT_TRUE(fq->layout_checked(1));
  // Documented behaviour: each buffer is checked once, so a layout that goes wrong later is not
  // caught. Under the debug switch the rows read are zeros and the output silently becomes the
  // re-sum of zeros (+0 everywhere, even the shared expert's part).
  ScopedEnv debug("MOEFQ_COMM_KERNEL_DEBUG", "1");
  std::vector<std::vector<bf16>> y;
  EXPECT_NO_THROW(y = host_forward(*fq, full));
  for (const auto& yr : y)
    for (const bf16& v : yr) ASSERT_EQ(v.bits, 0) << "expected the unchecked re-sum of zeroed rows";
}

// =============================================================================================
// calibrated amax equals the max of what each quantizer saw, identical on every rank

TEST(FakeQuantMoe, CalibratedAmaxIsTheMaxOfWhatEachQuantizerSawOnEveryRank) {
  const MoeConfig c = small_config();
  const int64_t R = 4, n = 9, H = c.hidden, K = c.top_k;
  auto fq = make_fq("mega_moe", c, R, n, /*fused=*/false);
  // Priming call (quantizers still off): every slot active with weight 1 on 8x larger tokens, so
  // the combine rows of slots that are inactive in the calibration call hold large stale values.
  Problem prime = make_problem(c, R, n, 800);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t k = 0; k < K; ++k) {
        prime.idx[size_t(r)][size_t(t * K + k)] = int32_t(k * 4 + (t + r) % 4);
        prime.wt[size_t(r)][size_t(t * K + k)] = 1.0f;
      }
    for (bf16& v : prime.x[size_t(r)]) v.bits = bf16_round(to_f32(v) * 8.0f);
  }
  host_forward(*fq, prime);
  configure(*fq, kCalibrateBoth);
  EXPECT_TRUE(fq->dispatch_quantizer(0).needs_calibration());
  EXPECT_TRUE(fq->combine_quantizer(0).needs_calibration());

  // Calibration data: padding tokens everywhere (every 3rd), rank 3 all padding; padding tokens
  // carry huge values that must not reach the dispatch amax.
  Problem p = make_problem(c, R, n, 810, 3, 3);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < n; ++t)
      if (!token_active(p.idx[size_t(r)], t, K)) p.x[size_t(r)][size_t(t * H + 5)].bits = bf16_round(60000.0f);
  float want_dispatch = 0.0f, pad_max = 0.0f;
  std::vector<float> rank_dispatch(static_cast<size_t>(R), 0.0f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const float a = std::fabs(to_f32(p.x[size_t(r)][size_t(t * H + h)]));
        if (token_active(p.idx[size_t(r)], t, K))
          rank_dispatch[size_t(r)] = std::max(rank_dispatch[size_t(r)], a);
        else
          pad_max = std::max(pad_max, a);
      }
  for (float m : rank_dispatch) want_dispatch = std::max(want_dispatch, m);
  ASSERT_GT(pad_max, want_dispatch);
  ASSERT_LT(*std::min_element(rank_dispatch.begin(), rank_dispatch.end() - 1), want_dispatch)
      << "some rank with data should see less than the global max";

  fq->start_calibration();
  const auto y_calib = host_forward(*fq, p);
  auto plain = backend("mega_moe", c, R, n, false);
  const auto y_plain = host_forward(*plain, p);
  for (int64_t r = 0; r < R; ++r)
    EXPECT_TRUE(test::bytes_equal(y_plain[size_t(r)], y_calib[size_t(r)])) << "QDQ during calibration, rank " << r;

  // The combine rows the quantizer saw: active routed slots only (read after the call; the
  // quantizer does not write into the buffer). Stale rows of inactive slots must be larger.
  float want_combine = 0.0f, stale_max = 0.0f;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const bf16* row = row_at(fq->backend(), r, k, t);
        const bool active = p.idx[size_t(r)][size_t(t * K + k)] >= 0;
        for (int64_t h = 0; h < H; ++h) {
          const float a = std::fabs(to_f32(row[h]));
          float& m = active ? want_combine : stale_max;
          m = std::max(m, a);
        }
      }
  ASSERT_GT(want_combine, 0.0f);
  ASSERT_GT(stale_max, want_combine) << "precondition: stale rows of inactive slots exceed the active rows";

  ASSERT_NO_THROW(fq->finish_calibration());
  for (int64_t r = 0; r < R; ++r) {
    ASSERT_TRUE(fq->dispatch_quantizer(r).amax().has_value()) << "rank " << r;
    ASSERT_TRUE(fq->combine_quantizer(r).amax().has_value()) << "rank " << r;
    EXPECT_EQ(f32_bits(*fq->dispatch_quantizer(r).amax()), f32_bits(want_dispatch))
        << "rank " << r << ": " << *fq->dispatch_quantizer(r).amax() << " vs " << want_dispatch;
    EXPECT_EQ(f32_bits(*fq->combine_quantizer(r).amax()), f32_bits(want_combine))
        << "rank " << r << ": " << *fq->combine_quantizer(r).amax() << " vs " << want_combine;
    EXPECT_FALSE(fq->dispatch_quantizer(r).calibrating());
  }
  // After calibration the quantizers apply QDQ.
  EXPECT_TRUE(any_differs(host_forward(*fq, p), y_plain));
}

TEST(FakeQuantMoe, CalibratedCombineAmaxExcludesTheFusedSharedSlot) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 8, H = c.hidden, K = c.top_k;
  Problem p = make_problem(c, R, n, 900, 4);
  for (auto& w : p.wt)
    for (float& v : w) v *= 0.01f;  // routed rows ~100x smaller than the shared expert's
  auto fq = make_fq("routed_experts", c, R, n, true);
  configure(*fq, "$import: [moe_combine_nvfp4]\n");
  fq->start_calibration();
  host_forward(*fq, p);
  float routed = 0.0f, shared = 0.0f;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t k = 0; k < K; ++k)
        if (p.idx[size_t(r)][size_t(t * K + k)] >= 0)
          for (int64_t h = 0; h < H; ++h)
            routed = std::max(routed, std::fabs(to_f32(row_at(fq->backend(), r, k, t)[h])));
      for (int64_t h = 0; h < H; ++h) shared = std::max(shared, std::fabs(to_f32(row_at(fq->backend(), r, K, t)[h])));
    }
  ASSERT_GT(shared, routed) << "precondition: the shared slot holds the largest values";
  fq->finish_calibration();
  for (int64_t r = 0; r < R; ++r)
    EXPECT_EQ(f32_bits(*fq->combine_quantizer(r).amax()), f32_bits(routed)) << "rank " << r;
}

TEST(FakeQuantMoe, CalibrationWithNoDataOnAnyRankFailsNamingTheQuantizer) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 5;
  Problem pad = make_problem(c, R, n, 1000, 0, 0);
  pad.idx[1].assign(pad.idx[1].size(), -1);
  {
    auto fq = make_fq("mega_moe", c, R, n, false);
    configure(*fq, kCalibrateBoth);
    fq->start_calibration();
    host_forward(*fq, pad);
    expect_error([&] { fq->finish_calibration(); }, {FakeQuantMoe::dispatch_name(0)});
  }
  {
    auto fq = make_fq("mega_moe", c, R, n, true);
    configure(*fq, "$import: [moe_combine_fp8]\n");
    fq->start_calibration();
    host_forward(*fq, pad);
    expect_error([&] { fq->finish_calibration(); }, {FakeQuantMoe::combine_name(0)});
  }
}

TEST(FakeQuantMoe, NonFiniteCalibrationDataIsAnErrorNamingTheQuantizer) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 6, K = c.top_k;
  for (const float bad : {std::nanf(""), INFINITY}) {
    Problem p = make_problem(c, R, n, 1100, 3);
    int64_t active_t = -1, pad_t = -1;
    for (int64_t t = 0; t < n; ++t) {
      if (token_active(p.idx[1], t, K))
        active_t = t;
      else
        pad_t = t;
    }
    ASSERT_GE(active_t, 0);
    ASSERT_GE(pad_t, 0);
    // In a padding token it is not seen; in an active token it is an error at the end of the
    // calibration (the statistics are gathered where the data is, on every device, and checked
    // once), naming the quantizer and the rank.
    {
      auto fq = make_fq("mega_moe", c, R, n, false);
      configure(*fq, "$import: [moe_dispatch_fp8]\n");
      fq->start_calibration();
      p.x[1][size_t(pad_t * c.hidden + 3)].bits = bf16_round(bad);
      host_forward(*fq, p);
      EXPECT_NO_THROW(fq->finish_calibration()) << bad;
    }
    auto fq = make_fq("mega_moe", c, R, n, false);
    configure(*fq, "$import: [moe_dispatch_fp8]\n");
    fq->start_calibration();
    p.x[1][size_t(active_t * c.hidden + 3)].bits = bf16_round(bad);
    host_forward(*fq, p);
    const auto e = expect_error([&] { fq->finish_calibration(); }, {FakeQuantMoe::dispatch_name(0), "rank 1", "NaN or inf"});
    if (e) {
      EXPECT_EQ(e->kind(), ErrorKind::kBadInput) << bad;
    }
  }
}

// =============================================================================================
// calibration files

TEST(FakeQuantMoe, SavedCalibrationLoadsIntoAFreshLayerWithIdenticalOutputs) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 8;
  auto fq = make_fq("mega_moe", c, R, n, false);
  configure(*fq, kCalibrateBoth);
  fq->start_calibration();
  host_forward(*fq, make_problem(c, R, n, 1200, 4));
  host_forward(*fq, make_problem(c, R, n, 1201, 3));
  fq->finish_calibration();
  const std::string path = ::testing::TempDir() + "moefq_fake_quant_moe_calib.json";
  save_calibration(path, fq->calibration_state());

  auto fresh = make_fq("mega_moe", c, R, n, false);
  configure(*fresh, kCalibrateBoth);
  fresh->load_calibration_file(path);
  std::remove(path.c_str());
  for (int64_t r = 0; r < R; ++r) {
    EXPECT_EQ(f32_bits(*fq->dispatch_quantizer(r).amax()), f32_bits(*fresh->dispatch_quantizer(r).amax())) << r;
    EXPECT_EQ(f32_bits(*fq->combine_quantizer(r).amax()), f32_bits(*fresh->combine_quantizer(r).amax())) << r;
  }
  const Problem eval = make_problem(c, R, n, 1210, 5);
  const auto a = host_forward(*fq, eval), b = host_forward(*fresh, eval);
  for (int64_t r = 0; r < R; ++r) EXPECT_TRUE(test::bytes_equal(a[size_t(r)], b[size_t(r)])) << "rank " << r;
  auto plain = backend("mega_moe", c, R, n, false);
  EXPECT_TRUE(any_differs(a, host_forward(*plain, eval)));
}

// =============================================================================================
// the output equals the re-sum of the QDQ'd rows, differs from the unquantized output, is finite

TEST(FakeQuantMoe, OutputEqualsResumOfQdqRowsForEveryCombineFormat) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 10;
  const struct {
    const char* unit;
    Format format;
  } units[] = {{"moe_combine_fp8", Format::kFp8},
               {"moe_combine_nvfp4", Format::kNvfp4},
               {"moe_combine_mxfp8", Format::kMxfp8},
               {"moe_combine_mxfp4", Format::kMxfp4},
               {"moe_combine_fp8_block128", Format::kFp8Block128},
               {"moe_combine_fp8_block128_ue8m0", Format::kFp8Block128Ue8m0},
               {"moe_combine_logfmt10", Format::kLogfmt10},
               {nullptr, Format::kInt8}};
  const Problem calib = make_problem(c, R, n, 1300, 4), eval = make_problem(c, R, n, 1301, 3);
  for (const std::string kind : {"mega_moe", "routed_experts"}) {
    auto plain = backend(kind, c, R, n, true);
    const auto unquantized = host_forward(*plain, eval);
    for (const auto& u : units) {
      const std::string recipe = u.unit
                                     ? std::string("$import: [") + u.unit + "]\n"
                                     : "quant_cfg:\n  - quantizer_name: '*combine_quantizer'\n    cfg: {num_bits: 8}\n";
      const std::string what = kind + " " + format_name(u.format);
      auto fq = make_fq(kind, c, R, n, true);
      configure(*fq, recipe);
      fq->start_calibration();
      host_forward(*fq, calib);
      fq->finish_calibration();
      const auto y = host_forward(*fq, eval);
      for (int64_t r = 0; r < R; ++r) {
        const float amax = fq->combine_quantizer(r).amax().value_or(0.0f);
        EXPECT_EQ(fq->combine_quantizer(r).has_amax(), format_has_global_amax(u.format)) << what;
        EXPECT_TRUE(test::bytes_equal(expected_resum(fq->backend(), eval, r, u.format, amax), y[size_t(r)]))
            << what << " rank " << r;
      }
      EXPECT_TRUE(any_differs(y, unquantized)) << what;
      EXPECT_TRUE(all_finite(y)) << what;
    }
  }
}

// =============================================================================================
// combine_weighting after: the rows are unweighted, the re-sum weights each QDQ'd routed row

// rows [K][T][H] bf16 with their routing, as combine_qdq_ref reads them (no shared row).
HostCombineRows host_rows(const std::vector<bf16>& rows, int64_t K, int64_t T, int64_t H,
                          const std::vector<int32_t>& idx, const std::vector<float>& weights) {
  HostCombineRows r;
  r.rows = rows.data();
  r.slot_stride = T * H;
  r.top_k = K;
  r.num_tokens = T;
  r.hidden = H;
  r.topk_idx = idx.data();
  r.topk_weights = weights.data();
  return r;
}

// A product whose rounding decides the sum: w0 * x0 = -(1 + 2^-7 + 2^-20 + 2^-27) rounds to
// -(1 + 2^-7 + 2^-20) in fp32 (the first fma adds it to +0), and w2 * x2 is its exact negation, so
// the second fma, one rounding of acc + w2 * x2, keeps 2^-27; RN(w * x) then RN(acc + p) would give
// +0. The inactive slot holds NaN (never read).
TEST(CombineQdqRef, WeightedResumIsOneFmaPerRow) {
  const int64_t K = 3, T = 2, H = 32;
  const float x = 1.0f + std::ldexp(1.0f, -7), w = 1.0f + std::ldexp(1.0f, -20);
  std::vector<bf16> rows(size_t(K * T * H));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      rows[size_t((0 * T + t) * H + h)].bits = bf16_round(x);
      rows[size_t((1 * T + t) * H + h)].bits = 0x7FC0;  // NaN
      rows[size_t((2 * T + t) * H + h)].bits = bf16_round(t == 0 ? x : 2.0f);
    }
  const std::vector<int32_t> idx = {0, -1, 2, 0, -1, 2};
  const std::vector<float> weights = {-w, 9.0f, w, 0.5f, 9.0f, 0.25f};
  std::vector<bf16> shared(size_t(T * H), bf16{bf16_round(3.0f)}), y(size_t(T * H));
  HostCombineRows r = host_rows(rows, K, T, H, idx, weights);
  combine_qdq_ref(r, std::nullopt, 0.0f, y.data());
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_EQ(y[size_t(h)].bits, bf16_round(std::ldexp(1.0f, -27))) << "token 0 element " << h;  // 2^-27, not +0
    EXPECT_EQ(y[size_t(H + h)].bits, bf16_round(1.0f)) << "token 1 element " << h;       // 0.5 * x + 0.25 * 2
  }
  r.shared = shared.data();  // the shared row is added last, never weighted
  combine_qdq_ref(r, std::nullopt, 0.0f, y.data());
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_EQ(y[size_t(h)].bits, bf16_round(3.0f)) << "token 0 element " << h;
    EXPECT_EQ(y[size_t(H + h)].bits, bf16_round(0.5f * x + 0.5f + 3.0f)) << "token 1 element " << h;
  }
}

// A top-k outside 1..32 is bad input whose message states the rule itself (users have no other
// document to look it up in), and nothing is written.
TEST(CombineQdqRef, TopKOutsideItsRangeNamesTheRule) {
  const int64_t T = 1, H = 32;
  std::vector<bf16> rows(size_t(33 * T * H), bf16{bf16_round(1.0f)}), y(size_t(T * H), bf16{0x1234});
  for (int64_t K : {int64_t(0), int64_t(33)}) {
    const std::vector<int32_t> idx(size_t(T * std::max<int64_t>(K, 1)), 0);
    const std::vector<float> weights(idx.size(), 1.0f);
    const HostCombineRows r = host_rows(rows, K, T, H, idx, weights);
    const auto e = expect_error([&] { combine_qdq_ref(r, std::nullopt, 0.0f, y.data()); },
                                {"top_k is " + std::to_string(K), "top-k must be 1..32"});
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->kind(), ErrorKind::kBadInput);
    EXPECT_EQ(std::string(e->what()).find(".md"), std::string::npos) << e->what();
    EXPECT_EQ(y[0].bits, 0x1234) << "K " << K << ": the output was written";
  }
}

// The combine quantizer's after re-sum on random rows against a loop written here: QDQ each
// active row, multiply by the weight in double (exact) and round to fp32, add in fp32.
TEST(CombineQdqRef, WeightedResumEqualsHandWrittenLoopForEveryFormat) {
  const int64_t K = 4, T = 5, H = 256;
  const auto v = test::activations(K * T, H, 77, true);
  std::vector<bf16> rows = test::to_bf16(v), shared = test::to_bf16(test::activations(T, H, 78, false));
  std::vector<int32_t> idx(size_t(T * K));
  std::vector<float> weights(size_t(T * K));
  std::mt19937_64 rng(5);
  for (size_t i = 0; i < idx.size(); ++i) {
    idx[i] = rng() % 5 == 0 ? -1 : int32_t(i % 16);
    weights[i] = float(rng() % 1000 + 1) / 700.0f;
  }
  for (Format f : kAllFormats) {
    const float amax = 40.0f;
    std::vector<bf16> y(size_t(T * H)), q(static_cast<size_t>(H));
    HostCombineRows r = host_rows(rows, K, T, H, idx, weights);
    r.shared = shared.data();
    combine_qdq_ref(r, f, amax, y.data());
    std::vector<bf16> want(size_t(T * H));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<float> acc(static_cast<size_t>(H), 0.0f);
      for (int64_t k = 0; k < K; ++k) {
        if (idx[size_t(t * K + k)] < 0) continue;
        qdq_ref(f, rows.data() + (k * T + t) * H, q.data(), 1, H, amax);
        for (int64_t h = 0; h < H; ++h)
          acc[size_t(h)] = std::fma(to_f32(q[size_t(h)]), weights[size_t(t * K + k)], acc[size_t(h)]);
      }
      for (int64_t h = 0; h < H; ++h) want[size_t(t * H + h)].bits = bf16_round(acc[size_t(h)] + to_f32(shared[size_t(t * H + h)]));
    }
    EXPECT_TRUE(test::bytes_equal(want, y)) << format_name(f);
  }
}

TEST(FakeQuantMoe, CombineWeightingAfterEqualsResumOfWeightedQdqRowsOnBothBackends) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 10;
  for (const bool fused : {true, false}) {
    const Problem p = make_problem(c, R, n, 210, 3);
    std::vector<std::vector<std::vector<bf16>>> outputs;
    for (const std::string kind : {"mega_moe", "routed_experts"}) {
      auto fq = make_fq(kind, c, R, n, fused, CombineWeighting::kAfter);
      EXPECT_EQ(fq->combine_weighting(), CombineWeighting::kAfter);
      configure(*fq, kCombineNvfp4);
      const auto y = host_forward(*fq, p);
      for (int64_t r = 0; r < R; ++r)
        EXPECT_TRUE(test::bytes_equal(expected_resum(fq->backend(), p, r, Format::kNvfp4, kCombineAmax), y[size_t(r)]))
            << kind << " fused=" << fused << " rank " << r;
      EXPECT_TRUE(fq->layout_checked(0) && fq->layout_checked(1)) << kind;
      // Not the before mode's output under the same recipe.
      auto before = make_fq(kind, c, R, n, fused);
      configure(*before, kCombineNvfp4);
      EXPECT_TRUE(any_differs(y, host_forward(*before, p))) << kind << " fused=" << fused;
      outputs.push_back(y);
    }
    for (int64_t r = 0; r < R; ++r)
      EXPECT_TRUE(test::bytes_equal(outputs[0][size_t(r)], outputs[1][size_t(r)])) << "fused=" << fused << " rank " << r;
  }
}

// The quantizer told the other weighting than the engine's: the unweighted re-sum is not the
// engine's output, and the layout check says so on the first call.
TEST(FakeQuantMoe, MixedCombineWeightingFailsTheLayoutCheck) {
  const MoeConfig c = small_config();
  const int64_t R = 2, n = 8;
  const Problem p = make_problem(c, R, n, 220, 3);
  for (const auto& [engine, quantizer] : {std::pair{CombineWeighting::kBefore, CombineWeighting::kAfter},
                                         std::pair{CombineWeighting::kAfter, CombineWeighting::kBefore}}) {
    auto fq = make_fq("mega_moe", c, R, n, true, engine);
    fq->set_combine_weighting(quantizer);
    configure(*fq, kCombineNvfp4);
    try {
      host_forward(*fq, p);
      ADD_FAILURE() << "no layout check error with the engine " << combine_weighting_name(engine)
                    << " and the quantizer " << combine_weighting_name(quantizer);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kFailedCheck) << e.what();
      EXPECT_NE(lower(e.what()).find("rank 0"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fq->layout_checked(0));
  }
}

// A finish that fails half-way (dispatch finished, combine saw no data) and is then aborted: every
// replica of both quantizers is back as start_calibration found it.
TEST(MoeQuantizers, AbortAfterAFinishThatFailedHalfWayRestoresEveryReplica) {
  const int64_t R = 2;
  MoeQuantizers q(0, R);
  q.configure(apply_recipe(parse_recipe_text(kCalibrateBoth, "test.yaml"), q.names()), false, true, "mega_moe");
  q.set_calibrated_amax(2.0f, 3.0f);
  q.abort_calibration();  // outside a calibration: nothing happens
  EXPECT_EQ(*q.dispatch(0).amax(), 2.0f);
  q.start_calibration();
  for (int64_t r = 0; r < R; ++r) q.dispatch(r).collect_max(9.0f);
  expect_error([&] { q.finish_calibration(); }, {MoeQuantizers::combine_name(0)});
  ASSERT_EQ(*q.dispatch(0).amax(), 9.0f) << "precondition: dispatch finished before combine failed";
  ASSERT_TRUE(q.combine(0).calibrating());
  q.abort_calibration();
  for (int64_t r = 0; r < R; ++r) {
    EXPECT_FALSE(q.dispatch(r).calibrating() || q.combine(r).calibrating()) << "rank " << r;
    EXPECT_EQ(*q.dispatch(r).amax(), 2.0f) << "rank " << r;
    EXPECT_EQ(*q.combine(r).amax(), 3.0f) << "rank " << r;
  }
  // A calibration that finishes leaves nothing to abort.
  q.start_calibration();
  for (int64_t r = 0; r < R; ++r) {
    q.dispatch(r).collect_max(5.0f);
    q.combine(r).collect_max(7.0f);
  }
  q.finish_calibration();
  q.abort_calibration();
  EXPECT_EQ(*q.dispatch(1).amax(), 5.0f);
  EXPECT_EQ(*q.combine(1).amax(), 7.0f);
}

// =============================================================================================
// the layer facade: the device a choice, the model's output composed in one place

// make(kCpu) is the layer on the "mega_moe" engine: the same bits as FakeQuantMoe around that
// back-end, under every recipe kind.
TEST(FakeQuantMoe, MakeOnTheCpuIsTheLayerOnTheMegaMoeEngine) {
  const MoeConfig c = small_config();
  const int64_t R = 2, T = 12;
  for (const char* recipe : {kNone, kDispatchFp8, kCombineNvfp4, kBoth}) {
    SCOPED_TRACE(recipe);
    auto made = FakeQuantMoe::make(LayerDevice::kCpu, c, R, T, weights_for(c, R), EngineOptions{false, 2}, 0);
    EXPECT_EQ(made->device(), LayerDevice::kCpu);
    EXPECT_STREQ(layer_device_name(made->device()), "cpu");
    auto direct = make_fq("mega_moe", c, R, T, false);
    configure(*made, recipe);
    configure(*direct, recipe);
    const Problem p = make_problem(c, R, T, 700, 4);
    const auto a = host_forward(*made, p), b = host_forward(*direct, p);
    for (int64_t r = 0; r < R; ++r) EXPECT_TRUE(test::bytes_equal(a[size_t(r)], b[size_t(r)])) << "rank " << r;
  }
}

// forward_with_shared = forward, then y = bf16(y + the shared expert on the unquantized x) in one
// fp32 addition per element: recomputed here from forward()'s output and the back-end's shared
// expert. Quantizing dispatch must not reach the shared expert (it sees the caller's x).
TEST(FakeQuantMoe, ForwardWithSharedAddsTheSharedExpertOnTheUnquantizedTokens) {
  const MoeConfig c = small_config();
  ASSERT_GT(c.num_shared, 0);
  const int64_t R = 2, T = 12, H = c.hidden;
  auto fq = FakeQuantMoe::make(LayerDevice::kCpu, c, R, T, weights_for(c, R), EngineOptions{false, 2}, 0);
  configure(*fq, kBoth);
  const Problem p = make_problem(c, R, T, 710, 4);
  const auto routed = host_forward(*fq, p);
  std::vector<std::vector<bf16>> y(static_cast<size_t>(R)), shared(static_cast<size_t>(R));
  std::vector<RankBatch> b;
  std::vector<bf16*> shared_ptrs;
  for (int64_t r = 0; r < R; ++r) {
    y[size_t(r)].assign(size_t(T * H), bf16{});
    shared[size_t(r)].assign(size_t(T * H), bf16{});
    shared_ptrs.push_back(shared[size_t(r)].data());
    b.push_back({p.x[size_t(r)].data(), T, p.idx[size_t(r)].data(), p.wt[size_t(r)].data(), y[size_t(r)].data()});
  }
  fq->forward_with_shared(b, shared_ptrs);
  bool differs = false;
  for (int64_t r = 0; r < R; ++r) {
    std::vector<bf16> alone(size_t(T * H)), want(size_t(T * H));
    fq->backend().shared_expert(r, p.x[size_t(r)].data(), T, alone.data());
    EXPECT_TRUE(test::bytes_equal(alone, shared[size_t(r)])) << "the shared expert's output, rank " << r;
    for (size_t i = 0; i < want.size(); ++i) {
      const float sum = to_f32(routed[size_t(r)][i]) + to_f32(alone[i]);
      want[i].bits = bf16_round(sum);
      differs = differs || want[i].bits != routed[size_t(r)][i].bits;
    }
    EXPECT_TRUE(test::bytes_equal(want, y[size_t(r)])) << "rank " << r;
  }
  EXPECT_TRUE(differs) << "the shared expert contributed nothing";
  // Without a shared expert: forward() alone, and no shared output is needed.
  const MoeConfig plain = small_config(16, 4, 0);
  auto fp = FakeQuantMoe::make(LayerDevice::kCpu, plain, R, T, weights_for(plain, R), EngineOptions{false, 2}, 0);
  const Problem q = make_problem(plain, R, T, 711, 4);
  const auto want = host_forward(*fp, q);
  for (int64_t r = 0; r < R; ++r) b[size_t(r)] = {q.x[size_t(r)].data(), T, q.idx[size_t(r)].data(),
                                                   q.wt[size_t(r)].data(), y[size_t(r)].data()};
  fp->forward_with_shared(b, {});
  for (int64_t r = 0; r < R; ++r) EXPECT_TRUE(test::bytes_equal(want[size_t(r)], y[size_t(r)])) << "rank " << r;
}

// add_shared's rule at the edges of bf16: inf + -inf is NaN, overflow rounds to inf, -0 + -0 is -0,
// subnormals add exactly; no shared output copies routed; out may be routed.
TEST(FakeQuantMoe, AddSharedIsOneRoundingOfTheFp32Sum) {
  const MoeConfig c = small_config();
  auto fq = FakeQuantMoe::make(LayerDevice::kCpu, c, 1, 4, weights_for(c, 1), EngineOptions{false, 2}, 0);
  const int64_t H = c.hidden, n = 2;
  std::vector<bf16> a(size_t(n * H)), b(size_t(n * H)), out(size_t(n * H));
  std::mt19937 rng(5);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i].bits = uint16_t(rng());
    b[i].bits = uint16_t(rng());
  }
  const uint16_t pairs[][3] = {{0x7F80, 0xFF80, 0x7FC0},   // inf + -inf: NaN (compared as NaN below)
                               {0x7F7F, 0x7F7F, 0x7F80},   // max + max: inf
                               {0x8000, 0x8000, 0x8000},   // -0 + -0: -0
                               {0x0001, 0x0001, 0x0002},   // two smallest subnormals
                               {0x3F80, 0x3380, 0x3F80},   // 1 + 2^-24: rounds back to 1
                               {0x3F81, 0x3B80, 0x3F82}};  // 1 + 2^-7 + 2^-8: a tie, to even
  for (size_t k = 0; k < std::size(pairs); ++k) {
    a[k].bits = pairs[k][0];
    b[k].bits = pairs[k][1];
  }
  fq->add_shared(a.data(), b.data(), out.data(), n);
  EXPECT_TRUE(std::isnan(to_f32(out[0])));
  for (size_t k = 1; k < std::size(pairs); ++k) EXPECT_EQ(out[k].bits, pairs[k][2]) << "pair " << k;
  for (size_t i = std::size(pairs); i < a.size(); ++i) {
    const float sum = to_f32(a[i]) + to_f32(b[i]);
    if (std::isnan(sum)) {
      EXPECT_TRUE(std::isnan(to_f32(out[i]))) << i;
      continue;
    }
    EXPECT_EQ(out[i].bits, bf16_round(sum)) << i;
  }
  std::vector<bf16> copy(a.size());
  fq->add_shared(a.data(), nullptr, copy.data(), n);
  EXPECT_TRUE(test::bytes_equal(a, copy));
  std::vector<bf16> in_place = a;
  fq->add_shared(in_place.data(), b.data(), in_place.data(), n);
  EXPECT_TRUE(test::bytes_equal(out, in_place));
}

// A CUDA layer needs the CUDA library's registration: without it (a CPU-only build, or nothing
// registered) make() says so instead of running anything; the CPU-only parts of the facade refuse
// the wrong use with a message.
TEST(FakeQuantMoe, CudaWithoutTheCudaLibraryIsAClearError) {
  const MoeConfig c = small_config();
  try {
    (void)FakeQuantMoe::make(LayerDevice::kCuda, c, 1, 4, weights_for(c, 1), EngineOptions{false, 2}, 0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBadInput);
    const std::string m = e.what();
    EXPECT_NE(m.find("on cuda"), std::string::npos) << m;
    EXPECT_NE(m.find("no CUDA support"), std::string::npos) << m;
  }
  auto fq = FakeQuantMoe::make(LayerDevice::kCpu, c, 2, 4, weights_for(c, 2), EngineOptions{false, 2}, 0);
  std::vector<bf16> x(size_t(4 * c.hidden)), y(x.size());
  expect_error([&] { fq->shared_expert(2, x.data(), 4, y.data()); }, {"shared_expert: rank 2", "[0, 2)"});
}

}  // namespace
}  // namespace moefq
