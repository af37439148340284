// The inputs of `moefq eval` / `moefq calibrate` (and the numbers of every command) as the real
// binary takes them: a calibration file of the other combine weighting, a checkpoint that lacks a
// later layer, activations with NaN, the progress lines, the strict number parser shared by every
// numeric option and the messages of refused commands and runs. Each refusal exits 2 with a message
// naming the argument or file, before any work and with nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint_test_util.h"
#include "cli_test_util.h"
#include "moefq/numerics.h"
#include "moefq/safetensors.h"
#include "moefq/synthetic.h"
#include "moefq_binary.h"
#include "test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::describe, test::quote, test::read_text, test::RunResult, test::span_of, test::split_lines;

// Small settings that keep a run to a second or two on 2 cores.
const std::string kSmallCal = "--device cpu --ranks 2 --tokens 32 --calib-batches 1";
const std::string kSmall = kSmallCal + " --eval-batches 1";

// "--name VALUE" ("--name=VALUE" for a value that starts with '-', which would read as an option).
std::string opt(const std::string& name, const std::string& v) {
  return !v.empty() && v[0] == '-' ? name + "=" + quote(v) : name + " " + quote(v);
}

class EvalInputs : public test::WorkDirTest {
 protected:
  EvalInputs() : WorkDirTest("moefq_evin_") {}

  RunResult moefq(const std::string& args) const { return run_in_work(test::moefq_command(args)); }

  // Exit 2, "moefq: error: " and every needle on stderr, no table, the directory as it was.
  RunResult expect_rejected(const std::string& args, const std::vector<std::string>& needles) {
    SCOPED_TRACE("moefq " + args);
    const auto before = listing();
    const RunResult r = moefq(args);
    expect_bad_input(r, before, needles);
    return r;
  }
};

// ------------------------------------------------------------------------------------------------
// A calibration file is used only with the combine weighting it was measured with.

TEST_F(EvalInputs, CalibrationOfTheOtherCombineWeightingIsRefused) {
  RunResult r = moefq("calibrate " + kSmallCal + " --save cal.json");
  ASSERT_EQ(r.status, 0) << describe(r);
  const RunResult bad = expect_rejected("eval " + kSmall + " --recipe moe_combine_fp8 --combine-weighting after "
                                        "--load-calibration cal.json --out rep",
                                        {"--load-calibration cal.json", "combine_weighting before", "after"});
  EXPECT_EQ(bad.err.find("layer 0 batch"), std::string::npos) << "refused before any work\n" << bad.err;
  // And the other way round; the same mode loads.
  r = moefq("calibrate " + kSmallCal + " --combine-weighting after --save cal_after.json");
  ASSERT_EQ(r.status, 0) << describe(r);
  expect_rejected("eval " + kSmall + " --recipe moe_combine_fp8 --load-calibration cal_after.json",
                  {"cal_after.json", "combine_weighting after", "before"});
  r = moefq("eval " + kSmall + " --recipe moe_combine_fp8 --combine-weighting after --load-calibration cal_after.json");
  EXPECT_EQ(r.status, 0) << describe(r);
  EXPECT_EQ(r.err.find("warning"), std::string::npos) << r.err;
}

// ------------------------------------------------------------------------------------------------
// A checkpoint lacking a requested layer is refused before the first layer runs.

