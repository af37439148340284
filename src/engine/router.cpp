// The MoE router (engine.md): fp32 gate logits in a fixed order, scoring, noaux_tc bias,
// group-limited top-k, normalisation and routed scaling. One token's result depends only on its
// own row, so chunking and threading cannot change a bit.
#include "moefq/router.h"

#include <algorithm>
#include <cmath>
#include <system_error>
#include <thread>

#include "moefq/errors.h"

namespace moefq {

namespace {

constexpr int kLanes = 8;
constexpr int64_t kThreadedMinTokens = 256;
constexpr int64_t kTokensPerThread = 64;

// The fixed accumulation order: lane j sums the products of h = j mod 8 in ascending h; the lanes
// are combined as a balanced tree. Plain float operations (the build has -ffp-contract=off), so a
// vectorised loop computes the same bits as a scalar one.
float logit_f32(const float* x, const float* g, int64_t hidden) {
  float lane[kLanes] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t h = 0;
  for (; h + kLanes <= hidden; h += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] = lane[j] + x[h + j] * g[h + j];
  for (int j = 0; h < hidden; ++h, ++j) lane[j] = lane[j] + x[h] * g[h];
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// Ordering key: NaN sorts below every number (-inf included; equal keys fall back to the id).
float order_key(float v) { return std::isnan(v) ? -INFINITY : v; }

// a before b: larger key first, ties to the lower id. A strict total order over distinct ids.
struct Before {
  const float* key;
  bool operator()(int32_t a, int32_t b) const {
    return key[a] != key[b] ? key[a] > key[b] : a < b;
  }
};

float sigmoid(float l) { return 1.0f / (1.0f + std::exp(-l)); }
float sqrt_softplus(float l) { return std::sqrt(l > 20.0f ? l : std::log1p(std::exp(l))); }

struct Scratch {
  std::vector<float> xrow;     // [H]
  std::vector<float> score;    // [E] s
  std::vector<float> select;   // [E] ordering keys of the selection scores
  std::vector<float> gscore;   // [n_group]
  std::vector<int32_t> order;  // candidates (experts or groups)
  std::vector<int32_t> cand;   // experts of the kept groups
};

void route_token(const MoeConfig& cfg, const bf16* x, const float* gate, const float* bias,
                 Scratch& s, int32_t* idx_out, float* w_out) {
  const int64_t H = cfg.hidden, E = cfg.num_experts, K = cfg.top_k;
  for (int64_t h = 0; h < H; ++h) s.xrow[size_t(h)] = to_f32(x[h]);
  for (int64_t e = 0; e < E; ++e) s.score[size_t(e)] = logit_f32(s.xrow.data(), gate + e * H, H);

  switch (cfg.scoring) {
    case ScoringFunc::kSigmoid:
      for (int64_t e = 0; e < E; ++e) s.score[size_t(e)] = sigmoid(s.score[size_t(e)]);
      break;
    case ScoringFunc::kSqrtSoftplus:
      for (int64_t e = 0; e < E; ++e) s.score[size_t(e)] = sqrt_softplus(s.score[size_t(e)]);
      break;
    case ScoringFunc::kSoftmax: {
      float mx = -INFINITY;
      for (int64_t e = 0; e < E; ++e) mx = std::max(mx, s.score[size_t(e)]);
      float sum = 0.0f;  // ascending e
      for (int64_t e = 0; e < E; ++e) {
        s.score[size_t(e)] = std::exp(s.score[size_t(e)] - mx);
        sum = sum + s.score[size_t(e)];
      }
      for (int64_t e = 0; e < E; ++e) s.score[size_t(e)] = s.score[size_t(e)] / sum;
      break;
    }
  }
  for (int64_t e = 0; e < E; ++e)
    s.select[size_t(e)] = order_key(bias ? s.score[size_t(e)] + bias[e] : s.score[size_t(e)]);

  // Candidates: every expert, or those of the kept groups (in ascending id either way).
  s.cand.clear();
  if (cfg.n_group > 1) {
    const int64_t G = cfg.n_group, per = E / G;
    for (int64_t g = 0; g < G; ++g) {
      const float* v = s.select.data() + g * per;
      float first = -INFINITY, second = -INFINITY;  // the two largest keys of the group
      for (int64_t i = 0; i < per; ++i) {
        if (v[i] > first) {
          second = first;
          first = v[i];
        } else if (v[i] > second) {
          second = v[i];
        }
      }
      // noaux_tc (DeepSeek-V3): sum of the top 2 (the top 1 alone in a group of one);
      // otherwise (DeepSeek-V2 group_limited_greedy): the group's max.
      const float gs = cfg.noaux_tc ? (per >= 2 ? first + second : first) : first;
      s.gscore[size_t(g)] = order_key(gs);
    }
    s.order.resize(size_t(G));
    for (int64_t g = 0; g < G; ++g) s.order[size_t(g)] = int32_t(g);
    std::partial_sort(s.order.begin(), s.order.begin() + cfg.topk_group, s.order.end(),
                      Before{s.gscore.data()});
    std::sort(s.order.begin(), s.order.begin() + cfg.topk_group);
    for (int64_t i = 0; i < cfg.topk_group; ++i)
      for (int64_t e = s.order[size_t(i)] * per; e < (s.order[size_t(i)] + 1) * per; ++e)
        s.cand.push_back(int32_t(e));
  } else {
    for (int64_t e = 0; e < E; ++e) s.cand.push_back(int32_t(e));
  }
  std::partial_sort(s.cand.begin(), s.cand.begin() + K, s.cand.end(), Before{s.select.data()});

  float sum = 0.0f;  // slot order
  for (int64_t k = 0; k < K; ++k) {
    idx_out[k] = s.cand[size_t(k)];
    w_out[k] = s.score[size_t(s.cand[size_t(k)])];
    sum = sum + w_out[k];
  }
  if (cfg.norm_topk_prob) {
    const float denom = sum + 1e-20f;
    for (int64_t k = 0; k < K; ++k) w_out[k] = w_out[k] / denom;
  }
  for (int64_t k = 0; k < K; ++k) w_out[k] = w_out[k] * cfg.routed_scaling;
}

}  // namespace

float gate_logit(const bf16* x, const float* g, int64_t hidden) {
  std::vector<float> xr(size_t(std::max<int64_t>(hidden, 0)));
  for (int64_t h = 0; h < hidden; ++h) xr[size_t(h)] = to_f32(x[h]);
  return logit_f32(xr.data(), g, hidden);
}

Routing route(const MoeConfig& cfg, const bf16* x, int64_t num_tokens, const std::vector<float>& gate,
              const std::vector<float>& bias, const std::vector<bool>& padding, int num_threads) {
  cfg.validate();
  const int64_t H = cfg.hidden, E = cfg.num_experts, K = cfg.top_k;
  MOEFQ_CHECK(num_tokens >= 0, "route: num_tokens = ", num_tokens, " must not be negative");
  MOEFQ_CHECK(num_tokens == 0 || x != nullptr, "route: x is null for ", num_tokens, " tokens");
  MOEFQ_CHECK(int64_t(gate.size()) == E * H, "route: gate has ", gate.size(), " values, expected [E, H] = ",
              E, " x ", H);
  MOEFQ_CHECK(bias.empty() || int64_t(bias.size()) == E, "route: bias has ", bias.size(),
              " values, expected [E] = ", E, " (or none)");
  MOEFQ_CHECK(padding.empty() || int64_t(padding.size()) == num_tokens, "route: padding has ",
              padding.size(), " entries, expected num_tokens = ", num_tokens, " (or none)");
  MOEFQ_CHECK(num_threads >= 0, "route: num_threads = ", num_threads, " must not be negative");

  Routing r;
  r.num_tokens = num_tokens;
  r.top_k = K;
  r.topk_idx.assign(size_t(num_tokens * K), -1);
  r.topk_weights.assign(size_t(num_tokens * K), 0.0f);
  const float* b = cfg.noaux_tc && !bias.empty() ? bias.data() : nullptr;

  auto make_scratch = [&] {
    Scratch s;
    s.xrow.resize(size_t(H));
    s.score.resize(size_t(E));
    s.select.resize(size_t(E));
    s.gscore.resize(size_t(cfg.n_group));
    s.cand.reserve(size_t(E));
    return s;
  };
  // Nothing in here throws: all allocation happens before the threads start.
  auto run = [&](Scratch* s, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (!padding.empty() && padding[size_t(t)]) continue;
      route_token(cfg, x + t * H, gate.data(), b, *s, r.topk_idx.data() + t * K, r.topk_weights.data() + t * K);
    }
  };

