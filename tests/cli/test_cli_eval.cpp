// End-to-end tests of `moefq eval` and `moefq calibrate`: the real binary runs in a fresh
// directory per test. The default run's table, report.json and report.csv must agree; a checkpoint
// directory and an activations file written here must be what the run uses; calibrate-then-eval
// must give the numbers of one eval; a layout mismatch exits 1; every bad argument exits 2 with a
// message naming it and leaves the directory as it was.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint_test_util.h"
#include "cli_test_util.h"
#include "moefq_binary.h"
#include "moefq/moe_config.h"
#include "moefq/safetensors.h"
#include "moefq/synthetic.h"
#include "moefq/weights.h"
#include "test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::kSmallConfigJson, test::small_config, test::write_checkpoint;

using test::describe, test::quote, test::read_text, test::RunResult, test::span_of, test::split_lines,
    test::split_words;

// Small settings that keep a run to a second or two on 2 cores.
const std::string kSmallCal = "--device cpu --ranks 2 --tokens 32 --calib-batches 1";
const std::string kSmall = kSmallCal + " --eval-batches 1";

class EvalCli : public test::WorkDirTest {
 protected:
  EvalCli() : WorkDirTest("moefq_eval_") {}

  // Runs `[env] moefq ARGS` in work_.
  RunResult moefq(const std::string& args, const std::string& env = "") const {
    return run_in_work(env + " " + test::moefq_command(args));
  }

  json report(const std::string& dir) const { return json::parse(read_text(path(dir) / "report.json")); }
};

// The table on stdout: header words, then one word list per row.
struct TextTable {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  std::string col(size_t row, const std::string& name) const {
    const auto it = std::find(header.begin(), header.end(), name);
    return it == header.end() ? "<no column " + name + ">" : rows[row][size_t(it - header.begin())];
  }
};

TextTable parse_table(const std::string& out) {
  TextTable t;
  const auto lines = split_lines(out);
  size_t i = 0;
  while (i < lines.size() && (split_words(lines[i]).empty() || split_words(lines[i])[0] != "layer")) ++i;
  if (i >= lines.size()) return t;
  t.header = split_words(lines[i]);
  for (i += 2; i < lines.size() && !split_words(lines[i]).empty(); ++i) t.rows.push_back(split_words(lines[i]));
  return t;
}

