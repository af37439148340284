// The router against a naive double-precision reference written differently (scores in double,
// std::sort over (score, id) pairs), plus determinism across chunking and threading, padding,
// tie-breaking, the group rules, the kimi-k3 shape and num_tokens = 0.
//
// Tolerances. Selected ids must be EXACTLY equal to the reference's, except on tokens where the
// reference sees two candidates (experts at the top-K boundary or inside the K slots, groups at
// the topk_group boundary) closer than kNearTie relative but not equal: there fp32 rounding may
// legitimately decide the other way, so such tokens are counted and skipped (at most 3 %).
// Weights must agree to kWeightRelTol = 1e-6 relative on exact-logit data: the fp32 path rounds
// each score a few times (exp, 1 +, /), sums at most E terms (softmax) or K terms (normalisation)
// and scales; measured worst case 4.7e-7 (softmax, E = 64). On general random data the fp32 logits
// are rounded too (H products in 8 lanes), which softmax turns into relative weight errors:
// kWeightRelTolRandom = 2e-6 (measured worst case 8e-7).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>

#include "engine/router_rules.h"
#include "moefq/errors.h"
#include "moefq/router.h"
#include "router_test_util.h"
#include "test_util.h"

namespace moefq {
namespace {

using test::router_config;

constexpr double kWeightRelTol = 1e-6;
constexpr double kWeightRelTolRandom = 2e-6;
constexpr double kNearTie = 1e-6;

// Inputs whose fp32 logits are exact: x = k/8 (|k| <= 8, exact in bf16), gate = m/256 (|m| <= 32);
// every product is a multiple of 2^-11 of magnitude <= 1/8, and any sum of H <= 4096 of them fits
// in 24 bits. Logits come out with a standard deviation near 0.7 (H = 256), where no score
// function saturates. The reference's double logits are then the same numbers, and equal logits (which occur
// often on this grid) are exact ties for both implementations.
struct Inputs {
  std::vector<bf16> x;      // [T, H]
  std::vector<float> gate;  // [E, H]
  std::vector<float> bias;  // [E]
};
Inputs exact_inputs(int64_t T, int64_t E, int64_t H, uint64_t seed, float bias_range) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> xk(-8, 8), gm(-32, 32);
  std::uniform_real_distribution<float> bu(-bias_range, bias_range);
  Inputs in;
  in.x.resize(size_t(T * H));
  for (bf16& v : in.x) v.bits = bf16_round(float(xk(rng)) / 8.0f);
  in.gate.resize(size_t(E * H));
  for (float& v : in.gate) v = float(gm(rng)) / 256.0f;
  in.bias.resize(size_t(E));
  for (float& v : in.bias) v = bu(rng);
  return in;
}
// General data: bf16 normal activations, fp32 normal gate; logits are rounded in fp32.
Inputs random_inputs(int64_t T, int64_t E, int64_t H, uint64_t seed, float bias_range) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> bu(-bias_range, bias_range);
  Inputs in;
  in.x.resize(size_t(T * H));
  for (bf16& v : in.x) v.bits = bf16_round(n(rng));
  in.gate.resize(size_t(E * H));
  for (float& v : in.gate) v = n(rng) * 0.05f;
  in.bias.resize(size_t(E));
  for (float& v : in.bias) v = bu(rng);
  return in;
}

// ---------------------------------------------------------------------------------------------
// The reference: one token in double, sorting instead of selecting.
struct RefToken {
  std::vector<int> idx;
  std::vector<double> w;
  bool ambiguous = false;
};

bool near_tie(double a, double b) { return a != b && std::fabs(a - b) < kNearTie * std::max(1.0, std::fabs(a)); }

// Sorted (value desc, id asc); marks the token ambiguous when positions [0, check] have a near tie.
std::vector<std::pair<double, int>> ranked(std::vector<std::pair<double, int>> v, size_t check, bool& ambiguous) {
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  for (size_t i = 0; i + 1 < v.size() && i < check; ++i)
    if (near_tie(v[i].first, v[i + 1].first)) ambiguous = true;
  return v;
}

