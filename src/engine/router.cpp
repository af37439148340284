// The MoE router (docs/models.md): fp32 gate logits in a fixed order, then the per-token rules of
// router_rules.h (scoring, noaux_tc bias, group-limited top-k, normalisation, routed scaling),
// which the CUDA router shares. One token's result depends only on its own row, so chunking and
// threading cannot change a bit.
#include "moefq/router.h"

#include <algorithm>
#include <system_error>
#include <thread>

#include "engine/router_rules.h"
#include "moefq/errors.h"

namespace moefq {

namespace {

using router_rules::kLogitLanes;

constexpr int64_t kThreadedMinTokens = 256;
constexpr int64_t kTokensPerThread = 64;

// The fixed accumulation order: lane j sums the products of h = j mod 8 in ascending h; the lanes
// are combined as a balanced tree. Explicit binary32 operations (and the build has
// -ffp-contract=off), so a vectorised loop computes the same bits as a scalar one.
float logit_f32(const float* x, const float* g, int64_t hidden) {
  float lane[kLogitLanes] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t h = 0;
  for (; h + kLogitLanes <= hidden; h += kLogitLanes)
    for (int j = 0; j < kLogitLanes; ++j) lane[j] = add_rn(lane[j], mul_rn(x[h + j], g[h + j]));
  for (int j = 0; h < hidden; ++h, ++j) lane[j] = add_rn(lane[j], mul_rn(x[h], g[h]));
  return router_rules::combine_lanes(lane);
}

struct Scratch {
  std::vector<float> xrow;    // [H]
  std::vector<float> score;   // [E] logits, then scores
  std::vector<float> gscore;  // [n_group]
};

// One token: logits, then the shared rules of router_rules.h (the CUDA router runs the same).
void route_token(const router_rules::Rules& rules, int64_t hidden, const bf16* x, const float* gate,
                 const float* bias, Scratch& s, int32_t* idx_out, float* w_out) {
  const int64_t H = hidden, E = rules.num_experts;
  for (int64_t h = 0; h < H; ++h) s.xrow[size_t(h)] = to_f32(x[h]);
  for (int64_t e = 0; e < E; ++e)
    s.score[size_t(e)] = router_rules::score_elementwise(rules.scoring, logit_f32(s.xrow.data(), gate + e * H, H));
  router_rules::route_scores(rules, s.score.data(), 1, bias, s.gscore.data(), 1, idx_out, w_out);
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
  const router_rules::Rules rules = router_rules::make_rules(cfg);

  auto make_scratch = [&] {
    Scratch s;
    s.xrow.resize(size_t(H));
    s.score.resize(size_t(E));
    s.gscore.resize(size_t(cfg.n_group));
    return s;
  };
  // Nothing in here throws: all allocation happens before the threads start.
  auto run = [&](Scratch* s, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (!padding.empty() && padding[size_t(t)]) continue;
      route_token(rules, H, x + t * H, gate.data(), b, *s, r.topk_idx.data() + t * K, r.topk_weights.data() + t * K);
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
