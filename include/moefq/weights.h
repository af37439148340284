// Expert weights of one MoE layer: e4m3 with fp32 128x128 block scales (the DeepSeek-V3
// checkpoint format) or bf16, and a seeded synthetic generator. Loading them from a checkpoint:
// checkpoint.h.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moefq/moe_config.h"
#include "moefq/numerics.h"

namespace moefq {

enum class WeightFormat { kE4m3, kBf16 };
const char* weight_format_name(WeightFormat f);

// How a checkpoint stores its expert weights (checkpoint.h); the engines hold them as loaded:
// kE4m3 and kBf16 as they are, kMxfp4 decoded to bf16 once, at load (every MXFP4 value is exact
// in bf16). Bytes per parameter: e4m3 1 + 4/16384 (fp32 128x128 block scales), bf16 2, MXFP4 as
// stored 17/32 (a 4-bit value, one ue8m0 byte per 32), as loaded 2.
enum class StoredWeightFormat { kE4m3, kBf16, kMxfp4 };
const char* stored_weight_format_name(StoredWeightFormat f);  // "e4m3", "bf16", "mxfp4"
WeightFormat loaded_weight_format(StoredWeightFormat f);     // kMxfp4 -> kBf16
// Bytes of `num_params` expert weights (the [rows, cols] matrices of whole 128 x 128 blocks) in f.
double stored_weight_bytes(StoredWeightFormat f, double num_params);

// MXFP4 (OCP MX: e2m1 values, one ue8m0 scale per 32 consecutive elements of a row) to bf16, as
// GPT-OSS and DeepSeek-V4 store their experts: packed [rows, cols / 2] bytes, element 2j of a row
// in the low nibble of its byte j and 2j + 1 in the high nibble; scales [rows, cols / 32], value
// 2^(code - 127) (0xFF is NaN). Value = e2m1 * scale, exact in bf16 unless it overflows (inf).
// cols must be a multiple of 32.
std::vector<bf16> decode_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols);

// How the expert GEMMs take their activations (docs/engine.md, "Staging"):
// - kE4m3: x and the SwiGLU output h are cast to e4m3 with one fp32 scale per 128 elements before
//   the gate/up and the down GEMM (the FP8 Mega-MoE / DeepGEMM way);
// - kNone: bf16 x and h = bf16(silu(g) * u * w) go into the GEMMs as they are, as a bf16 model is
//   served through DeepEP or a grouped GEMM. With e4m3 weights each 128 x 128 block's partial sum
//   is multiplied by its fp32 scale at the block's promotion, exactly as under kE4m3: the weights
//   are used dequantized (float(w8) * scale), never rounded to bf16.
enum class Staging { kE4m3, kNone };
const char* staging_name(Staging s);               // "e4m3", "none"
std::optional<Staging> parse_staging(std::string_view name);
// parse_staging, or a bad-input error naming `what` (e.g. "--staging") and the choices.
Staging staging_from_name(std::string_view name, std::string_view what);
// A sentence naming the baseline a run with this staging compares against, for reports.
const char* staging_baseline(Staging s);
// The staging a model is served with, the default everywhere (the one place this rule lives): a
// checkpoint's own weight format when one is given (e4m3: kE4m3, bf16: kNone); otherwise the
// format the architecture ships its weights in: DeepSeek-V3/V4 and Kimi-K2 (and configs without a
// model_type, as the tiny and kimi-k3 presets) in e4m3, hence kE4m3; DeepSeek-V2, GLM-4.5,
// Qwen3-MoE, Mixtral and OLMoE in bf16, hence kNone.
Staging default_staging(const MoeConfig& cfg, std::optional<WeightFormat> checkpoint_format = std::nullopt);

// One expert: gate_up [2I, H] (rows [0, I) gate, [I, 2I) up) and down [H, I], row-major.
// e4m3: *_e4m3 bytes and *_scale fp32 per 128x128 block ([2I/128, H/128] and [H/128, I/128]);
// dequantized weight = e4m3_decode(w) * scale. bf16: *_bf16.
struct ExpertWeights {
  int64_t hidden = 0, intermediate = 0;
  WeightFormat format = WeightFormat::kE4m3;
  std::vector<uint8_t> gate_up_e4m3, down_e4m3;
  std::vector<float> gate_up_scale, down_scale;
  std::vector<bf16> gate_up_bf16, down_bf16;

  // The dequantized fp32 matrices ([2I, H] and [H, I]).
  std::vector<float> gate_up_f32() const;
  std::vector<float> down_f32() const;
};

// Progress of making a rank's layer weights: called on the calling thread with the number of
// experts (routed, then the shared one) done so far, after each group of them.
using ExpertProgress = std::function<void(int64_t num_done)>;

struct LayerWeights {
  int64_t first_expert = 0;             // global id of experts[0]
  std::vector<ExpertWeights> experts;   // the rank's local routed experts
  std::vector<ExpertWeights> shared;    // 0 or 1: the shared expert(s) as one expert of I * S
  std::vector<float> gate;              // [E, H] router weight: the values of the bf16 weight
                                        // (a checkpoint's F32 gate is kept as it is)
  std::vector<float> gate_bias;         // [E] e_score_correction_bias when cfg.noaux_tc, else empty
};

// The synthetic model's weights of one layer (moefq/synthetic.h: synthetic_layer(cfg, seed) and
// synthetic_layer_weights): experts [first_expert, first_expert + num_local) and, when
// cfg.num_shared > 0, the shared expert (intermediate I * S), the router weight and bias. Expert e
// depends only on (seed, e), never on the range asked for; kBf16 gives the bf16 rounding of the
// same dequantized e4m3 weights. Throws for an expert range outside [0, E).
LayerWeights synthetic_weights(const MoeConfig& cfg, WeightFormat format, uint64_t seed,
                               int64_t first_expert, int64_t num_local);

}  // namespace moefq
