// End-to-end runs of `moefq eval` on each MoE architecture it reads: the models' own config.json
// files (tests/engine/data/hf_configs) at small sizes through --config, small checkpoints in each
// tensor naming through --checkpoint, and recipes in Model Optimizer's layout through --recipe and
// --recipe-root (the notice of ignored entries, a missing import). Each run takes well under a
// second on 2 cores.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "moefq_binary.h"
#include "checkpoint_test_util.h"
#include "moefq/moe_config.h"
#include "moefq/weights.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::describe, test::quote, test::read_text, test::RunResult;

const std::string kSmall = "--device cpu --ranks 2 --tokens 32 --calib-batches 1 --eval-batches 1";
const std::string kData = std::string(MOEFQ_SOURCE_DIR) + "/tests";

// An architecture: its model's config.json, how that file spells the sizes, its tensor naming and
// the weight format its small checkpoint is written in.
struct Arch {
  const char* model;  // folder under tests/engine/data/hf_configs
  const char* intermediate_key;
  const char* experts_key;
  test::TensorNaming naming;
  WeightFormat format;
  const char* scoring;
  bool norm;
  int64_t shared;
};

const Arch kArchs[] = {
    {"qwen3-30b-a3b", "moe_intermediate_size", "num_experts", test::TensorNaming::mlp(), WeightFormat::kBf16, "softmax",
     true, 0},
    {"mixtral-8x7b", "intermediate_size", "num_local_experts", test::TensorNaming::block_sparse_moe(),
     WeightFormat::kBf16, "softmax", true, 0},
    {"olmoe-1b-7b", "intermediate_size", "num_experts", test::TensorNaming::mlp(), WeightFormat::kBf16, "softmax", false,
     0},
    {"kimi-k2", "moe_intermediate_size", "n_routed_experts", test::TensorNaming::mlp(), WeightFormat::kE4m3, "sigmoid",
     true, 1},
    {"glm-4.5", "moe_intermediate_size", "n_routed_experts", test::TensorNaming::mlp(), WeightFormat::kBf16, "sigmoid",
     true, 1},
};

class EvalModels : public test::WorkDirTest {
 protected:
  EvalModels() : WorkDirTest("moefq_eval_models_") {}

  RunResult moefq(const std::string& args) const { return run_in_work(test::moefq_command(args)); }
  json report(const std::string& dir) const { return json::parse(read_text(path(dir) / "report.json")); }

  // The model's config.json at a small size (H 256, I 128, 8 experts, top-2), in `dir`.
  std::string write_small_config(const Arch& a, const std::string& dir) const {
    std::ifstream in(kData + "/engine/data/hf_configs/" + a.model + "/config.json");
    json j = json::parse(in);
    j["hidden_size"] = 256;
    j[a.intermediate_key] = 128;
    j[a.experts_key] = 8;
    j["num_experts_per_tok"] = 2;
    fs::create_directories(path(dir));
    std::ofstream(path(dir) / "config.json") << j.dump(2);
    return dir + "/config.json";
  }
};

TEST_F(EvalModels, ConfigOfEachArchitectureRuns) {
  for (const Arch& a : kArchs) {
    SCOPED_TRACE(a.model);
    const std::string cfg = write_small_config(a, a.model);
    const RunResult r = moefq("eval --config " + cfg + " " + kSmall + " --recipe moe_combine_nvfp4 --out rep_" + a.model);
    ASSERT_EQ(r.status, 0) << describe(r);
    const json j = report(std::string("rep_") + a.model);
    const json& m = j.at("config").at("model");
    EXPECT_EQ(m.at("name"), a.model);
    EXPECT_EQ(m.at("hidden"), 256);
    EXPECT_EQ(m.at("num_experts"), 8);
    EXPECT_EQ(m.at("top_k"), 2);
    EXPECT_EQ(m.at("scoring"), a.scoring);
    EXPECT_EQ(m.at("norm_topk_prob"), a.norm);
    EXPECT_EQ(m.at("num_shared"), a.shared);
    ASSERT_EQ(j.at("results").size(), 1u);
    EXPECT_GT(j.at("results")[0].at("rel_l2").get<double>(), 0.0);
  }
}

