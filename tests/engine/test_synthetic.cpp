// The synthetic model (moefq/synthetic.h): determinism and independence of every element, the
// normal draws, the weights' statistics against DeepSeek-format checkpoints, and the activations'
// and the MoE outputs' quantile ratios against the published statistics of real MoE models
// (docs/eval.md lists the sources).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "engine/synthetic_rules.h"
#include "moefq/cpu_engine.h"
#include "moefq/router.h"
#include "moefq/synthetic.h"
#include "test_util.h"
#include "weights_test_util.h"

namespace moefq {
namespace {

using test::bytes_equal;
using test::error_of;

using test::expect_same_expert;

MoeConfig small_config() { return test::small_weights_config(); }

// A model-shaped config small enough for a 2-core CPU: H 1024 (quantiles need width), 32 experts.
MoeConfig stats_config() {
  MoeConfig c = preset("tiny");
  c.hidden = 1024;
  c.intermediate = 256;
  return c;
}

double quantile(std::vector<double> v, double q) {
  const size_t i = std::min(v.size() - 1, size_t(q * double(v.size())));
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(i), v.end());
  return v[i];
}

struct Ratios {
  double p99, p999, max;
};

// 99th, 99.9th percentile and max of |x| over its median.
template <typename T>
Ratios ratios(const std::vector<T>& x) {
  std::vector<double> a;
  a.reserve(x.size());
  for (const T& v : x) a.push_back(std::fabs(double(to_f32(v))));
  const double med = quantile(a, 0.5);
  return {quantile(a, 0.99) / med, quantile(a, 0.999) / med, *std::max_element(a.begin(), a.end()) / med};
}

TEST(SyntheticRules, NormalQuantileMatchesKnownValues) {
  // Phi^-1 at a few probabilities (exact to 1e-9), from the centre to the tails.
  const std::pair<float, double> known[] = {{0.5f, 0.0},          {0.8413447f, 1.0},   {0.9772499f, 2.0},
                                            {0.0013499f, -3.0},   {0.00003167f, -4.0}, {0.975f, 1.959963985},
                                            {0.01f, -2.326347874}, {1e-7f, -5.199337582}};
  for (auto [p, z] : known) EXPECT_NEAR(synth::normal_quantile(p), z, 2e-4 * std::max(1.0, std::fabs(z))) << p;
}

TEST(SyntheticRules, GaussianDrawsHaveUnitMomentsAndTails) {
  const uint64_t key = synth::stream_key(3, 1, 2);
  const int64_t n = 1 << 20;
  double s1 = 0, s2 = 0, s4 = 0;
  int64_t beyond3 = 0;
  float mx = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = synth::gaussian(synth::draw(key, uint64_t(i)));
    s1 += g;
    s2 += g * g;
    s4 += g * g * g * g;
    beyond3 += std::fabs(g) > 3.0;
    mx = std::max(mx, float(std::fabs(g)));
  }
  EXPECT_NEAR(s1 / n, 0.0, 5e-3);
  EXPECT_NEAR(s2 / n, 1.0, 5e-3);
  EXPECT_NEAR(s4 / n, 3.0, 0.05);                   // kurtosis of a normal
  EXPECT_NEAR(double(beyond3) / n, 0.0027, 0.0004);  // P(|z| > 3)
  EXPECT_GT(mx, 4.5f);                               // real tails, not a bounded sum of uniforms
}

TEST(Synthetic, ExpertDependsOnlyOnSeedAndGlobalId) {
  const MoeConfig c = preset("tiny");
  const LayerWeights lo = synthetic_weights(c, WeightFormat::kE4m3, 5, 0, 4);
  const LayerWeights hi = synthetic_weights(c, WeightFormat::kE4m3, 5, 3, 1);
  EXPECT_EQ(lo.experts[3].gate_up_e4m3, hi.experts[0].gate_up_e4m3);
  EXPECT_EQ(lo.experts[3].down_scale, hi.experts[0].down_scale);
  EXPECT_EQ(lo.shared[0].down_e4m3, hi.shared[0].down_e4m3);
  EXPECT_EQ(lo.gate, hi.gate);
  EXPECT_NE(lo.experts[2].gate_up_e4m3, lo.experts[3].gate_up_e4m3);
  const LayerWeights other = synthetic_weights(c, WeightFormat::kE4m3, 6, 0, 1);
  EXPECT_NE(other.experts[0].gate_up_e4m3, lo.experts[0].gate_up_e4m3);
}

