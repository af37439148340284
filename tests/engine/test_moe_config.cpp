// MoE presets (engine.md's table), validate()'s error paths, and the config.json loader on files
// the tests write: every missing, mistyped or inconsistent field must be named in the error.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "moefq/errors.h"
#include "moefq/moe_config.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// Runs f, which must throw a bad-input moefq::Error whose message contains every needle.
::testing::AssertionResult throws_naming(const std::function<void()>& f, std::vector<std::string> needles) {
  try {
    f();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kBadInput)
      return ::testing::AssertionFailure() << "wrong error kind: " << e.what();
    for (const std::string& n : needles)
      if (std::string(e.what()).find(n) == std::string::npos)
        return ::testing::AssertionFailure() << "message '" << e.what() << "' does not name '" << n << "'";
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "no error thrown";
}

TEST(MoePresets, NamesAndAllValidate) {
  const std::vector<std::string> names = preset_names();
  EXPECT_EQ(names, (std::vector<std::string>{"deepseek-v3", "deepseek-v4-flash", "deepseek-v4-pro", "kimi-k3", "tiny"}));
  for (const std::string& n : names) {
    const MoeConfig c = preset(n);
    EXPECT_EQ(c.name, n);
    EXPECT_NO_THROW(c.validate()) << n;
  }
}

TEST(MoePresets, EngineTableValues) {
  struct Row {
    const char* name;
    int64_t h, i, e, k, s, n_group, topk_group;
    ScoringFunc scoring;
    bool noaux_tc;
    float scaling;
    std::optional<float> clamp;
  };
  using S = ScoringFunc;
  const Row rows[] = {
      {"deepseek-v3", 7168, 2048, 256, 8, 1, 8, 4, S::kSigmoid, true, 2.5f, std::nullopt},
      {"deepseek-v4-flash", 4096, 2048, 256, 6, 1, 1, 1, S::kSqrtSoftplus, true, 1.5f, 10.0f},
      {"deepseek-v4-pro", 7168, 3072, 384, 6, 1, 1, 1, S::kSqrtSoftplus, true, 1.0f, 10.0f},
      {"kimi-k3", 3584, 3072, 896, 16, 2, 1, 1, S::kSigmoid, true, 1.0f, std::nullopt},
      {"tiny", 1024, 256, 32, 8, 1, 4, 2, S::kSigmoid, true, 2.5f, std::nullopt},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.name);
    const MoeConfig c = preset(r.name);
    EXPECT_EQ(c.hidden, r.h);
    EXPECT_EQ(c.intermediate, r.i);
    EXPECT_EQ(c.num_experts, r.e);
    EXPECT_EQ(c.top_k, r.k);
    EXPECT_EQ(c.num_shared, r.s);
    EXPECT_EQ(c.n_group, r.n_group);
    EXPECT_EQ(c.topk_group, r.topk_group);
    EXPECT_EQ(c.scoring, r.scoring);
    EXPECT_EQ(c.noaux_tc, r.noaux_tc);
    EXPECT_EQ(c.routed_scaling, r.scaling);
    EXPECT_TRUE(c.norm_topk_prob);
    EXPECT_EQ(c.swiglu_clamp, r.clamp);
  }
}

TEST(MoePresets, UnknownNameListsThePresets) {
  EXPECT_TRUE(throws_naming([] { preset("deepseek-v9"); }, {"deepseek-v9", "deepseek-v3", "kimi-k3", "tiny"}));
}

TEST(MoePresets, ScoringNames) {
  EXPECT_STREQ(scoring_name(ScoringFunc::kSigmoid), "sigmoid");
  EXPECT_STREQ(scoring_name(ScoringFunc::kSoftmax), "softmax");
  EXPECT_STREQ(scoring_name(ScoringFunc::kSqrtSoftplus), "sqrtsoftplus");
}