RefToken ref_route_token(const MoeConfig& c, const bf16* x, const std::vector<float>& gate,
                         const std::vector<float>& bias) {
  const int64_t E = c.num_experts, H = c.hidden, K = c.top_k;
  std::vector<double> logit(size_t(E), 0.0), s(size_t(E), 0.0), sel(size_t(E), 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t h = 0; h < H; ++h) logit[size_t(e)] += double(to_f32(x[h])) * double(gate[size_t(e * H + h)]);
  if (c.scoring == ScoringFunc::kSoftmax) {
    const double mx = *std::max_element(logit.begin(), logit.end());
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(logit[size_t(e)] - mx);
    for (int64_t e = 0; e < E; ++e) s[size_t(e)] = std::exp(logit[size_t(e)] - mx) / sum;
  } else {
    for (int64_t e = 0; e < E; ++e) {
      const double l = logit[size_t(e)];
      s[size_t(e)] = c.scoring == ScoringFunc::kSigmoid ? 1.0 / (1.0 + std::exp(-l)) : std::sqrt(std::log1p(std::exp(l)));
    }
  }
  for (int64_t e = 0; e < E; ++e) sel[size_t(e)] = s[size_t(e)] + (c.noaux_tc && !bias.empty() ? double(bias[size_t(e)]) : 0.0);

  RefToken out;
  std::vector<std::pair<double, int>> cand;
  if (c.n_group > 1) {
    const int64_t per = E / c.n_group;
    std::vector<std::pair<double, int>> groups;
    for (int64_t g = 0; g < c.n_group; ++g) {
      std::vector<double> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
      std::sort(v.begin(), v.end(), std::greater<double>());
      groups.push_back({c.noaux_tc ? v[0] + (per > 1 ? v[1] : 0.0) : v[0], int(g)});
    }
    groups = ranked(groups, size_t(c.topk_group), out.ambiguous);
    for (int64_t i = 0; i < c.topk_group; ++i)
      for (int64_t e = groups[size_t(i)].second * per; e < (groups[size_t(i)].second + 1) * per; ++e)
        cand.push_back({sel[size_t(e)], int(e)});
  } else {
    for (int64_t e = 0; e < E; ++e) cand.push_back({sel[size_t(e)], int(e)});
  }
  cand = ranked(cand, size_t(K), out.ambiguous);
  double sum = 0.0;
  for (int64_t k = 0; k < K; ++k) {
    out.idx.push_back(cand[size_t(k)].second);
    out.w.push_back(s[size_t(cand[size_t(k)].second)]);
    sum += out.w.back();
  }
  for (double& w : out.w) w = (c.norm_topk_prob ? w / sum : w) * double(c.routed_scaling);
  return out;
}

struct OracleStats {
  int64_t compared = 0, ambiguous = 0;
  double max_rel = 0.0;
};

// Checks route() against the reference on every token; returns the statistics.
OracleStats check_against_ref(const MoeConfig& c, const Inputs& in, int64_t T, double tol = kWeightRelTol) {
  const Routing r = route(c, in.x.data(), T, in.gate, in.bias);
  EXPECT_EQ(r.num_tokens, T);
  EXPECT_EQ(r.top_k, c.top_k);
  OracleStats st;
  int reported = 0;
  for (int64_t t = 0; t < T; ++t) {
    const RefToken ref = ref_route_token(c, in.x.data() + t * c.hidden, in.gate, in.bias);
    if (ref.ambiguous) {
      ++st.ambiguous;
      continue;
    }
    ++st.compared;
    for (int64_t k = 0; k < c.top_k; ++k) {
      const int32_t got = r.topk_idx[size_t(t * c.top_k + k)];
      const double w = r.topk_weights[size_t(t * c.top_k + k)];
      const double rel = std::fabs(w - ref.w[size_t(k)]) / std::fabs(ref.w[size_t(k)]);
      st.max_rel = std::max(st.max_rel, rel);
      if ((got != ref.idx[size_t(k)] || !(rel <= tol)) && reported++ < 5)
        ADD_FAILURE() << "token " << t << " slot " << k << ": expert " << got << " weight " << w
                      << ", reference expert " << ref.idx[size_t(k)] << " weight " << ref.w[size_t(k)];
    }
  }
  EXPECT_LE(st.ambiguous * 100, T * 3) << "too many near-tie tokens to be a meaningful comparison";
  EXPECT_GT(st.compared, 0);
  return st;
}

