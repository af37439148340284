// Expert weights: exact dequantization, the seeded synthetic generator (determinism per global
// expert id, value distributions) and the DeepSeek-V3-format checkpoint loader, checked against
// checkpoints the tests write themselves, every error path included.
#include "moefq/weights.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "moefq/errors.h"
#include "moefq/safetensors.h"
#include "test_util.h"
#include "weights_test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using test::bytes_equal;
using test::expect_same_expert;

// The message of the moefq::Error that f throws ("" when it throws none).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

MoeConfig small_config(bool noaux_tc = true) { return test::small_weights_config(noaux_tc); }

// A fresh directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("moefq_weights_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// ---------------------------------------------------------------------------------------------
// Dequantization

// Independent oracle: the product of an e4m3 value (4 significant bits) and a binary32 scale is
// exact in binary64, so one rounding to binary32 gives the correctly rounded product.
float product_ref(uint8_t code, float scale) { return float(double(e4m3_decode(code)) * double(scale)); }

TEST(Dequant, E4m3BlocksHandBuilt) {
  ExpertWeights w;
  w.hidden = 256;
  w.intermediate = 128;  // gate_up [256, 256] -> scales [2, 2]; down [256, 128] -> scales [2, 1]
  w.format = WeightFormat::kE4m3;
  w.gate_up_e4m3.resize(256 * 256);
  for (size_t i = 0; i < w.gate_up_e4m3.size(); ++i) {
    const uint8_t c = uint8_t((i * 37) & 0xFF);
    w.gate_up_e4m3[i] = (c & 0x7F) == 0x7F ? 0x38 : c;  // no NaN codes
  }
  w.gate_up_scale = {1.0f, 2.0f, 0.1f, 3.0e-3f};
  w.down_e4m3.resize(256 * 128);
  for (size_t i = 0; i < w.down_e4m3.size(); ++i) w.down_e4m3[i] = uint8_t(i % 2 ? 0x7E : 0xB8);
  w.down_scale = {0.25f, 1.0e-3f};

  // Hand-checked elements: code 0x38 = 1.0, 0x40 = 2.0, 0x7E = 448, 0xB8 = -1.0, 0x01 = 2^-9.
  w.gate_up_e4m3[0] = 0x38;               // block (0, 0), scale 1
  w.gate_up_e4m3[200] = 0x40;             // block (0, 1), scale 2
  w.gate_up_e4m3[130 * 256 + 5] = 0x7E;   // block (1, 0), scale 0.1
  w.gate_up_e4m3[255 * 256 + 255] = 0x01; // block (1, 1), scale 3e-3
  const std::vector<float> gu = w.gate_up_f32();
  ASSERT_EQ(gu.size(), 256u * 256u);
  EXPECT_EQ(gu[0], 1.0f);
  EXPECT_EQ(gu[200], 4.0f);
  EXPECT_EQ(gu[130 * 256 + 5], 448.0f * 0.1f);
  EXPECT_EQ(gu[255 * 256 + 255], 0x1p-9f * 3.0e-3f);
  for (int64_t r = 0; r < 256; ++r)
    for (int64_t c = 0; c < 256; ++c) {
      const float s = w.gate_up_scale[size_t((r / 128) * 2 + c / 128)];
      ASSERT_EQ(f32_bits(gu[size_t(r * 256 + c)]), f32_bits(product_ref(w.gate_up_e4m3[size_t(r * 256 + c)], s)))
          << "gate_up[" << r << ", " << c << "]";
    }

  const std::vector<float> dn = w.down_f32();
  ASSERT_EQ(dn.size(), 256u * 128u);
  EXPECT_EQ(dn[0], -0.25f);
  EXPECT_EQ(dn[1], 112.0f);
  EXPECT_EQ(dn[128 * 128], -1.0e-3f);
  EXPECT_EQ(dn[128 * 128 + 1], 448.0f * 1.0e-3f);
}