std::string g4(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

std::vector<std::string> default_recipes() {
  std::vector<std::string> names = {"none"};
  for (const char* f : {"fp8", "nvfp4", "mxfp8", "mxfp4"})
    for (const char* side : {"dispatch", "combine", "both"}) names.push_back(std::string(side) + "_" + f);
  return names;
}

// ------------------------------------------------------------------------------------------------
// The default run.

TEST_F(EvalCli, DefaultRunTableJsonAndCsvAgree) {
  const RunResult r = moefq("eval --out rep");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.err.find("[30/30] layer 0 batch 2/2 "), std::string::npos) << "progress on stderr:\n" << r.err;
  EXPECT_NE(r.err.find(" s, eta "), std::string::npos) << "progress shows an ETA:\n" << r.err;
  EXPECT_EQ(listing(), (std::vector<std::string>{"rep", "rep/report.csv", "rep/report.html", "rep/report.json"}));

  const TextTable t = parse_table(r.out);
  ASSERT_EQ(t.rows.size(), 13u) << r.out;
  // The default table: the columns that say what each recipe costs and saves, within 120
  // columns; the legend wrapped at 100, the time on its own last line.
  EXPECT_EQ(t.header, (std::vector<std::string>{"layer", "recipe", "disp", "comb", "rel_l2", "tok_p99", "tok_max",
                                                 "no_outl", "cosine", "clip_d", "clip_c", "B/token", "saving",
                                                 "layout"}));
  const auto out_lines = split_lines(r.out);
  for (const std::string& line : out_lines) EXPECT_LE(line.size(), 120u) << line;
  const size_t legend_at = size_t(std::find_if(out_lines.begin(), out_lines.end(), [](const std::string& l) {
                                    return l.rfind("rows:", 0) == 0;
                                  }) - out_lines.begin());
  ASSERT_LT(legend_at, out_lines.size()) << r.out;
  for (size_t i = legend_at; i < out_lines.size(); ++i) EXPECT_LE(out_lines[i].size(), 100u) << out_lines[i];
  EXPECT_EQ(out_lines.back().rfind("done in ", 0), 0u) << out_lines.back();
  const json j = report("rep");
  EXPECT_EQ(j.at("tool"), "moefq eval");
  EXPECT_EQ(j.at("version"), MOEFQ_VERSION);
  EXPECT_FALSE(j.at("device").get<std::string>().empty());
  const json& cfg = j.at("config");
  EXPECT_EQ(cfg.at("model").at("name"), "tiny");
  EXPECT_EQ(cfg.at("ranks"), 4);
  EXPECT_EQ(cfg.at("layers"), json::array({0}));
  EXPECT_EQ(cfg.at("recipes").size(), 13u);
  const json& res = j.at("results");
  ASSERT_EQ(res.size(), 13u) << j.dump(2);

  // Every recipe present once, in the same order as the table, best first.
  std::vector<std::string> names;
  double prev = -1;
  for (size_t i = 0; i < res.size(); ++i) {
    const json& row = res[i];
    SCOPED_TRACE(row.dump());
    names.push_back(row.at("recipe"));
    EXPECT_EQ(t.col(i, "recipe"), row.at("recipe").get<std::string>());
    EXPECT_EQ(t.col(i, "layer"), "0");
    ASSERT_TRUE(row.at("rel_l2").is_number());
    const double rel = row.at("rel_l2");
    EXPECT_GE(rel, prev) << "rows must be sorted best first";
    prev = rel;
    EXPECT_EQ(t.col(i, "rel_l2"), g4(rel));
    EXPECT_EQ(t.col(i, "tok_p99"), g4(row.at("rel_l2_token_p99").get<double>()));
    // The tiny preset's layer 0 has no outlier output channel: no_outl is rel_l2 itself, shown "-".
    EXPECT_EQ(row.at("num_outlier_channels"), 0);
    EXPECT_EQ(row.at("rel_l2_non_outlier"), row.at("rel_l2"));
    EXPECT_EQ(t.col(i, "no_outl"), "-");
    // The error's shape, clipping and wire bytes: every field, finite.
    for (const char* k : {"rel_l2_token_p50", "rel_l2_token_p99", "rel_l2_token_max", "rel_l2_non_outlier",
                          "dispatch_wire_bytes_per_token", "combine_wire_bytes_per_token", "wire_saving_vs_bf16"})
      EXPECT_TRUE(row.at(k).is_number() && std::isfinite(row.at(k).get<double>())) << k;
    for (const char* side : {"dispatch", "combine"}) {
      const json& clip = row.at(std::string(side) + "_clipped_fraction");
      EXPECT_EQ(clip.is_null(), row.at(std::string(side) + "_amax").is_null()) << side;
      if (!clip.is_null()) {
        EXPECT_TRUE(clip.get<double>() >= 0 && clip.get<double>() <= 1) << side;
      }
    }
    EXPECT_EQ(row.at("count"), 2 * 4 * 256 * 1024) << "metrics over the whole evaluation set";
    const bool comb = !row.at("combine_format").is_null();
    EXPECT_EQ(row.at("layout_check"), comb ? "pass" : "n/a");
    EXPECT_EQ(t.col(i, "layout"), comb ? "pass" : "n/a");
    if (row.at("recipe") == "none") {
      EXPECT_EQ(rel, 0.0);
      EXPECT_EQ(row.at("cosine").get<double>(), 1.0);
      EXPECT_EQ(row.at("calc_diff").get<double>(), 0.0);
      EXPECT_EQ(row.at("max_abs").get<double>(), 0.0);
      EXPECT_EQ(row.at("snr_db"), "inf");
      EXPECT_TRUE(row.at("dispatch_format").is_null());
      EXPECT_TRUE(row.at("combine_format").is_null());
    } else {
      EXPECT_GT(rel, 0.0) << "a quantized recipe changes the output";
      EXPECT_LT(rel, 0.5);
      EXPECT_GT(row.at("cosine").get<double>(), 0.9);
    }
    // fp8/nvfp4 use the calibrated amax, the mx formats none.
    const std::string rec = row.at("recipe");
    const bool global = rec.find("fp8") != std::string::npos && rec.find("mxfp8") == std::string::npos;
    const bool nv = rec.find("nvfp4") != std::string::npos;
    if ((global || nv) && !row.at("combine_format").is_null()) {
      EXPECT_EQ(row.at("combine_amax"), j.at("calibration")[0].at("combine_amax"));
    }
    if ((global || nv) && !row.at("dispatch_format").is_null()) {
      EXPECT_EQ(row.at("dispatch_amax"), j.at("calibration")[0].at("dispatch_amax"));
    }
    if (rec.rfind("none", 0) == 0 || rec.find("mx") != std::string::npos) {
      EXPECT_TRUE(row.at("dispatch_amax").is_null());
      EXPECT_TRUE(row.at("combine_amax").is_null());
    }
  }
  std::vector<std::string> want = default_recipes(), got = names;
  std::sort(want.begin(), want.end());
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, want);
  EXPECT_EQ(names.front(), "none");

  // The calibration: per-rank maxima, reduced with MAX.
  const json& cal = j.at("calibration").at(0);
  for (const char* side : {"dispatch", "combine"}) {
    const auto ranks = cal.at(std::string(side) + "_rank_amax").get<std::vector<double>>();
    ASSERT_EQ(ranks.size(), 4u);
    EXPECT_EQ(*std::max_element(ranks.begin(), ranks.end()), cal.at(std::string(side) + "_amax").get<double>());
    EXPECT_GT(cal.at(std::string(side) + "_amax").get<double>(), 0.0);
  }

  // report.csv: the same rows, full precision.
  const auto csv = split_lines(read_text(path("rep") / "report.csv"));
  ASSERT_EQ(csv.size(), 14u);
  EXPECT_EQ(csv[0].substr(0, 20), "layer,recipe,dispatc");
  // Fields by the header's names, empty ones kept (a line may end with some).
  const auto fields = [](const std::string& line) {
    std::vector<std::string> f(1);
    for (char c : line)
      if (c == ',')
        f.emplace_back();
      else
        f.back().push_back(c);
    return f;
  };
  const std::vector<std::string> head = fields(csv[0]);
  const auto col = [&](const char* name) {
    return size_t(std::find(head.begin(), head.end(), name) - head.begin());
  };
  ASSERT_EQ(head.size(), 31u) << csv[0];
  for (size_t i = 0; i < res.size(); ++i) {
    const std::vector<std::string> f = fields(csv[i + 1]);
    ASSERT_EQ(f.size(), head.size()) << csv[i + 1];
    EXPECT_EQ(f[col("combine_weighting")], "before");
    EXPECT_EQ(f[col("num_outlier_channels")], "0");
    EXPECT_EQ(f[1], res[i].at("recipe").get<std::string>());
    EXPECT_EQ(std::strtod(f[6].c_str(), nullptr), res[i].at("rel_l2").get<double>()) << csv[i + 1];
  }
  const std::string html = read_text(path("rep") / "report.html");
  EXPECT_NE(html.find("<svg"), std::string::npos);
  EXPECT_EQ(html.find("<script"), std::string::npos);
}

