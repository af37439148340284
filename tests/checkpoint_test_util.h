// Checkpoints written by the tests: one MoE layer of a Hugging Face checkpoint (model.safetensors,
// or two shards and model.safetensors.index.json) from LayerWeights, under either tensor naming
// the loader reads (spelled out here, independently of src/engine/checkpoint.cpp), editable before
// it is written to produce each kind of bad checkpoint; MXFP4 experts with their own decode; and a
// small DeepSeek-V3-format checkpoint directory (config.json and one model.safetensors) holding the
// synthetic weights of the layers asked for.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "moefq/moe_config.h"
#include "moefq/safetensors.h"
#include "moefq/weights.h"
#include "test_util.h"

namespace moefq::test {

// How a model names a layer's MoE tensors: the module ("mlp" or "block_sparse_moe") and the three
// projections of an expert.
struct TensorNaming {
  std::string module, gate, up, down;
  static TensorNaming mlp() { return {"mlp", "gate_proj", "up_proj", "down_proj"}; }
  // Mixtral: w1 is the gate, w3 the up and w2 the down projection.
  static TensorNaming block_sparse_moe() { return {"block_sparse_moe", "w1", "w3", "w2"}; }
};

// "<weight name minus .weight>" + suffix: the name of a tensor beside a weight (its scales).
inline std::string beside(const std::string& weight_name, const std::string& suffix) {
  return weight_name.substr(0, weight_name.size() - std::string(".weight").size()) + suffix;
}

struct Tensor {
  StDtype dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

struct FakeCheckpoint {
  int64_t layer = 3;  // the layer add_layer wrote last (moe() names its module)
  TensorNaming naming = TensorNaming::mlp();
  std::map<std::string, Tensor> tensors;
  std::map<std::string, int> shard_of;  // tensor name -> shard number

  std::string moe() const { return "model.layers." + std::to_string(layer) + "." + naming.module + "."; }

  void add(const std::string& name, StDtype dtype, std::vector<int64_t> shape, std::span<const uint8_t> bytes,
           int shard) {
    tensors[name] = {dtype, std::move(shape), std::vector<uint8_t>(bytes.begin(), bytes.end())};
    shard_of[name] = shard;
  }

  void erase(const std::string& name) {
    tensors.erase(name);
    shard_of.erase(name);
  }

  // Splits gate_up into gate and up (rows and scale rows), as the checkpoints store them.
  void add_expert(const std::string& prefix, const ExpertWeights& w, int shard) {
    const int64_t H = w.hidden, I = w.intermediate;
    const std::string gate = prefix + naming.gate, up = prefix + naming.up, down = prefix + naming.down;
    if (w.format == WeightFormat::kE4m3) {
      const auto gu = std::span<const uint8_t>(w.gate_up_e4m3);
      const auto gus = span_of(w.gate_up_scale);
      const size_t half = size_t(I * H), shalf = gus.size() / 2;
      add(gate + ".weight", StDtype::kF8E4M3, {I, H}, gu.subspan(0, half), shard);
      add(up + ".weight", StDtype::kF8E4M3, {I, H}, gu.subspan(half), shard);
      add(gate + ".weight_scale_inv", StDtype::kF32, {I / 128, H / 128}, gus.subspan(0, shalf), shard);
      add(up + ".weight_scale_inv", StDtype::kF32, {I / 128, H / 128}, gus.subspan(shalf), shard);
      add(down + ".weight", StDtype::kF8E4M3, {H, I}, w.down_e4m3, shard);
      add(down + ".weight_scale_inv", StDtype::kF32, {H / 128, I / 128}, span_of(w.down_scale), shard);
    } else {
      const auto gu = span_of(w.gate_up_bf16);
      const size_t half = gu.size() / 2;
      add(gate + ".weight", StDtype::kBF16, {I, H}, gu.subspan(0, half), shard);
      add(up + ".weight", StDtype::kBF16, {I, H}, gu.subspan(half), shard);
      add(down + ".weight", StDtype::kBF16, {H, I}, span_of(w.down_bf16), shard);
    }
  }

