// MoE presets (docs/models.md: the models' config.json values), validate()'s error
// paths, and the config.json loader: the architectures' own config files (tests/engine/data) load
// to their presets, and on files the tests write every missing, mistyped or inconsistent field
// (in the architecture's own spelling) and every unknown model_type is named in the error.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <functional>
#include <optional>
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
  EXPECT_EQ(names, (std::vector<std::string>{"deepseek-v3", "deepseek-v4-flash", "deepseek-v4-pro", "kimi-k2",
                                             "kimi-k3", "glm-4.5", "glm-4.5-air", "qwen3-30b-a3b", "qwen3-235b-a22b",
                                             "mixtral-8x7b", "olmoe-1b-7b", "tiny"}));
  for (const std::string& n : names) {
    const MoeConfig c = preset(n);
    EXPECT_EQ(c.name, n);
    EXPECT_NO_THROW(c.validate()) << n;
  }
}

TEST(MoePresets, EngineTableValues) {
  struct Row {
    const char* name;
    const char* model_type;
    int64_t h, i, e, k, s, n_group, topk_group;
    ScoringFunc scoring;
    bool noaux_tc;
    float scaling;
    bool norm;
    std::optional<float> clamp;
  };
  using S = ScoringFunc;
  const auto none = std::nullopt;
  const Row rows[] = {
      {"deepseek-v3", "deepseek_v3", 7168, 2048, 256, 8, 1, 8, 4, S::kSigmoid, true, 2.5f, true, none},
      {"deepseek-v4-flash", "deepseek_v4", 4096, 2048, 256, 6, 1, 1, 1, S::kSqrtSoftplus, true, 1.5f, true, 10.0f},
      {"deepseek-v4-pro", "deepseek_v4", 7168, 3072, 384, 6, 1, 1, 1, S::kSqrtSoftplus, true, 1.0f, true, 10.0f},
      {"kimi-k2", "kimi_k2", 7168, 2048, 384, 8, 1, 1, 1, S::kSigmoid, true, 2.827f, true, none},
      {"kimi-k3", "", 3584, 3072, 896, 16, 2, 1, 1, S::kSigmoid, true, 1.0f, true, none},
      {"glm-4.5", "glm4_moe", 5120, 1536, 160, 8, 1, 1, 1, S::kSigmoid, true, 2.5f, true, none},
      {"glm-4.5-air", "glm4_moe", 4096, 1408, 128, 8, 1, 1, 1, S::kSigmoid, true, 1.0f, true, none},
      {"qwen3-30b-a3b", "qwen3_moe", 2048, 768, 128, 8, 0, 1, 1, S::kSoftmax, false, 1.0f, true, none},
      {"qwen3-235b-a22b", "qwen3_moe", 4096, 1536, 128, 8, 0, 1, 1, S::kSoftmax, false, 1.0f, true, none},
      {"mixtral-8x7b", "mixtral", 4096, 14336, 8, 2, 0, 1, 1, S::kSoftmax, false, 1.0f, true, none},
      {"olmoe-1b-7b", "olmoe", 2048, 1024, 64, 8, 0, 1, 1, S::kSoftmax, false, 1.0f, false, none},
      {"tiny", "", 1024, 256, 32, 8, 1, 4, 2, S::kSigmoid, true, 2.5f, true, none},
  };
  EXPECT_EQ(std::size(rows), preset_names().size());
  for (const Row& r : rows) {
    SCOPED_TRACE(r.name);
    const MoeConfig c = preset(r.name);
    EXPECT_EQ(c.model_type, r.model_type);
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
    EXPECT_EQ(c.norm_topk_prob, r.norm);
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
  static std::string read_file(const std::string& path) {
    std::ifstream in(path);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

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

// ---------------------------------------------------------------------------------------------
// Every architecture's config.json

// The config.json of each model, with its published field names and values.
const std::string kConfigs = std::string(MOEFQ_SOURCE_DIR) + "/tests/engine/data/hf_configs";

void expect_same_moe(const MoeConfig& want, const MoeConfig& got) {
  EXPECT_EQ(got.model_type, want.model_type);
  EXPECT_EQ(got.hidden, want.hidden);
  EXPECT_EQ(got.intermediate, want.intermediate);
  EXPECT_EQ(got.num_experts, want.num_experts);
  EXPECT_EQ(got.top_k, want.top_k);
  EXPECT_EQ(got.num_shared, want.num_shared);
  EXPECT_EQ(got.n_group, want.n_group);
  EXPECT_EQ(got.topk_group, want.topk_group);
  EXPECT_EQ(got.routed_scaling, want.routed_scaling);
  EXPECT_EQ(got.scoring, want.scoring);
  EXPECT_EQ(got.norm_topk_prob, want.norm_topk_prob);
  EXPECT_EQ(got.noaux_tc, want.noaux_tc);
  EXPECT_EQ(got.swiglu_clamp, want.swiglu_clamp);
}

TEST(HfArchitectures, EachModelsConfigLoadsToItsPreset) {
  for (const char* model : {"qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "olmoe-1b-7b", "kimi-k2", "glm-4.5",
                            "glm-4.5-air"}) {
    SCOPED_TRACE(model);
    const MoeConfig c = load_hf_config(kConfigs + "/" + model + "/config.json");
    EXPECT_EQ(c.name, model);  // the folder's name
    expect_same_moe(preset(model), c);
  }
  EXPECT_EQ(hf_model_types(), (std::vector<std::string>{"deepseek_v2", "deepseek_v3", "deepseek_v4", "glm4_moe",
                                                        "kimi_k2", "mixtral", "olmoe", "qwen3_moe"}));
}

TEST_F(HfConfig, RoutingDefaultsOfEachModelType) {
  struct Case {
    const char* model_type;
    ScoringFunc scoring;
    bool noaux_tc, norm;
  };
  const Case cases[] = {
      {"deepseek_v2", ScoringFunc::kSoftmax, false, false}, {"deepseek_v3", ScoringFunc::kSigmoid, true, true},
      {"deepseek_v4", ScoringFunc::kSqrtSoftplus, true, true}, {"kimi_k2", ScoringFunc::kSigmoid, true, true},
      {"glm4_moe", ScoringFunc::kSigmoid, true, true},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.model_type);
    Json j = Json::parse(R"({"hidden_size": 1024, "moe_intermediate_size": 512, "n_routed_experts": 16,
                             "num_experts_per_tok": 4})");
    j["model_type"] = k.model_type;
    const MoeConfig c = load_hf_config(write_json(k.model_type, j));
    EXPECT_EQ(c.model_type, k.model_type);
    EXPECT_EQ(c.scoring, k.scoring);
    EXPECT_EQ(c.noaux_tc, k.noaux_tc);
    EXPECT_EQ(c.norm_topk_prob, k.norm);
  }
  // Softmax architectures: no shared expert, no groups, no scaling, whatever else the file holds.
  Json q = Json::parse(R"({"model_type": "qwen3_moe", "hidden_size": 1024, "moe_intermediate_size": 512,
                           "intermediate_size": 3072, "num_experts": 16, "num_experts_per_tok": 4,
                           "n_shared_experts": 2, "n_group": 4, "routed_scaling_factor": 3.0,
                           "scoring_func": "sigmoid"})");
  MoeConfig c = load_hf_config(write_json("qwen", q));
  EXPECT_EQ(c.intermediate, 512);
  EXPECT_EQ(c.num_experts, 16);
  EXPECT_EQ(c.num_shared, 0);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.routed_scaling, 1.0f);
  EXPECT_EQ(c.scoring, ScoringFunc::kSoftmax);
  EXPECT_FALSE(c.norm_topk_prob);  // Qwen3-MoE's default when the field is absent
  EXPECT_FALSE(c.noaux_tc);
  // Mixtral always renormalises its top-k weights.
  Json m = Json::parse(R"({"model_type": "mixtral", "hidden_size": 1024, "intermediate_size": 512,
                           "num_local_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": false})");
  c = load_hf_config(write_json("mixtral", m));
  EXPECT_EQ(c.intermediate, 512);
  EXPECT_EQ(c.num_experts, 8);
  EXPECT_TRUE(c.norm_topk_prob);
  // OLMoE reads the flag.
  Json o = Json::parse(R"({"model_type": "olmoe", "hidden_size": 1024, "intermediate_size": 512,
                           "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true})");
  EXPECT_TRUE(load_hf_config(write_json("olmoe", o)).norm_topk_prob);
}