// --wide: every column, each equal to the report's figure; no_outl "-" exactly in the layers
// without outlier output channels (the tiny preset's layer 0 has none, layers 1 and 2 some), whose
// number the JSON and the CSV carry per row.
TEST_F(EvalCli, WideTableHasEveryColumnAndNoOutlMarksLayersWithoutOutliers) {
  const RunResult r = moefq("eval " + kSmall + " --layers 0-2 --recipe none --recipe moe_combine_fp8 "
                            "--recipe moe_dispatch_mxfp8 --wide --max-rel-l2 0.03 --out rep");
  ASSERT_EQ(r.status, 0) << describe(r);
  const TextTable t = parse_table(r.out);
  EXPECT_EQ(t.header, (std::vector<std::string>{"layer", "recipe", "disp", "comb", "disp_amax", "comb_amax",
                                                 "rel_l2", "tok_p50", "tok_p99", "tok_max", "no_outl", "cosine",
                                                 "calc_diff", "snr_db", "clip_d", "clip_c", "B/token", "saving",
                                                 "layout", "budget"}));
  const json j = report("rep");
  const json& res = j.at("results");
  ASSERT_EQ(t.rows.size(), 9u) << r.out;
  ASSERT_EQ(res.size(), 9u);
  const auto csv = split_lines(read_text(path("rep") / "report.csv"));
  ASSERT_EQ(csv.size(), 10u);
  EXPECT_NE(csv[0].find(",combine_weighting,num_outlier_channels,"), std::string::npos) << csv[0];
  int64_t with = 0, without = 0;
  for (size_t i = 0; i < res.size(); ++i) {
    const json& row = res[i];
    SCOPED_TRACE(row.dump());
    ASSERT_EQ(t.col(i, "recipe"), row.at("recipe").get<std::string>());
    const auto opt6 = [&](const char* k) {
      if (row.at(k).is_null()) return std::string("-");
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.6g", row.at(k).get<double>());
      return std::string(buf);
    };
    EXPECT_EQ(t.col(i, "disp_amax"), opt6("dispatch_amax"));
    EXPECT_EQ(t.col(i, "comb_amax"), opt6("combine_amax"));
    EXPECT_EQ(t.col(i, "rel_l2"), g4(row.at("rel_l2").get<double>()));
    EXPECT_EQ(t.col(i, "tok_p50"), g4(row.at("rel_l2_token_p50").get<double>()));
    EXPECT_EQ(t.col(i, "calc_diff"), g4(row.at("calc_diff").get<double>()));
    if (row.at("snr_db").is_string()) {
      EXPECT_EQ(t.col(i, "snr_db"), row.at("snr_db").get<std::string>());
    } else {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.2f", row.at("snr_db").get<double>());
      EXPECT_EQ(t.col(i, "snr_db"), buf);
    }
    EXPECT_EQ(t.col(i, "budget"), row.at("over_budget").get<bool>() ? "OVER" : "ok");
    const int64_t n = row.at("num_outlier_channels");
    EXPECT_LE(n, 10) << "at most 1% of 1024 channels";
    (n > 0 ? with : without)++;
    EXPECT_EQ(t.col(i, "no_outl"), n > 0 ? g4(row.at("rel_l2_non_outlier").get<double>()) : "-");
    if (n == 0) {
      EXPECT_EQ(row.at("rel_l2_non_outlier"), row.at("rel_l2"));
    }
    // num_outlier_channels, then the calibration method, the cast fractions and the times (empty).
    const std::string method = row.at("calibration").is_null() ? "" : row.at("calibration").get<std::string>();
    EXPECT_TRUE(csv[i + 1].ends_with("," + std::to_string(n) + "," + method + ",,,,,")) << csv[i + 1];
    EXPECT_EQ(n, res[i - i % 3].at("num_outlier_channels")) << "one count per layer";
  }
  EXPECT_EQ(without, 3) << "layer 0 has no outlier channel";
  EXPECT_EQ(with, 6) << "layers 1 and 2 have some";
  // The quantized rows of a layer with outlier channels: the error outside them differs.
  for (const json& row : res)
    if (row.at("num_outlier_channels") > 0 && row.at("recipe") != "none") {
      EXPECT_NE(row.at("rel_l2_non_outlier"), row.at("rel_l2")) << row.dump();
    }
  const std::string html = read_text(path("rep") / "report.html");
  EXPECT_NE(html.find("<th>outlier channels</th>"), std::string::npos);
}

