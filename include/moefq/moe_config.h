// The routed-MoE part of a model: shapes, routing rule and presets (engine.md), and a loader for
// a Hugging Face config.json of a DeepSeek-V3-style model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moefq {

enum class ScoringFunc { kSigmoid, kSoftmax, kSqrtSoftplus };
const char* scoring_name(ScoringFunc s);

struct MoeConfig {
  std::string name;
  int64_t hidden = 0;        // H, a multiple of 128
  int64_t intermediate = 0;  // I of one routed expert, a multiple of 128
  int64_t num_experts = 0;   // E routed experts
  int64_t top_k = 0;         // K, 1..32
  int64_t num_shared = 0;    // S shared experts (one fused expert of intermediate I * S)
  int64_t n_group = 1;       // expert groups for group-limited routing
  int64_t topk_group = 1;    // groups kept per token
  float routed_scaling = 1.0f;
  ScoringFunc scoring = ScoringFunc::kSigmoid;
  bool norm_topk_prob = true;  // renormalise the K selected weights to sum 1 (before scaling)
  bool noaux_tc = false;       // add the correction bias for selection (not for the weights)
  std::optional<float> swiglu_clamp;  // c: g = min(g, c), u = clamp(u, -c, c)

  // Throws moefq::Error (bad input) naming the first inconsistent field.
  void validate() const;
};

// deepseek-v3, deepseek-v4-flash, deepseek-v4-pro, kimi-k3, tiny.
std::vector<std::string> preset_names();
// Throws for an unknown name, listing the presets.
MoeConfig preset(std::string_view name);
// Reads the DeepSeek-V3-style fields of a Hugging Face config.json (hidden_size,
// moe_intermediate_size, n_routed_experts, num_experts_per_tok, n_shared_experts, n_group,
// topk_group, routed_scaling_factor, scoring_func, norm_topk_prob, topk_method, swiglu_limit);
// missing, mistyped or inconsistent fields are errors naming the field and the file.
MoeConfig load_hf_config(const std::string& path);

}  // namespace moefq
