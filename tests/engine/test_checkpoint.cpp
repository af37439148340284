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
  first.dtype = StDtype::kU8;
  EXPECT_HAS(load_error(), "dtype U8, expected F8_E4M3 (with weight_scale_inv) or BF16");
  auto& zero = ckpt_.tensors.at(ckpt_.moe() + "experts.0.gate_proj.weight");
  zero.dtype = StDtype::kU8;
  ckpt_.write(dir_.str());
  {
    const std::string msg = error_of([&] { checkpoint_weight_format(dir_.str(), ckpt_.layer, cfg_); });
    EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.0.gate_proj.weight in ");
    EXPECT_HAS(msg, "dtype U8, expected F8_E4M3 (with weight_scale_inv) or BF16");
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

}  // namespace
}  // namespace moefq