TEST_F(EvalInputs, CheckpointLayersAreCheckedBeforeAnyWork) {
  test::write_checkpoint(path("ckpt"), {{0, 7}, {1, 8}});
  for (const std::string& cmd : {"eval " + kSmall + " --recipe moe_combine_fp8 --out rep",
                                 "calibrate " + kSmallCal + " --save c.json"}) {
    const RunResult r = expect_rejected(cmd.substr(0, cmd.find(' ')) + " --checkpoint ckpt --layers 0,5" +
                                            cmd.substr(cmd.find(' ')),
                                        {"--checkpoint ckpt", "layer 5", "model.layers.5.mlp.experts.0.gate_proj.weight"});
    EXPECT_EQ(r.err.find("calibrating"), std::string::npos) << "layer 0 must not run first\n" << r.err;
    EXPECT_EQ(r.err.find("loading weights"), std::string::npos) << r.err;
  }
  // A later expert's tensor with the wrong shape: found from the headers too.
  const MoeConfig cfg = test::small_config();
  test::FakeCheckpoint ck = test::FakeCheckpoint::from(cfg, synthetic_weights(cfg, WeightFormat::kE4m3, 3, 0, cfg.num_experts),
                                                       false, test::TensorNaming::mlp(), 0);
  LayerWeights other = synthetic_weights(cfg, WeightFormat::kE4m3, 4, 0, cfg.num_experts);
  ck.add_layer(cfg, other, 2);
  const std::string bad = "model.layers.2.mlp.experts.7.down_proj.weight_scale_inv";
  ck.erase(bad);
  const std::vector<float> scales(4, 1.0f);
  ck.add(bad, StDtype::kF32, {2, 2}, span_of(scales), 0);
  fs::create_directories(path("ck2"));
  fs::copy_file(path("ckpt") / "config.json", path("ck2") / "config.json");
  ck.write(path("ck2").string());
  expect_rejected("eval --checkpoint ck2 --layers 0,2 " + kSmall + " --recipe moe_combine_fp8",
                  {"--checkpoint ck2", "layer 2", bad, "shape [2, 2]"});
}

// ------------------------------------------------------------------------------------------------
// Non-finite inputs are named where they are: the activations file's tensor and row; a qdq tensor
// with nothing to compare shows no figures rather than perfect ones.

// [rows, cols] bf16 activations (synthetic) with `bad` at (row, col) of the tensor `name`.
void write_activations_with(const fs::path& p, const std::string& name, int64_t rows, int64_t cols, int64_t row,
                            int64_t col, float bad) {
  auto b = test::to_bf16(synthetic_activations(rows, cols, 3));
  b[size_t(row * cols + col)].bits = bf16_round(bad);
  SafetensorsWriter w;
  w.add(name, StDtype::kBF16, {rows, cols}, span_of(b));
  w.write(p.string());
}

TEST_F(EvalInputs, NonFiniteActivationsAreNamedByFileTensorAndRow) {
  // tiny: H 1024; 2 ranks x 32 tokens x (1 + 1) batches = 128 rows used.
  write_activations_with(path("nan.safetensors"), "layers.0", 128, 1024, 70, 3, NAN);
  write_activations_with(path("inf.safetensors"), "hidden_states", 128, 1024, 0, 1023, -INFINITY);
  expect_rejected("eval " + kSmall + " --activations nan.safetensors --out rep",
                  {"--activations nan.safetensors", "'layers.0'", "1 NaN or inf value", "row 70, column 3"});
  expect_rejected("calibrate " + kSmallCal + " --activations inf.safetensors --save c.json",
                  {"--activations inf.safetensors", "'hidden_states'", "row 0, column 1023"});
  // A NaN beyond the rows the run uses is no error.
  write_activations_with(path("late.safetensors"), "layers.0", 200, 1024, 150, 0, NAN);
  const RunResult r = moefq("eval " + kSmall + " --recipe moe_combine_fp8 --activations late.safetensors");
  EXPECT_EQ(r.status, 0) << describe(r);
}

TEST_F(EvalInputs, QdqOfATensorWithNothingToCompareShowsNoFigures) {
  const std::vector<float> nan(256, NAN), ok = [] {
    std::vector<float> v(256);
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(i % 17) - 8.0f;
    return v;
  }();
  SafetensorsWriter w;
  w.add("all_nan", StDtype::kF32, {2, 128}, span_of(nan));
  w.add("fine", StDtype::kF32, {2, 128}, span_of(ok));
  w.write(path("in.safetensors").string());
  const RunResult r = moefq("qdq --device cpu --in in.safetensors --out out.safetensors --format mxfp8 --report r.json");
  ASSERT_EQ(r.status, 0) << describe(r);
  std::vector<std::string> nan_row, fine_row;
  for (const std::string& line : split_lines(r.out)) {
    const auto words = test::split_words(line);
    if (!words.empty() && words[0] == "all_nan") nan_row = words;
    if (!words.empty() && words[0] == "fine") fine_row = words;
  }
  // tensor dtype shape format amax rel_l2 cosine calc_diff max_abs snr_db skipped B/row cast
  ASSERT_EQ(nan_row.size(), 13u) << r.out;
  for (size_t c = 5; c <= 9; ++c) EXPECT_EQ(nan_row[c], "-") << "column " << c << "\n" << r.out;
  EXPECT_EQ(nan_row[10], "256");
  EXPECT_EQ(nan_row[11], "132") << "mxfp8's bytes per row of 128: 128 + 4 scales";
  EXPECT_EQ(nan_row[12], "-") << "no cast fraction but logfmt10's";
  ASSERT_EQ(fine_row.size(), 13u) << r.out;
  EXPECT_NE(fine_row[6], "-");
  const json j = json::parse(read_text(path("r.json")));
  const json& n = j.at("results")[0].at("tensor") == "all_nan" ? j.at("results")[0] : j.at("results")[1];
  EXPECT_EQ(n.at("count"), 0);
  for (const char* k : {"rel_l2", "cosine", "calc_diff", "max_abs", "snr_db"}) EXPECT_EQ(n.at(k), "nan") << k;
}