  // Layer `layer` of lw's experts, shared expert and router: experts 0..E/2-1 and the router go to
  // shard 1, the rest, the shared expert and the bias to shard 2.
  void add_layer(const MoeConfig& cfg, const LayerWeights& lw, int64_t at_layer, bool gate_f32 = false) {
    layer = at_layer;
    const std::string m = moe();
    for (size_t e = 0; e < lw.experts.size(); ++e)
      add_expert(m + "experts." + std::to_string(lw.first_expert + int64_t(e)) + ".", lw.experts[e],
                 int64_t(e) < cfg.num_experts / 2 ? 1 : 2);
    if (!lw.shared.empty()) add_expert(m + "shared_experts.", lw.shared[0], 2);
    if (gate_f32) {
      add(m + "gate.weight", StDtype::kF32, {cfg.num_experts, cfg.hidden}, span_of(lw.gate), 1);
    } else {
      const auto g = to_bf16(lw.gate);
      add(m + "gate.weight", StDtype::kBF16, {cfg.num_experts, cfg.hidden}, span_of(g), 1);
    }
    if (!lw.gate_bias.empty())
      add(m + "gate.e_score_correction_bias", StDtype::kF32, {cfg.num_experts}, span_of(lw.gate_bias), 2);
    // Some other tensor of the layer, as real shards hold attention weights beside the MoE.
    const std::vector<float> norm(16, 1.0f);
    add("model.layers." + std::to_string(layer) + ".input_layernorm.weight", StDtype::kF32, {16}, span_of(norm), 1);
  }

  // A checkpoint of one layer.
  static FakeCheckpoint from(const MoeConfig& cfg, const LayerWeights& lw, bool gate_f32 = false,
                             TensorNaming naming = TensorNaming::mlp(), int64_t layer = 3) {
    FakeCheckpoint c;
    c.naming = naming;
    c.add_layer(cfg, lw, layer, gate_f32);
    return c;
  }

  static std::string shard_name(int shard) { return "model-0000" + std::to_string(shard) + "-of-00002.safetensors"; }

  // With an index: two shards and model.safetensors.index.json; without: one model.safetensors.
  void write(const std::string& dir, bool with_index = true) const {
    std::map<int, SafetensorsWriter> writers;
    for (const auto& [name, t] : tensors) writers[with_index ? shard_of.at(name) : 0].add(name, t.dtype, t.shape, t.bytes);
    if (!with_index) {
      writers[0].write(dir + "/model.safetensors");
      return;
    }
    for (const auto& [shard, w] : writers) w.write(dir + "/" + shard_name(shard));
    std::string index = "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {";
    bool first = true;
    for (const auto& [name, shard] : shard_of) {
      index += (first ? "\n  \"" : ",\n  \"") + name + "\": \"" + shard_name(shard) + "\"";
      first = false;
    }
    index += "\n}}\n";
    std::ofstream(dir + "/model.safetensors.index.json") << index;
  }
};

// MXFP4 test data: a [rows, cols] weight as a checkpoint stores it (packed e2m1 pairs, element 2j
// of a row in the low nibble of byte j; one ue8m0 scale per 32 elements of a row) and its values,
// decoded here independently of src/engine/weights.cpp: the eight e2m1 magnitudes and ldexp.
struct Mxfp4Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> packed, scales;

  // Random nibbles (every code, +-0 included) and scale codes in [118, 130] (2^-9 .. 2^3).
  static Mxfp4Matrix random(int64_t rows, int64_t cols, uint64_t seed) {
    Mxfp4Matrix m;
    m.rows = rows;
    m.cols = cols;
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    const auto next = [&x] {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      return x;
    };
    m.packed.resize(size_t(rows * cols / 2));
    m.scales.resize(size_t(rows * cols / 32));
    for (uint8_t& b : m.packed) b = uint8_t(next());
    for (uint8_t& s : m.scales) s = uint8_t(118 + next() % 13);
    return m;
  }

  static float e2m1_value(uint8_t nibble) {
    static const float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float v = kMagnitude[nibble & 7];
    return (nibble & 8) ? -v : v;
  }

