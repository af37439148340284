// A small DeepSeek-V3-format checkpoint written by the tests: config.json and one
// model.safetensors holding the synthetic weights of the layers asked for.
#pragma once

#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <string>

#include "moefq/moe_config.h"
#include "moefq/safetensors.h"
#include "moefq/weights.h"
#include "test_util.h"

namespace moefq::test {

inline MoeConfig small_config() {
  MoeConfig c;
  c.name = "ckpt";
  c.hidden = 256;
  c.intermediate = 128;
  c.num_experts = 8;
  c.top_k = 2;
  c.num_shared = 1;
  c.routed_scaling = 2.5f;
  c.scoring = ScoringFunc::kSigmoid;
  c.norm_topk_prob = true;
  c.noaux_tc = true;
  return c;
}

inline const char* kSmallConfigJson = R"({"hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 8,
  "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
  "scoring_func": "sigmoid", "norm_topk_prob": true, "topk_method": "noaux_tc"})";

inline void add_expert(SafetensorsWriter& w, const std::string& prefix, const ExpertWeights& e) {
  const int64_t H = e.hidden, I = e.intermediate;
  const std::span<const uint8_t> gu(e.gate_up_e4m3);
  const auto gus = span_of(e.gate_up_scale);
  w.add(prefix + "gate_proj.weight", StDtype::kF8E4M3, {I, H}, gu.subspan(0, size_t(I * H)));
  w.add(prefix + "up_proj.weight", StDtype::kF8E4M3, {I, H}, gu.subspan(size_t(I * H)));
  w.add(prefix + "gate_proj.weight_scale_inv", StDtype::kF32, {I / 128, H / 128}, gus.subspan(0, gus.size() / 2));
  w.add(prefix + "up_proj.weight_scale_inv", StDtype::kF32, {I / 128, H / 128}, gus.subspan(gus.size() / 2));
  w.add(prefix + "down_proj.weight", StDtype::kF8E4M3, {H, I}, e.down_e4m3);
  w.add(prefix + "down_proj.weight_scale_inv", StDtype::kF32, {H / 128, I / 128}, span_of(e.down_scale));
}

// Layers and the weight seed of each.
inline void write_checkpoint(const std::filesystem::path& dir, const std::map<int64_t, uint64_t>& layer_seeds) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << kSmallConfigJson;
  const MoeConfig cfg = small_config();
  SafetensorsWriter w;
  for (const auto& [layer, seed] : layer_seeds) {
    const LayerWeights lw = synthetic_weights(cfg, WeightFormat::kE4m3, seed, 0, cfg.num_experts);
    const std::string mlp = "model.layers." + std::to_string(layer) + ".mlp.";
    for (int64_t e = 0; e < cfg.num_experts; ++e) add_expert(w, mlp + "experts." + std::to_string(e) + ".", lw.experts[size_t(e)]);
    add_expert(w, mlp + "shared_experts.", lw.shared[0]);
    const auto gate = to_bf16(lw.gate);
    w.add(mlp + "gate.weight", StDtype::kBF16, {cfg.num_experts, cfg.hidden}, span_of(gate));
    w.add(mlp + "gate.e_score_correction_bias", StDtype::kF32, {cfg.num_experts}, span_of(lw.gate_bias));
  }
  w.write((dir / "model.safetensors").string());
}

}  // namespace moefq::test