// [rows, cols] synthetic activations as bf16 (or their exact f32 values) in tensor `name`.
void write_activations(const fs::path& p, const std::string& name, int64_t rows, int64_t cols, uint64_t seed,
                       bool f32 = false) {
  const auto b = test::to_bf16(synthetic_activations(rows, cols, seed));
  SafetensorsWriter w;
  if (f32) {
    std::vector<float> v(b.size());
    for (size_t i = 0; i < b.size(); ++i) v[i] = to_f32(b[i]);
    w.add(name, StDtype::kF32, {rows, cols}, span_of(v));
  } else {
    w.add(name, StDtype::kBF16, {rows, cols}, span_of(b));
  }
  w.write(p.string());
}

std::vector<json> rows_of_layer(const json& j, int64_t layer) {
  std::vector<json> rows;
  for (const json& r : j.at("results"))
    if (r.at("layer") == layer) {
      json x = r;
      x.erase("layer");
      rows.push_back(x);
    }
  return rows;
}

TEST_F(EvalCli, CheckpointLayersUseTheirOwnWeights) {
  // Layers 1 and 2 hold the same weights, layer 3 others; all layers see the same activations.
  write_checkpoint(path("ckpt"), {{1, 7}, {2, 7}, {3, 8}});
  write_activations(path("acts.safetensors"), "hidden_states", 128, 256, 5);
  const RunResult r = moefq("eval --checkpoint ckpt --layers 1-3 --activations acts.safetensors " + kSmall +
                            " --recipe moe_combine_fp8 --recipe moe_dispatch_nvfp4 --out rep");
  ASSERT_EQ(r.status, 0) << describe(r);
  const json j = report("rep");
  EXPECT_EQ(j.at("config").at("layers"), json::array({1, 2, 3}));
  EXPECT_EQ(j.at("config").at("model").at("hidden"), 256);
  EXPECT_NE(j.at("config").at("weights").get<std::string>().find("checkpoint"), std::string::npos);
  ASSERT_EQ(j.at("results").size(), 6u) << "one row per layer and recipe";
  const auto l1 = rows_of_layer(j, 1), l2 = rows_of_layer(j, 2), l3 = rows_of_layer(j, 3);
  ASSERT_EQ(l1.size(), 2u);
  EXPECT_EQ(l1, l2) << "the same weights and activations must give the same numbers";
  EXPECT_NE(l1, l3) << "layer 3's own weights must be used";
  for (const json& row : l1) EXPECT_GT(row.at("rel_l2").get<double>(), 0.0);
  // Several layers: the summary table on stdout and the per-layer line chart in the page.
  EXPECT_NE(r.out.find("over 3 layers"), std::string::npos) << r.out;
  EXPECT_EQ(j.at("summary").size(), 2u);
  const std::string html = read_text(path("rep") / "report.html");
  EXPECT_NE(html.find("Error per layer"), std::string::npos);
  EXPECT_NE(html.find("<polyline"), std::string::npos);

  // A layer the checkpoint lacks: bad input naming the tensor, and no report.
  const RunResult bad = moefq("eval --checkpoint ckpt --layers 4 --activations acts.safetensors " + kSmall + " --out rep2");
  EXPECT_EQ(bad.status, 2) << describe(bad);
  EXPECT_NE(bad.err.find("model.layers.4.mlp"), std::string::npos) << bad.err;
  EXPECT_FALSE(fs::exists(path("rep2")));
}

