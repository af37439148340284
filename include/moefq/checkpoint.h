// Loading one MoE layer from a Hugging Face checkpoint directory (model.safetensors.index.json and
// its shards, or one model.safetensors): the routed experts a rank holds, the shared expert and
// the router, under the tensor names of the config's architecture (MoeConfig::model_type).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moefq/moe_config.h"
#include "moefq/weights.h"

namespace moefq {

// The tensor names of one layer.
// - DeepSeek-V2/V3/V4, Kimi-K2, GLM-4.5, Qwen3-MoE, OLMoE and configs without model_type:
//   model.layers.{L}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight, mlp.shared_experts.*,
//   mlp.gate.weight and mlp.gate.e_score_correction_bias.
// - Mixtral: model.layers.{L}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight (w1 the gate, w3 the
//   up and w2 the down projection) and block_sparse_moe.gate.weight.
// An e4m3 weight has its fp32 128x128 block scales in `<weight name minus ".weight">.weight_scale_inv`
// (or, DeepSeek-V4's, ue8m0 ones, F8_E8M0, in `<weight name minus ".weight">.scale`);
// an MXFP4 weight (U8 or I8, [rows, cols / 2] packed e2m1 pairs) its ue8m0 scales, [rows, cols / 32]
// F8_E8M0 or U8, in `<weight name minus ".weight">.scale` (DeepSeek-V4's per-expert layout).
struct LayerTensorNames {
  std::string experts;  // "model.layers.3.mlp.experts." (then "{e}.")
  std::string shared;   // "model.layers.3.mlp.shared_experts."
  std::string gate_proj, up_proj, down_proj;  // "gate_proj", "up_proj", "down_proj" or "w1", "w3", "w2"
  std::string router;   // "model.layers.3.mlp.gate.weight"
  std::string bias;     // "model.layers.3.mlp.gate.e_score_correction_bias"

  // "<prefix><proj>.weight" of routed expert e, e.g. "model.layers.3.mlp.experts.7.up_proj.weight".
  std::string expert_weight(int64_t e, const std::string& proj) const;
};
LayerTensorNames layer_tensor_names(const MoeConfig& cfg, int64_t layer);
// DeepSeek-V4's own names, which its checkpoints use (read for model_type deepseek_v4 where the
// Hugging Face router name above is absent): layers.{L}.ffn.experts.{e}.{w1,w3,w2}.weight (w1 the
// gate, w3 the up, w2 the down projection) with `.scale` beside each, layers.{L}.ffn.shared_experts.*,
// layers.{L}.ffn.gate.weight and layers.{L}.ffn.gate.bias (the correction bias).
LayerTensorNames deepseek_v4_own_tensor_names(int64_t layer);

// The files of the checkpoint's weights: its index and every shard the index names, or its one
// model.safetensors (what an output must not replace). Reads the index only; errors as
// load_checkpoint_layer's for a missing or malformed index.
std::vector<std::string> checkpoint_files(const std::string& dir);

// The format the checkpoint stores its expert weights in, from layer `layer`'s expert 0 gate
// projection: kE4m3 for F8_E4M3, kBf16 for BF16, kMxfp4 for U8/I8 with a `.scale` beside it; reads
// the index and the shards' headers only. Any other format (F16, F32, F8_E5M2, NVFP4, GPTQ/AWQ
// qweight, compressed-tensors weight_packed) is bad input naming it and the supported ones; other
// errors as load_checkpoint_layer's.
StoredWeightFormat checkpoint_stored_format(const std::string& dir, int64_t layer, const MoeConfig& cfg);
// The format the engines hold those weights in: loaded_weight_format(checkpoint_stored_format(...)).
WeightFormat checkpoint_weight_format(const std::string& dir, int64_t layer, const MoeConfig& cfg);

// Checks every tensor load_checkpoint_layer reads for each of `layers` (all E routed experts, the
// shared expert, the router and, with cfg.noaux_tc, its bias): present, with its dtype and shape,
// and one expert-weight format over all of them; from the index and the shards' headers only (no
// tensor data is read). Returns the format the weights are loaded in, and (when `stored` is not
// null) the one they are stored in there. Errors as load_checkpoint_layer's, prefixed with "layer
// L: " for the first layer that fails; an unsupported format as checkpoint_stored_format's.
WeightFormat check_checkpoint_layers(const std::string& dir, const std::vector<int64_t>& layers, const MoeConfig& cfg,
                                     StoredWeightFormat* stored = nullptr);

// Loads experts [first_expert, first_expert + num_local) of layer `layer`, opening each shard
// once. The format is the checkpoint's: kE4m3 when the expert weights are F8_E4M3 (scale_inv
// required), kBf16 when they are BF16, and kBf16 for MXFP4 weights too, decoded at load
// (decode_mxfp4: exact). The shared expert is in the routed experts' format, except beside MXFP4
// routed experts, where it may be in any supported format and is held as bf16 too (DeepSeek-V4's
// e4m3 one with ue8m0 scales: exact). A layer with a gate.tid2eid table (routed by token id) is
// refused. The router weight may be BF16 or F32, the correction bias F32 or BF16; the bias is
// required (and loaded) only with cfg.noaux_tc. Missing tensors or shard files, wrong shapes or
// dtypes, a malformed index and an expert range outside [0, E) are moefq::Error (bad input)
// naming the tensor and the file.
// on_progress (may be empty) hears the experts read so far.
LayerWeights load_checkpoint_layer(const std::string& dir, int64_t layer, const MoeConfig& cfg,
                                   int64_t first_expert, int64_t num_local, const ExpertProgress& on_progress = {});

}  // namespace moefq
