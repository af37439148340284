// The checkpoint loader: one MoE layer of each tensor naming (DeepSeek-V3 / Kimi-K2 / GLM-4.5 /
// Qwen3-MoE / OLMoE under mlp, Mixtral under block_sparse_moe with w1/w3/w2), e4m3 with block
// scales and bf16, loaded bit for bit from checkpoints the tests write, every error path included.
#include "moefq/checkpoint.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "checkpoint_test_util.h"
#include "moefq/errors.h"
#include "moefq/safetensors.h"
#include "test_util.h"
#include "weights_test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using test::bytes_equal;
using test::error_of;
using test::expect_layers_equal;
using test::FakeCheckpoint;
using test::TensorNaming;

MoeConfig small_config(bool noaux_tc = true) { return test::small_weights_config(noaux_tc); }

// A fresh directory, removed at the end of the test.
struct TempDir : test::TempDir {
  TempDir() : test::TempDir("moefq_checkpoint_") {}
};

// ---------------------------------------------------------------------------------------------
// A DeepSeek-V3-format checkpoint: every error path

class Loader : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg_ = small_config();
    all_ = synthetic_weights(cfg_, WeightFormat::kE4m3, 2024, 0, cfg_.num_experts);
    ckpt_ = FakeCheckpoint::from(cfg_, all_);
  }
  // The synthetic weights of experts [first, first + n) (what the loader must reproduce).
  LayerWeights expected(int64_t first, int64_t n) const {
    return synthetic_weights(cfg_, WeightFormat::kE4m3, 2024, first, n);
  }
  std::string load_error(int64_t first = 2, int64_t n = 2) {
    ckpt_.write(dir_.str());
    return error_of([&] { load_checkpoint_layer(dir_.str(), ckpt_.layer, cfg_, first, n); });
  }

  MoeConfig cfg_;
  LayerWeights all_;
  FakeCheckpoint ckpt_;
  TempDir dir_;
};

TEST_F(Loader, ShardedCheckpointLoadsBitIdentically) {
  ckpt_.write(dir_.str());
  ASSERT_TRUE(fs::exists(dir_.path() / FakeCheckpoint::shard_name(1)));
  ASSERT_TRUE(fs::exists(dir_.path() / FakeCheckpoint::shard_name(2)));
  const LayerWeights got = load_checkpoint_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2);
  expect_layers_equal(expected(2, 2), got);
  // And against the arrays written, directly: expert 3's down weight and scales.
  EXPECT_TRUE(bytes_equal(all_.experts[3].down_e4m3, got.experts[1].down_e4m3));
  EXPECT_TRUE(bytes_equal(all_.experts[3].gate_up_scale, got.experts[1].gate_up_scale));
  EXPECT_EQ(got.experts[0].format, WeightFormat::kE4m3);
  // Experts spanning both shards, and all of them.
  expect_layers_equal(expected(1, 2), load_checkpoint_layer(dir_.str(), ckpt_.layer, cfg_, 1, 2));
  expect_layers_equal(all_, load_checkpoint_layer(dir_.str(), ckpt_.layer, cfg_, 0, 4));
}

TEST_F(Loader, OnlyTheRequestedExpertsAreRead) {
  // Experts 0 and 1 are absent from the checkpoint: loading [2, 4) must not need them.
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
    for (const char* suffix : {".weight", ".weight_scale_inv"})
      for (int e = 0; e < 2; ++e) ckpt_.erase(ckpt_.moe() + "experts." + std::to_string(e) + "." + proj + suffix);
  ckpt_.write(dir_.str());
  expect_layers_equal(expected(2, 2), load_checkpoint_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2));
  EXPECT_HAS(error_of([&] { load_checkpoint_layer(dir_.str(), ckpt_.layer, cfg_, 0, 2); }),
             "missing tensor model.layers.3.mlp.experts.0.gate_proj.weight");
}

TEST_F(Loader, SingleFileCheckpoint) {
  ckpt_.write(dir_.str(), /*with_index=*/false);
  ASSERT_FALSE(fs::exists(dir_.path() / "model.safetensors.index.json"));
  expect_layers_equal(expected(2, 2), load_checkpoint_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2));
  ckpt_.tensors.erase(ckpt_.moe() + "experts.2.up_proj.weight_scale_inv");
  ckpt_.write(dir_.str(), false);
  const std::string msg =
      error_of([&] { load_checkpoint_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2); });
  EXPECT_HAS(msg, "missing tensor model.layers.3.mlp.experts.2.up_proj.weight_scale_inv");
  EXPECT_HAS(msg, "model.safetensors");
}