TEST(Synthetic, TokenDependsOnlyOnItsIndex) {
  const SyntheticLayer L = synthetic_layer(preset("tiny"), 11);
  const std::vector<bf16> all = synthetic_activations(L, 0, 64);
  const std::vector<bf16> part = synthetic_activations(L, 40, 10, 1);
  const int64_t H = L.hidden;
  for (int64_t i = 0; i < 10 * H; ++i) ASSERT_EQ(all[size_t(40 * H + i)].bits, part[size_t(i)].bits) << i;
}

TEST(Synthetic, WeightsLikeDeepSeekCheckpoints) {
  // sigma ~0.02 after dequantization, block max ~4-5 sigma, scales = block max / 448 (every block's
  // largest code is +-448), e4m3 codes that fill the range.
  const MoeConfig c = stats_config();
  const SyntheticLayer L = synthetic_layer(c, 1, SyntheticKind::kGaussian);
  const LayerWeights w = synthetic_layer_weights(L, c, WeightFormat::kE4m3, 0, 2);
  const ExpertWeights& e = w.experts[0];
  const std::vector<float> f = e.gate_up_f32();
  double s2 = 0;
  for (float v : f) s2 += double(v) * v;
  const double sigma = std::sqrt(s2 / double(f.size()));
  EXPECT_NEAR(sigma, 0.02, 0.0005);
  const int64_t H = c.hidden, bc = H / 128;
  for (int64_t b = 0; b < int64_t(e.gate_up_scale.size()); ++b) {
    float bmax = 0;
    uint8_t top = 0;
    for (int64_t r = 0; r < 128; ++r)
      for (int64_t k = 0; k < 128; ++k) {
        const int64_t i = ((b / bc) * 128 + r) * H + (b % bc) * 128 + k;
        bmax = std::max(bmax, std::fabs(f[size_t(i)]));
        top = std::max<uint8_t>(top, e.gate_up_e4m3[size_t(i)] & 0x7F);
      }
    EXPECT_EQ(top, 0x7E) << "block " << b << ": the largest code must be 448";
    EXPECT_GT(bmax / sigma, 3.5) << b;
    EXPECT_LT(bmax / sigma, 5.6) << b;
  }
}

TEST(Synthetic, GaussianKindIsPlainNormalData) {
  const SyntheticLayer L = synthetic_layer(preset("tiny"), 2, SyntheticKind::kGaussian);
  EXPECT_TRUE(L.sink_tokens(100000).empty());
  EXPECT_TRUE(L.outlier_channels.empty());
  const std::vector<bf16> x = synthetic_activations(L, 0, 512);
  const Ratios r = ratios(x);
  EXPECT_NEAR(r.p99, 3.82, 0.2);  // |N(0, 1)|: 2.576 / 0.674
  EXPECT_NEAR(r.p999, 4.88, 0.35);
}

TEST(Synthetic, InputsMatchPublishedQuantileRatios) {
  // Post-RMSNorm MoE inputs: 99th / median 5.4-8.0, 99.9th / median 11-46, max / median 57-238
  // (sink tokens excluded from the max: they are ~10^3 by construction, checked below).
  const MoeConfig c = stats_config();
  for (uint64_t seed : {1, 2, 3}) {
    const SyntheticLayer L = synthetic_layer(c, seed);
    std::vector<bf16> x = synthetic_activations(L, 1, 2047);  // tokens 1..2047: no sink
    const Ratios r = ratios(x);
    std::printf("seed %llu inputs: p99/med %.2f p99.9/med %.2f max/med %.1f\n", (unsigned long long)seed, r.p99,
                r.p999, r.max);
    EXPECT_GE(r.p99, 5.4);
    EXPECT_LE(r.p99, 8.0);
    EXPECT_GE(r.p999, 11.0);
    EXPECT_LE(r.p999, 46.0);
    EXPECT_GE(r.max, 57.0);
    EXPECT_LE(r.max, 238.0);
    // About 0.1% of the channels are outliers at 15-30x (at least one); 1-3 sink channels and
    // super experts.
    EXPECT_GE(L.outlier_channels.size(), 1u);
    EXPECT_LE(L.outlier_channels.size(), 5u);
    EXPECT_GE(L.sink_channels.size(), 1u);
    EXPECT_LE(L.sink_channels.size(), 3u);
    EXPECT_GE(L.super_experts.size(), 1u);
    EXPECT_LE(L.super_experts.size(), 3u);
  }
}

