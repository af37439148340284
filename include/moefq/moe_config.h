// The routed-MoE part of a model: shapes, routing rule and presets (docs/models.md), and a loader for
// the Hugging Face config.json of the MoE architectures moefq knows (DeepSeek-V2/V3/V4, Kimi-K2,
// GLM-4.5, Qwen3-MoE, Mixtral, OLMoE), dispatched on its model_type.
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
  // The Hugging Face model_type the config came from ("qwen3_moe", "mixtral", ...; "" when it has
  // none); it decides how a checkpoint names the layer's tensors (checkpoint.h).
  std::string model_type;

  // Throws moefq::Error (bad input) naming the first inconsistent field.
  void validate() const;
};

// deepseek-v3, deepseek-v4-flash, deepseek-v4-pro, kimi-k2, kimi-k3, glm-4.5, glm-4.5-air,
// qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, olmoe-1b-7b, tiny.
std::vector<std::string> preset_names();
// Throws for an unknown name, listing the presets.
MoeConfig preset(std::string_view name);
// The model_type values load_hf_config reads, sorted.
std::vector<std::string> hf_model_types();
// Reads the MoE fields of a Hugging Face config.json, as its model_type names them:
// - deepseek_v2, deepseek_v3, deepseek_v4, kimi_k2, glm4_moe, and a config without model_type:
//   hidden_size, moe_intermediate_size, n_routed_experts, num_experts_per_tok, n_shared_experts,
//   n_group, topk_group, routed_scaling_factor, scoring_func, topk_method, norm_topk_prob,
//   swiglu_limit (the routing defaults are the architecture's: sigmoid and noaux_tc for V3, V4,
//   Kimi-K2 and GLM-4.5, softmax and greedy for V2 and no model_type);
// - qwen3_moe: hidden_size, moe_intermediate_size, num_experts, num_experts_per_tok,
//   norm_topk_prob (softmax, no shared expert);
// - olmoe: hidden_size, intermediate_size, num_experts, num_experts_per_tok, norm_topk_prob;
// - mixtral: hidden_size, intermediate_size, num_local_experts, num_experts_per_tok (softmax, the
//   top-k weights renormalised).
// A multimodal wrapper's text_config is read instead of the top level when the top level has no
// hidden_size. An unknown model_type, and missing, mistyped or inconsistent fields, are errors
// naming the field (or the supported model types) and the file.
MoeConfig load_hf_config(const std::string& path);

}  // namespace moefq
