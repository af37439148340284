// Staging none (include/moefq/weights.h): bf16 activations into the expert GEMMs, the baseline of
// a model served in bf16. The CPU engine against a computation of the layer written here from the
// definition (docs/engine.md "Staging"), on a small checkpoint written by the test: bf16 weights,
// and e4m3 weights used dequantized. The same check of e4m3 staging must fail, so the tolerance
// really tells the two baselines apart. Then the buffer's bf16 regions, the modular back-end's
// agreement, the shared expert run on its own, and the default per model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "checkpoint_test_util.h"
#include "eval/layer_runner.h"
#include "moefq/checkpoint.h"
#include "moefq/cpu_engine.h"
#include "moefq/expert_backend.h"
#include "moefq/router.h"
#include "moefq/weights.h"
#include "moe_test_util.h"
#include "test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;

float bf16_of(double v) { return bf16_to_f32(bf16_round(float(v))); }

// One expert on one token as a bf16 model computes it, in double precision: gate/up from the
// dequantized weights (bf16 values, or float(e4m3) * block scale) on the bf16 x, g and u rounded
// to bf16, h = bf16(silu(g) * u * w), down on h, rounded to bf16. Nothing of the engine's code.
std::vector<float> reference_expert(const ExpertWeights& e, const bf16* x, float w, std::optional<float> clamp) {
  const int64_t H = e.hidden, I = e.intermediate;
  const std::vector<float> gu = e.gate_up_f32(), dn = e.down_f32();
  std::vector<double> h(static_cast<size_t>(I));
  for (int64_t i = 0; i < I; ++i) {
    double g = 0, u = 0;
    for (int64_t k = 0; k < H; ++k) {
      const double xv = to_f32(x[k]);
      g += xv * gu[size_t(i * H + k)];
      u += xv * gu[size_t((I + i) * H + k)];
    }
    double gb = bf16_of(g), ub = bf16_of(u);
    if (clamp) {
      gb = std::min(gb, double(*clamp));
      ub = std::clamp(ub, -double(*clamp), double(*clamp));
    }
    h[size_t(i)] = bf16_of(gb / (1.0 + std::exp(-gb)) * ub * double(w));
  }
  std::vector<float> out(static_cast<size_t>(H));
  for (int64_t n = 0; n < H; ++n) {
    double acc = 0;
    for (int64_t i = 0; i < I; ++i) acc += h[size_t(i)] * dn[size_t(n * I + i)];
    out[size_t(n)] = bf16_of(acc);
  }
  return out;
}

double rel_l2(const std::vector<bf16>& y, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = double(to_f32(y[i])) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / den);
}

class StagingLayer : public ::testing::TestWithParam<WeightFormat> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("moefq_staging_" + std::to_string(::getpid()) + "_" +
                                        weight_format_name(GetParam()));
    fs::create_directories(dir_);
    std::ofstream(dir_ / "config.json") << test::kSmallConfigJson;
    cfg_ = load_hf_config((dir_ / "config.json").string());
    test::FakeCheckpoint::from(cfg_, synthetic_weights(cfg_, GetParam(), 5, 0, cfg_.num_experts)).write(dir_.string());
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path dir_;
  MoeConfig cfg_;
};