TEST(Synthetic, SinkTokensCarryMassiveActivations) {
  // About one per 2-4k tokens (the first of each sequence), 1-3 fixed channels at ~10^3 times the
  // token's median |x|.
  const MoeConfig c = stats_config();
  const SyntheticLayer L = synthetic_layer(c, 4);
  const std::vector<int64_t> sinks = L.sink_tokens(20000);
  ASSERT_GE(sinks.size(), 5u);
  ASSERT_LE(sinks.size(), 10u);
  EXPECT_EQ(sinks[0], 0);
  for (size_t i = 1; i < sinks.size(); ++i) {
    EXPECT_GE(sinks[i] - sinks[i - 1], 2048);
    EXPECT_LE(sinks[i] - sinks[i - 1], 4096);
  }
  const std::vector<bf16> x = synthetic_activations(L, sinks[1], 1);
  std::vector<double> a;
  for (const bf16& v : x) a.push_back(std::fabs(double(to_f32(v))));
  const double med = quantile(a, 0.5);
  for (int32_t ch : L.sink_channels) {
    EXPECT_GT(a[size_t(ch)] / med, 500.0);
    EXPECT_LT(a[size_t(ch)] / med, 2000.0);
  }
}

// The layer's routed output (plus the shared expert), tokens [first, first + n), one rank.
std::vector<bf16> moe_output(const MoeConfig& c, const SyntheticLayer& L, int64_t first, int64_t n,
                             std::vector<int32_t>* idx = nullptr) {
  std::vector<LayerWeights> w{synthetic_layer_weights(L, c, WeightFormat::kE4m3, 0, c.num_experts)};
  const std::vector<bf16> x = synthetic_activations(L, first, n);
  const Routing r = route(c, x.data(), n, w[0].gate, w[0].gate_bias);
  if (idx) *idx = r.topk_idx;
  CpuEngine eng(c, 1, n, std::move(w), {true, 0});
  std::vector<bf16> y(x.size());
  const RankBatch b{x.data(), n, r.topk_idx.data(), r.topk_weights.data(), y.data()};
  eng.forward({&b, 1});
  return y;
}

TEST(Synthetic, MoeOutputsMatchPublishedQuantileRatios) {
  // MoE outputs of middle layers: 99th / median 4.9-5.6, 99.9th / median 8.6-10.3 (a range over
  // real models). Layers differ (with one outlier channel at this width, its factor moves the
  // tail): the mean over layers lies in the published range, each layer within 10% of it. The
  // outputs' magnitude is a real layer's (median |y| well under 1).
  const MoeConfig c = stats_config();
  double sum99 = 0, sum999 = 0;
  const uint64_t seeds[] = {5, 6, 7};
  for (uint64_t seed : seeds) {
    const SyntheticLayer L = synthetic_layer(c, seed);
    const std::vector<bf16> y = moe_output(c, L, 1, 1024);  // no sink token
    const Ratios r = ratios(y);
    std::vector<double> a;
    for (const bf16& v : y) a.push_back(std::fabs(double(to_f32(v))));
    std::printf("seed %llu outputs: median %.4f p99/med %.2f p99.9/med %.2f max/med %.1f\n",
                (unsigned long long)seed, quantile(a, 0.5), r.p99, r.p999, r.max);
    EXPECT_GE(r.p99, 4.9 * 0.9);
    EXPECT_LE(r.p99, 5.6 * 1.1);
    EXPECT_GE(r.p999, 8.6 * 0.9);
    EXPECT_LE(r.p999, 10.3 * 1.1);
    EXPECT_GT(quantile(a, 0.5), 0.01);
    EXPECT_LT(quantile(a, 0.5), 1.0);
    sum99 += r.p99;
    sum999 += r.p999;
  }
  EXPECT_GE(sum99 / 3, 4.9);
  EXPECT_LE(sum99 / 3, 5.6);
  EXPECT_GE(sum999 / 3, 8.6);
  EXPECT_LE(sum999 / 3, 10.3);
}