TEST(MoeValidate, EveryErrorNamesItsField) {
  struct Case {
    const char* field;
    std::function<void(MoeConfig&)> mutate;
  };
  const Case cases[] = {
      {"hidden", [](MoeConfig& c) { c.hidden = 0; }},
      {"hidden", [](MoeConfig& c) { c.hidden = 500; }},
      {"hidden", [](MoeConfig& c) { c.hidden = -128; }},
      {"intermediate", [](MoeConfig& c) { c.intermediate = 0; }},
      {"intermediate", [](MoeConfig& c) { c.intermediate = 200; }},
      {"num_experts", [](MoeConfig& c) { c.num_experts = 0; }},
      {"top_k", [](MoeConfig& c) { c.top_k = 0; }},
      {"top_k", [](MoeConfig& c) { c.top_k = 33; }},
      {"top_k", [](MoeConfig& c) { c.num_experts = 4, c.n_group = 1, c.topk_group = 1, c.top_k = 5; }},
      {"top_k", [](MoeConfig& c) { c.top_k = 17; }},  // tiny: 2 kept groups of 8 experts
      {"num_shared", [](MoeConfig& c) { c.num_shared = -1; }},
      {"n_group", [](MoeConfig& c) { c.n_group = 0; }},
      {"n_group", [](MoeConfig& c) { c.n_group = 5; }},  // 32 % 5 != 0
      {"topk_group", [](MoeConfig& c) { c.topk_group = 0; }},
      {"topk_group", [](MoeConfig& c) { c.topk_group = 5; }},
      {"routed_scaling", [](MoeConfig& c) { c.routed_scaling = 0.0f; }},
      {"routed_scaling", [](MoeConfig& c) { c.routed_scaling = -1.0f; }},
      {"routed_scaling", [](MoeConfig& c) { c.routed_scaling = INFINITY; }},
      {"routed_scaling", [](MoeConfig& c) { c.routed_scaling = NAN; }},
      {"swiglu_clamp", [](MoeConfig& c) { c.swiglu_clamp = 0.0f; }},
      {"swiglu_clamp", [](MoeConfig& c) { c.swiglu_clamp = INFINITY; }},
      {"swiglu_clamp", [](MoeConfig& c) { c.swiglu_clamp = NAN; }},
      {"scoring", [](MoeConfig& c) { c.scoring = ScoringFunc(7); }},
  };
  for (const Case& k : cases) {
    MoeConfig c = preset("tiny");
    k.mutate(c);
    EXPECT_TRUE(throws_naming([&] { c.validate(); }, {k.field, "tiny"})) << k.field;
  }
  // The limits themselves are accepted.
  MoeConfig c = preset("tiny");
  c.top_k = 16;  // = topk_group * E / n_group
  c.num_shared = 0;
  EXPECT_NO_THROW(c.validate());
  c.n_group = c.topk_group = 1;
  c.top_k = 32;
  c.num_experts = 32;
  EXPECT_NO_THROW(c.validate());
}

// ---------------------------------------------------------------------------------------------
// config.json

class HfConfig : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::path(::testing::TempDir()) / (std::string("moefq_cfg_") + info->name() + "_" +
                                              std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  // The MoE fields of DeepSeek-V3's config.json, plus fields the loader must ignore.
  static Json deepseek_v3() {
    return Json::parse(R"({
      "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
      "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
      "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
      "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
      "norm_topk_prob": true, "topk_method": "noaux_tc", "num_hidden_layers": 61,
      "quantization_config": {"fmt": "e4m3", "weight_block_size": [128, 128]}})");
  }
  std::string write_text(const std::string& dir, const std::string& text) {
    const fs::path d = root_ / dir;
    fs::create_directories(d);
    const fs::path p = d / "config.json";
    std::ofstream(p) << text;
    return p.string();
  }
  std::string write_json(const std::string& dir, const Json& j) { return write_text(dir, j.dump(2)); }

  fs::path root_;
};