TEST_F(Loader, Bf16ExpertWeightsLoadAsBf16) {
  const LayerWeights b = synthetic_weights(cfg_, WeightFormat::kBf16, 77, 0, cfg_.num_experts);
  FakeCheckpoint::from(cfg_, b).write(dir_.str());
  const LayerWeights got = load_checkpoint_layer(dir_.str(), 3, cfg_, 2, 2);
  ASSERT_EQ(got.experts.size(), 2u);
  EXPECT_EQ(got.experts[0].format, WeightFormat::kBf16);
  EXPECT_EQ(got.shared[0].format, WeightFormat::kBf16);
  expect_layers_equal(synthetic_weights(cfg_, WeightFormat::kBf16, 77, 2, 2), got);
}

TEST_F(Loader, F32RouterIsAccepted) {
  FakeCheckpoint::from(cfg_, all_, /*gate_f32=*/true).write(dir_.str());
  const LayerWeights got = load_checkpoint_layer(dir_.str(), 3, cfg_, 0, 1);
  EXPECT_TRUE(bytes_equal(all_.gate, got.gate));
}

TEST_F(Loader, BiasIgnoredWithoutNoauxTc) {
  cfg_.noaux_tc = false;
  ckpt_.tensors.erase(ckpt_.moe() + "gate.e_score_correction_bias");
  ckpt_.shard_of.erase(ckpt_.moe() + "gate.e_score_correction_bias");
  ckpt_.write(dir_.str());
  const LayerWeights got = load_checkpoint_layer(dir_.str(), 3, cfg_, 0, 4);
  EXPECT_TRUE(got.gate_bias.empty());
  EXPECT_TRUE(bytes_equal(all_.gate, got.gate));
}

TEST_F(Loader, ErrorMissingTensor) {
  const std::string name = ckpt_.moe() + "experts.3.down_proj.weight";
  ckpt_.tensors.erase(name);
  ckpt_.shard_of.erase(name);
  const std::string msg = load_error();
  EXPECT_HAS(msg, "missing tensor " + name);
  EXPECT_HAS(msg, "model.safetensors.index.json");
}

TEST_F(Loader, ErrorMissingSharedExpert) {
  const std::string name = ckpt_.moe() + "shared_experts.gate_proj.weight_scale_inv";
  ckpt_.tensors.erase(name);
  ckpt_.shard_of.erase(name);
  EXPECT_HAS(load_error(), "missing tensor " + name);
}

TEST_F(Loader, ErrorTensorListedButAbsentFromShard) {
  // The index names shard 2 for a tensor the shard does not hold.
  const std::string name = ckpt_.moe() + "experts.2.gate_proj.weight";
  ckpt_.write(dir_.str());
  auto moved = ckpt_;
  moved.tensors.erase(name);
  std::map<int, SafetensorsWriter> writers;
  for (const auto& [n, t] : moved.tensors) writers[moved.shard_of.at(n)].add(n, t.dtype, t.shape, t.bytes);
  writers[2].write(dir_.str() + "/" + FakeCheckpoint::shard_name(2));
  const std::string msg =
      error_of([&] { load_checkpoint_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2); });
  EXPECT_HAS(msg, "tensor " + name);
  EXPECT_HAS(msg, FakeCheckpoint::shard_name(2));
}

TEST_F(Loader, ErrorWrongShape) {
  auto& t = ckpt_.tensors.at(ckpt_.moe() + "experts.2.up_proj.weight");
  t.shape = {256, 128};  // transposed: expected [I, H] = [128, 256]
  const std::string msg = load_error();
  EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.2.up_proj.weight");
  EXPECT_HAS(msg, "shape [256, 128], expected [128, 256]");
  EXPECT_HAS(msg, FakeCheckpoint::shard_name(2));
}

TEST_F(Loader, ErrorWrongScaleShape) {
  auto& t = ckpt_.tensors.at(ckpt_.moe() + "experts.3.down_proj.weight_scale_inv");
  t.shape = {1, 2};  // expected [H/128, I/128] = [2, 1]
  const std::string msg = load_error();
  EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.3.down_proj.weight_scale_inv");
  EXPECT_HAS(msg, "shape [1, 2], expected [2, 1]");
}