TEST(Synthetic, SuperExpertsEmitMassiveOutputsOnSinkTokens) {
  // A sink token routes to the super experts, whose outputs there are massive: 10^2-10^3 (and
  // over 100 times the layer's median output).
  const MoeConfig c = stats_config();
  const SyntheticLayer L = synthetic_layer(c, 6);
  std::vector<int32_t> idx;
  const int64_t n = 256;
  const std::vector<bf16> y = moe_output(c, L, 0, n, &idx);  // token 0 is a sink
  for (int32_t e : L.super_experts)
    EXPECT_NE(std::find(idx.begin(), idx.begin() + c.top_k, e), idx.begin() + c.top_k)
        << "super expert " << e << " not routed on the sink token";
  std::vector<double> rest;
  for (int64_t i = c.hidden; i < n * c.hidden; ++i) rest.push_back(std::fabs(double(to_f32(y[size_t(i)]))));
  const double med = quantile(rest, 0.5);
  double sink_max = 0;
  for (int32_t ch : L.sink_channels) sink_max = std::max(sink_max, std::fabs(double(to_f32(y[size_t(ch)]))));
  std::printf("sink token output %.1f, median output %.4f, ratio %.0f\n", sink_max, med, sink_max / med);
  EXPECT_GT(sink_max / med, 100.0);
  EXPECT_GE(sink_max, 100.0);
  EXPECT_LE(sink_max, 1000.0);
}

TEST(Synthetic, ShapesOfTheE4m3Format) {
  const MoeConfig cfg = small_config();
  const LayerWeights lw = synthetic_weights(cfg, WeightFormat::kE4m3, 7, 1, 2);
  EXPECT_EQ(lw.first_expert, 1);
  ASSERT_EQ(lw.experts.size(), 2u);
  ASSERT_EQ(lw.shared.size(), 1u);
  for (const auto& e : lw.experts) {
    EXPECT_EQ(e.format, WeightFormat::kE4m3);
    EXPECT_EQ(e.gate_up_e4m3.size(), 256u * 256u);
    EXPECT_EQ(e.gate_up_scale.size(), 2u * 2u);
    EXPECT_EQ(e.down_e4m3.size(), 256u * 128u);
    EXPECT_EQ(e.down_scale.size(), 2u * 1u);
    EXPECT_TRUE(e.gate_up_bf16.empty() && e.down_bf16.empty());
  }
  EXPECT_EQ(lw.shared[0].intermediate, 128);
  EXPECT_EQ(lw.gate.size(), 4u * 256u);
  EXPECT_EQ(lw.gate_bias.size(), 4u);

  MoeConfig two_shared = cfg;
  two_shared.num_shared = 2;
  two_shared.noaux_tc = false;
  const LayerWeights lw2 = synthetic_weights(two_shared, WeightFormat::kE4m3, 7, 0, 0);
  EXPECT_TRUE(lw2.experts.empty());
  ASSERT_EQ(lw2.shared.size(), 1u);
  EXPECT_EQ(lw2.shared[0].intermediate, 256);
  EXPECT_EQ(lw2.shared[0].gate_up_e4m3.size(), 512u * 256u);
  EXPECT_EQ(lw2.shared[0].down_scale.size(), 2u * 2u);
  EXPECT_TRUE(lw2.gate_bias.empty());

  MoeConfig no_shared = cfg;
  no_shared.num_shared = 0;
  EXPECT_TRUE(synthetic_weights(no_shared, WeightFormat::kE4m3, 7, 0, 1).shared.empty());
}


TEST(Synthetic, SameSeedSameBytes) {
  const MoeConfig cfg = small_config();
  const LayerWeights a = synthetic_weights(cfg, WeightFormat::kE4m3, 42, 0, 4);
  const LayerWeights b = synthetic_weights(cfg, WeightFormat::kE4m3, 42, 0, 4);
  for (size_t e = 0; e < 4; ++e) expect_same_expert(a.experts[e], b.experts[e]);
  expect_same_expert(a.shared[0], b.shared[0]);
  EXPECT_TRUE(bytes_equal(a.gate, b.gate));
  EXPECT_TRUE(bytes_equal(a.gate_bias, b.gate_bias));
}


TEST(Synthetic, DifferentSeedsDiffer) {
  const MoeConfig cfg = small_config();
  const LayerWeights a = synthetic_weights(cfg, WeightFormat::kE4m3, 1, 0, 2);
  const LayerWeights b = synthetic_weights(cfg, WeightFormat::kE4m3, 2, 0, 2);
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_NE(a.experts[e].gate_up_e4m3, b.experts[e].gate_up_e4m3);
    EXPECT_NE(a.experts[e].down_e4m3, b.experts[e].down_e4m3);
    EXPECT_NE(a.experts[e].gate_up_scale, b.experts[e].gate_up_scale);
  }
  EXPECT_NE(a.shared[0].down_e4m3, b.shared[0].down_e4m3);
  EXPECT_NE(a.gate, b.gate);
  EXPECT_NE(a.gate_bias, b.gate_bias);
}