  // The values in bf16: exact by construction (2 significant bits), checked.
  std::vector<bf16> decoded() const {
    std::vector<bf16> out(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t byte = packed[size_t(r * cols / 2 + c / 2)];
        const uint8_t nibble = c % 2 == 0 ? uint8_t(byte & 0x0F) : uint8_t(byte >> 4);
        const float v = std::ldexp(e2m1_value(nibble), int(scales[size_t(r * cols / 32 + c / 32)]) - 127);
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        if ((bits & 0xFFFFu) != 0) throw std::logic_error("Mxfp4Matrix: a value not exact in bf16");
        out[size_t(r * cols + c)].bits = uint16_t(bits >> 16);
      }
    return out;
  }
};

// One layer of MXFP4 experts (routed and shared) under `naming`, as DeepSeek-V4 stores them:
// `<proj>.weight` packed values and `<proj>.scale` ue8m0 scales; the gate weights U8 with F8_E8M0
// scales, the up weights I8 with F8_E8M0 scales, the down weights U8 with U8 scales (every dtype
// the loader accepts). The router is synthetic_weights(cfg, kBf16, seed)'s. Returns the checkpoint
// and, in `expected`, the layer as the loader must give it (bf16, the values decoded here).
inline FakeCheckpoint mxfp4_checkpoint(const MoeConfig& cfg, uint64_t seed, int64_t layer, LayerWeights& expected,
                                       TensorNaming naming = TensorNaming::mlp()) {
  FakeCheckpoint c;
  c.naming = naming;
  expected = synthetic_weights(cfg, WeightFormat::kBf16, seed, 0, cfg.num_experts);
  c.add_layer(cfg, expected, layer);  // the router and the bias; the experts are replaced below
  const int64_t H = cfg.hidden;
  uint64_t salt = seed * 1000;
  const auto add_expert = [&](const std::string& prefix, int64_t I, ExpertWeights& w, int shard) {
    const Mxfp4Matrix gate = Mxfp4Matrix::random(I, H, ++salt), up = Mxfp4Matrix::random(I, H, ++salt),
                      down = Mxfp4Matrix::random(H, I, ++salt);
    const auto put = [&](const std::string& proj, const Mxfp4Matrix& m, StDtype wd, StDtype sd) {
      c.erase(prefix + proj + ".weight_scale_inv");
      c.add(prefix + proj + ".weight", wd, {m.rows, m.cols / 2}, m.packed, shard);
      c.add(prefix + proj + ".scale", sd, {m.rows, m.cols / 32}, m.scales, shard);
    };
    put(c.naming.gate, gate, StDtype::kU8, StDtype::kF8E8M0);
    put(c.naming.up, up, StDtype::kI8, StDtype::kF8E8M0);
    put(c.naming.down, down, StDtype::kU8, StDtype::kU8);
    w.format = WeightFormat::kBf16;
    w.gate_up_bf16 = gate.decoded();
    const std::vector<bf16> u = up.decoded();
    w.gate_up_bf16.insert(w.gate_up_bf16.end(), u.begin(), u.end());
    w.down_bf16 = down.decoded();
  };
  const std::string m = c.moe();
  for (int64_t e = 0; e < cfg.num_experts; ++e)
    add_expert(m + "experts." + std::to_string(e) + ".", cfg.intermediate, expected.experts[size_t(e)],
               e < cfg.num_experts / 2 ? 1 : 2);
  if (cfg.num_shared > 0) add_expert(m + "shared_experts.", cfg.intermediate * cfg.num_shared, expected.shared[0], 2);
  return c;
}

// e4m3 decoded here independently of src/: sign, 4 exponent bits (bias 7), 3 mantissa bits,
// subnormals below exponent 1; 0x7F / 0xFF are NaN (never generated by the tests).
inline float e4m3_value_ref(uint8_t c) {
  const int e = (c >> 3) & 0xF, m = c & 7;
  const float v = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + float(m) / 8.0f, e - 7);
  return (c & 0x80) ? -v : v;
}