struct OracleCase {
  ScoringFunc scoring;
  int64_t n_group, topk_group;
  bool noaux_tc, norm;
};
std::string case_name(const ::testing::TestParamInfo<OracleCase>& p) {
  return std::string(scoring_name(p.param.scoring)) + "_g" + std::to_string(p.param.n_group) + "k" +
         std::to_string(p.param.topk_group) + (p.param.noaux_tc ? "_noaux" : "_plain") +
         (p.param.norm ? "_norm" : "_raw");
}
std::vector<OracleCase> all_oracle_cases() {
  std::vector<OracleCase> v;
  for (ScoringFunc s : {ScoringFunc::kSigmoid, ScoringFunc::kSoftmax, ScoringFunc::kSqrtSoftplus})
    for (auto [g, tg] : {std::pair<int64_t, int64_t>{1, 1}, {8, 3}, {4, 1}})
      for (bool noaux : {false, true})
        for (bool norm : {false, true}) v.push_back({s, g, tg, noaux, norm});
  return v;
}

class RouterOracle : public ::testing::TestWithParam<OracleCase> {};

TEST_P(RouterOracle, ExactLogits) {
  const OracleCase p = GetParam();
  const MoeConfig c = router_config(64, 256, 6, p.scoring, p.n_group, p.topk_group, p.noaux_tc, p.norm, 2.5f);
  // Bias comparable to the score spread, so it changes selections (softmax scores are ~1/E).
  const float bias_range = p.scoring == ScoringFunc::kSoftmax ? 0.02f : 0.2f;
  const OracleStats st = check_against_ref(c, exact_inputs(300, 64, 256, 11 + uint64_t(p.n_group), bias_range), 300);
  std::ostringstream os;
  os << st.max_rel;
  RecordProperty("max_rel_weight_error", os.str());
  RecordProperty("near_tie_tokens", int(st.ambiguous));
}

TEST_P(RouterOracle, RandomData) {
  const OracleCase p = GetParam();
  const MoeConfig c = router_config(64, 384, 8, p.scoring, p.n_group, p.topk_group, p.noaux_tc, p.norm, 1.5f);
  const float bias_range = p.scoring == ScoringFunc::kSoftmax ? 0.02f : 0.2f;
  const OracleStats st = check_against_ref(c, random_inputs(200, 64, 384, 97, bias_range), 200,
                                           kWeightRelTolRandom);
  std::ostringstream os;
  os << st.max_rel;
  RecordProperty("max_rel_weight_error", os.str());
  RecordProperty("near_tie_tokens", int(st.ambiguous));
}

INSTANTIATE_TEST_SUITE_P(AllRules, RouterOracle, ::testing::ValuesIn(all_oracle_cases()), case_name);

// The bias decides the selection, but the weights are the scores without it.
TEST(Router, BiasSelectsButDoesNotWeigh) {
  MoeConfig c = router_config(16, 128, 4, ScoringFunc::kSigmoid, 1, 1, true, true, 2.0f);
  std::vector<float> gate(16 * 128, 0.0f), bias(16);
  for (int e = 0; e < 16; ++e) bias[size_t(e)] = 0.01f * float(e);
  std::vector<bf16> x(128, bf16{bf16_round(1.0f)});
  Routing r = route(c, x.data(), 1, gate, bias);
  EXPECT_EQ(r.topk_idx, (std::vector<int32_t>{15, 14, 13, 12}));
  for (float w : r.topk_weights) EXPECT_EQ(w, 0.5f);  // (0.5 / (2 + 1e-20)) * 2
  // Without noaux_tc the bias is ignored: all scores tie, lower ids win.
  c.noaux_tc = false;
  r = route(c, x.data(), 1, gate, bias);
  EXPECT_EQ(r.topk_idx, (std::vector<int32_t>{0, 1, 2, 3}));
  // Without normalisation the weight is the score times the scaling factor: sigmoid(0) * 2.
  c.norm_topk_prob = false;
  r = route(c, x.data(), 1, gate, {});
  for (float w : r.topk_weights) EXPECT_EQ(w, 1.0f);
}

// Logits set one by one: x = e_0, gate[e][0] = the wanted logit (exact).
struct Handmade {
  std::vector<bf16> x;
  std::vector<float> gate;
};
Handmade handmade(const std::vector<float>& logits, int64_t H) {
  Handmade m;
  m.x.assign(size_t(H), bf16{0});
  m.x[0].bits = bf16_round(1.0f);
  m.gate.assign(logits.size() * size_t(H), 0.0f);
  for (size_t e = 0; e < logits.size(); ++e) m.gate[e * size_t(H)] = logits[e];
  return m;
}