// The layer over R = 2 ranks with the shared expert fused, router output given by the router,
// against the reference layer: each active slot's expert row weighted by its router weight, the
// rows summed in fp32 in the combine's order (slots ascending, the shared expert last), one bf16
// rounding. Staging none agrees to 1e-4 (bf16 weights: exactly, as every sum here is exact in
// fp32's order too; e4m3 weights: the block scale applied to the fp32 partial sum instead of each
// weight, about 2e-5); e4m3 staging, the other baseline, is some 3e-2 away.
TEST_P(StagingLayer, NoneMatchesAnIndependentBf16Layer) {
  const LayerWeights lw = load_checkpoint_layer(dir_.string(), 3, cfg_, 0, cfg_.num_experts, {});
  ASSERT_EQ(lw.experts.at(0).format, GetParam());
  const int64_t R = 2, T = 24, H = cfg_.hidden, el = cfg_.num_experts / R;
  std::vector<LayerWeights> ranks(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    ranks[size_t(r)].first_expert = r * el;
    ranks[size_t(r)].experts.assign(lw.experts.begin() + r * el, lw.experts.begin() + (r + 1) * el);
    ranks[size_t(r)].shared = lw.shared;
  }
  std::vector<std::vector<bf16>> x(static_cast<size_t>(R));
  std::vector<Routing> routing;
  for (int64_t r = 0; r < R; ++r) {
    x[size_t(r)] = test::to_bf16(test::activations(T, H, 11 + uint64_t(r), false));
    routing.push_back(route(cfg_, x[size_t(r)].data(), T, lw.gate, lw.gate_bias));
  }
  std::vector<float> ref(size_t(R * T * H));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < T; ++t) {
      const bf16* xt = x[size_t(r)].data() + t * H;
      std::vector<float> acc(size_t(H), 0.0f);
      for (int64_t k = 0; k < cfg_.top_k; ++k) {
        const int32_t e = routing[size_t(r)].topk_idx[size_t(t * cfg_.top_k + k)];
        if (e < 0) continue;
        const std::vector<float> row =
            reference_expert(lw.experts[size_t(e)], xt, routing[size_t(r)].topk_weights[size_t(t * cfg_.top_k + k)],
                             cfg_.swiglu_clamp);
        for (int64_t h = 0; h < H; ++h) acc[size_t(h)] += row[size_t(h)];
      }
      const std::vector<float> shared = reference_expert(lw.shared[0], xt, 1.0f, cfg_.swiglu_clamp);
      for (int64_t h = 0; h < H; ++h) ref[size_t((r * T + t) * H + h)] = bf16_of(acc[size_t(h)] + shared[size_t(h)]);
    }
  const auto run = [&](Staging st) {
    EngineOptions o;
    o.staging = st;
    CpuEngine eng(cfg_, R, T, ranks, o);
    std::vector<bf16> y(size_t(R * T * H));
    std::vector<RankBatch> b;
    for (int64_t r = 0; r < R; ++r)
      b.push_back({x[size_t(r)].data(), T, routing[size_t(r)].topk_idx.data(),
                   routing[size_t(r)].topk_weights.data(), y.data() + r * T * H});
    eng.forward(b);
    return rel_l2(y, ref);
  };
  const double none = run(Staging::kNone), e4m3 = run(Staging::kE4m3);
  EXPECT_LT(none, 1e-4);
  EXPECT_GT(e4m3, 100 * 1e-4) << "e4m3 staging must fail this check";
  std::printf("rel_l2 against the bf16 layer: staging none %.3g, e4m3 %.3g\n", none, e4m3);
}

INSTANTIATE_TEST_SUITE_P(Weights, StagingLayer, ::testing::Values(WeightFormat::kBf16, WeightFormat::kE4m3),
                         [](const auto& info) { return std::string(weight_format_name(info.param)); });

// The staged regions hold bf16 rows and no scales: sized by BufferLayout, never elsewhere.
TEST(StagingBuffer, Bf16RegionsAndNoScales) {
  const MoeConfig c = test::small_config(16, 4, 1);
  EngineOptions o;
  o.staging = Staging::kNone;
  const BufferLayout none(engine_buffer_shape(c, 2, 32, {}, o)), e4m3(engine_buffer_shape(c, 2, 32, {}, {}));
  const size_t T = 32, H = size_t(c.hidden), P = size_t(none.shape().pool_rows()), imax = size_t(c.intermediate);
  EXPECT_EQ(none.shape().staging, Staging::kNone);
  EXPECT_EQ(none.staged_x.bytes, T * H * 2);
  EXPECT_EQ(none.pool_x.bytes, P * H * 2);
  EXPECT_EQ(none.pool_h.bytes, (P + T) * imax * 2);
  EXPECT_EQ(none.staged_scales.bytes + none.pool_x_scales.bytes + none.pool_h_scales.bytes, 0u);
  EXPECT_EQ(e4m3.staged_x.bytes, T * H);
  EXPECT_EQ(none.combine.bytes, e4m3.combine.bytes);
  for (const BufferLayout* l : {&none, &e4m3}) EXPECT_EQ(l->combine.offset + l->combine.bytes, l->total_bytes());
}

// Both CPU back-ends, the modular layer and the fused engine, give the same bits with staging
// none (rows and output), with either weighting; the rows differ from e4m3 staging's.
TEST(StagingBackends, RoutedExpertsAndMegaMoeAgreeBitForBit) {
  const MoeConfig c = test::small_config(16, 4, 1);
  const test::Problem p = test::make_problem(c, 2, 20, 3, 5);
  for (CombineWeighting w : {CombineWeighting::kBefore, CombineWeighting::kAfter}) {
    EngineOptions o;
    o.staging = Staging::kNone;
    o.combine_weighting = w;
    auto fused = make_expert_backend("mega_moe", c, 2, 20, test::weights_for(c, 2, WeightFormat::kBf16), o);
    auto modular = make_expert_backend("routed_experts", c, 2, 20, test::weights_for(c, 2, WeightFormat::kBf16), o);
    const auto a = test::host_forward(*fused, p), b = test::host_forward(*modular, p);
    for (size_t r = 0; r < 2; ++r) EXPECT_TRUE(test::bytes_equal(a[r], b[r])) << "rank " << r;
    o.staging = Staging::kE4m3;
    auto staged = make_expert_backend("mega_moe", c, 2, 20, test::weights_for(c, 2, WeightFormat::kBf16), o);
    const auto s = test::host_forward(*staged, p);
    EXPECT_FALSE(test::bytes_equal(s[0], a[0])) << "e4m3 staging gave the bits of none";
  }
}