TEST_F(HfConfig, EachArchitecturesFieldsAreNamedInItsErrors) {
  struct Case {
    const char* model_type;
    const char* missing;  // a required field in this architecture's spelling
    const char* other;    // another architecture's spelling, present in the file and not read
  };
  const Case cases[] = {
      {"qwen3_moe", "num_experts", "n_routed_experts"},
      {"qwen3_moe", "moe_intermediate_size", "intermediate_size"},
      {"olmoe", "intermediate_size", "moe_intermediate_size"},
      {"mixtral", "num_local_experts", "num_experts"},
  };
  int i = 0;
  for (const Case& k : cases) {
    SCOPED_TRACE(std::string(k.model_type) + " " + k.missing);
    Json j = Json::parse(R"({"hidden_size": 1024, "moe_intermediate_size": 512, "intermediate_size": 512,
                             "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8,
                             "num_experts_per_tok": 2})");
    j["model_type"] = k.model_type;
    j.erase(k.missing);
    ASSERT_TRUE(j.contains(k.other));  // the file has it, and it does not stand in for the missing one
    const std::string path = write_json("arch_" + std::to_string(i++), j);
    EXPECT_TRUE(throws_naming([&] { load_hf_config(path); }, {path, "missing required field", k.missing}));
  }
  Json bad = Json::parse(R"({"model_type": "mixtral", "hidden_size": 1024, "intermediate_size": 500,
                             "num_local_experts": 8, "num_experts_per_tok": 2})");
  std::string path = write_json("mixtral_bad", bad);
  EXPECT_TRUE(throws_naming([&] { load_hf_config(path); }, {path, "intermediate_size = 500"}));
  bad["intermediate_size"] = 512;
  bad["num_experts_per_tok"] = 9;
  path = write_json("mixtral_bad2", bad);
  EXPECT_TRUE(throws_naming([&] { load_hf_config(path); }, {path, "num_experts_per_tok = 9 exceeds num_local_experts = 8"}));
}