TEST_F(EvalModels, CheckpointOfEachNamingRuns) {
  for (const Arch& a : kArchs) {
    SCOPED_TRACE(a.model);
    const std::string dir = std::string("ckpt_") + a.model;
    const std::string cfg_path = write_small_config(a, dir);
    const MoeConfig cfg = load_hf_config(path(cfg_path).string());
    const LayerWeights lw = synthetic_weights(cfg, a.format, 5, 0, cfg.num_experts);
    test::FakeCheckpoint::from(cfg, lw, false, a.naming, 0).write(path(dir).string());
    const RunResult r = moefq("eval --checkpoint " + dir + " --layers 0 " + kSmall +
                              " --recipe moe_dispatch_fp8 --out rep_" + a.model);
    ASSERT_EQ(r.status, 0) << describe(r);
    const json j = report(std::string("rep_") + a.model);
    EXPECT_EQ(j.at("config").at("weights"), "checkpoint " + dir + " (" + weight_format_name(a.format) + ")");
    EXPECT_GT(j.at("results")[0].at("rel_l2").get<double>(), 0.0);
  }
  // A Mixtral config beside tensors named the DeepSeek way: bad input naming Mixtral's tensor.
  const std::string dir = "mixtral_misnamed";
  const MoeConfig cfg = load_hf_config(path(write_small_config(kArchs[1], dir)).string());
  test::FakeCheckpoint::from(cfg, synthetic_weights(cfg, WeightFormat::kBf16, 5, 0, 8), false,
                             test::TensorNaming::mlp(), 0)
      .write(path(dir).string());
  const RunResult bad = moefq("eval --checkpoint " + dir + " --layers 0 " + kSmall + " --out rep_bad");
  EXPECT_EQ(bad.status, 2) << describe(bad);
  EXPECT_NE(bad.err.find("model.layers.0.block_sparse_moe.experts.0.w1.weight"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(path("rep_bad")));
}

// A checkpoint whose expert weights are in a format moefq does not read is refused before the run
// (exit 2, no report) with the format named, on either device; an MXFP4 one runs on the CPU.
TEST_F(EvalModels, CheckpointFormatsRefusedByNameOrRun) {
  const Arch& qwen = kArchs[0];
  const MoeConfig cfg = load_hf_config(path(write_small_config(qwen, "f16")).string());
  test::FakeCheckpoint ckpt =
      test::FakeCheckpoint::from(cfg, synthetic_weights(cfg, WeightFormat::kBf16, 5, 0, 8), false, qwen.naming, 0);
  for (auto& [name, t] : ckpt.tensors)
    if (name.find(".experts.") != std::string::npos) t.dtype = StDtype::kF16;  // the same bytes, as fp16
  ckpt.write(path("f16").string());
  for (const char* device : {"cpu", "cuda"}) {
    SCOPED_TRACE(device);
    const RunResult r = moefq(std::string("eval --checkpoint f16 --layers 0 --device ") + device +
                              " --ranks 2 --tokens 32 --calib-batches 1 --eval-batches 1 --out rep_f16");
    EXPECT_EQ(r.status, 2) << describe(r);
    // No GPU here: --device cuda is refused first, for that (exit 2 too).
    if (std::string(device) == "cuda" && r.err.find("no CUDA device") != std::string::npos) continue;
    for (const char* needle : {"model.layers.0.mlp.experts.0.gate_proj.weight", "dtype F16 (fp16) are not supported",
                               "mxfp4"})
      EXPECT_NE(r.err.find(needle), std::string::npos) << needle << "\n" << r.err;
    EXPECT_FALSE(fs::exists(path("rep_f16")));
  }
  LayerWeights decoded;
  write_small_config(qwen, "mx");
  test::mxfp4_checkpoint(cfg, 4, 0, decoded, qwen.naming).write(path("mx").string());
  const RunResult ok = moefq("eval --checkpoint mx --layers 0 " + kSmall + " --recipe moe_dispatch_fp8 --out rep_mx");
  ASSERT_EQ(ok.status, 0) << describe(ok);
  const json j = report("rep_mx");
  EXPECT_EQ(j.at("config").at("weights"), "checkpoint mx (mxfp4, decoded to bf16 at load)");
  EXPECT_GT(j.at("results")[0].at("rel_l2").get<double>(), 0.0);
}

// GPT-OSS's config is refused with what the engine lacks for its MoE layer, not as unknown.
TEST_F(EvalModels, GptOssIsRefusedWithWhatIsMissing) {
  std::ofstream(path("gpt_oss.json")) << R"({"model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "num_local_experts": 32, "num_experts_per_tok": 4, "swiglu_limit": 7.0})";
  const RunResult r = moefq("eval --config gpt_oss.json " + kSmall + " --out rep");
  EXPECT_EQ(r.status, 2) << describe(r);
  for (const char* needle : {"model_type 'gpt_oss' (GPT-OSS) is not supported", "router bias", "gate_up_proj_bias",
                             "(up + 1) * gate * sigmoid(1.702 * gate)", "gate_up_proj_blocks", "2880"})
    EXPECT_NE(r.err.find(needle), std::string::npos) << needle << "\n" << r.err;
  EXPECT_FALSE(fs::exists(path("rep")));
}