TEST_F(Loader, ErrorWrongRouterShape) {
  MoeConfig other = cfg_;
  other.num_experts = 8;  // the checkpoint's router has 4 rows
  ckpt_.write(dir_.str());
  const std::string msg = error_of([&] { load_checkpoint_layer(dir_.str(), 3, other, 2, 2); });
  EXPECT_HAS(msg, "tensor model.layers.3.mlp.gate.weight");
  EXPECT_HAS(msg, "shape [4, 256], expected [8, 256]");
}

TEST_F(Loader, ErrorWrongDtype) {
  auto& t = ckpt_.tensors.at(ckpt_.moe() + "experts.2.gate_proj.weight_scale_inv");
  t.dtype = StDtype::kBF16;  // same bytes, so shape [1, 2] of BF16 needs 4 bytes, not 8
  t.shape = {1, 4};
  {
    const std::string msg = load_error();
    EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.2.gate_proj.weight_scale_inv");
    EXPECT_HAS(msg, "dtype BF16, expected F32");
  }
  SetUp();
  auto& w = ckpt_.tensors.at(ckpt_.moe() + "experts.3.down_proj.weight");
  w.dtype = StDtype::kI8;
  {
    const std::string msg = load_error();
    EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.3.down_proj.weight");
    EXPECT_HAS(msg, "dtype I8, expected F8_E4M3");
  }
  SetUp();
  auto& first = ckpt_.tensors.at(ckpt_.moe() + "experts.2.gate_proj.weight");
  first.dtype = StDtype::kU8;  // packed bytes with no .scale beside them: not MXFP4
  EXPECT_HAS(load_error(), "dtype U8 with no model.layers.3.mlp.experts.2.gate_proj.scale beside it");
  EXPECT_HAS(load_error(), "the supported expert weight formats are e4m3");
  auto& zero = ckpt_.tensors.at(ckpt_.moe() + "experts.0.gate_proj.weight");
  zero.dtype = StDtype::kU8;
  ckpt_.write(dir_.str());
  {
    const std::string msg = error_of([&] { checkpoint_weight_format(dir_.str(), ckpt_.layer, cfg_); });
    EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.0.gate_proj.weight in ");
    EXPECT_HAS(msg, "dtype U8 with no model.layers.3.mlp.experts.0.gate_proj.scale beside it");
  }
  SetUp();
  auto& bias = ckpt_.tensors.at(ckpt_.moe() + "gate.e_score_correction_bias");
  bias.dtype = StDtype::kI32;
  {
    const std::string msg = load_error();
    EXPECT_HAS(msg, "tensor model.layers.3.mlp.gate.e_score_correction_bias");
    EXPECT_HAS(msg, "dtype I32, expected F32");
  }
}

// A format moefq does not read is refused before any data is read, named: by its dtype (F16, F32,
// F8_E5M2), or by the tensors beside the weight (NVFP4's F8_E4M3 weight_scale, GPTQ/AWQ's qweight,
// compressed-tensors' weight_packed).
TEST_F(Loader, UnsupportedFormatsAreRefusedByName) {
  const std::string w = ckpt_.moe() + "experts.0.gate_proj.weight";
  const auto refused = [&](const std::function<void()>& edit, const std::vector<std::string>& says) {
    SetUp();
    edit();
    ckpt_.write(dir_.str());
    for (const auto& f : {std::function<void()>([&] { checkpoint_stored_format(dir_.str(), ckpt_.layer, cfg_); }),
                          std::function<void()>([&] { check_checkpoint_layers(dir_.str(), {ckpt_.layer}, cfg_); })}) {
      const std::string msg = error_of(f);
      for (const std::string& s : says) EXPECT_HAS(msg, s);
      EXPECT_HAS(msg, "the supported expert weight formats are e4m3");
    }
  };
  // The same bytes reread: [128, 256] e4m3 codes are [128, 128] fp16 values or [128, 64] fp32 ones.
  const auto retype = [&](StDtype d, std::vector<int64_t> shape) {
    return [this, w, d, shape] {
      ckpt_.tensors.at(w).dtype = d;
      ckpt_.tensors.at(w).shape = shape;
    };
  };
  refused(retype(StDtype::kF16, {128, 128}), {w, "expert weights of dtype F16 (fp16) are not supported"});
  refused(retype(StDtype::kF32, {128, 64}), {"dtype F32 (fp32) are not supported"});
  refused(retype(StDtype::kF8E5M2, {128, 256}), {"dtype F8_E5M2 (fp8 e5m2) are not supported"});
  refused(
      [&] {
        ckpt_.tensors.at(w).dtype = StDtype::kU8;
        const std::vector<uint8_t> sc(size_t(128 * 256 / 16), 0x38);
        ckpt_.add(test::beside(w, ".weight_scale"), StDtype::kF8E4M3, {128, 256 / 16}, sc, 1);
      },
      {w, "NVFP4 expert weights"});
  refused(
      [&] {
        const std::vector<uint8_t> q(size_t(128 * 256 / 2), 0);
        ckpt_.erase(w);
        ckpt_.add(test::beside(w, ".qweight"), StDtype::kI32, {256 / 8, 128}, q, 1);
      },
      {"GPTQ/AWQ int4 expert weights (qweight, scales, qzeros) are not supported"});
  refused(
      [&] {
        const std::vector<uint8_t> q(size_t(128 * 256 / 2), 0);
        ckpt_.erase(w);
        ckpt_.add(test::beside(w, ".weight_packed"), StDtype::kI32, {128, 256 / 8}, q, 1);
      },
      {"compressed-tensors packed int4 expert weights are not supported"});
}