TEST(Dequant, Bf16IsExact) {
  ExpertWeights w;
  w.hidden = 128;
  w.intermediate = 128;
  w.format = WeightFormat::kBf16;
  w.gate_up_bf16.resize(256 * 128);
  w.down_bf16.resize(128 * 128);
  for (size_t i = 0; i < w.gate_up_bf16.size(); ++i) w.gate_up_bf16[i].bits = uint16_t(i * 7919);
  for (size_t i = 0; i < w.down_bf16.size(); ++i) w.down_bf16[i].bits = uint16_t(0x3F80 + i);
  const auto gu = w.gate_up_f32();
  const auto dn = w.down_f32();
  ASSERT_EQ(gu.size(), w.gate_up_bf16.size());
  ASSERT_EQ(dn.size(), w.down_bf16.size());
  for (size_t i = 0; i < gu.size(); ++i) {
    const uint32_t want = uint32_t(w.gate_up_bf16[i].bits) << 16;
    if (is_nan(gu[i])) {
      ASSERT_TRUE(((want >> 23) & 0xFF) == 0xFF && (want & 0x7FFFFF) != 0) << i;
    } else {
      ASSERT_EQ(f32_bits(gu[i]), want) << i;
    }
  }
  EXPECT_EQ(dn[0], 1.0f);
  EXPECT_EQ(dn[1], 1.0f + 0x1p-7f);
}

TEST(Dequant, InconsistentShapesAreCaught) {
  ExpertWeights w;
  w.hidden = 256;
  w.intermediate = 128;
  w.gate_up_e4m3.resize(256 * 256);
  w.gate_up_scale.resize(3);  // should be [2, 2]
  w.down_e4m3.resize(100);    // should be [256, 128]
  w.down_scale.resize(2);
  EXPECT_HAS(error_of([&] { w.gate_up_f32(); }), "block scales");
  EXPECT_HAS(error_of([&] { w.down_f32(); }), "e4m3 codes");
  w.format = WeightFormat::kBf16;
  EXPECT_HAS(error_of([&] { w.down_f32(); }), "bf16 values");
}

// ---------------------------------------------------------------------------------------------
// Checkpoint loading