TEST_F(EvalModels, UnknownModelTypeIsBadInput) {
  std::ofstream(path("qwen2.json")) << R"({"model_type": "qwen2_moe", "hidden_size": 256})";
  const RunResult r = moefq("eval --config qwen2.json " + kSmall + " --out rep");
  EXPECT_EQ(r.status, 2) << describe(r);
  for (const char* needle : {"qwen2.json", "model_type 'qwen2_moe'", "qwen3_moe", "mixtral", "olmoe", "kimi_k2", "glm4_moe"})
    EXPECT_NE(r.err.find(needle), std::string::npos) << needle << "\n" << r.err;
  EXPECT_FALSE(fs::exists(path("rep")));
}

TEST_F(EvalModels, ModelOptRecipesWithARecipeRoot) {
  // A whole-model recipe outside any recipe tree, importing a unit only the test tree has.
  std::ofstream(path("r.yaml")) << "imports:\n"
                                   "  w8a8: configs/ptq/units/w8a8_fp8_fp8\n"
                                   "  combine: configs/ptq/units/moe_combine_nvfp4\n"
                                   "metadata: {recipe_type: ptq}\n"
                                   "quantize:\n"
                                   "  algorithm: {method: max}\n"
                                   "  quant_cfg:\n"
                                   "    - {quantizer_name: '*', enable: false}\n"
                                   "    - $import: w8a8\n"
                                   "    - $import: combine\n";
  RunResult r = moefq("eval " + kSmall + " --recipe r.yaml --out rep");
  EXPECT_EQ(r.status, 2) << describe(r);
  EXPECT_NE(r.err.find("r.yaml: imports.w8a8: cannot find 'configs/ptq/units/w8a8_fp8_fp8'"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("--recipe-root"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(path("rep")));

  const std::string root = kData + "/quant/data/modelopt_layout";
  r = moefq("eval " + kSmall + " --recipe r.yaml --recipe-root " + quote(root) + " --out rep");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.err.find("r: ignored 2 entries for quantizers moefq does not simulate"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("'*weight_quantizer', '*input_quantizer'"), std::string::npos) << r.err;
  const json j = report("rep");
  EXPECT_EQ(j.at("config").at("recipes"), json::array({"r"}));
  EXPECT_EQ(j.at("results")[0].at("combine_format"), "nvfp4");
  EXPECT_TRUE(j.at("results")[0].at("dispatch_format").is_null());
}

}  // namespace
}  // namespace moefq
