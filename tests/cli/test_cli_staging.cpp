// --staging on the CLI (the baseline every recipe is compared with): `moefq eval`, `calibrate`,
// `bench engine-cpu`, `bench eval` and `bench moe` take e4m3 or none; the default follows the
// model (a bf16 checkpoint or a Qwen3-MoE config: none; the tiny preset, DeepSeek-V3's layout:
// e4m3); the header, the JSON (top-level "staging" and "baseline") and the HTML name it; bad
// values exit 2 naming the flag and leave the directory as it was.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "checkpoint_test_util.h"
#include "cli_test_util.h"
#include "moefq_binary.h"
#include "moefq/synthetic.h"
#include "moefq/weights.h"
#include "test_util.h"

namespace moefq {
namespace {

using json = nlohmann::json;
using test::describe, test::read_text, test::RunResult;

const std::string kSmall = "--device cpu --ranks 2 --tokens 32 --calib-batches 1 --eval-batches 1";

class StagingCli : public test::WorkDirTest {
 protected:
  StagingCli() : WorkDirTest("moefq_staging_") {}
  RunResult moefq(const std::string& args) const { return run_in_work(test::moefq_command(args)); }
  json report(const std::string& dir) const { return json::parse(read_text(path(dir) / "report.json")); }
  void expect_rejected(const std::string& args, const std::vector<std::string>& needles) {
    SCOPED_TRACE("moefq " + args);
    const auto before = listing();
    expect_bad_input(moefq(args), before, needles);
  }
};

// The baseline is named in the header, report.json and report.html, and changes the numbers.
TEST_F(StagingCli, EvalNamesTheBaselineEverywhere) {
  RunResult r = moefq("eval " + kSmall + " --recipe moe_dispatch_fp8 --staging none --out a");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.out.find("baseline: staging none, bf16 activations into the expert GEMMs"), std::string::npos) << r.out;
  r = moefq("eval " + kSmall + " --recipe moe_dispatch_fp8 --out b");  // tiny: e4m3 by default
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.out.find("baseline: staging e4m3, e4m3 activations"), std::string::npos) << r.out;
  const json a = report("a"), b = report("b");
  EXPECT_EQ(a.at("staging"), "none");
  EXPECT_EQ(b.at("staging"), "e4m3");
  EXPECT_EQ(a.at("baseline"), staging_baseline(Staging::kNone));
  EXPECT_NE(a.at("results")[0].at("rel_l2"), b.at("results")[0].at("rel_l2"));
  const std::string html = read_text(path("a") / "report.html");
  EXPECT_NE(html.find("staging none: bf16 activations"), std::string::npos);
}

// The default follows the weights: a bf16 checkpoint and a Qwen3-MoE config run with staging
// none, an e4m3 checkpoint with e4m3; --staging overrides.
TEST_F(StagingCli, DefaultFollowsTheModel) {
  const MoeConfig cfg = test::small_config();
  const std::filesystem::path e4m3 = path("e4m3"), bf16 = path("bf16");
  test::write_checkpoint(e4m3, {{1, 7}});
  std::filesystem::create_directories(bf16);
  std::filesystem::copy_file(e4m3 / "config.json", bf16 / "config.json");
  test::FakeCheckpoint::from(cfg, synthetic_weights(cfg, WeightFormat::kBf16, 7, 0, cfg.num_experts), false,
                             test::TensorNaming::mlp(), 1)
      .write(bf16.string());
  std::ofstream(path("qwen.json")) << R"({"model_type": "qwen3_moe", "hidden_size": 256,
    "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true})";
  const auto staging_of = [&](const std::string& args, const std::string& out) {
    const RunResult r = moefq("eval " + kSmall + " --recipe moe_dispatch_fp8 " + args + " --out " + out);
    EXPECT_EQ(r.status, 0) << describe(r);
    return r.status == 0 ? report(out).at("staging").get<std::string>() : std::string("failed");
  };
  EXPECT_EQ(staging_of("--checkpoint bf16 --layers 1", "r1"), "none");
  EXPECT_EQ(staging_of("--checkpoint e4m3 --layers 1", "r2"), "e4m3");
  EXPECT_EQ(staging_of("--config qwen.json", "r3"), "none");
  EXPECT_EQ(staging_of("--config qwen.json --staging e4m3", "r4"), "e4m3");
  EXPECT_EQ(staging_of("--checkpoint e4m3 --layers 1 --staging none", "r5"), "none");
  // calibrate records it in the file's setup.
  const RunResult c = moefq("calibrate --device cpu --ranks 2 --tokens 32 --calib-batches 1 --config qwen.json "
                            "--save cal.json");
  ASSERT_EQ(c.status, 0) << describe(c);
  EXPECT_NE(c.out.find("baseline: staging none"), std::string::npos) << c.out;
  EXPECT_EQ(json::parse(read_text(path("cal.json"))).at("setup").at("staging"), "none");
}

TEST_F(StagingCli, BadValuesExitTwo) {
  for (const char* bad : {"bf16", "E4M3", "fp8", "''"}) {
    expect_rejected("eval " + kSmall + " --staging " + bad + " --out rep", {"--staging", "expected e4m3 or none"});
    expect_rejected("calibrate --device cpu --ranks 2 --tokens 32 --staging " + std::string(bad) + " --save c.json",
                    {"--staging"});
    expect_rejected("bench engine-cpu --staging " + std::string(bad), {"--staging"});
    expect_rejected("bench eval --device cpu --staging " + std::string(bad), {"--staging"});
    expect_rejected("bench moe --staging " + std::string(bad), {"--staging"});
  }
  expect_rejected("bench engine-cpu --weights fp8", {"--weights", "e4m3 or bf16"});
}

TEST_F(StagingCli, BenchEngineCpuTakesIt) {
  for (const char* st : {"none", "e4m3"}) {
    const RunResult r = moefq(std::string("bench engine-cpu --ranks 2 --tokens 16 --reps 1 --weights bf16 --staging ") +
                              st + " --json b.json");
    ASSERT_EQ(r.status, 0) << describe(r);
    EXPECT_NE(r.out.find(std::string("staging ") + st), std::string::npos) << r.out;
    const json j = json::parse(read_text(path("b.json")));
    EXPECT_EQ(j.at("staging"), st);
    EXPECT_EQ(j.at("weights"), "bf16");
  }
}

}  // namespace
}  // namespace moefq