template <typename T>
std::span<const uint8_t> as_bytes(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

struct Tensor {
  StDtype dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// A DeepSeek-V3-format checkpoint of one layer, built from synthetic weights and editable before
// it is written (to produce each kind of bad checkpoint).
struct FakeCheckpoint {
  int64_t layer = 3;
  std::map<std::string, Tensor> tensors;
  std::map<std::string, int> shard_of;  // tensor name -> shard number

  std::string mlp() const { return "model.layers." + std::to_string(layer) + ".mlp."; }

  void add(const std::string& name, StDtype dtype, std::vector<int64_t> shape,
           std::span<const uint8_t> bytes, int shard) {
    tensors[name] = {dtype, std::move(shape), std::vector<uint8_t>(bytes.begin(), bytes.end())};
    shard_of[name] = shard;
  }

  // Splits gate_up into gate and up (rows and scale rows), as the checkpoints store them.
  void add_expert(const std::string& prefix, const ExpertWeights& w, int shard) {
    const int64_t H = w.hidden, I = w.intermediate;
    if (w.format == WeightFormat::kE4m3) {
      const auto gu = std::span<const uint8_t>(w.gate_up_e4m3);
      const auto gus = as_bytes(w.gate_up_scale);
      const size_t half = size_t(I * H), shalf = gus.size() / 2;
      add(prefix + "gate_proj.weight", StDtype::kF8E4M3, {I, H}, gu.subspan(0, half), shard);
      add(prefix + "up_proj.weight", StDtype::kF8E4M3, {I, H}, gu.subspan(half), shard);
      add(prefix + "gate_proj.weight_scale_inv", StDtype::kF32, {I / 128, H / 128},
          gus.subspan(0, shalf), shard);
      add(prefix + "up_proj.weight_scale_inv", StDtype::kF32, {I / 128, H / 128}, gus.subspan(shalf),
          shard);
      add(prefix + "down_proj.weight", StDtype::kF8E4M3, {H, I}, w.down_e4m3, shard);
      add(prefix + "down_proj.weight_scale_inv", StDtype::kF32, {H / 128, I / 128},
          as_bytes(w.down_scale), shard);
    } else {
      const auto gu = as_bytes(w.gate_up_bf16);
      const size_t half = gu.size() / 2;
      add(prefix + "gate_proj.weight", StDtype::kBF16, {I, H}, gu.subspan(0, half), shard);
      add(prefix + "up_proj.weight", StDtype::kBF16, {I, H}, gu.subspan(half), shard);
      add(prefix + "down_proj.weight", StDtype::kBF16, {H, I}, as_bytes(w.down_bf16), shard);
    }
  }

  // Experts 0..E/2-1 and the router go to shard 1, the rest, the shared expert and the bias to 2.
  static FakeCheckpoint from(const MoeConfig& cfg, const LayerWeights& lw, bool gate_f32 = false) {
    FakeCheckpoint c;
    const std::string mlp = c.mlp();
    for (size_t e = 0; e < lw.experts.size(); ++e)
      c.add_expert(mlp + "experts." + std::to_string(lw.first_expert + int64_t(e)) + ".",
                   lw.experts[e], int64_t(e) < cfg.num_experts / 2 ? 1 : 2);
    if (!lw.shared.empty()) c.add_expert(mlp + "shared_experts.", lw.shared[0], 2);
    if (gate_f32) {
      c.add(mlp + "gate.weight", StDtype::kF32, {cfg.num_experts, cfg.hidden}, as_bytes(lw.gate), 1);
    } else {
      const auto g = test::to_bf16(lw.gate);
      c.add(mlp + "gate.weight", StDtype::kBF16, {cfg.num_experts, cfg.hidden}, as_bytes(g), 1);
    }
    if (!lw.gate_bias.empty())
      c.add(mlp + "gate.e_score_correction_bias", StDtype::kF32, {cfg.num_experts},
            as_bytes(lw.gate_bias), 2);
    // Some other tensor of the layer, as real shards hold attention weights beside the MoE.
    const std::vector<float> norm(16, 1.0f);
    c.add("model.layers." + std::to_string(c.layer) + ".input_layernorm.weight", StDtype::kF32,
          {16}, as_bytes(norm), 1);
    return c;
  }

  static std::string shard_name(int shard) {
    return "model-0000" + std::to_string(shard) + "-of-00002.safetensors";
  }

  // With an index: two shards and model.safetensors.index.json; without: one model.safetensors.
  void write(const std::string& dir, bool with_index = true) const {
    std::map<int, SafetensorsWriter> writers;
    for (const auto& [name, t] : tensors)
      writers[with_index ? shard_of.at(name) : 0].add(name, t.dtype, t.shape, t.bytes);
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

void expect_layers_equal(const LayerWeights& want, const LayerWeights& got) {
  EXPECT_EQ(want.first_expert, got.first_expert);
  ASSERT_EQ(want.experts.size(), got.experts.size());
  for (size_t e = 0; e < want.experts.size(); ++e) {
    SCOPED_TRACE("expert " + std::to_string(want.first_expert + int64_t(e)));
    expect_same_expert(want.experts[e], got.experts[e]);
  }
  ASSERT_EQ(want.shared.size(), got.shared.size());
  if (!want.shared.empty()) expect_same_expert(want.shared[0], got.shared[0]);
  EXPECT_TRUE(bytes_equal(want.gate, got.gate));
  EXPECT_TRUE(bytes_equal(want.gate_bias, got.gate_bias));
}

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
    return error_of([&] { load_deepseek_layer(dir_.str(), ckpt_.layer, cfg_, first, n); });
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
  const LayerWeights got = load_deepseek_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2);
  expect_layers_equal(expected(2, 2), got);
  // And against the arrays written, directly: expert 3's down weight and scales.
  EXPECT_TRUE(bytes_equal(all_.experts[3].down_e4m3, got.experts[1].down_e4m3));
  EXPECT_TRUE(bytes_equal(all_.experts[3].gate_up_scale, got.experts[1].gate_up_scale));
  EXPECT_EQ(got.experts[0].format, WeightFormat::kE4m3);
  // Experts spanning both shards, and all of them.
  expect_layers_equal(expected(1, 2), load_deepseek_layer(dir_.str(), ckpt_.layer, cfg_, 1, 2));
  expect_layers_equal(all_, load_deepseek_layer(dir_.str(), ckpt_.layer, cfg_, 0, 4));
}

TEST_F(Loader, OnlyTheRequestedExpertsAreRead) {
  // Experts 0 and 1 are absent from the checkpoint: loading [2, 4) must not need them.
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
    for (const char* suffix : {".weight", ".weight_scale_inv"})
      for (int e = 0; e < 2; ++e) {
        const std::string name = ckpt_.mlp() + "experts." + std::to_string(e) + "." + proj + suffix;
        ckpt_.tensors.erase(name);
        ckpt_.shard_of.erase(name);
      }
  ckpt_.write(dir_.str());
  expect_layers_equal(expected(2, 2), load_deepseek_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2));
  EXPECT_HAS(error_of([&] { load_deepseek_layer(dir_.str(), ckpt_.layer, cfg_, 0, 2); }),
             "missing tensor model.layers.3.mlp.experts.0.gate_proj.weight");
}

TEST_F(Loader, SingleFileCheckpoint) {
  ckpt_.write(dir_.str(), /*with_index=*/false);
  ASSERT_FALSE(fs::exists(dir_.path() / "model.safetensors.index.json"));
  expect_layers_equal(expected(2, 2), load_deepseek_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2));
  ckpt_.tensors.erase(ckpt_.mlp() + "experts.2.up_proj.weight_scale_inv");
  ckpt_.write(dir_.str(), false);
  const std::string msg =
      error_of([&] { load_deepseek_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2); });
  EXPECT_HAS(msg, "missing tensor model.layers.3.mlp.experts.2.up_proj.weight_scale_inv");
  EXPECT_HAS(msg, "model.safetensors");
}