TEST_F(HfConfig, UnknownModelTypeNamesTheSupportedOnes) {
  Json j = deepseek_v3();
  j["model_type"] = "qwen2_moe";
  const std::string path = write_json("qwen2", j);
  EXPECT_TRUE(throws_naming([&] { load_hf_config(path); },
                            {path, "model_type 'qwen2_moe'", "deepseek_v3", "kimi_k2", "glm4_moe", "qwen3_moe",
                             "mixtral", "olmoe"}));
  j["model_type"] = 3;
  const std::string path2 = write_json("typed", j);
  EXPECT_TRUE(throws_naming([&] { load_hf_config(path2); }, {path2, "model_type must be a string"}));
}

TEST_F(HfConfig, AWrappersTextConfigGivesTheModelType) {
  // Kimi-K2.5-style: the top level names the multimodal model, text_config the language model.
  Json kimi = Json::parse(read_file(kConfigs + "/kimi-k2/config.json"));
  Json j = Json::object();
  j["model_type"] = "kimi_k25";
  j["vision_config"] = Json::object();
  j["text_config"] = kimi;
  MoeConfig c = load_hf_config(write_json("k25", j));
  expect_same_moe(preset("kimi-k2"), c);
  // A text_config without model_type takes the top level's.
  Json q = Json::parse(read_file(kConfigs + "/qwen3-30b-a3b/config.json"));
  q.erase("model_type");
  j = Json::object();
  j["model_type"] = "qwen3_moe";
  j["text_config"] = q;
  expect_same_moe(preset("qwen3-30b-a3b"), load_hf_config(write_json("qvl", j)));
}

}  // namespace
}  // namespace moefq