TEST(Router, TiesGoToTheLowerId) {
  // Experts 5 and 3 share the best logit, 1 and 6 the second: slots 3, 5, 1, 6.
  const Handmade m = handmade({0.0f, 1.0f, 0.0f, 2.0f, 0.0f, 2.0f, 1.0f, 0.0f}, 128);
  for (ScoringFunc s : {ScoringFunc::kSigmoid, ScoringFunc::kSoftmax, ScoringFunc::kSqrtSoftplus}) {
    const MoeConfig c = router_config(8, 128, 4, s, 1, 1, false, true, 1.0f);
    const Routing r = route(c, m.x.data(), 1, m.gate, {});
    EXPECT_EQ(r.topk_idx, (std::vector<int32_t>{3, 5, 1, 6})) << scoring_name(s);
    EXPECT_EQ(r.topk_weights[0], r.topk_weights[1]);
    EXPECT_EQ(r.topk_weights[2], r.topk_weights[3]);
  }
  // All equal: ids 0..K-1, and with groups the lower groups.
  const Handmade flat = handmade(std::vector<float>(16, 0.5f), 128);
  const MoeConfig g = router_config(16, 128, 6, ScoringFunc::kSigmoid, 4, 2, true, true, 1.0f);
  const Routing r = route(g, flat.x.data(), 1, flat.gate, std::vector<float>(16, 0.0f));
  EXPECT_EQ(r.topk_idx, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  // Groups 1 and 3 tie for best, group 2 is worse, group 0 worst: topk_group = 2 keeps 1 and 3.
  std::vector<float> l(16, 0.0f);
  for (int e = 4; e < 8; ++e) l[size_t(e)] = 1.0f;
  for (int e = 12; e < 16; ++e) l[size_t(e)] = 1.0f;
  for (int e = 8; e < 12; ++e) l[size_t(e)] = 0.5f;
  for (int e = 0; e < 4; ++e) l[size_t(e)] = -1.0f;
  const Handmade gm = handmade(l, 128);
  const Routing r2 = route(g, gm.x.data(), 1, gm.gate, std::vector<float>(16, 0.0f));
  EXPECT_EQ(r2.topk_idx, (std::vector<int32_t>{4, 5, 6, 7, 12, 13}));
  // topk_group = 1: only group 1 (the lower of the tied pair); K = 4 fills it.
  const MoeConfig g1 = router_config(16, 128, 4, ScoringFunc::kSigmoid, 4, 1, true, true, 1.0f);
  const Routing r3 = route(g1, gm.x.data(), 1, gm.gate, std::vector<float>(16, 0.0f));
  EXPECT_EQ(r3.topk_idx, (std::vector<int32_t>{4, 5, 6, 7}));
}

TEST(Router, GroupScoreRules) {
  // Group 0: one strong expert; group 1: two good ones. Top-2 sum (noaux_tc) prefers group 1:
  // s(3) + s(-3) = 1 < 2 s(2) = 1.76; the max rule (group_limited_greedy) prefers group 0.
  const Handmade m = handmade({3.0f, -3.0f, -3.0f, -3.0f, 2.0f, 2.0f, -3.0f, -3.0f}, 128);
  const MoeConfig top2 = router_config(8, 128, 2, ScoringFunc::kSigmoid, 2, 1, true, false, 1.0f);
  EXPECT_EQ(route(top2, m.x.data(), 1, m.gate, std::vector<float>(8, 0.0f)).topk_idx,
            (std::vector<int32_t>{4, 5}));
  const MoeConfig mx = router_config(8, 128, 2, ScoringFunc::kSoftmax, 2, 1, false, false, 1.0f);
  EXPECT_EQ(route(mx, m.x.data(), 1, m.gate, {}).topk_idx, (std::vector<int32_t>{0, 1}));
  // Without groups both strong experts of the whole set win.
  const MoeConfig flat = router_config(8, 128, 2, ScoringFunc::kSigmoid, 1, 1, true, false, 1.0f);
  EXPECT_EQ(route(flat, m.x.data(), 1, m.gate, {}).topk_idx, (std::vector<int32_t>{0, 4}));
  // Experts outside the kept groups are never chosen even when every kept score is negative.
  const MoeConfig neg = router_config(8, 128, 4, ScoringFunc::kSigmoid, 2, 1, true, false, 1.0f);
  std::vector<float> bias(8, 0.0f);
  for (int e = 0; e < 4; ++e) bias[size_t(e)] = -5.0f;
  const Routing r = route(neg, m.x.data(), 1, m.gate, bias);
  EXPECT_EQ(r.topk_idx, (std::vector<int32_t>{4, 5, 6, 7}));
}

TEST(Router, WeightsFollowTheFormula) {
  // sigmoid, norm: w = s / (sum s + 1e-20f) * scaling, in slot order, all in fp32.
  const Handmade m = handmade({0.25f, -1.0f, 1.5f, 0.5f}, 128);
  const MoeConfig c = router_config(4, 128, 3, ScoringFunc::kSigmoid, 1, 1, false, true, 2.5f);
  const Routing r = route(c, m.x.data(), 1, m.gate, {});
  ASSERT_EQ(r.topk_idx, (std::vector<int32_t>{2, 3, 0}));
  // The scores come from numerics.h's portable sigmoid: 1 / (1 + exp_f32(-l)) for l >= 0.
  const float s2 = div_rn(1.0f, 1.0f + exp_f32(-1.5f)), s3 = div_rn(1.0f, 1.0f + exp_f32(-0.5f)),
              s0 = div_rn(1.0f, 1.0f + exp_f32(-0.25f));
  const float denom = ((s2 + s3) + s0) + 1e-20f;
  EXPECT_EQ(r.topk_weights[0], (s2 / denom) * 2.5f);
  EXPECT_EQ(r.topk_weights[1], (s3 / denom) * 2.5f);
  EXPECT_EQ(r.topk_weights[2], (s0 / denom) * 2.5f);
  // sqrtsoftplus above the threshold is sqrt(l), below it sqrt(log1p(exp(l))) (portable functions).
  const Handmade big = handmade({25.0f, 4.0f}, 128);
  const MoeConfig sp = router_config(2, 128, 2, ScoringFunc::kSqrtSoftplus, 1, 1, false, false, 1.0f);
  const Routing rs = route(sp, big.x.data(), 1, big.gate, {});
  EXPECT_EQ(rs.topk_weights[0], std::sqrt(25.0f));
  EXPECT_EQ(rs.topk_weights[1], std::sqrt(log1p_f32(exp_f32(4.0f))));
  EXPECT_NEAR(rs.topk_weights[1], std::sqrt(std::log1p(std::exp(4.0))), 4e-7);
}

// The CUDA router's layout: the shared rules of router_rules.h run on token-minor scores
// ([E][T_pad], stride T_pad) and group scores, one token at a time, as router_select_kernel does.
// Same ids and weight bits as route() (which runs them with stride 1).
TEST(Router, SharedRulesOnTokenMinorScoresGiveTheSameBits) {
  for (const char* name : {"deepseek-v3", "deepseek-v4-flash", "kimi-k3", "tiny"}) {
    for (ScoringFunc s : {ScoringFunc::kSigmoid, ScoringFunc::kSoftmax, ScoringFunc::kSqrtSoftplus}) {
      MoeConfig c = preset(name);
      c.hidden = 256;
      c.scoring = s;
      const int64_t T = 37, Tp = 64, E = c.num_experts, H = c.hidden, K = c.top_k, G = c.n_group;
      const Inputs in = random_inputs(T, E, H, 123, s == ScoringFunc::kSoftmax ? 0.002f : 0.1f);
      std::vector<float> scores(size_t(E * Tp), NAN), gscore(size_t(G * Tp), NAN);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t e = 0; e < E; ++e)
          scores[size_t(e * Tp + t)] = router_rules::score_elementwise(
              s, gate_logit(in.x.data() + t * H, in.gate.data() + e * H, H));
      const router_rules::Rules rules = router_rules::make_rules(c);
      std::vector<int32_t> idx(size_t(T * K), -7);
      std::vector<float> w(size_t(T * K), -7.0f);
      for (int64_t t = 0; t < T; ++t)
        router_rules::route_scores(rules, scores.data() + t, Tp, c.noaux_tc ? in.bias.data() : nullptr,
                                   gscore.data() + t, Tp, idx.data() + t * K, w.data() + t * K);
      const Routing want = route(c, in.x.data(), T, in.gate, in.bias);
      EXPECT_TRUE(test::bytes_equal(want.topk_idx, idx)) << name << " " << scoring_name(s);
      EXPECT_TRUE(test::bytes_equal(want.topk_weights, w)) << name << " " << scoring_name(s);
    }
  }
}