TEST_F(HfConfig, DeepSeekV3MatchesThePreset) {
  const std::string path = write_json("DeepSeek-V3", deepseek_v3());
  const MoeConfig c = load_hf_config(path);
  MoeConfig want = preset("deepseek-v3");
  EXPECT_EQ(c.name, "DeepSeek-V3");  // the folder's name
  want.name = c.name;
  EXPECT_EQ(c.hidden, want.hidden);
  EXPECT_EQ(c.intermediate, want.intermediate);
  EXPECT_EQ(c.num_experts, want.num_experts);
  EXPECT_EQ(c.top_k, want.top_k);
  EXPECT_EQ(c.num_shared, want.num_shared);
  EXPECT_EQ(c.n_group, want.n_group);
  EXPECT_EQ(c.topk_group, want.topk_group);
  EXPECT_EQ(c.routed_scaling, want.routed_scaling);
  EXPECT_EQ(c.scoring, want.scoring);
  EXPECT_EQ(c.norm_topk_prob, want.norm_topk_prob);
  EXPECT_EQ(c.noaux_tc, want.noaux_tc);
  EXPECT_EQ(c.swiglu_clamp, want.swiglu_clamp);
}

TEST_F(HfConfig, DeepSeekV4FlashMatchesThePreset) {
  Json j = deepseek_v3();
  j["hidden_size"] = 4096;
  j["num_experts_per_tok"] = 6;
  j["n_group"] = 1;
  j["topk_group"] = 1;
  j["routed_scaling_factor"] = 1.5;
  j["scoring_func"] = "sqrtsoftplus";
  j["swiglu_limit"] = 10.0;
  const MoeConfig c = load_hf_config(write_json("flash", j));
  const MoeConfig want = preset("deepseek-v4-flash");
  EXPECT_EQ(c.hidden, want.hidden);
  EXPECT_EQ(c.top_k, want.top_k);
  EXPECT_EQ(c.scoring, want.scoring);
  EXPECT_EQ(c.routed_scaling, want.routed_scaling);
  EXPECT_EQ(c.swiglu_clamp, want.swiglu_clamp);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_TRUE(c.noaux_tc);
}

TEST_F(HfConfig, OptionalFieldsDefaultWhenAbsentOrNull) {
  Json j = Json::object();
  j["hidden_size"] = 1024;
  j["moe_intermediate_size"] = 512;
  j["n_routed_experts"] = 16;
  j["num_experts_per_tok"] = 4;
  for (bool with_nulls : {false, true}) {
    if (with_nulls)
      for (const char* k : {"n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "scoring_func",
                            "norm_topk_prob", "topk_method", "swiglu_limit"})
        j[k] = nullptr;
    const MoeConfig c = load_hf_config(write_json(with_nulls ? "nulls" : "plain", j));
    EXPECT_EQ(c.num_shared, 0);
    EXPECT_EQ(c.n_group, 1);
    EXPECT_EQ(c.topk_group, 1);
    EXPECT_EQ(c.routed_scaling, 1.0f);
    EXPECT_EQ(c.scoring, ScoringFunc::kSoftmax);
    EXPECT_FALSE(c.norm_topk_prob);
    EXPECT_FALSE(c.noaux_tc);
    EXPECT_FALSE(c.swiglu_clamp.has_value());
  }
}

TEST_F(HfConfig, TopkMethods) {
  Json j = deepseek_v3();
  j["topk_method"] = "group_limited_greedy";
  j["scoring_func"] = "softmax";
  MoeConfig c = load_hf_config(write_json("glg", j));
  EXPECT_FALSE(c.noaux_tc);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  // greedy ignores the groups (plain top-k over all experts).
  j["topk_method"] = "greedy";
  c = load_hf_config(write_json("greedy", j));
  EXPECT_FALSE(c.noaux_tc);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_NO_THROW(c.validate());
}

TEST_F(HfConfig, TextConfigWrapper) {
  Json j = Json::object();
  j["model_type"] = "kimi_vl";
  j["text_config"] = deepseek_v3();
  const MoeConfig c = load_hf_config(write_json("wrapped", j));
  EXPECT_EQ(c.hidden, 7168);
  EXPECT_EQ(c.num_experts, 256);
}

TEST_F(HfConfig, MissingRequiredFields) {
  for (const char* k : {"hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"}) {
    Json j = deepseek_v3();
    j.erase(k);
    const std::string path = write_json(std::string("missing_") + k, j);
    EXPECT_TRUE(throws_naming([&] { load_hf_config(path); }, {k, path, "missing"})) << k;
    j[k] = nullptr;  // null is absent
    const std::string path2 = write_json(std::string("null_") + k, j);
    EXPECT_TRUE(throws_naming([&] { load_hf_config(path2); }, {k, path2})) << k;
  }
}