// One layer of DeepSeek-V4 as its checkpoints store it, under its own names
// (deepseek_v4_own_tensor_names): routed experts MXFP4 (I8 packed values, F8_E8M0 scales per 32),
// the shared expert e4m3 with F8_E8M0 128 x 128 block scales, the router BF16 and its correction
// bias F32 (synthetic_weights(cfg, kBf16, seed)'s). `expected`: the layer as the loader must give
// it, every expert bf16, decoded here.
inline FakeCheckpoint deepseek_v4_checkpoint(const MoeConfig& cfg, uint64_t seed, int64_t layer,
                                             LayerWeights& expected) {
  FakeCheckpoint c;
  expected = synthetic_weights(cfg, WeightFormat::kBf16, seed, 0, cfg.num_experts);
  const std::string ffn = "layers." + std::to_string(layer) + ".ffn.";
  const int64_t H = cfg.hidden;
  uint64_t salt = seed * 1000 + 7;
  for (int64_t e = 0; e < cfg.num_experts; ++e) {
    const std::string prefix = ffn + "experts." + std::to_string(e) + ".";
    const int64_t I = cfg.intermediate;
    const Mxfp4Matrix gate = Mxfp4Matrix::random(I, H, ++salt), up = Mxfp4Matrix::random(I, H, ++salt),
                      down = Mxfp4Matrix::random(H, I, ++salt);
    for (const auto& [proj, m] : {std::pair<const char*, const Mxfp4Matrix*>{"w1", &gate}, {"w3", &up}, {"w2", &down}}) {
      c.add(prefix + proj + ".weight", StDtype::kI8, {m->rows, m->cols / 2}, m->packed, 1);
      c.add(prefix + proj + ".scale", StDtype::kF8E8M0, {m->rows, m->cols / 32}, m->scales, 1);
    }
    ExpertWeights& w = expected.experts[size_t(e)];
    w.gate_up_bf16 = gate.decoded();
    const std::vector<bf16> u = up.decoded();
    w.gate_up_bf16.insert(w.gate_up_bf16.end(), u.begin(), u.end());
    w.down_bf16 = down.decoded();
  }
  if (cfg.num_shared > 0) {
    const int64_t Is = cfg.intermediate * cfg.num_shared;
    ExpertWeights& w = expected.shared[0];
    w.gate_up_bf16.clear();
    w.down_bf16.clear();
    uint64_t x = seed * 0x2545F4914F6CDD1Dull + 3;
    const auto next = [&x] {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      return x;
    };
    for (const auto& [proj, rows, cols] : {std::tuple<const char*, int64_t, int64_t>{"w1", Is, H}, {"w3", Is, H},
                                           {"w2", H, Is}}) {
      std::vector<uint8_t> codes(size_t(rows * cols)), scales(size_t((rows / 128) * (cols / 128)));
      for (uint8_t& v : codes) {
        v = uint8_t(next());
        if ((v & 0x7F) == 0x7F) v ^= 1;  // no NaN
      }
      for (uint8_t& v : scales) v = uint8_t(118 + next() % 13);
      c.add(ffn + "shared_experts." + proj + ".weight", StDtype::kF8E4M3, {rows, cols}, codes, 2);
      c.add(ffn + "shared_experts." + proj + ".scale", StDtype::kF8E8M0, {rows / 128, cols / 128}, scales, 2);
      std::vector<bf16>& out = std::string(proj) == "w2" ? w.down_bf16 : w.gate_up_bf16;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < cols; ++k) {
          const float v = std::ldexp(e4m3_value_ref(codes[size_t(r * cols + k)]),
                                     int(scales[size_t((r / 128) * (cols / 128) + k / 128)]) - 127);
          uint32_t bits;
          std::memcpy(&bits, &v, 4);
          if ((bits & 0xFFFFu) != 0) throw std::logic_error("deepseek_v4_checkpoint: a value not exact in bf16");
          out.push_back(bf16{uint16_t(bits >> 16)});
        }
    }
  }
  const auto g = to_bf16(expected.gate);
  c.add(ffn + "gate.weight", StDtype::kBF16, {cfg.num_experts, H}, span_of(g), 1);
  if (!expected.gate_bias.empty())
    c.add(ffn + "gate.bias", StDtype::kF32, {cfg.num_experts}, span_of(expected.gate_bias), 2);
  return c;
}

// A small DeepSeek-V4 config.json (H 256, I 128, 8 experts, top-2, one shared expert).
inline const char* kSmallDeepseekV4ConfigJson = R"({"model_type": "deepseek_v4", "hidden_size": 256,
  "moe_intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
  "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.5, "norm_topk_prob": true, "swiglu_limit": 10.0})";

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

// small_config()'s checkpoint: config.json and one model.safetensors with the synthetic weights of
// each layer (layer -> weight seed), e4m3 with block scales (as DeepSeek-V3 ships them) or bf16 (as
// Qwen3-MoE and most MoE models do).
inline void write_checkpoint(const std::filesystem::path& dir, const std::map<int64_t, uint64_t>& layer_seeds,
                             WeightFormat format = WeightFormat::kE4m3) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "config.json") << kSmallConfigJson;
  const MoeConfig cfg = small_config();
  FakeCheckpoint ckpt;
  for (const auto& [layer, seed] : layer_seeds)
    ckpt.add_layer(cfg, synthetic_weights(cfg, format, seed, 0, cfg.num_experts), layer);
  ckpt.write(dir.string(), /*with_index=*/false);
}

}  // namespace moefq::test