TEST(Router, LogitOrderIsTheDocumentedOne) {
  // 8 lanes over h % 8, then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). Random data makes a different
  // order (plain ascending sum) give different bits for some rows: checked so the test bites.
  std::mt19937_64 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  int differs_from_sequential = 0;
  for (int trial = 0; trial < 50; ++trial) {
    const int64_t H = 1024;
    std::vector<bf16> x(H);
    std::vector<float> g(H);
    for (int64_t h = 0; h < H; ++h) {
      x[size_t(h)].bits = bf16_round(n(rng));
      g[size_t(h)] = n(rng);
    }
    float lanes[8] = {};
    float seq = 0.0f;
    for (int64_t h = 0; h < H; ++h) {
      const float p = to_f32(x[size_t(h)]) * g[size_t(h)];
      lanes[h % 8] = lanes[h % 8] + p;
      seq = seq + p;
    }
    const float want = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    const float got = gate_logit(x.data(), g.data(), H);
    EXPECT_EQ(f32_bits(got), f32_bits(want)) << "trial " << trial;
    differs_from_sequential += f32_bits(seq) != f32_bits(want);
  }
  EXPECT_GT(differs_from_sequential, 0);
}

// ---------------------------------------------------------------------------------------------
// Determinism and shapes.

bool same_routing(const Routing& a, const Routing& b) {
  return a.num_tokens == b.num_tokens && a.top_k == b.top_k && a.topk_idx.size() == b.topk_idx.size() &&
         a.topk_weights.size() == b.topk_weights.size() &&
         test::bytes_equal(a.topk_idx.data(), b.topk_idx.data(), a.topk_idx.size(), 4) &&
         test::bytes_equal(a.topk_weights.data(), b.topk_weights.data(), a.topk_weights.size(), 4);
}