TEST_F(Loader, ErrorMixedFormats) {
  // Expert 2 in e4m3, expert 3 in bf16: one layer holds one format.
  const LayerWeights b = synthetic_weights(cfg_, WeightFormat::kBf16, 1, 3, 1);
  ckpt_.add_expert(ckpt_.moe() + "experts.3.", b.experts[0], 2);
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
    const std::string n = ckpt_.moe() + "experts.3." + proj + ".weight_scale_inv";
    ckpt_.tensors.erase(n);
    ckpt_.shard_of.erase(n);
  }
  EXPECT_HAS(load_error(), "tensor model.layers.3.mlp.experts.3.gate_proj.weight in");
  EXPECT_HAS(load_error(), "dtype BF16, expected F8_E4M3");
}

TEST_F(Loader, ErrorMissingShardFile) {
  ckpt_.write(dir_.str());
  fs::remove(dir_.path() / FakeCheckpoint::shard_name(2));
  const std::string msg =
      error_of([&] { load_checkpoint_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2); });
  EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.2.gate_proj.weight");
  EXPECT_HAS(msg, "shard file");
  EXPECT_HAS(msg, FakeCheckpoint::shard_name(2));
  EXPECT_HAS(msg, "no such file");
}

TEST_F(Loader, ErrorMalformedIndex) {
  ckpt_.write(dir_.str());
  const std::string index = (dir_.path() / "model.safetensors.index.json").string();
  auto load = [&] { return error_of([&] { load_checkpoint_layer(dir_.str(), 3, cfg_, 2, 2); }); };
  struct Case {
    const char* text;
    const char* expect;
  } cases[] = {
      {"{\"weight_map\": {", "not JSON"},
      {"[1, 2]", "top level is a JSON array"},
      {"{\"metadata\": {}}", "no \"weight_map\""},
      {"{\"weight_map\": [\"a\"]}", "\"weight_map\" is a JSON array"},
      {"{\"weight_map\": {\"model.layers.3.mlp.gate.weight\": 5}}",
       "entry \"model.layers.3.mlp.gate.weight\" is a JSON number"},
      {"{\"weight_map\": {\"x\": \"../elsewhere.safetensors\"}}", "not a file inside the directory"},
  };
  for (const auto& c : cases) {
    std::ofstream(index, std::ios::trunc) << c.text;
    const std::string msg = load();
    EXPECT_HAS(msg, "malformed checkpoint index");
    EXPECT_HAS(msg, c.expect);
    EXPECT_HAS(msg, "model.safetensors.index.json");
  }
}

TEST_F(Loader, ErrorNotACheckpointDirectory) {
  const std::string msg = error_of([&] { load_checkpoint_layer(dir_.str(), 3, cfg_, 0, 1); });
  EXPECT_HAS(msg, "neither model.safetensors.index.json nor model.safetensors");
}

TEST_F(Loader, ErrorBiasMissingWithNoauxTc) {
  ckpt_.tensors.erase(ckpt_.moe() + "gate.e_score_correction_bias");
  ckpt_.shard_of.erase(ckpt_.moe() + "gate.e_score_correction_bias");
  const std::string msg = load_error();
  EXPECT_HAS(msg, "missing tensor model.layers.3.mlp.gate.e_score_correction_bias");
  EXPECT_HAS(msg, "noaux_tc");
}