// ------------------------------------------------------------------------------------------------
// Progress: the weights' progress within a layer's load, elapsed time and an estimate by step kind.

TEST_F(EvalInputs, QdqProgressLinesHaveElapsedTime) {
  const std::vector<float> v(4096, 1.5f);
  SafetensorsWriter w;
  for (const char* name : {"a", "b", "c"}) w.add(name, StDtype::kF32, {32, 128}, span_of(v));
  w.write(path("in.safetensors").string());
  const RunResult r = moefq("qdq --device cpu --in in.safetensors --out out.safetensors --format fp8");
  ASSERT_EQ(r.status, 0) << describe(r);
  int lines = 0;
  for (const std::string& line : split_lines(r.err)) {
    if (line.rfind("[", 0) != 0) continue;
    ++lines;
    if (line.rfind("[1/", 0) == 0) continue;
    EXPECT_NE(line.find(" s"), std::string::npos) << "elapsed time: " << line;
    EXPECT_NE(line.find("eta "), std::string::npos) << line;
  }
  EXPECT_EQ(lines, 3) << r.err;
}

// ------------------------------------------------------------------------------------------------
// Messages: numbers, commands, the memory plan, clipping.

TEST_F(EvalInputs, MaxRelL2SaysWhatItTakes) {
  for (const std::string v : {"0", "-1", "inf", "nan", "0.05abc", "0x1p-3", " 0.05", ""}) {
    const RunResult r = expect_rejected("eval " + kSmall + " " + opt("--max-rel-l2", v) + " --out rep",
                                        {"--max-rel-l2", "must be a finite number > 0, got '" + v + "'"});
    EXPECT_LT(r.err.size(), 200u) << r.err;
  }
  const RunResult ok = moefq("eval " + kSmall + " --recipe moe_combine_fp8 --max-rel-l2 5e-2");
  EXPECT_EQ(ok.status, 0) << describe(ok);
}

TEST_F(EvalInputs, EveryNumericOptionTakesPlainDecimalsOnly) {
  // Integers: eval, calibrate, qdq and bench options alike.
  for (const std::string v : {"12abc", "", "1.5", "0x40", " 64", "64 ", "+64", "1e2", "-"}) {
    expect_rejected("eval " + kSmall + " " + opt("--tokens", v) + " --out rep", {"--tokens", "expected an integer"});
    expect_rejected("calibrate " + kSmallCal + " " + opt("--calib-batches", v) + " --save c.json",
                    {"--calib-batches", "expected an integer"});
    expect_rejected("qdq " + opt("--sample-rows", v) + " --report r.json", {"--sample-rows", "expected an integer"});
    expect_rejected("bench engine-cpu " + opt("--reps", v), {"--reps", "expected an integer"});
  }
  expect_rejected("eval --tokens 99999999999999999999 --out rep", {"--tokens", "out of the integer range"});
  // An integer out of the option's range keeps its range check.
  expect_rejected("eval --tokens 0 --out rep", {"--tokens", "0"});
  // --seed and qdq --amax take the same forms.
  expect_rejected("eval --seed 0x10 --out rep", {"--seed", "0x10"});
  for (const std::string v : {"0x10", "inf", " 2", "1e", "+2"})
    expect_rejected("qdq " + opt("--amax", v) + " --report r.json", {"--amax", v});
  const RunResult r = moefq("qdq --device cpu --sample-rows 8 --sample-cols 256 --format fp8 --amax 1.5e1");
  EXPECT_EQ(r.status, 0) << describe(r);
}

