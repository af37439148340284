// The MoE benchmarks' inputs (bench_moe.cu, bench_moe_ranks.cu): repeated synthetic expert weights
// and uniform routing. Timing does not depend on the weight values, and uniform routing spreads
// the rows evenly over the experts, as a balanced router does.
#pragma once

#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "moefq/moe_config.h"
#include "moefq/weights.h"

namespace moefq::bench {

// Expert 0's synthetic weights (e4m3, or their bf16 rounding) for each of the `count` experts from
// `first` (the shared expert is the same on every rank).
inline LayerWeights repeated_weights(const MoeConfig& c, int64_t first, int64_t count,
                                     WeightFormat format = WeightFormat::kE4m3) {
  LayerWeights w = synthetic_weights(c, format, 1, 0, 1);
  w.first_expert = first;
  const ExpertWeights one = w.experts[0];
  w.experts.assign(size_t(count), one);
  return w;
}

struct Routing {
  std::vector<int32_t> idx;  // [T, K]
  std::vector<float> wt;     // [T, K]
};

// Every token to K distinct experts of [0, E), uniformly; router weights in [0.1, 0.2).
inline Routing uniform_routing(int64_t T, int64_t K, int64_t E, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Routing r{std::vector<int32_t>(size_t(T * K)), std::vector<float>(size_t(T * K))};
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t k = 0; k < K; ++k) {
      std::swap(perm[size_t(k)], perm[size_t(k + int64_t(rng() % uint64_t(E - k)))]);
      r.idx[size_t(t * K + k)] = perm[size_t(k)];
      r.wt[size_t(t * K + k)] = 0.1f + float(rng() % 1000) * 1e-4f;
    }
  }
  return r;
}

}  // namespace moefq::bench