TEST_F(HfConfig, MistypedFields) {
  struct Case {
    const char* key;
    Json value;
  };
  const Case cases[] = {
      {"hidden_size", "7168"},
      {"hidden_size", 7168.0},
      {"hidden_size", 7168.5},
      {"hidden_size", true},
      {"hidden_size", Json::array({7168})},
      {"moe_intermediate_size", "2048"},
      {"n_routed_experts", 256.5},
      {"num_experts_per_tok", Json::object()},
      {"n_shared_experts", "1"},
      {"n_group", false},
      {"topk_group", 4.2},
      {"routed_scaling_factor", "2.5"},
      {"routed_scaling_factor", true},
      {"scoring_func", 1},
      {"scoring_func", "relu"},
      {"norm_topk_prob", 1},
      {"norm_topk_prob", "true"},
      {"topk_method", true},
      {"topk_method", "aux_loss"},
      {"swiglu_limit", "10"},
      {"hidden_size", Json(uint64_t(1) << 63)},
      {"routed_scaling_factor", 1e300},
  };
  int i = 0;
  for (const Case& k : cases) {
    Json j = deepseek_v3();
    j[k.key] = k.value;
    const std::string path = write_json("typed_" + std::to_string(i++), j);
    EXPECT_TRUE(throws_naming([&] { load_hf_config(path); }, {k.key, path})) << k.key << " = " << k.value.dump();
  }
}

TEST_F(HfConfig, InconsistentFields) {
  struct Case {
    const char* key;
    Json value;
  };
  const Case cases[] = {
      {"hidden_size", 7000},           {"hidden_size", 0},
      {"hidden_size", -7168},          {"moe_intermediate_size", 100},
      {"n_routed_experts", 0},         {"num_experts_per_tok", 0},
      {"num_experts_per_tok", 33},     {"num_experts_per_tok", 200},  // > 4 kept groups of 32
      {"n_shared_experts", -1},        {"n_group", 7},
      {"n_group", 0},                  {"topk_group", 9},
      {"topk_group", 0},               {"routed_scaling_factor", 0.0},
      {"routed_scaling_factor", -2.5}, {"swiglu_limit", 0.0},
      {"swiglu_limit", -10.0},
      // Beyond any MoE model: refused by name instead of sizing allocations that cannot succeed.
      {"hidden_size", 65536 + 128},    {"moe_intermediate_size", 131072 + 128},
      {"n_routed_experts", 8192 + 8},  {"n_routed_experts", int64_t(1) << 40},
      {"n_shared_experts", 65},
  };
  int i = 0;
  for (const Case& k : cases) {
    Json j = deepseek_v3();
    j[k.key] = k.value;
    const std::string path = write_json("bad_" + std::to_string(i++), j);
    EXPECT_TRUE(throws_naming([&] { load_hf_config(path); }, {k.key, path})) << k.key << " = " << k.value.dump();
  }
}

TEST_F(HfConfig, MalformedJsonAndNonObjects) {
  const std::string text = deepseek_v3().dump();
  for (const std::string& bad : {text.substr(0, text.size() / 2), std::string("{\"hidden_size\": 7168,}"),
                                 std::string(""), std::string("\xff\xfe{}")}) {
    const std::string path = write_text("malformed", bad);
    EXPECT_TRUE(throws_naming([&] { load_hf_config(path); }, {path, "JSON"})) << bad;
  }
  for (const char* not_object : {"[1, 2]", "7168", "null"}) {
    const std::string path = write_text("array", not_object);
    EXPECT_TRUE(throws_naming([&] { load_hf_config(path); }, {path, "object"})) << not_object;
  }
}

TEST_F(HfConfig, MissingFileAndDirectory) {
  const std::string path = (root_ / "nowhere" / "config.json").string();
  EXPECT_TRUE(throws_naming([&] { load_hf_config(path); }, {path}));
  EXPECT_TRUE(throws_naming([&] { load_hf_config(root_.string()); }, {root_.string()}));
}

}  // namespace
}  // namespace moefq