// --pipeline was removed (one runner per device): with any value, on eval and calibrate, an old
// script is told why (exit 2, nothing written), not run on another path.
TEST_F(EvalInputs, RemovedPipelineOptionIsRefusedWithTheReason) {
  for (const std::string v : {"host", "device", "x"}) {
    const std::vector<std::string> why = {"--pipeline " + v, "removed", "the device runner gives the same bits",
                                          "drop --pipeline"};
    expect_rejected("eval " + kSmall + " --pipeline " + v + " --out rep", why);
    expect_rejected("calibrate " + kSmallCal + " --pipeline " + v + " --save c.json", why);
  }
  // The option is no longer offered.
  const RunResult help = moefq("eval --help");
  EXPECT_EQ(help.status, 0) << describe(help);
  EXPECT_EQ(help.out.find("--pipeline"), std::string::npos) << help.out;
}

TEST_F(EvalInputs, UnknownCommandsAreNamed) {
  for (const std::string cmd : {"evl", "EVAL", "frobnicate --tokens 4"}) {
    const std::string word = cmd.substr(0, cmd.find(' '));
    expect_rejected(cmd, {"unknown command '" + word + "'", "eval, calibrate, qdq, bench, launch"});
  }
  const RunResult r = expect_rejected("EVAL", {"did you mean 'eval'?"});
  EXPECT_EQ(r.err.find("A subcommand is required"), std::string::npos) << r.err;
}

TEST_F(EvalInputs, MemoryRefusalNamesTheCommandAndAdvisesOnlyWhatHelps) {
  // Far beyond any host, and beyond any GPU too.
  for (const std::string& cmd : {std::string("eval --device cpu --preset deepseek-v3 --tokens 1048576 --out rep"),
                                 std::string("calibrate --device cpu --preset deepseek-v3 --tokens 1048576 --save c.json")}) {
    const std::string name = "moefq " + cmd.substr(0, cmd.find(' '));
    const RunResult r = expect_rejected(cmd, {name + ": needs ", "of host memory"});
    EXPECT_EQ(r.err.find("--device cuda"), std::string::npos) << "no GPU could take it\n" << r.err;
    if (cmd.rfind("calibrate", 0) == 0) {
      EXPECT_EQ(r.err.find("moefq eval"), std::string::npos) << r.err;
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Options that did nothing are refused; the default table's "none" is a recipe name.

TEST_F(EvalInputs, OptionsThatWouldDoNothingAreRefused) {
  expect_rejected("eval " + kSmall + " --recipe-root /nonexistent/moefq --out rep", {"--recipe-root", "/nonexistent/moefq"});
  expect_rejected("eval " + kSmall + " --recipe-root '' --out rep", {"--recipe-root"});
  std::ofstream(path("file.txt")) << "x\n";
  expect_rejected("eval " + kSmall + " --recipe moe_combine_fp8 --recipe-root file.txt --out rep", {"--recipe-root", "file.txt"});
  const std::vector<float> v(256, 1.0f);
  SafetensorsWriter w;
  w.add("t", StDtype::kF32, {2, 128}, span_of(v));
  w.write(path("in.safetensors").string());
  expect_rejected("qdq --in in.safetensors --out o.safetensors --format fp8 --sample-rows 5",
                  {"--sample-rows", "--in"});
  expect_rejected("qdq --in in.safetensors --out o.safetensors --format fp8 --sample-cols 128",
                  {"--sample-cols", "--in"});
}

TEST_F(EvalInputs, RecipeNoneIsTheUnquantizedBaseline) {
  const RunResult r = moefq("eval " + kSmall + " --recipe none --recipe moe_combine_fp8 --out rep");
  ASSERT_EQ(r.status, 0) << describe(r);
  const json j = json::parse(read_text(path("rep") / "report.json"));
  ASSERT_EQ(j.at("results").size(), 2u);
  bool seen = false;
  for (const json& row : j.at("results"))
    if (row.at("recipe") == "none") {
      seen = true;
      EXPECT_EQ(row.at("rel_l2"), 0.0);
    }
  EXPECT_TRUE(seen) << j.at("results").dump();
}

}  // namespace
}  // namespace moefq