TEST(Router, ChunksAndThreadsGiveTheSameBits) {
  const MoeConfig c = preset("tiny");
  const int64_t T = 700;
  const Inputs in = random_inputs(T, c.num_experts, c.hidden, 23, 0.1f);
  const Routing all = route(c, in.x.data(), T, in.gate, in.bias);  // automatic: threaded
  for (int threads : {1, 2, 3, 8}) {
    EXPECT_TRUE(same_routing(all, route(c, in.x.data(), T, in.gate, in.bias, {}, threads))) << threads;
  }
  Routing joined;
  joined.num_tokens = T;
  joined.top_k = c.top_k;
  int64_t t0 = 0;
  for (int64_t len : {1, 99, 300, 0, 300}) {
    const Routing part = route(c, in.x.data() + t0 * c.hidden, len, in.gate, in.bias);
    joined.topk_idx.insert(joined.topk_idx.end(), part.topk_idx.begin(), part.topk_idx.end());
    joined.topk_weights.insert(joined.topk_weights.end(), part.topk_weights.begin(), part.topk_weights.end());
    t0 += len;
  }
  ASSERT_EQ(t0, T);
  EXPECT_TRUE(same_routing(all, joined));
}

TEST(Router, PaddingTokens) {
  const MoeConfig c = preset("tiny");
  const int64_t T = 300;  // threaded
  const Inputs in = random_inputs(T, c.num_experts, c.hidden, 31, 0.1f);
  std::vector<bool> pad(size_t(T), false);
  for (int64_t t = 0; t < T; t += 7) pad[size_t(t)] = true;
  const Routing full = route(c, in.x.data(), T, in.gate, in.bias);
  const Routing padded = route(c, in.x.data(), T, in.gate, in.bias, pad);
  Routing marked = full;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < c.top_k; ++k) {
      const size_t i = size_t(t * c.top_k + k);
      if (pad[size_t(t)]) {
        EXPECT_EQ(padded.topk_idx[i], -1);
        EXPECT_EQ(f32_bits(padded.topk_weights[i]), 0u);
      } else {
        EXPECT_EQ(padded.topk_idx[i], full.topk_idx[i]);
        EXPECT_EQ(padded.topk_weights[i], full.topk_weights[i]);
        EXPECT_GE(padded.topk_idx[i], 0);
      }
    }
    if (pad[size_t(t)]) mark_padding(marked, t);
  }
  EXPECT_TRUE(same_routing(padded, marked));
  // All padding.
  const Routing none = route(c, in.x.data(), T, in.gate, in.bias, std::vector<bool>(size_t(T), true));
  EXPECT_TRUE(std::all_of(none.topk_idx.begin(), none.topk_idx.end(), [](int32_t v) { return v == -1; }));
  EXPECT_TRUE(std::all_of(none.topk_weights.begin(), none.topk_weights.end(), [](float v) { return v == 0.0f; }));
  EXPECT_THROW(mark_padding(marked, T), Error);
  EXPECT_THROW(mark_padding(marked, -1), Error);
}