TEST_F(Loader, Bf16ExpertWeightsLoadAsBf16) {
  const LayerWeights b = synthetic_weights(cfg_, WeightFormat::kBf16, 77, 0, cfg_.num_experts);
  FakeCheckpoint::from(cfg_, b).write(dir_.str());
  const LayerWeights got = load_deepseek_layer(dir_.str(), 3, cfg_, 2, 2);
  ASSERT_EQ(got.experts.size(), 2u);
  EXPECT_EQ(got.experts[0].format, WeightFormat::kBf16);
  EXPECT_EQ(got.shared[0].format, WeightFormat::kBf16);
  expect_layers_equal(synthetic_weights(cfg_, WeightFormat::kBf16, 77, 2, 2), got);
}

TEST_F(Loader, F32RouterIsAccepted) {
  FakeCheckpoint::from(cfg_, all_, /*gate_f32=*/true).write(dir_.str());
  const LayerWeights got = load_deepseek_layer(dir_.str(), 3, cfg_, 0, 1);
  EXPECT_TRUE(bytes_equal(all_.gate, got.gate));
}

TEST_F(Loader, BiasIgnoredWithoutNoauxTc) {
  cfg_.noaux_tc = false;
  ckpt_.tensors.erase(ckpt_.mlp() + "gate.e_score_correction_bias");
  ckpt_.shard_of.erase(ckpt_.mlp() + "gate.e_score_correction_bias");
  ckpt_.write(dir_.str());
  const LayerWeights got = load_deepseek_layer(dir_.str(), 3, cfg_, 0, 4);
  EXPECT_TRUE(got.gate_bias.empty());
  EXPECT_TRUE(bytes_equal(all_.gate, got.gate));
}

TEST_F(Loader, ErrorMissingTensor) {
  const std::string name = ckpt_.mlp() + "experts.3.down_proj.weight";
  ckpt_.tensors.erase(name);
  ckpt_.shard_of.erase(name);
  const std::string msg = load_error();
  EXPECT_HAS(msg, "missing tensor " + name);
  EXPECT_HAS(msg, "model.safetensors.index.json");
}

TEST_F(Loader, ErrorMissingSharedExpert) {
  const std::string name = ckpt_.mlp() + "shared_experts.gate_proj.weight_scale_inv";
  ckpt_.tensors.erase(name);
  ckpt_.shard_of.erase(name);
  EXPECT_HAS(load_error(), "missing tensor " + name);
}

TEST_F(Loader, ErrorTensorListedButAbsentFromShard) {
  // The index names shard 2 for a tensor the shard does not hold.
  const std::string name = ckpt_.mlp() + "experts.2.gate_proj.weight";
  ckpt_.write(dir_.str());
  auto moved = ckpt_;
  moved.tensors.erase(name);
  std::map<int, SafetensorsWriter> writers;
  for (const auto& [n, t] : moved.tensors) writers[moved.shard_of.at(n)].add(n, t.dtype, t.shape, t.bytes);
  writers[2].write(dir_.str() + "/" + FakeCheckpoint::shard_name(2));
  const std::string msg =
      error_of([&] { load_deepseek_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2); });
  EXPECT_HAS(msg, "tensor " + name);
  EXPECT_HAS(msg, FakeCheckpoint::shard_name(2));
}

TEST_F(Loader, ErrorWrongShape) {
  auto& t = ckpt_.tensors.at(ckpt_.mlp() + "experts.2.up_proj.weight");
  t.shape = {256, 128};  // transposed: expected [I, H] = [128, 256]
  const std::string msg = load_error();
  EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.2.up_proj.weight");
  EXPECT_HAS(msg, "shape [256, 128], expected [128, 256]");
  EXPECT_HAS(msg, FakeCheckpoint::shard_name(2));
}