// ------------------------------------------------------------------------------------------------
// Activations from a file.

TEST_F(EvalCli, ActivationsFromAFile) {
  // tiny: H 1024; 2 ranks x 32 tokens x (1 + 1) batches = 128 tokens needed.
  write_activations(path("a_bf16.safetensors"), "layers.0", 128, 1024, 3);
  write_activations(path("a_f32.safetensors"), "layers.0", 128, 1024, 3, /*f32=*/true);
  write_activations(path("b.safetensors"), "hidden_states", 200, 1024, 4);
  const std::string recipes = " --recipe moe_combine_nvfp4 --recipe moe_dispatch_mxfp4";
  RunResult r = moefq("eval --activations a_bf16.safetensors " + kSmall + recipes + " --out x");
  ASSERT_EQ(r.status, 0) << describe(r);
  r = moefq("eval --activations a_f32.safetensors " + kSmall + recipes + " --out y");
  ASSERT_EQ(r.status, 0) << describe(r);
  r = moefq("eval --activations b.safetensors " + kSmall + recipes + " --out z");
  ASSERT_EQ(r.status, 0) << describe(r);
  r = moefq("eval " + kSmall + recipes + " --out s");
  ASSERT_EQ(r.status, 0) << describe(r);
  const json x = report("x"), y = report("y"), z = report("z"), s = report("s");
  EXPECT_EQ(x.at("config").at("activations"), "a_bf16.safetensors");
  EXPECT_EQ(x.at("results"), y.at("results")) << "F32 holding bf16 values must give the bf16 file's numbers";
  EXPECT_EQ(x.at("calibration"), y.at("calibration"));
  EXPECT_NE(x.at("results"), z.at("results")) << "other activations, other numbers";
  EXPECT_NE(x.at("results"), s.at("results")) << "the file, not the synthetic activations, must be used";
  // The calibrated dispatch amax is the max |x| over the calibration batch's routed tokens: every
  // token is routed, so it is the file's max over the calibration tokens (the first 64).
  const auto acts = test::to_bf16(synthetic_activations(128, 1024, 3));
  float mx = 0;
  for (size_t i = 0; i < 64 * 1024; ++i) mx = std::max(mx, std::fabs(to_f32(acts[i])));
  const double damax = x.at("calibration")[0].at("dispatch_amax");
  EXPECT_EQ(damax, double(mx));
}

// ------------------------------------------------------------------------------------------------
// calibrate, then eval with the saved file: the numbers of one eval.

