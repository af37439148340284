// The text output of `moefq eval` (src/cli/eval_table.cpp) on results made here: the default
// table fits 120 columns for the default sweep at deepseek-v3's size with a budget, the wide table
// has every column, no_outl shows "-" for a layer without outlier channels and its figure for one
// with them, the legend's lines stay within 100 characters, and the clipped fractions and the
// table's alignment are as documented.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cli/cli_test_util.h"
#include "cli/eval_table.h"
#include "cli/table.h"
#include "moefq/eval.h"

namespace moefq {
namespace {

using cli::eval_footer_lines, cli::eval_table_lines, test::split_words;

const std::vector<std::string> kDefaultColumns = {"layer",  "recipe", "disp",   "comb",    "rel_l2",
                                                  "tok_p99", "tok_max", "no_outl", "cosine", "clip_d",
                                                  "clip_c", "B/token", "saving", "layout"};
const std::vector<std::string> kWideColumns = {
    "layer",   "recipe",  "disp",    "comb",   "disp_amax", "comb_amax", "rel_l2", "tok_p50", "tok_p99", "tok_max",
    "no_outl", "cosine",  "calc_diff", "snr_db", "clip_d",  "clip_c",    "B/token", "saving", "layout"};

// The default sweep over `layers` at hidden size H: the widest figures each column takes on such
// runs (5-digit bytes, 4 significant digits, a clipped fraction of 1.2e-05, two-digit layers).
// Layer l has l outlier channels.
EvalResult sweep_result(int64_t H, const std::vector<int64_t>& layers, bool budget) {
  EvalResult r;
  r.setup.config.hidden = H;
  r.setup.layers = layers;
  if (budget) r.setup.max_rel_l2 = 0.05;
  std::vector<std::string> names = {"none"};
  for (const char* f : {"fp8", "nvfp4", "mxfp8", "mxfp4"})
    for (const char* side : {"dispatch", "combine", "both"}) names.push_back(std::string(side) + "_" + f);
  for (int64_t l : layers)
    for (size_t i = 0; i < names.size(); ++i) {
      EvalRow row;
      row.layer = l;
      row.recipe = names[i];
      if (i > 0) {
        const std::string f = names[i].substr(names[i].find('_') + 1);
        if (names[i].rfind("combine", 0) != 0) row.dispatch_format = f;
        if (names[i].rfind("dispatch", 0) != 0) row.combine_format = f;
        if (f == "fp8" || f == "nvfp4") {
          if (row.dispatch_format) {
            row.dispatch_amax = 1234.5678f;
            row.dispatch_clipped_fraction = 1.234e-5;
          }
          if (row.combine_format) {
            row.combine_amax = 16.25f;
            row.combine_clipped_fraction = 5.96e-8;
          }
        }
      }
      row.metrics.rel_l2 = i == 0 ? 0.0 : 0.01234 + 0.012345 * double(i);
      row.metrics.cosine = 1 - row.metrics.rel_l2 * row.metrics.rel_l2 / 2;
      row.metrics.calc_diff = 1.2345e-5 * double(i);
      row.metrics.snr_db = i == 0 ? INFINITY : -20 * std::log10(row.metrics.rel_l2);
      row.rel_l2_token_p50 = row.metrics.rel_l2 * 1.1;
      row.rel_l2_token_p99 = row.metrics.rel_l2 * 1.5;
      row.rel_l2_token_max = row.metrics.rel_l2 * 1.7;
      row.num_outlier_channels = l;
      row.rel_l2_non_outlier = row.metrics.rel_l2 * 0.75;
      row.dispatch_wire_bytes_per_token = row.dispatch_format ? H + 4.0 * H / 128 : 2.0 * H;
      row.combine_wire_bytes_per_token = row.combine_format ? H + 4.0 * H / 128 : 2.0 * H;
      row.wire_saving = 1 - (row.dispatch_wire_bytes_per_token + row.combine_wire_bytes_per_token) / (4.0 * H);
      row.layout_check = row.combine_format ? "pass" : "n/a";
      row.over_budget = budget && row.metrics.rel_l2 > 0.05;
      r.rows.push_back(row);
    }
  r.cheapest_within_budget = "both_fp8";
  r.wall_seconds = 8.34;
  return r;
}

// The lines' words joined by single spaces (a wrapped sentence reads as one).
std::string flat(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines)
    for (const std::string& w : split_words(l)) s += (s.empty() ? "" : " ") + w;
  return s;
}

size_t widest(const std::vector<std::string>& lines) {
  size_t w = 0;
  for (const std::string& l : lines) w = std::max(w, l.size());
  return w;
}

TEST(EvalTable, DefaultTableFits120ColumnsAtDeepseekV3Size) {
  for (const bool budget : {false, true}) {
    SCOPED_TRACE(budget ? "with a budget" : "without a budget");
    for (const EvalResult& r : {sweep_result(1024, {0}, budget), sweep_result(7168, {3, 60}, budget)}) {
      const std::vector<std::string> lines = eval_table_lines(r, false);
      ASSERT_EQ(lines.size(), 2 + r.rows.size());
      EXPECT_LE(widest(lines), 120u) << lines[0];
      std::vector<std::string> head = kDefaultColumns;
      if (budget) head.push_back("budget");
      EXPECT_EQ(split_words(lines[0]), head);
      EXPECT_EQ(lines[1], std::string(lines[1].size(), '-'));
      for (size_t i = 2; i < lines.size(); ++i) EXPECT_EQ(split_words(lines[i]).size(), head.size()) << lines[i];
    }
  }
}

TEST(EvalTable, WideTableHasEveryColumn) {
  const EvalResult r = sweep_result(7168, {3}, true);
  const std::vector<std::string> lines = eval_table_lines(r, true);
  std::vector<std::string> head = kWideColumns;
  head.push_back("budget");
  EXPECT_EQ(split_words(lines[0]), head);
  // The row of both_fp8 (index 3 in the sweep, the 4th row here): every figure in its column.
  const std::vector<std::string> w = split_words(lines[2 + 3]);
  ASSERT_EQ(w.size(), head.size()) << lines[2 + 3];
  const EvalRow& row = r.rows[3];
  ASSERT_EQ(row.recipe, "both_fp8");
  const auto at = [&](const std::string& col) { return w[size_t(std::find(head.begin(), head.end(), col) - head.begin())]; };
  EXPECT_EQ(at("disp"), "fp8");
  EXPECT_EQ(at("disp_amax"), "1234.57");
  EXPECT_EQ(at("comb_amax"), "16.25");
  EXPECT_EQ(at("rel_l2"), cli::fmt_num(row.metrics.rel_l2));
  EXPECT_EQ(at("tok_p50"), cli::fmt_num(row.rel_l2_token_p50));
  EXPECT_EQ(at("calc_diff"), cli::fmt_num(row.metrics.calc_diff));
  EXPECT_EQ(at("snr_db"), cli::fmt_fixed(row.metrics.snr_db, 2));
  EXPECT_EQ(at("clip_d"), "1.2e-5");
  EXPECT_EQ(at("clip_c"), "6.0e-8");
  EXPECT_EQ(at("B/token"), "14784");
  EXPECT_EQ(at("saving"), "48.4%");
  EXPECT_EQ(at("budget"), "ok");
  EXPECT_EQ(cli::eval_wide_only_columns(), (std::vector<std::string>{"disp_amax", "comb_amax", "tok_p50", "calc_diff",
                                                                       "snr_db"}));
}

TEST(EvalTable, NoOutlShowsADashWithoutOutlierChannels) {
  // Layer 0 has no outlier channel, layer 2 has two: "-" there, the figure here, in both tables.
  const EvalResult r = sweep_result(1024, {0, 2}, false);
  for (const bool wide : {false, true}) {
    const std::vector<std::string> lines = eval_table_lines(r, wide);
    const std::vector<std::string> head = split_words(lines[0]);
    const size_t col = size_t(std::find(head.begin(), head.end(), "no_outl") - head.begin());
    ASSERT_LT(col, head.size());
    for (size_t i = 0; i < r.rows.size(); ++i) {
      const std::vector<std::string> w = split_words(lines[2 + i]);
      SCOPED_TRACE(lines[2 + i]);
      EXPECT_EQ(w[col], r.rows[i].num_outlier_channels == 0 ? "-" : cli::fmt_num(r.rows[i].rel_l2_non_outlier));
    }
  }
  // The legend says how the channels are found and how many were.
  const std::string legend = flat(eval_footer_lines(r, false));
  EXPECT_NE(legend.find("6x the median channel's, at most 1% of the channels"), std::string::npos) << legend;
  EXPECT_NE(legend.find("found: 0 to 2 of 1024 per layer"), std::string::npos) << legend;
  const std::string one = flat(eval_footer_lines(sweep_result(1024, {0}, false), false));
  EXPECT_NE(one.find("found: 0 of 1024 in layer 0"), std::string::npos) << one;
}

TEST(EvalTable, LegendWrapsAt100AndEndsWithTheTime) {
  for (const bool wide : {false, true})
    for (const bool budget : {false, true}) {
      const EvalResult r = sweep_result(7168, {0, 1, 2}, budget);
      const std::vector<std::string> lines = eval_footer_lines(r, wide);
      SCOPED_TRACE(std::string(wide ? "wide" : "default") + (budget ? ", budget" : ""));
      EXPECT_LE(widest(lines), 100u);
      EXPECT_EQ(lines.back(), "done in 8.3 s");
      std::string all;
      for (const std::string& l : lines) all += l + "\n";
      EXPECT_EQ(all.find("over 3 layers, best first:") != std::string::npos, true) << all;
      EXPECT_EQ(all.find("answer: both_fp8 is the cheapest recipe within rel_l2 <= 0.05") != std::string::npos, budget);
      EXPECT_EQ(all.find("budget:") != std::string::npos, budget);
      EXPECT_EQ(all.find("calc_diff:") != std::string::npos, wide) << "the wide table's columns are explained";
      EXPECT_EQ(all.find("--wide adds disp_amax, comb_amax, tok_p50, calc_diff, snr_db") != std::string::npos, !wide);
    }
}

TEST(EvalTable, ClippedFractionsInSixCharacters) {
  EXPECT_EQ(cli::fmt_fraction(0), "0");
  EXPECT_EQ(cli::fmt_fraction(5.96e-8), "6.0e-8");
  EXPECT_EQ(cli::fmt_fraction(1.234e-5), "1.2e-5");
  EXPECT_EQ(cli::fmt_fraction(0.0123), "0.012");
  EXPECT_EQ(cli::fmt_fraction(0.5), "0.5");
  EXPECT_EQ(cli::fmt_fraction(1), "1");
  EXPECT_EQ(cli::fmt_fraction(NAN), "nan");
  for (double v = 1e-9; v <= 1; v *= 1.37) EXPECT_LE(cli::fmt_fraction(v).size(), 6u) << v;
}

TEST(TextTable, DashTakesItsColumnsAlignmentAndGapsAreHonoured) {
  cli::Table t({"name", "format", "value", "clip"}, 1);
  t.add({"a", "-", "-", "-"});
  t.add({"bb", "mxfp8", "12.5", "-"});
  const std::vector<std::string> lines = t.lines();
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], "name format value clip");
  EXPECT_EQ(lines[1], "----------------------");
  // A dash under words is left-aligned, under numbers or alone right-aligned.
  EXPECT_EQ(lines[2], "a    -          -    -");
  EXPECT_EQ(lines[3], "bb   mxfp8   12.5    -");
}

TEST(TextTable, WrapKeepsWordsAndWidth) {
  const std::string text = "rel_l2 outside the layer's outlier output channels: RMS over the reference output more "
                           "than 6x the median channel's";
  const std::vector<std::string> lines = cli::wrap_text("no_outl: ", "         ", text, 40);
  std::string joined;
  for (const std::string& l : lines) {
    EXPECT_LE(l.size(), 40u) << l;
    joined += l.substr(9) + " ";
  }
  EXPECT_EQ(lines[0].substr(0, 9), "no_outl: ");
  for (size_t i = 1; i < lines.size(); ++i) EXPECT_EQ(lines[i].substr(0, 9), "         ");
  EXPECT_EQ(joined, text + " ");
}

}  // namespace
}  // namespace moefq