  int64_t threads = 1;
  if (num_threads == 0) {
    if (num_tokens >= kThreadedMinTokens)
      threads = std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()),
                                  num_tokens / kTokensPerThread);
  } else {
    threads = std::min<int64_t>(num_threads, std::max<int64_t>(num_tokens, 1));
  }
  std::vector<Scratch> scratch;
  for (int64_t i = 0; i < std::max<int64_t>(threads, 1); ++i) scratch.push_back(make_scratch());
  if (threads <= 1) {
    run(&scratch[0], 0, num_tokens);
    return r;
  }
  // Contiguous token ranges; each thread writes only its own rows.
  std::vector<std::thread> pool;
  pool.reserve(size_t(threads));
  for (int64_t i = 0; i < threads; ++i) {
    try {
      pool.emplace_back(run, &scratch[size_t(i)], num_tokens * i / threads, num_tokens * (i + 1) / threads);
    } catch (const std::system_error&) {
      break;  // no more threads: the ranges not started run below, on this thread
    }
  }
  for (std::thread& th : pool) th.join();
  for (int64_t i = int64_t(pool.size()); i < threads; ++i)
    run(&scratch[0], num_tokens * i / threads, num_tokens * (i + 1) / threads);
  return r;
}

void mark_padding(Routing& r, int64_t token) {
  MOEFQ_CHECK(token >= 0 && token < r.num_tokens, "mark_padding: token ", token, " is outside [0, ",
              r.num_tokens, ")");
  for (int64_t k = 0; k < r.top_k; ++k) {
    r.topk_idx[size_t(token * r.top_k + k)] = -1;
    r.topk_weights[size_t(token * r.top_k + k)] = 0.0f;
  }
}

}  // namespace moefq