TEST_F(Loader, ErrorExpertRangeOutOfBounds) {
  EXPECT_HAS(load_error(3, 2), "expert range [3, 5)");
  EXPECT_HAS(load_error(3, 2), "outside the routed experts [0, 4)");
  EXPECT_HAS(load_error(-1, 2), "expert range [-1, 1)");
  EXPECT_HAS(load_error(0, -1), "expert range [0, -1)");
}

TEST_F(Loader, ErrorWrongLayer) {
  ckpt_.write(dir_.str());
  EXPECT_HAS(error_of([&] { load_checkpoint_layer(dir_.str(), 4, cfg_, 0, 1); }),
             "missing tensor model.layers.4.mlp.experts.0.gate_proj.weight");
}


// ---------------------------------------------------------------------------------------------
// Every architecture's naming

struct Arch {
  const char* model_type;
  TensorNaming naming;
  int64_t num_shared;
  bool noaux_tc;
};

const Arch kArchs[] = {
    {"", TensorNaming::mlp(), 1, true},           {"deepseek_v3", TensorNaming::mlp(), 1, true},
    {"kimi_k2", TensorNaming::mlp(), 1, true},    {"glm4_moe", TensorNaming::mlp(), 1, true},
    {"qwen3_moe", TensorNaming::mlp(), 0, false}, {"olmoe", TensorNaming::mlp(), 0, false},
    {"mixtral", TensorNaming::block_sparse_moe(), 0, false},
};

MoeConfig arch_config(const Arch& a) {
  MoeConfig c = small_config(a.noaux_tc);
  c.model_type = a.model_type;
  c.num_shared = a.num_shared;
  c.scoring = a.noaux_tc ? ScoringFunc::kSigmoid : ScoringFunc::kSoftmax;
  return c;
}

TEST(CheckpointNames, EveryArchitectureLoadsBitIdenticallyInBothFormats) {
  for (const Arch& a : kArchs) {
    for (const WeightFormat f : {WeightFormat::kE4m3, WeightFormat::kBf16}) {
      SCOPED_TRACE(std::string(a.model_type) + " " + weight_format_name(f));
      const MoeConfig cfg = arch_config(a);
      const LayerWeights all = synthetic_weights(cfg, f, 11, 0, cfg.num_experts);
      TempDir dir;
      FakeCheckpoint::from(cfg, all, false, a.naming, 5).write(dir.str());
      EXPECT_EQ(checkpoint_weight_format(dir.str(), 5, cfg), f);
      for (const auto& [first, n] : std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {1, 2}, {3, 1}})
        expect_layers_equal(synthetic_weights(cfg, f, 11, first, n), load_checkpoint_layer(dir.str(), 5, cfg, first, n));
      // The other naming's checkpoint is not this architecture's: the first tensor is missing.
      const bool mixtral = std::string(a.model_type) == "mixtral";
      TempDir other;
      FakeCheckpoint::from(cfg, all, false, mixtral ? TensorNaming::mlp() : TensorNaming::block_sparse_moe(), 5)
          .write(other.str());
      const std::string first = std::string("model.layers.5.") + (mixtral ? "block_sparse_moe.experts.0.w1.weight"
                                                                          : "mlp.experts.0.gate_proj.weight");
      EXPECT_HAS(error_of([&] { load_checkpoint_layer(other.str(), 5, cfg, 0, 1); }), "missing tensor " + first);
      EXPECT_HAS(error_of([&] { checkpoint_weight_format(other.str(), 5, cfg); }), "missing tensor " + first);
    }
  }
}

