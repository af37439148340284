// The per-token rules of the MoE router (router.h), written once as host+device functions: the CPU
// router (engine/router.cpp) and the CUDA router (engine/cuda/router_kernels.cu) call exactly these, so
// they score, select and weigh identically, bit for bit. Every fp32 operation is explicit
// (numerics.h's add_rn / mul_rn / div_rn and the portable exp_f32, sigmoid_f32, softplus_f32,
// sqrt_rn), so no compiler can contract or reorder one on either side.
//
// One token, in three steps:
//   1. logit[e]  (the gate_logit order of router.h; each backend has its own loop, combine_lanes
//      is the shared last step);
//   2. s[e] = score_elementwise(scoring, logit[e])  (sigmoid, sqrt(softplus), or the logit itself
//      for softmax);
//   3. route_scores(): softmax_row for softmax, then select_experts (groups, top-k, weights).
// Scores live at s[e * stride] so that a kernel can keep them token-minor ([E][num_tokens]).
#pragma once

#include <cstdint>

#include "moefq/moe_config.h"
#include "moefq/numerics.h"

namespace moefq::router_rules {

inline constexpr int kLogitLanes = 8;
inline constexpr int kMaxTopK = 32;  // MoeConfig::validate's bound on top_k

// The routing fields of a (validated) MoeConfig, as a plain struct a kernel takes by value.
struct Rules {
  int64_t num_experts;
  int64_t top_k;
  int64_t n_group;
  int64_t topk_group;
  ScoringFunc scoring;
  bool noaux_tc;
  bool norm_topk_prob;
  float routed_scaling;
};
inline Rules make_rules(const MoeConfig& c) {
  return {c.num_experts, c.top_k, c.n_group, c.topk_group, c.scoring, c.noaux_tc, c.norm_topk_prob,
          c.routed_scaling};
}

// The last step of a gate logit: lane j holds the sum over h = j mod 8 (h ascending, from +0);
// the lanes combine as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). A kernel that keeps the lanes in 8
// threads reaches the same bits with xor-1, xor-2, xor-4 shuffles (addition is commutative).
MOEFQ_HD float combine_lanes(const float* l) {
  return add_rn(add_rn(add_rn(l[0], l[1]), add_rn(l[2], l[3])), add_rn(add_rn(l[4], l[5]), add_rn(l[6], l[7])));
}

// Step 2: the score of one logit. Softmax is a rule over the row (softmax_row): the logit passes.
MOEFQ_HD float score_elementwise(ScoringFunc f, float logit) {
  switch (f) {
    case ScoringFunc::kSigmoid:
      return sigmoid_f32(logit);
    case ScoringFunc::kSqrtSoftplus:
      return sqrt_rn(softplus_f32(logit));
    case ScoringFunc::kSoftmax:
      break;
  }
  return logit;
}

// Softmax over one token's E logits v[e * stride], in place: mx = the largest non-NaN logit (-inf
// if none); every v = exp_f32(v - mx); sum = those values added in ascending e, from +0; every
// v = v / sum. (Sequential sums: both backends run one token on one thread.)
MOEFQ_HD void softmax_row(float* v, int64_t num_experts, int64_t stride) {
  float mx = f32_from_bits(0xFF800000u);
  for (int64_t e = 0; e < num_experts; ++e) {
    const float l = v[e * stride];
    mx = l > mx ? l : mx;
  }
  float sum = 0.0f;
  for (int64_t e = 0; e < num_experts; ++e) {
    const float p = exp_f32(add_rn(v[e * stride], -mx));
    v[e * stride] = p;
    sum = add_rn(sum, p);
  }
  for (int64_t e = 0; e < num_experts; ++e) v[e * stride] = div_rn(v[e * stride], sum);
}

// Ordering key: NaN ranks below every number, -inf included (equal keys fall back to the id).
MOEFQ_HD float order_key(float v) { return is_nan(v) ? f32_from_bits(0xFF800000u) : v; }

// (ka, a) before (kb, b): the larger key first, ties to the lower id. Keys are order_key results
// (never NaN), so over distinct ids this is a strict total order: the top-k of any candidate set
// is unique, whatever the algorithm or the order the candidates are visited in.
MOEFQ_HD bool before(float ka, int64_t a, float kb, int64_t b) { return ka != kb ? ka > kb : a < b; }

// The selection key of expert e: s + bias (noaux_tc; bias null = zero bias) or s.
MOEFQ_HD float selection_key(const float* s, int64_t stride, const float* bias, int64_t e) {
  const float v = s[e * stride];
  return order_key(bias != nullptr ? add_rn(v, bias[e]) : v);
}

// Step 3 without softmax: group-limited top-k and the weights of one token.
// s: the token's scores at stride; bias: [E] or null; gscore: scratch for n_group floats at
// gstride (unused when n_group == 1). Writes idx [K] (global expert ids, in slot order) and w [K].
// Groups (n_group > 1): group score = the sum of the group's two largest keys (noaux_tc; the
// largest alone in a group of one) or its largest key; the topk_group best groups (by the order
// above) are kept. Then the K best experts of the kept groups, best first. Weight = s of the
// expert (no bias); sum = the K weights added in slot order from +0; if norm_topk_prob each is
// divided by (sum + 1e-20f); then multiplied by routed_scaling. A NaN weight is canonical.
MOEFQ_HD void select_experts(const Rules& r, const float* s, int64_t stride, const float* bias, float* gscore,
                             int64_t gstride, int32_t* idx, float* w) {
  const int64_t E = r.num_experts, K = r.top_k, G = r.n_group, per = E / G;
  const bool grouped = G > 1;
  // The topk_group-th best group (thr_key, thr_group): a group is kept when it is that group or
  // comes before it. Found by topk_group passes, each taking the best group after the previous.
  float thr_key = 0.0f;
  int64_t thr_group = -1;
  if (grouped) {
    for (int64_t g = 0; g < G; ++g) {
      float first = f32_from_bits(0xFF800000u), second = first;  // the two largest keys
      for (int64_t e = g * per; e < (g + 1) * per; ++e) {
        const float k = selection_key(s, stride, bias, e);
        if (k > first) {
          second = first;
          first = k;
        } else if (k > second) {
          second = k;
        }
      }
      gscore[g * gstride] = order_key(r.noaux_tc ? (per >= 2 ? add_rn(first, second) : first) : first);
    }
    for (int64_t i = 0; i < r.topk_group; ++i) {
      float best_key = 0.0f;
      int64_t best = -1;
      for (int64_t g = 0; g < G; ++g) {
        const float k = gscore[g * gstride];
        if (thr_group >= 0 && !before(thr_key, thr_group, k, g)) continue;  // already taken
        if (best < 0 || before(k, g, best_key, best)) {
          best_key = k;
          best = g;
        }
      }
      thr_key = best_key;
      thr_group = best;
    }
  }

  // Top-K of the kept groups' experts: a bounded insertion sort, best first. A candidate enters
  // when the list is short or it comes before the last entry (tail_*).
  float top_key[kMaxTopK];
  int32_t top_id[kMaxTopK];
  int64_t count = 0;
  float tail_key = 0.0f;
  int64_t tail_id = -1;
  for (int64_t g = 0; g < G; ++g) {
    if (grouped && before(thr_key, thr_group, gscore[g * gstride], g)) continue;  // not kept
    for (int64_t e = g * per; e < (g + 1) * per; ++e) {
      const float k = selection_key(s, stride, bias, e);
      if (count == K && !before(k, e, tail_key, tail_id)) continue;
      int64_t p = count < K ? count++ : K - 1;
      while (p > 0 && before(k, e, top_key[p - 1], top_id[p - 1])) {
        top_key[p] = top_key[p - 1];
        top_id[p] = top_id[p - 1];
        --p;
      }
      top_key[p] = k;
      top_id[p] = int32_t(e);
      tail_key = top_key[count - 1];
      tail_id = top_id[count - 1];
    }
  }

  float weight[kMaxTopK];
  float sum = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    weight[k] = s[int64_t(top_id[k]) * stride];
    sum = add_rn(sum, weight[k]);
  }
  const float denom = add_rn(sum, 1e-20f);
  for (int64_t k = 0; k < K; ++k) {
    float v = r.norm_topk_prob ? div_rn(weight[k], denom) : weight[k];
    v = mul_rn(v, r.routed_scaling);
    idx[k] = top_id[k];
    w[k] = is_nan(v) ? canonical_nan_f32() : v;
  }
}

// Step 3: softmax (when that is the scoring function; s is overwritten with the scores) and the
// selection. s holds step 2's values.
MOEFQ_HD void route_scores(const Rules& r, float* s, int64_t stride, const float* bias, float* gscore,
                           int64_t gstride, int32_t* idx, float* w) {
  if (r.scoring == ScoringFunc::kSoftmax) softmax_row(s, r.num_experts, stride);
  select_experts(r, s, stride, bias, gscore, gstride, idx, w);
}

// A padding token: every slot -1, every weight +0.
MOEFQ_HD void padding_slots(int64_t top_k, int32_t* idx, float* w) {
  for (int64_t k = 0; k < top_k; ++k) {
    idx[k] = -1;
    w[k] = 0.0f;
  }
}

}  // namespace moefq::router_rules