TEST_F(EvalCli, CalibrateThenEvalMatchesOneEval) {
  RunResult r = moefq("calibrate " + kSmallCal + " --layers 0,2 --save calib.json");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.out.find("dispatch_amax"), std::string::npos) << r.out;
  const std::string opts = kSmall + " --layers 0,2";
  r = moefq("eval " + opts + " --load-calibration calib.json --out a");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.out.find("loaded from calib.json"), std::string::npos) << r.out;
  r = moefq("eval " + opts + " --out b");
  ASSERT_EQ(r.status, 0) << describe(r);
  const json a = report("a"), b = report("b");
  ASSERT_EQ(a.at("results").size(), 26u);
  EXPECT_EQ(a.at("results"), b.at("results"));
  EXPECT_EQ(a.at("calibration"), b.at("calibration"));
  // Loading a calibration for the layers it has (a subset) works; a missing layer does not.
  r = moefq("eval " + kSmall + " --layers 2 --recipe moe_combine_fp8 --load-calibration calib.json");
  EXPECT_EQ(r.status, 0) << describe(r);
  r = moefq("eval " + kSmall + " --layers 1 --load-calibration calib.json");
  EXPECT_EQ(r.status, 2) << describe(r);
  EXPECT_NE(r.err.find("no calibration for layer 1"), std::string::npos) << r.err;
}

// ------------------------------------------------------------------------------------------------
// --combine-weighting (or a recipe's combine_weighting): the mode is reported everywhere, and
// after (the rows unweighted, weighted after their QDQ) is another computation than before.

TEST_F(EvalCli, CombineWeightingAfterIsReportedAndChangesTheResult) {
  std::ofstream(path("after.yaml")) << "$import: [moe_combine_nvfp4]\nalgorithm: max\ncombine_weighting: after\n";
  const std::string opts = kSmall + " --recipe moe_combine_nvfp4";
  RunResult r = moefq("eval " + opts + " --combine-weighting after --out a");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.out.find("router weight applied after the combine"), std::string::npos) << r.out;
  r = moefq("eval " + opts + " --out b");
  ASSERT_EQ(r.status, 0) << describe(r);
  EXPECT_NE(r.out.find("router weight applied before the combine"), std::string::npos) << r.out;
  r = moefq("eval " + kSmall + " --recipe after.yaml --out c");  // the recipe says after
  ASSERT_EQ(r.status, 0) << describe(r);
  const json a = report("a"), b = report("b"), c = report("c");
  EXPECT_EQ(a.at("config").at("combine_weighting"), "after");
  EXPECT_EQ(b.at("config").at("combine_weighting"), "before");
  EXPECT_EQ(c.at("config").at("combine_weighting"), "after");
  ASSERT_EQ(a.at("results").size(), 1u);
  EXPECT_EQ(a.at("results")[0].at("combine_weighting"), "after");
  EXPECT_EQ(b.at("results")[0].at("combine_weighting"), "before");
  EXPECT_EQ(a.at("results")[0].at("layout_check"), "pass");
  // Unweighted rows: another combine amax and another error than before; the recipe's mode is
  // the flag's.
  EXPECT_NE(a.at("calibration")[0].at("combine_amax"), b.at("calibration")[0].at("combine_amax"));
  EXPECT_NE(a.at("results")[0].at("rel_l2"), b.at("results")[0].at("rel_l2"));
  EXPECT_EQ(a.at("results")[0].at("rel_l2"), c.at("results")[0].at("rel_l2"));
  const auto csv = split_lines(read_text(path("a") / "report.csv"));
  ASSERT_EQ(csv.size(), 2u);
  EXPECT_NE(csv[0].find(",combine_weighting,num_outlier_channels,"), std::string::npos) << csv[0];
  EXPECT_NE(csv[1].find(",after," + a.at("results")[0].at("num_outlier_channels").dump() + ","), std::string::npos)
      << csv[1];
}

// ------------------------------------------------------------------------------------------------
// A failed check: exit 1.

TEST_F(EvalCli, LayoutMismatchExitsOne) {
  // The engine's debug switch zeroes its buffers after each call: the combine rows the quantizer
  // reads are then not the rows the engine summed.
  const RunResult r = moefq("eval " + kSmall + " --out rep", "MOEFQ_COMM_KERNEL_DEBUG=1");
  EXPECT_EQ(r.status, 1) << describe(r);
  EXPECT_NE(r.err.find("layout check failed"), std::string::npos) << r.err;
  EXPECT_TRUE(listing().empty()) << "no report after a failed check";
}

// ------------------------------------------------------------------------------------------------
// Help.