TEST(CheckpointNames, MixtralW1IsTheGateW3TheUpW2TheDown) {
  // Three bf16 matrices of distinct constants under Mixtral's names, written by hand.
  MoeConfig cfg = arch_config(kArchs[6]);
  cfg.num_experts = 2;
  const int64_t H = cfg.hidden, I = cfg.intermediate;
  const auto filled = [](int64_t n, float v) { return test::to_bf16(std::vector<float>(size_t(n), v)); };
  const auto w1 = filled(I * H, 1.0f), w3 = filled(I * H, 3.0f), w2 = filled(H * I, 2.0f);
  const auto gate = filled(cfg.num_experts * H, 0.5f);
  SafetensorsWriter w;
  for (int e = 0; e < 2; ++e) {
    const std::string p = "model.layers.0.block_sparse_moe.experts." + std::to_string(e) + ".";
    w.add(p + "w1.weight", StDtype::kBF16, {I, H}, test::span_of(w1));
    w.add(p + "w3.weight", StDtype::kBF16, {I, H}, test::span_of(w3));
    w.add(p + "w2.weight", StDtype::kBF16, {H, I}, test::span_of(w2));
  }
  w.add("model.layers.0.block_sparse_moe.gate.weight", StDtype::kBF16, {cfg.num_experts, H}, test::span_of(gate));
  TempDir dir;
  w.write(dir.str() + "/model.safetensors");
  const LayerWeights got = load_checkpoint_layer(dir.str(), 0, cfg, 0, 2);
  const std::vector<float> gu = got.experts[1].gate_up_f32(), down = got.experts[1].down_f32();
  EXPECT_EQ(gu.front(), 1.0f);                 // rows [0, I): the gate
  EXPECT_EQ(gu[size_t(I * H - 1)], 1.0f);
  EXPECT_EQ(gu[size_t(I * H)], 3.0f);          // rows [I, 2I): the up projection
  EXPECT_EQ(gu.back(), 3.0f);
  EXPECT_EQ(down.front(), 2.0f);
  EXPECT_EQ(got.gate.front(), 0.5f);
  EXPECT_TRUE(got.shared.empty());
  EXPECT_TRUE(got.gate_bias.empty());
}

TEST(CheckpointNames, TheNamesOfEachModelType) {
  MoeConfig cfg = small_config();
  for (const char* t : {"", "deepseek_v3", "kimi_k2", "glm4_moe", "qwen3_moe", "olmoe"}) {
    cfg.model_type = t;
    const LayerTensorNames n = layer_tensor_names(cfg, 7);
    EXPECT_EQ(n.expert_weight(12, n.up_proj), "model.layers.7.mlp.experts.12.up_proj.weight") << t;
    EXPECT_EQ(n.shared + n.down_proj, "model.layers.7.mlp.shared_experts.down_proj") << t;
    EXPECT_EQ(n.router, "model.layers.7.mlp.gate.weight") << t;
    EXPECT_EQ(n.bias, "model.layers.7.mlp.gate.e_score_correction_bias") << t;
  }
  cfg.model_type = "mixtral";
  const LayerTensorNames m = layer_tensor_names(cfg, 31);
  EXPECT_EQ(m.expert_weight(7, m.gate_proj), "model.layers.31.block_sparse_moe.experts.7.w1.weight");
  EXPECT_EQ(m.expert_weight(7, m.up_proj), "model.layers.31.block_sparse_moe.experts.7.w3.weight");
  EXPECT_EQ(m.expert_weight(7, m.down_proj), "model.layers.31.block_sparse_moe.experts.7.w2.weight");
  EXPECT_EQ(m.router, "model.layers.31.block_sparse_moe.gate.weight");
}

// ---------------------------------------------------------------------------------------------
// MXFP4 experts (DeepSeek-V4's per-expert layout): decoded to bf16 at load

// decode_mxfp4 on values chosen by hand: the low nibble is the even element, the sign is the
// nibble's high bit, the scale is 2^(code - 127), the smallest scale gives bf16 subnormals, the
// largest overflows to inf and 0xFF is NaN.
TEST(Mxfp4, DecodeNibbleOrderSignAndScale) {
  std::vector<uint8_t> packed(16 * 2, 0), scales = {128, 0, 254, 0xFF};
  packed[0] = 0x71;   // low 1: +0.5, high 7: +6 (row 0, scale 2)
  packed[1] = 0x9A;   // low 0xA: -1, high 0x9: -0.5
  packed[16] = 0x01;  // row 0, block 1 (scale 2^-127): 0.5 * 2^-127 = 2^-128
  const std::vector<bf16> a = decode_mxfp4(packed.data(), scales.data(), 1, 64);
  EXPECT_EQ(to_f32(a[0]), 1.0f);
  EXPECT_EQ(to_f32(a[1]), 12.0f);
  EXPECT_EQ(to_f32(a[2]), -2.0f);
  EXPECT_EQ(to_f32(a[3]), -1.0f);
  EXPECT_EQ(a[4].bits, 0x0000);
  EXPECT_EQ(a[32].bits, 0x0020);  // 2^-128: bf16 subnormal 32 * 2^-133
  EXPECT_EQ(a[33].bits, 0x0000);
  std::vector<uint8_t> big(16, 0x07);  // +6 everywhere
  std::vector<uint8_t> sc = {254};
  EXPECT_EQ(decode_mxfp4(big.data(), sc.data(), 1, 32)[0].bits, 0x7F80);  // 6 * 2^127: inf
  sc = {253};
  EXPECT_EQ(to_f32(decode_mxfp4(big.data(), sc.data(), 1, 32)[0]), std::ldexp(6.0f, 126));
  sc = {0xFF};
  EXPECT_TRUE(std::isnan(to_f32(decode_mxfp4(big.data(), sc.data(), 1, 32)[0])));
  EXPECT_EQ(stored_weight_bytes(StoredWeightFormat::kMxfp4, 1024.0), 512.0 + 32.0);
  EXPECT_EQ(stored_weight_bytes(StoredWeightFormat::kBf16, 1024.0), 2048.0);
  EXPECT_EQ(stored_weight_bytes(StoredWeightFormat::kE4m3, 16384.0), 16384.0 + 4.0);
}