TEST(Router, KimiK3Shape) {
  MoeConfig c = preset("kimi-k3");
  c.hidden = 256;
  const OracleStats st = check_against_ref(c, exact_inputs(64, c.num_experts, c.hidden, 41, 0.2f), 64);
  EXPECT_EQ(st.compared + st.ambiguous, 64);
  const Inputs in = exact_inputs(64, c.num_experts, c.hidden, 41, 0.2f);
  const Routing r = route(c, in.x.data(), 64, in.gate, in.bias);
  ASSERT_EQ(r.topk_idx.size(), size_t(64 * 16));
  for (int64_t t = 0; t < 64; ++t) {  // 16 distinct valid experts per token
    std::vector<int32_t> ids(r.topk_idx.begin() + t * 16, r.topk_idx.begin() + (t + 1) * 16);
    std::sort(ids.begin(), ids.end());
    EXPECT_EQ(std::adjacent_find(ids.begin(), ids.end()), ids.end());
    EXPECT_GE(ids.front(), 0);
    EXPECT_LT(ids.back(), 896);
  }
}

TEST(Router, PresetShapesAgainstReference) {
  // deepseek-v3's routing rule (8 groups, top-4) and v4-flash's at a reduced H.
  for (const char* name : {"deepseek-v3", "deepseek-v4-flash", "tiny"}) {
    MoeConfig c = preset(name);
    c.hidden = 256;
    SCOPED_TRACE(name);
    check_against_ref(c, exact_inputs(48, c.num_experts, c.hidden, 43, 0.2f), 48);
  }
}

TEST(Router, ZeroTokens) {
  const MoeConfig c = preset("tiny");
  const std::vector<float> gate(size_t(c.num_experts * c.hidden), 0.0f);
  const Routing r = route(c, nullptr, 0, gate, {});
  EXPECT_EQ(r.num_tokens, 0);
  EXPECT_EQ(r.top_k, c.top_k);
  EXPECT_TRUE(r.topk_idx.empty());
  EXPECT_TRUE(r.topk_weights.empty());
  EXPECT_TRUE(route(c, nullptr, 0, gate, {}, {}, 4).topk_idx.empty());
}

TEST(Router, NanLogitsRankLast) {
  // A NaN row: every key is NaN, ranked like -inf, so the lowest ids win; the weights are NaN.
  const MoeConfig c = router_config(8, 128, 2, ScoringFunc::kSigmoid, 1, 1, false, false, 1.0f);
  std::vector<bf16> x(128, bf16{bf16_round(1.0f)});
  x[3].bits = kCanonicalNanBf16;
  const Handmade m = handmade({0, 1, 2, 3, 4, 5, 6, 7}, 128);
  const Routing r = route(c, x.data(), 1, m.gate, {});
  EXPECT_EQ(r.topk_idx, (std::vector<int32_t>{0, 1}));
  EXPECT_TRUE(std::isnan(r.topk_weights[0]));
  // One NaN expert among finite ones ranks below them all, -inf included.
  std::vector<float> gate = handmade({1, -INFINITY, 3, 2}, 128).gate;
  gate[0] = NAN;
  const MoeConfig c4 = router_config(4, 128, 3, ScoringFunc::kSigmoid, 1, 1, false, false, 1.0f);
  EXPECT_EQ(route(c4, m.x.data(), 1, gate, {}).topk_idx, (std::vector<int32_t>{2, 3, 1}));
}

TEST(Router, BadInputsAreNamed) {
  const MoeConfig c = preset("tiny");
  const std::vector<bf16> x(size_t(c.hidden), bf16{0});
  const std::vector<float> gate(size_t(c.num_experts * c.hidden), 0.0f);
  auto names = [](const std::function<void()>& f, const char* what) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what()).find(what) != std::string::npos;
    }
    return false;
  };
  EXPECT_TRUE(names([&] { route(c, x.data(), 1, std::vector<float>(10), {}); }, "gate"));
  EXPECT_TRUE(names([&] { route(c, x.data(), 1, gate, std::vector<float>(3)); }, "bias"));
  EXPECT_TRUE(names([&] { route(c, x.data(), 1, gate, {}, std::vector<bool>(2)); }, "padding"));
  EXPECT_TRUE(names([&] { route(c, x.data(), -1, gate, {}); }, "num_tokens"));
  EXPECT_TRUE(names([&] { route(c, nullptr, 1, gate, {}); }, "x"));
  MoeConfig bad = c;
  bad.top_k = 0;
  EXPECT_TRUE(names([&] { route(bad, x.data(), 1, gate, {}); }, "top_k"));
}

}  // namespace
}  // namespace moefq