TEST_F(EvalCli, HelpHasAnExample) {
  for (const std::string cmd : {"eval", "calibrate"}) {
    const RunResult r = moefq(cmd + " --help");
    EXPECT_EQ(r.status, 0) << describe(r);
    EXPECT_NE(r.out.find("Example"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("moefq " + cmd), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("--checkpoint"), std::string::npos) << r.out;
  }
  const RunResult top = moefq("--help");
  EXPECT_EQ(top.status, 0);
  EXPECT_NE(top.out.find("eval"), std::string::npos);
  EXPECT_LT(top.out.find("eval"), top.out.find("qdq")) << "the main job is listed first";
  // bench fake-quant is gone (moefq eval replaces it).
  const RunResult gone = moefq("bench fake-quant");
  EXPECT_EQ(gone.status, 2) << describe(gone);
}

// ------------------------------------------------------------------------------------------------
// Bad input: exit 2, a message naming the argument, nothing written.

class EvalBadInput : public EvalCli {
 protected:
  void SetUp() override {
    EvalCli::SetUp();
    std::ofstream(path("file.txt")) << "not a directory\n";
    std::ofstream(path("bad.yaml")) << "quant_cfg:\n  - quantizer_name: '*combine_quantizer'\n    enable: true\n"
                                       "    cfg: {num_bits: e4m3, axis: null, colour: blue}\nalgorithm: max\n";
    std::ofstream(path("dyn.yaml")) << "quant_cfg:\n  - quantizer_name: '*combine_quantizer'\n    enable: true\n"
                                       "    cfg: {num_bits: e4m3, axis: null, amax: dynamic}\nalgorithm: max\n";
    std::ofstream(path("config.json")) << kSmallConfigJson;
    std::ofstream(path("notjson.json")) << "{ nope";
    std::ofstream(path("othercal.json")) << R"({"version": 2, "kind": "moefq calibration",
        "setup": {"hidden": 7168, "num_experts": 256, "top_k": 8}, "quantizers": {}})";
    fs::create_directories(path("emptydir"));
    write_activations(path("acts.safetensors"), "layers.0", 100, 1024, 1);
    write_activations(path("acts256.safetensors"), "layers.0", 256, 256, 1);
    SafetensorsWriter w;
    const std::vector<int32_t> ints(128 * 1024, 1);
    w.add("hidden_states", StDtype::kI32, {128, 1024}, span_of(ints));
    w.write(path("ints.safetensors").string());
  }

  void expect_rejected(const std::string& args, const std::vector<std::string>& needles) {
    SCOPED_TRACE("moefq " + args);
    const auto before = listing();
    expect_bad_input(moefq(args), before, needles);
  }
};

TEST_F(EvalBadInput, Model) {
  expect_rejected("eval --preset nope --out rep", {"nope", "tiny"});
  expect_rejected("eval --preset tiny --config config.json --out rep", {"--preset", "--config"});
  expect_rejected("eval --preset tiny --checkpoint emptydir --layers 1 --out rep", {"--preset", "--checkpoint"});
  expect_rejected("eval --config config.json --checkpoint emptydir --layers 1", {"--config", "--checkpoint"});
  expect_rejected("eval --config missing.json --out rep", {"--config", "missing.json"});
  expect_rejected("eval --config notjson.json --out rep", {"notjson.json"});
  expect_rejected("eval --checkpoint emptydir --layers 1 --out rep", {"--checkpoint", "config.json"});
  expect_rejected("eval --checkpoint nowhere --layers 1 --out rep", {"--checkpoint", "nowhere"});
  expect_rejected("calibrate --checkpoint nowhere --layers 1 --save c.json", {"--checkpoint", "nowhere"});
}

TEST_F(EvalBadInput, CheckpointNeedsLayers) {
  write_checkpoint(path("ckpt"), {{1, 7}});
  expect_rejected("eval --checkpoint ckpt --out rep", {"--checkpoint", "--layers"});
}

TEST_F(EvalBadInput, Layers) {
  for (const std::string v : {"a", "3-", "-1", "5-3", "1,,2", "1,", "1.5", "0-99999"})
    expect_rejected("eval --layers=" + quote(v) + " --out rep", {"--layers"});
}

TEST_F(EvalBadInput, Sizes) {
  expect_rejected("eval --ranks 3 --out rep", {"--ranks", "3", "32"});
  expect_rejected("eval --ranks 0 --out rep", {"--ranks"});
  expect_rejected("eval --tokens 0 --out rep", {"--tokens"});
  expect_rejected("eval --tokens x --out rep", {"--tokens"});
  expect_rejected("eval --calib-batches 0 --out rep", {"--calib-batches"});
  expect_rejected("eval --eval-batches 0 --out rep", {"--eval-batches"});
  expect_rejected("eval --seed -1 --out rep", {"--seed"});
  expect_rejected("eval --threads -2 --out rep", {"--threads"});
  expect_rejected("eval --no-such-option", {"--no-such-option"});
  expect_rejected("calibrate --eval-batches 2 --save c.json", {"--eval-batches"});
}