// A layer of random MXFP4 experts (every code, U8/I8 weights, F8_E8M0/U8 scales) loads as the
// bf16 values the test decodes on its own, in both namings, sharded or not.
TEST(Mxfp4, CheckpointDecodesToTheExpectedBf16) {
  const MoeConfig cfg = small_config();
  for (const TensorNaming& naming : {TensorNaming::mlp(), TensorNaming::block_sparse_moe()}) {
    for (const bool with_index : {true, false}) {
      SCOPED_TRACE(naming.module + (with_index ? " sharded" : " single file"));
      MoeConfig c = cfg;
      if (naming.module == "block_sparse_moe") {
        c.model_type = "mixtral";
        c.num_shared = 0;
        c.noaux_tc = false;
      }
      LayerWeights expected;
      const FakeCheckpoint ckpt = test::mxfp4_checkpoint(c, 11, 3, expected, naming);
      TempDir dir;
      ckpt.write(dir.str(), with_index);
      EXPECT_EQ(checkpoint_stored_format(dir.str(), 3, c), StoredWeightFormat::kMxfp4);
      EXPECT_EQ(checkpoint_weight_format(dir.str(), 3, c), WeightFormat::kBf16);
      StoredWeightFormat stored = StoredWeightFormat::kE4m3;
      EXPECT_EQ(check_checkpoint_layers(dir.str(), {3}, c, &stored), WeightFormat::kBf16);
      EXPECT_EQ(stored, StoredWeightFormat::kMxfp4);
      const LayerWeights got = load_checkpoint_layer(dir.str(), 3, c, 1, 2);
      ASSERT_EQ(got.experts.size(), 2u);
      EXPECT_EQ(got.experts[0].format, WeightFormat::kBf16);
      LayerWeights want = expected;
      want.first_expert = 1;
      want.experts = {expected.experts[1], expected.experts[2]};
      expect_layers_equal(want, got);
      EXPECT_TRUE(bytes_equal(expected.experts[2].down_bf16, got.experts[1].down_bf16));
      // Not all zeros, and both signs: the data exercises the decode.
      int neg = 0, pos = 0;
      for (const bf16 v : got.experts[0].gate_up_bf16) (to_f32(v) < 0 ? neg : pos) += to_f32(v) != 0;
      EXPECT_GT(neg, 1000);
      EXPECT_GT(pos, 1000);
    }
  }
}

TEST(Mxfp4, BadScalesAreNamed) {
  const MoeConfig cfg = small_config();
  LayerWeights expected;
  const std::string s = "model.layers.3.mlp.experts.1.up_proj.scale";
  const auto error_with = [&](const std::function<void(FakeCheckpoint&)>& edit) {
    FakeCheckpoint ckpt = test::mxfp4_checkpoint(cfg, 5, 3, expected);
    edit(ckpt);
    TempDir dir;
    ckpt.write(dir.str());
    return error_of([&] { load_checkpoint_layer(dir.str(), 3, cfg, 0, cfg.num_experts); });
  };
  // A NaN scale (0xFF): named by the weight it scales.
  std::string msg = error_with([&](FakeCheckpoint& c) { c.tensors.at(s).bytes[5] = 0xFF; });
  EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.1.up_proj.weight");
  EXPECT_HAS(msg, "must be finite");
  // A scale that overflows bf16 (6 * 2^127).
  msg = error_with([&](FakeCheckpoint& c) {
    c.tensors.at(s).bytes[0] = 254;
    c.tensors.at("model.layers.3.mlp.experts.1.up_proj.weight").bytes[0] = 0x77;
  });
  EXPECT_HAS(msg, "must be finite");
  // Scales of the wrong shape or dtype, and missing scales after the first expert set the format.
  msg = error_with([&](FakeCheckpoint& c) { c.tensors.at(s).shape = {256, 4}; });
  EXPECT_HAS(msg, "tensor " + s);
  EXPECT_HAS(msg, "shape [256, 4], expected [128, 8]");
  msg = error_with([&](FakeCheckpoint& c) { c.tensors.at(s).dtype = StDtype::kI8; });
  EXPECT_HAS(msg, "dtype I8, expected F8_E8M0 or U8");
  msg = error_with([&](FakeCheckpoint& c) { c.erase(s); });
  EXPECT_HAS(msg, "missing tensor " + s + " (ue8m0 scales of an mxfp4 expert weight)");
  // A weight of the wrong packed shape.
  msg = error_with([&](FakeCheckpoint& c) { c.tensors.at("model.layers.3.mlp.experts.1.up_proj.weight").shape = {64, 256}; });
  EXPECT_HAS(msg, "shape [64, 256], expected [128, 128]");
}

