// The synthetic MoE layer of `moefq eval`: weights and activations whose statistics follow what
// is published about real MoE models (docs/eval.md cites each parameter's source), generated
// from a seed. Every value is a pure function of (layer seed, tensor, element index), so the CPU
// and the GPU generators (src/engine/synthetic_rules.h) give the same bits, an expert depends only
// on its global id, and a token only on its index in the layer's token stream.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moefq/moe_config.h"
#include "moefq/numerics.h"
#include "moefq/weights.h"

namespace moefq {

// model: activations as after RMSNorm (per-channel lognormal gain, a few outlier channels, sink
// tokens with massive activations) and structured weights (output-channel gains, super experts);
// gaussian: plain N(0, 1) activations and N(0, sigma) weights, for comparisons with published
// microbenchmarks.
enum class SyntheticKind { kModel, kGaussian };
const char* synthetic_kind_name(SyntheticKind k);  // "model", "gaussian"
std::optional<SyntheticKind> parse_synthetic_kind(std::string_view name);

// The per-layer parameters of the synthetic model, derived from (config, seed, kind). Small
// (O(H + E)); the per-element values come from the rules of src/engine/synthetic_rules.h.
struct SyntheticLayer {
  SyntheticKind kind = SyntheticKind::kModel;
  uint64_t seed = 0;
  int64_t hidden = 0, num_experts = 0;
  float weight_sigma = 0.02f;            // sigma of every expert weight before the e4m3 cast
  std::vector<float> in_gain;            // [H] each input channel's gain (the RMSNorm weight)
  std::vector<float> out_gain;           // [H] each output channel's gain (rows of the down matrices)
  std::vector<int32_t> outlier_channels; // input channels with a gain of 15-30 (ascending)
  std::vector<int32_t> sink_channels;    // the 1-3 channels of the massive activations (ascending)
  std::vector<int32_t> super_experts;    // 1-3 routed experts whose outputs are massive on sinks (early layers)
  float sink_value = 0;                  // the value on a sink channel of a sink token
  float sink_scale = 1;                  // a sink token's other channels: x this (its RMS stays ~1)
  float super_up_gain = 1;               // a super expert's gate/up columns at the sink channels: x this
  float super_down_gain = 1;             // a super expert's down rows at the sink channels: x this
  float router_sink_super = 0;           // the router weight of a super expert at a sink channel

  // The sink tokens among tokens [0, n) of the layer's stream, ascending: the first token of each
  // sequence, sequences of 2048 to 4096 tokens (none for gaussian).
  std::vector<int64_t> sink_tokens(int64_t n) const;
  // Row gain of an expert's down matrix at output channel h (out_gain, and the super-expert boost),
  // column gain of its gate/up matrix at input channel h (the super-expert boost, else 1).
  float down_row_gain(int64_t expert, bool shared, int64_t h) const;
  float gate_up_col_gain(int64_t expert, bool shared, int64_t h) const;
  bool is_super(int64_t expert, bool shared) const;
  bool is_sink_channel(int64_t h) const;
};

// early: an early layer, whose 1-3 super experts turn sink tokens into massive outputs (the
// literature finds them in the first layers; later layers carry the massive activations in their
// inputs only).
SyntheticLayer synthetic_layer(const MoeConfig& cfg, uint64_t seed, SyntheticKind kind = SyntheticKind::kModel,
                               bool early = true);
// The layers the eval's synthetic model treats as early: [0, kEarlySyntheticLayers).
inline constexpr int64_t kEarlySyntheticLayers = 3;

// Experts [first_expert, first_expert + num_local) of the layer (and the shared expert when the
// config has one), the router weight and bias: e4m3 with 128 x 128 block scales = block max / 448,
// or (kBf16) the bf16 rounding of the same dequantized weights. Throws for a range outside [0, E).
// num_threads: 0 = all. on_progress (may be empty) hears the experts made so far.
LayerWeights synthetic_layer_weights(const SyntheticLayer& layer, const MoeConfig& cfg, WeightFormat format,
                                     int64_t first_expert, int64_t num_local, int num_threads = 0,
                                     const ExpertProgress& on_progress = {});

// The router weight ([E, H] fp32 holding bf16 values) and, with noaux_tc, its correction bias ([E],
// else empty) of the layer, as synthetic_layer_weights gives them.
void synthetic_router(const SyntheticLayer& layer, const MoeConfig& cfg, std::vector<float>& gate,
                      std::vector<float>& bias);

// Tokens [first_token, first_token + n) of the layer's stream: [n, H] bf16.
std::vector<bf16> synthetic_activations(const SyntheticLayer& layer, int64_t first_token, int64_t n,
                                        int num_threads = 0);

// [rows, cols] fp32 activations of the model kind (seeded), for samples and benchmarks that need
// realistic data of any width: the same per-channel gains, outliers and sinks as a layer of
// hidden size `cols` (values not rounded to bf16).
std::vector<float> synthetic_activations(int64_t rows, int64_t cols, uint64_t seed);

}  // namespace moefq