TEST_F(EvalBadInput, Device) {
  expect_rejected("eval --device gpu --out rep", {"--device", "gpu"});
#ifndef MOEFQ_HAS_CUDA
  expect_rejected("eval --device cuda --out rep", {"--device cuda"});
#endif
}

TEST_F(EvalBadInput, Recipes) {
  expect_rejected("eval " + kSmall + " --recipe missing.yaml --out rep", {"missing.yaml"});
  expect_rejected("eval " + kSmall + " --recipe bad.yaml --out rep", {"bad.yaml", "colour"});
  expect_rejected("eval " + kSmall + " --recipe dyn.yaml --out rep", {"combine_quantizer", "dynamic"});
  expect_rejected("eval " + kSmall + " --recipe moe_combine_fp8 --recipe moe_combine_fp8 --out rep",
                  {"--recipe", "moe_combine_fp8"});
}

TEST_F(EvalBadInput, CombineWeighting) {
  std::ofstream(path("after.yaml")) << "$import: [moe_combine_nvfp4]\ncombine_weighting: after\n";
  std::ofstream(path("odd.yaml")) << "$import: [moe_combine_nvfp4]\ncombine_weighting: sideways\n";
  expect_rejected("eval " + kSmall + " --combine-weighting sideways --out rep", {"--combine-weighting", "sideways"});
  expect_rejected("calibrate " + kSmallCal + " --combine-weighting During --save c.json",
                  {"--combine-weighting", "During"});
  expect_rejected("eval " + kSmall + " --recipe odd.yaml --out rep", {"odd.yaml", "combine_weighting", "sideways"});
  expect_rejected("eval " + kSmall + " --recipe after.yaml --combine-weighting before --out rep",
                  {"recipe after", "combine_weighting: after", "--combine-weighting says before"});
  expect_rejected("eval " + kSmall + " --recipe moe_combine_fp8 --recipe after.yaml --recipe moe_combine_nvfp4 "
                  "--combine-weighting before --out rep", {"recipe after"});
}

TEST_F(EvalBadInput, Activations) {
  expect_rejected("eval " + kSmall + " --activations missing.safetensors --out rep", {"missing.safetensors"});
  expect_rejected("eval " + kSmall + " --activations file.txt --out rep", {"file.txt"});
  expect_rejected("eval " + kSmall + " --layers 1 --activations acts.safetensors --out rep",
                  {"--activations", "layers.1", "hidden_states", "layers.0"});
  expect_rejected("eval " + kSmall + " --activations acts256.safetensors --out rep", {"acts256.safetensors", "1024"});
  expect_rejected("eval " + kSmall + " --activations ints.safetensors --out rep", {"ints.safetensors", "I32"});
  // 100 tokens, but (1 + 1) batches x 2 ranks x 32 tokens = 128 are needed.
  expect_rejected("eval " + kSmall + " --activations acts.safetensors --out rep", {"acts.safetensors", "100", "128"});
}

TEST_F(EvalBadInput, OutputsAndCalibrationFiles) {
  expect_rejected("eval " + kSmall + " --out file.txt", {"--out", "file.txt", "not a directory"});
  expect_rejected("eval " + kSmall + " --out file.txt/sub", {"--out", "file.txt"});
  expect_rejected("calibrate " + kSmallCal, {"--save"});
  expect_rejected("calibrate " + kSmallCal + " --save emptydir", {"--save", "directory"});
  expect_rejected("calibrate " + kSmallCal + " --save nowhere/c.json", {"--save", "nowhere"});
  expect_rejected("eval " + kSmall + " --load-calibration missing.json --out rep", {"--load-calibration", "missing.json"});
  expect_rejected("eval " + kSmall + " --load-calibration notjson.json --out rep", {"--load-calibration", "notjson.json"});
  expect_rejected("eval " + kSmall + " --load-calibration config.json --out rep", {"--load-calibration", "config.json"});
  expect_rejected("eval " + kSmall + " --load-calibration othercal.json --out rep", {"othercal.json", "hidden", "7168"});
}

}  // namespace
}  // namespace moefq