TEST(Synthetic, Bf16IsTheRoundingOfTheE4m3Weights) {
  const MoeConfig cfg = small_config();
  const LayerWeights q = synthetic_weights(cfg, WeightFormat::kE4m3, 9, 1, 2);
  const LayerWeights b = synthetic_weights(cfg, WeightFormat::kBf16, 9, 1, 2);
  ASSERT_EQ(b.experts.size(), 2u);
  ASSERT_EQ(b.shared.size(), 1u);
  auto check = [](const ExpertWeights& qe, const ExpertWeights& be) {
    EXPECT_EQ(be.format, WeightFormat::kBf16);
    EXPECT_TRUE(be.gate_up_e4m3.empty() && be.gate_up_scale.empty());
    EXPECT_TRUE(be.down_e4m3.empty() && be.down_scale.empty());
    EXPECT_TRUE(bytes_equal(test::to_bf16(qe.gate_up_f32()), be.gate_up_bf16));
    EXPECT_TRUE(bytes_equal(test::to_bf16(qe.down_f32()), be.down_bf16));
    const auto f = be.gate_up_f32();
    ASSERT_EQ(f.size(), be.gate_up_bf16.size());
    EXPECT_EQ(f32_bits(f[3]), uint32_t(be.gate_up_bf16[3].bits) << 16);
  };
  check(q.experts[0], b.experts[0]);
  check(q.experts[1], b.experts[1]);
  check(q.shared[0], b.shared[0]);
  EXPECT_TRUE(bytes_equal(q.gate, b.gate));
}


TEST(Synthetic, RejectsBadRangesAndShapes) {
  const MoeConfig cfg = small_config();
  EXPECT_HAS(error_of([&] { synthetic_weights(cfg, WeightFormat::kE4m3, 1, 3, 2); }),
             "expert range [3, 5)");
  EXPECT_HAS(error_of([&] { synthetic_weights(cfg, WeightFormat::kE4m3, 1, -1, 1); }),
             "first_expert -1");
  EXPECT_HAS(error_of([&] { synthetic_weights(cfg, WeightFormat::kE4m3, 1, 0, -2); }),
             "num_local -2");
  MoeConfig bad = cfg;
  bad.hidden = 200;
  EXPECT_HAS(error_of([&] { synthetic_weights(bad, WeightFormat::kE4m3, 1, 0, 1); }),
             "hidden size 200");
  bad = cfg;
  bad.intermediate = 0;
  EXPECT_HAS(error_of([&] { synthetic_weights(bad, WeightFormat::kE4m3, 1, 0, 1); }),
             "intermediate size 0");
}

TEST(Synthetic, RouterLikeCheckpoints) {
  // Router: bf16-representable, std about 1/sqrt(H) (the sink channels' columns aside); bias small.
  const MoeConfig cfg = stats_config();
  const LayerWeights lw = synthetic_weights(cfg, WeightFormat::kE4m3, 123, 0, 1);
  const SyntheticLayer L = synthetic_layer(cfg, 123);
  double sum_sq = 0;
  int64_t n = 0;
  for (int64_t i = 0; i < int64_t(lw.gate.size()); ++i) {
    const float g = lw.gate[size_t(i)];
    ASSERT_EQ(f32_bits(g) & 0xFFFFu, 0u) << g << " is not a bf16 value";
    if (std::binary_search(L.sink_channels.begin(), L.sink_channels.end(), int32_t(i % cfg.hidden))) continue;
    sum_sq += double(g) * double(g);
    ++n;
  }
  EXPECT_NEAR(std::sqrt(sum_sq / double(n)) * std::sqrt(double(cfg.hidden)), 1.0, 0.05);
  ASSERT_EQ(lw.gate_bias.size(), size_t(cfg.num_experts));
  double bias_sq = 0;
  for (const float b : lw.gate_bias) {
    EXPECT_LT(std::fabs(b), 0.05f);
    bias_sq += double(b) * double(b);
  }
  const double bias_std = std::sqrt(bias_sq / double(cfg.num_experts));
  EXPECT_GT(bias_std, 0.005);
  EXPECT_LT(bias_std, 0.02);
}

}  // namespace
}  // namespace moefq
