// MoE test helpers shared by the engine and fake-quant suites: a small config, synthetic weights
// split over R ranks, and randomised routing.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "moefq/moe_config.h"
#include "moefq/weights.h"

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

}  // namespace moefq::test