TEST_F(Loader, ErrorWrongScaleShape) {
  auto& t = ckpt_.tensors.at(ckpt_.mlp() + "experts.3.down_proj.weight_scale_inv");
  t.shape = {1, 2};  // expected [H/128, I/128] = [2, 1]
  const std::string msg = load_error();
  EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.3.down_proj.weight_scale_inv");
  EXPECT_HAS(msg, "shape [1, 2], expected [2, 1]");
}

TEST_F(Loader, ErrorWrongRouterShape) {
  MoeConfig other = cfg_;
  other.num_experts = 8;  // the checkpoint's router has 4 rows
  ckpt_.write(dir_.str());
  const std::string msg = error_of([&] { load_deepseek_layer(dir_.str(), 3, other, 2, 2); });
  EXPECT_HAS(msg, "tensor model.layers.3.mlp.gate.weight");
  EXPECT_HAS(msg, "shape [4, 256], expected [8, 256]");
}

TEST_F(Loader, ErrorWrongDtype) {
  auto& t = ckpt_.tensors.at(ckpt_.mlp() + "experts.2.gate_proj.weight_scale_inv");
  t.dtype = StDtype::kBF16;  // same bytes, so shape [1, 2] of BF16 needs 4 bytes, not 8
  t.shape = {1, 4};
  {
    const std::string msg = load_error();
    EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.2.gate_proj.weight_scale_inv");
    EXPECT_HAS(msg, "dtype BF16, expected F32");
  }
  SetUp();
  auto& w = ckpt_.tensors.at(ckpt_.mlp() + "experts.3.down_proj.weight");
  w.dtype = StDtype::kI8;
  {
    const std::string msg = load_error();
    EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.3.down_proj.weight");
    EXPECT_HAS(msg, "dtype I8, expected F8_E4M3");
  }
  SetUp();
  auto& first = ckpt_.tensors.at(ckpt_.mlp() + "experts.2.gate_proj.weight");
  first.dtype = StDtype::kU8;
  EXPECT_HAS(load_error(), "dtype U8, expected F8_E4M3 (with weight_scale_inv) or BF16");
  SetUp();
  auto& bias = ckpt_.tensors.at(ckpt_.mlp() + "gate.e_score_correction_bias");
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
  ckpt_.add_expert(ckpt_.mlp() + "experts.3.", b.experts[0], 2);
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
    const std::string n = ckpt_.mlp() + "experts.3." + proj + ".weight_scale_inv";
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
      error_of([&] { load_deepseek_layer(dir_.str(), ckpt_.layer, cfg_, 2, 2); });
  EXPECT_HAS(msg, "tensor model.layers.3.mlp.experts.2.gate_proj.weight");
  EXPECT_HAS(msg, "shard file");
  EXPECT_HAS(msg, FakeCheckpoint::shard_name(2));
  EXPECT_HAS(msg, "no such file");
}

TEST_F(Loader, ErrorMalformedIndex) {
  ckpt_.write(dir_.str());
  const std::string index = (dir_.path() / "model.safetensors.index.json").string();
  auto load = [&] { return error_of([&] { load_deepseek_layer(dir_.str(), 3, cfg_, 2, 2); }); };
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
  const std::string msg = error_of([&] { load_deepseek_layer(dir_.str(), 3, cfg_, 0, 1); });
  EXPECT_HAS(msg, "neither model.safetensors.index.json nor model.safetensors");
}

TEST_F(Loader, ErrorBiasMissingWithNoauxTc) {
  ckpt_.tensors.erase(ckpt_.mlp() + "gate.e_score_correction_bias");
  ckpt_.shard_of.erase(ckpt_.mlp() + "gate.e_score_correction_bias");
  const std::string msg = load_error();
  EXPECT_HAS(msg, "missing tensor model.layers.3.mlp.gate.e_score_correction_bias");
  EXPECT_HAS(msg, "noaux_tc");
}

TEST_F(Loader, ErrorExpertRangeOutOfBounds) {
  EXPECT_HAS(load_error(3, 2), "expert range [3, 5)");
  EXPECT_HAS(load_error(3, 2), "outside the routed experts [0, 4)");
  EXPECT_HAS(load_error(-1, 2), "first_expert -1");
  EXPECT_HAS(load_error(0, -1), "num_local -1");
}

TEST_F(Loader, ErrorWrongLayer) {
  ckpt_.write(dir_.str());
  EXPECT_HAS(error_of([&] { load_deepseek_layer(dir_.str(), 4, cfg_, 0, 1); }),
             "missing tensor model.layers.4.mlp.experts.0.gate_proj.weight");
}

}  // namespace
}  // namespace moefq
