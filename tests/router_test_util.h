// Router test helper shared by the CPU and CUDA router suites: a validated MoeConfig built from the
// routing fields alone (the router reads no other field; intermediate 128, one shared expert).
#pragma once

#include <cstdint>

#include "moefq/moe_config.h"

namespace moefq::test {

// E experts of hidden size H, top-K, scoring, n_group groups of which topk_group are kept,
// noaux_tc bias, normalisation of the top-K weights and the routed scaling factor.
inline MoeConfig router_config(int64_t E, int64_t H, int64_t K, ScoringFunc scoring, int64_t n_group,
                               int64_t topk_group, bool noaux_tc, bool norm, float scaling) {
  MoeConfig c;
  c.name = "test";
  c.hidden = H;
  c.intermediate = 128;
  c.num_experts = E;
  c.top_k = K;
  c.num_shared = 1;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.scoring = scoring;
  c.noaux_tc = noaux_tc;
  c.norm_topk_prob = norm;
  c.routed_scaling = scaling;
  c.validate();
  return c;
}

}  // namespace moefq::test