namespace moefq {
namespace {

// A naive fp32 router, written per token with full sorts, using the same fp32 formulas (scores with
// numerics.h's portable exp_f32 / log1p_f32 and IEEE sqrt, normalisation in slot order) and the
// documented logit order (gate_logit): ids AND weights must be bit-identical to route().
Routing naive_fp32_route(const MoeConfig& c, const Inputs& in, int64_t T) {
  const int64_t E = c.num_experts, H = c.hidden, K = c.top_k, G = c.n_group, per = E / G;
  Routing out;
  out.num_tokens = T;
  out.top_k = K;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> s(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) s[size_t(e)] = gate_logit(in.x.data() + t * H, in.gate.data() + e * H, H);
    if (c.scoring == ScoringFunc::kSigmoid) {
      for (float& v : s) v = v >= 0.0f ? 1.0f / (1.0f + exp_f32(-v)) : exp_f32(v) / (1.0f + exp_f32(v));
    } else if (c.scoring == ScoringFunc::kSqrtSoftplus) {
      for (float& v : s) v = std::sqrt(v > 20.0f ? v : log1p_f32(exp_f32(v)));
    } else {
      float mx = -INFINITY, sum = 0.0f;
      for (float v : s) mx = std::max(mx, v);
      for (float& v : s) sum = sum + (v = exp_f32(v - mx));
      for (float& v : s) v = v / sum;
    }
    std::vector<float> sel(s);
    if (c.noaux_tc)
      for (int64_t e = 0; e < E; ++e) sel[size_t(e)] = sel[size_t(e)] + in.bias[size_t(e)];
    auto by_score = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    };
    std::vector<bool> kept(static_cast<size_t>(G), true);
    if (G > 1) {
      std::vector<std::pair<float, int64_t>> gs;
      for (int64_t g = 0; g < G; ++g) {
        std::vector<float> v(sel.begin() + g * per, sel.begin() + (g + 1) * per);
        std::sort(v.rbegin(), v.rend());
        gs.push_back({c.noaux_tc ? (per > 1 ? v[0] + v[1] : v[0]) : v[0], g});
      }
      std::sort(gs.begin(), gs.end(), by_score);
      kept.assign(size_t(G), false);
      for (int64_t i = 0; i < c.topk_group; ++i) kept[size_t(gs[size_t(i)].second)] = true;
    }
    std::vector<std::pair<float, int64_t>> cand;
    for (int64_t e = 0; e < E; ++e)
      if (kept[size_t(e / per)]) cand.push_back({sel[size_t(e)], e});
    std::sort(cand.begin(), cand.end(), by_score);
    float sum = 0.0f;
    std::vector<float> w;
    for (int64_t k = 0; k < K; ++k) {
      out.topk_idx.push_back(int32_t(cand[size_t(k)].second));
      w.push_back(s[size_t(cand[size_t(k)].second)]);
      sum = sum + w.back();
    }
    for (float v : w) out.topk_weights.push_back((c.norm_topk_prob ? v / (sum + 1e-20f) : v) * c.routed_scaling);
  }
  return out;
}

TEST(Router, NaiveFp32RouterGivesIdenticalIdsAndWeightBits) {
  struct Case {
    ScoringFunc s;
    int64_t groups, topk_groups;
    bool noaux, norm;
  };
  for (const Case& k : {Case{ScoringFunc::kSigmoid, 8, 4, true, true}, Case{ScoringFunc::kSigmoid, 1, 1, true, false},
                        Case{ScoringFunc::kSoftmax, 4, 2, false, true}, Case{ScoringFunc::kSoftmax, 1, 1, false, false},
                        Case{ScoringFunc::kSqrtSoftplus, 1, 1, true, true}}) {
    const MoeConfig c = router_config(64, 256, 8, k.s, k.groups, k.topk_groups, k.noaux, k.norm, 2.5f);
    const Inputs in = random_inputs(100, 64, 256, 77, 0.1f);
    const Routing got = route(c, in.x.data(), 100, in.gate, in.bias);
    const Routing want = naive_fp32_route(c, in, 100);
    EXPECT_EQ(got.topk_idx, want.topk_idx) << scoring_name(k.s) << " groups " << k.groups;
    ASSERT_EQ(got.topk_weights.size(), want.topk_weights.size());
    for (size_t i = 0; i < got.topk_weights.size(); ++i)
      ASSERT_EQ(f32_bits(got.topk_weights[i]), f32_bits(want.topk_weights[i]))
          << scoring_name(k.s) << " groups " << k.groups << " slot " << i;
  }
}

}  // namespace
}  // namespace moefq