// DeepSeek-V4 as its checkpoints store it: its own names, MXFP4 routed experts (I8 values, F8_E8M0
// scales per 32) and an e4m3 shared expert with F8_E8M0 block scales, all held as bf16, every value
// as the test decodes it on its own.
TEST(DeepseekV4, OwnNamesMxfp4RoutedAndE4m3SharedLoadAsBf16) {
  MoeConfig cfg = small_config();
  cfg.model_type = "deepseek_v4";
  LayerWeights expected;
  const FakeCheckpoint ckpt = test::deepseek_v4_checkpoint(cfg, 17, 4, expected);
  TempDir dir;
  ckpt.write(dir.str());
  EXPECT_EQ(deepseek_v4_own_tensor_names(4).expert_weight(2, "w3"), "layers.4.ffn.experts.2.w3.weight");
  EXPECT_EQ(checkpoint_stored_format(dir.str(), 4, cfg), StoredWeightFormat::kMxfp4);
  StoredWeightFormat stored = StoredWeightFormat::kE4m3;
  EXPECT_EQ(check_checkpoint_layers(dir.str(), {4}, cfg, &stored), WeightFormat::kBf16);
  EXPECT_EQ(stored, StoredWeightFormat::kMxfp4);
  const LayerWeights got = load_checkpoint_layer(dir.str(), 4, cfg, 0, cfg.num_experts);
  ASSERT_EQ(got.shared.size(), 1u);
  EXPECT_EQ(got.shared[0].format, WeightFormat::kBf16);
  EXPECT_TRUE(got.shared[0].gate_up_e4m3.empty());
  expect_layers_equal(expected, got);
  // A rank without routed experts of its own still holds the shared expert as bf16.
  EXPECT_EQ(load_checkpoint_layer(dir.str(), 4, cfg, 1, 0).shared[0].format, WeightFormat::kBf16);
  // Under another model_type the Hugging Face names are looked for, and named as missing.
  MoeConfig v3 = cfg;
  v3.model_type = "deepseek_v3";
  EXPECT_HAS(error_of([&] { load_checkpoint_layer(dir.str(), 4, v3, 0, 1); }),
             "missing tensor model.layers.4.mlp.experts.0.gate_proj.weight");
}

// A hash-routed layer (DeepSeek-V4's first layers: a gate.tid2eid table) is refused by name.
TEST(DeepseekV4, HashRoutedLayerIsRefused) {
  MoeConfig cfg = small_config();
  cfg.model_type = "deepseek_v4";
  LayerWeights expected;
  FakeCheckpoint ckpt = test::deepseek_v4_checkpoint(cfg, 3, 0, expected);
  const std::vector<int32_t> table(64 * 2, 1);
  ckpt.add("layers.0.ffn.gate.tid2eid", StDtype::kI32, {64, 2}, test::span_of(table), 1);
  TempDir dir;
  ckpt.write(dir.str());
  for (const auto& f : {std::function<void()>([&] { load_checkpoint_layer(dir.str(), 0, cfg, 0, 1); }),
                        std::function<void()>([&] { check_checkpoint_layers(dir.str(), {0}, cfg); })}) {
    const std::string msg = error_of(f);
    EXPECT_HAS(msg, "tensor layers.0.ffn.gate.tid2eid");
    EXPECT_HAS(msg, "routes its tokens by token id");
  }
}

}  // namespace
}  // namespace moefq
