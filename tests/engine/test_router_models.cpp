// The router under the softmax architectures' presets: Mixtral's top-2 renormalised (softmax over
// all experts, the two kept divided by their sum) equals the softmax of the two kept logits up to
// rounding; OLMoE keeps the softmax probabilities as they are (no renormalisation); Qwen3-MoE
// renormalises its top 8. Checked against a double-precision reference on the router's own fp32
// logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "moefq/moe_config.h"
#include "moefq/router.h"
#include "test_util.h"

namespace moefq {
namespace {

// A preset at a small hidden size (the routing rule is the preset's).
MoeConfig small(const char* name) {
  MoeConfig c = preset(name);
  c.hidden = 256;
  c.intermediate = 128;
  return c;
}

struct Routed {
  MoeConfig cfg;
  std::vector<bf16> x;      // [T, H]
  std::vector<float> gate;  // [E, H]
  Routing r;
};

Routed route_random(const char* name, int64_t tokens, uint64_t seed) {
  Routed o{small(name), {}, {}, {}};
  const int64_t H = o.cfg.hidden, E = o.cfg.num_experts;
  // Logits of order 1 (x ~ N(0, 1), gate ~ N(0, 1/H)), so no score underflows to a tie.
  std::mt19937 rng{uint32_t(seed)};
  std::normal_distribution<float> unit(0.0f, 1.0f), g(0.0f, 1.0f / std::sqrt(float(H)));
  std::vector<float> x(size_t(tokens * H));
  for (float& v : x) v = unit(rng);
  o.x = test::to_bf16(x);
  o.gate.resize(size_t(E * H));
  for (float& v : o.gate) v = g(rng);
  o.r = route(o.cfg, o.x.data(), tokens, o.gate, {});
  return o;
}

// The router's fp32 logits of token t, widened.
std::vector<double> logits(const Routed& o, int64_t t) {
  const int64_t H = o.cfg.hidden, E = o.cfg.num_experts;
  std::vector<double> l(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) l[size_t(e)] = gate_logit(o.x.data() + t * H, o.gate.data() + e * H, H);
  return l;
}

// The indices of the k largest values, largest first (ties to the lower index).
std::vector<int32_t> top_k(const std::vector<double>& v, int64_t k) {
  std::vector<int32_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return v[size_t(a)] > v[size_t(b)]; });
  idx.resize(size_t(k));
  return idx;
}

TEST(RouterModels, MixtralTop2IsTheSoftmaxOfTheTwoKeptLogits) {
  const Routed o = route_random("mixtral-8x7b", 512, 3);
  ASSERT_EQ(o.r.top_k, 2);
  double worst = 0.0;
  for (int64_t t = 0; t < 512; ++t) {
    const std::vector<double> l = logits(o, t);
    const std::vector<int32_t> want = top_k(l, 2);
    const int32_t* idx = o.r.topk_idx.data() + t * 2;
    const float* w = o.r.topk_weights.data() + t * 2;
    ASSERT_EQ(idx[0], want[0]) << "token " << t;
    ASSERT_EQ(idx[1], want[1]) << "token " << t;
    // softmax over the two kept logits: 1 / (1 + exp(l1 - l0)) and the rest.
    const double p0 = 1.0 / (1.0 + std::exp(l[size_t(idx[1])] - l[size_t(idx[0])]));
    worst = std::max({worst, std::fabs(w[0] - p0) / p0, std::fabs(w[1] - (1.0 - p0)) / (1.0 - p0)});
    EXPECT_NEAR(double(w[0]) + double(w[1]), 1.0, 2.5e-7) << "token " << t;
  }
  // A few fp32 roundings (the exponentials, the sum over all experts, two divisions) apart.
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(worst, 0.0);  // not the same formula: equal up to rounding only
}

TEST(RouterModels, OlmoeKeepsTheSoftmaxProbabilities) {
  const Routed o = route_random("olmoe-1b-7b", 256, 4);
  ASSERT_EQ(o.r.top_k, 8);
  ASSERT_FALSE(o.cfg.norm_topk_prob);
  for (int64_t t = 0; t < 256; ++t) {
    const std::vector<double> l = logits(o, t);
    const double m = *std::max_element(l.begin(), l.end());
    double sum = 0.0;
    for (double v : l) sum += std::exp(v - m);
    const std::vector<int32_t> want = top_k(l, 8);
    double kept = 0.0;
    for (int k = 0; k < 8; ++k) {
      const int32_t e = o.r.topk_idx[size_t(t * 8 + k)];
      ASSERT_EQ(e, want[size_t(k)]) << "token " << t;
      const double p = std::exp(l[size_t(e)] - m) / sum;
      EXPECT_NEAR(o.r.topk_weights[size_t(t * 8 + k)], p, 1e-6 * p) << "token " << t;
      kept += o.r.topk_weights[size_t(t * 8 + k)];
    }
    EXPECT_LT(kept, 1.0 - 1e-3) << "8 of 64 experts keep less than all the probability";
  }
}

TEST(RouterModels, Qwen3RenormalisesItsTop8) {
  const Routed o = route_random("qwen3-30b-a3b", 128, 5);
  for (int64_t t = 0; t < 128; ++t) {
    double kept = 0.0;
    for (int k = 0; k < 8; ++k) kept += o.r.topk_weights[size_t(t * 8 + k)];
    EXPECT_NEAR(kept, 1.0, 1e-6) << "token " << t;
  }
}

}  // namespace
}  // namespace moefq