// The shared expert run on its own (shared_expert(), bf16 x straight into its GEMMs) writes the
// rows the fused engine leaves in slot K for the same tokens.
TEST(StagingBackends, SharedExpertAloneEqualsTheFusedSlot) {
  const MoeConfig c = test::small_config(16, 4, 1);
  const test::Problem p = test::make_problem(c, 1, 12, 9);
  EngineOptions o;
  o.staging = Staging::kNone;
  CpuEngine eng(c, 1, 12, test::weights_for(c, 1, WeightFormat::kBf16), o);
  test::host_forward(eng, p);
  std::vector<bf16> alone(size_t(12 * c.hidden));
  eng.shared_expert(0, p.x[0].data(), 12, alone.data());
  const uint8_t* buf = eng.buffer(0).data();
  for (int64_t t = 0; t < 12; ++t)
    EXPECT_TRUE(test::bytes_equal(buf + eng.layout().combine_row_offset(c.top_k, t), alone.data() + t * c.hidden,
                                  size_t(c.hidden), 2))
        << "token " << t;
}

// The eval's memory plan sizes the engine buffers with the run's staging (bf16 staged rows).
TEST(StagingMemoryPlan, EvalCountsTheBf16Buffers) {
  RunnerSetup s;
  s.config = preset("tiny");
  s.ranks = 4;
  s.tokens = 256;
  s.calib_batches = s.eval_batches = 1;
  double bytes[2] = {0, 0};
  for (Staging st : {Staging::kE4m3, Staging::kNone}) {
    s.staging = st;
    EngineOptions o;
    o.fuse_shared = false;  // the eval runs the shared expert on its own
    o.staging = st;
    const double want = 4.0 * double(BufferLayout(engine_buffer_shape(s.config, 4, 256, {}, o)).total_bytes());
    const MemoryPlan plan = plan_run_memory(s, EvalDevice::kCpu);
    const auto it = std::find_if(plan.items.begin(), plan.items.end(),
                                 [](const MemoryItem& m) { return m.what == "engine buffers (4 ranks)"; });
    ASSERT_NE(it, plan.items.end());
    EXPECT_EQ(it->host_bytes, want) << staging_name(st);
    bytes[st == Staging::kNone] = it->host_bytes;
  }
  EXPECT_GT(bytes[1], bytes[0]);
}

TEST(StagingDefault, FollowsTheWeightsTheModelShips) {
  for (const char* name : {"deepseek-v3", "deepseek-v4-flash", "deepseek-v4-pro", "kimi-k2", "kimi-k3", "tiny"})
    EXPECT_EQ(default_staging(preset(name)), Staging::kE4m3) << name;
  for (const char* name : {"glm-4.5", "glm-4.5-air", "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "olmoe-1b-7b"})
    EXPECT_EQ(default_staging(preset(name)), Staging::kNone) << name;
  MoeConfig v2 = preset("deepseek-v3");
  v2.model_type = "deepseek_v2";  // a --config of DeepSeek-V2, which ships bf16 weights
  EXPECT_EQ(default_staging(v2), Staging::kNone);
  // A checkpoint's own format decides, whatever the architecture.
  EXPECT_EQ(default_staging(preset("qwen3-30b-a3b"), WeightFormat::kE4m3), Staging::kE4m3);
  EXPECT_EQ(default_staging(preset("deepseek-v3"), WeightFormat::kBf16), Staging::kNone);
}

TEST(StagingNames, ParseAndRefuse) {
  EXPECT_EQ(parse_staging("e4m3"), Staging::kE4m3);
  EXPECT_EQ(parse_staging("none"), Staging::kNone);
  for (const char* bad : {"", "E4M3", "bf16", "fp8", "none "}) {
    EXPECT_FALSE(parse_staging(bad).has_value()) << bad;
    const std::string msg = test::error_of([&] { staging_from_name(bad, "--staging"); });
    EXPECT_NE(msg.find("--staging: unknown staging '" + std::string(bad) + "' (expected e4m3 or none)"),
              std::string::npos)
        << msg;
  }
  EXPECT_STREQ(staging_name(Staging::kNone), "none");
  EXPECT_STREQ(staging_name(Staging::kE4m3), "e4m3");
}

}  // namespace
}  // namespace moefq
