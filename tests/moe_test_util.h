// MoE test helpers shared by the engine and fake-quant suites (CPU and CUDA): a small config,
// synthetic weights split over R ranks, randomised routing, one call's per-rank inputs, and that
// call run through a host layer (the reference outputs).
#pragma once

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "moefq/cpu_engine.h"
#include "moefq/moe_config.h"
#include "moefq/qdq.h"
#include "moefq/weights.h"
#include "test_util.h"

namespace moefq::test {

// H 256, I 128: small enough for a 2-core CPU in well under a second.
inline MoeConfig small_config(int64_t E = 16, int64_t K = 4, int64_t shared = 1) {
  MoeConfig c;
  c.name = "test";
  c.hidden = 256;
  c.intermediate = 128;
  c.num_experts = E;
  c.top_k = K;
  c.num_shared = shared;
  c.routed_scaling = 2.5f;
  return c;
}

// Random routing: distinct experts per token, skewed towards low ids (so some experts get many
// rows and some none), weights in (0, 1]; `padding_every` tokens are all -1.
inline void random_routing(const MoeConfig& c, int64_t n, uint64_t seed, std::vector<int32_t>& idx,
                    std::vector<float>& w, int64_t padding_every = 0, int64_t max_expert = -1) {
  std::mt19937_64 rng(seed);
  const int64_t E = max_expert > 0 ? max_expert : c.num_experts, K = c.top_k;
  idx.assign(size_t(n * K), -1);
  w.assign(size_t(n * K), 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    if (padding_every && t % padding_every == padding_every - 1) continue;
    for (int64_t k = 0; k < K; ++k) {
      if (rng() % 11 == 0) continue;  // some inactive slots in active tokens
      int32_t e;
      bool dup;
      do {
        const double u = double(rng() % 1000000) / 1e6;
        e = int32_t(double(E) * u * u);
        dup = false;
        for (int64_t j = 0; j < k; ++j) dup |= idx[size_t(t * K + j)] == e;
      } while (dup);
      idx[size_t(t * K + k)] = e;
      w[size_t(t * K + k)] = float(rng() % 1000 + 1) / 1000.0f;
    }
  }
}

inline std::vector<LayerWeights> weights_for(const MoeConfig& c, int64_t R, WeightFormat f = WeightFormat::kE4m3) {
  std::vector<LayerWeights> w;
  for (int64_t r = 0; r < R; ++r)
    w.push_back(synthetic_weights(c, f, 42, r * (c.num_experts / R), c.num_experts / R));
  return w;
}

// Per-rank inputs of one call of every rank.
struct Problem {
  int64_t R = 0, H = 0, K = 0;
  std::vector<int64_t> n;                 // [R] tokens per rank
  std::vector<std::vector<bf16>> x;       // [R][n, H]
  std::vector<std::vector<int32_t>> idx;  // [R][n, K]
  std::vector<std::vector<float>> wt;     // [R][n, K]
};

// Rank r gets n tokens from seed + r (so the ranks' data differ); `all_padding_rank` gets only
// padding tokens.
inline Problem make_problem(const MoeConfig& c, int64_t R, int64_t n, uint64_t seed, int64_t padding_every = 0,
                            int64_t all_padding_rank = -1) {
  Problem p;
  p.R = R;
  p.H = c.hidden;
  p.K = c.top_k;
  for (int64_t r = 0; r < R; ++r) {
    p.n.push_back(n);
    p.x.push_back(test::to_bf16(test::activations(n, c.hidden, seed + uint64_t(r) * 17, false)));
    std::vector<int32_t> idx;
    std::vector<float> wt;
    random_routing(c, n, seed + uint64_t(r) * 31 + 1, idx, wt, padding_every);
    if (r == all_padding_rank) {
      std::fill(idx.begin(), idx.end(), -1);
      std::fill(wt.begin(), wt.end(), 0.0f);
    }
    p.idx.push_back(idx);
    p.wt.push_back(wt);
  }
  return p;
}

// The one-rank problem `whole` cut into R ranks of n / R consecutive tokens each (R divides n):
// the same tokens and routing, so a layer's concatenated output must not depend on R.
inline Problem split_problem(const Problem& whole, int64_t R) {
  Problem p;
  p.R = R;
  p.H = whole.H;
  p.K = whole.K;
  const int64_t per = whole.n[0] / R;
  for (int64_t r = 0; r < R; ++r) {
    p.n.push_back(per);
    p.x.emplace_back(whole.x[0].begin() + r * per * p.H, whole.x[0].begin() + (r + 1) * per * p.H);
    p.idx.emplace_back(whole.idx[0].begin() + r * per * p.K, whole.idx[0].begin() + (r + 1) * per * p.K);
    p.wt.emplace_back(whole.wt[0].begin() + r * per * p.K, whole.wt[0].begin() + (r + 1) * per * p.K);
  }
  return p;
}

// Runs one call of every rank of p through `layer` (a CpuEngine, an ExpertBackend or a
// FakeQuantMoe); xs ([R][n, H] bf16) replaces the problem's tokens when given. Returns y per rank,
// [R][n, H] bf16.
template <typename Layer>
std::vector<std::vector<bf16>> host_forward(Layer& layer, const Problem& p,
                                            const std::vector<std::vector<bf16>>* xs = nullptr) {
  std::vector<std::vector<bf16>> y(static_cast<size_t>(p.R));
  std::vector<RankBatch> b(static_cast<size_t>(p.R));
  for (size_t r = 0; r < size_t(p.R); ++r) {
    y[r].assign(size_t(p.n[r] * p.H), bf16{});
    b[r] = {(xs ? (*xs)[r] : p.x[r]).data(), p.n[r], p.idx[r].data(), p.wt[r].data(), y[r].data()};
  }
  layer.forward(b);
  return y;
}

// The combine re-sum of docs/fake_quant.md for rank r's tokens over the rows of a buffer (`buf`, rows
// at combine_offset, [K + fused][T][H] bf16): fp32 from +0, the active routed slots ascending,
// each row QDQ'd with format f (qdq_ref, blocks along H; no QDQ when f is nullopt), the fused
// shared slot last and unquantized, one bf16 rounding. weighted (combine_weighting after): each
// QDQ'd routed value v is added as std::fma(v, w, acc) with its router weight w = p.wt (one rounding).
inline std::vector<bf16> qdq_resum(const uint8_t* buf, size_t combine_offset, int64_t T, bool fused, const Problem& p,
                                   int64_t r, std::optional<Format> f, float amax, bool weighted = false) {
  const int64_t H = p.H, K = p.K, n = p.n[size_t(r)];
  auto row = [&](int64_t k, int64_t t) { return reinterpret_cast<const bf16*>(buf + combine_offset + size_t((k * T + t) * H) * 2); };
  std::vector<bf16> y(size_t(n * H)), q(static_cast<size_t>(H));
  for (int64_t t = 0; t < n; ++t) {
    std::vector<float> acc(static_cast<size_t>(H), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      if (p.idx[size_t(r)][size_t(t * K + k)] < 0) continue;
      if (f)
        qdq_ref(*f, row(k, t), q.data(), 1, H, amax);
      else
        std::copy(row(k, t), row(k, t) + H, q.begin());
      const float w = p.wt[size_t(r)][size_t(t * K + k)];
      for (int64_t h = 0; h < H; ++h) {
        const float v = to_f32(q[size_t(h)]);
        acc[size_t(h)] = weighted ? std::fma(v, w, acc[size_t(h)]) : acc[size_t(h)] + v;
      }
    }
    if (fused)
      for (int64_t h = 0; h < H; ++h) acc[size_t(h)] = acc[size_t(h)] + to_f32(row(K, t)[h]);
    for (int64_t h = 0; h < H; ++h) y[size_t(t * H + h)].bits = bf16_round(acc[size_t(h)]);
  }
  return y;
}

}  // namespace moefq::test
