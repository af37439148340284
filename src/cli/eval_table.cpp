#include "cli/eval_table.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>

#include "cli/table.h"

namespace moefq::cli {
namespace {

// One column of the results table: its header, whether only the wide table has it, its cell.
// Columns that only some runs have: a link's transfer times, logfmt10's cast fractions, the
// calibration method of each row (when the run uses a method beyond max).
enum class Only { kAlways, kLink, kCast, kCalibration };
struct Column {
  const char* header;
  bool wide_only;
  std::function<std::string(const EvalRow&)> cell;
  Only only = Only::kAlways;
};

std::string opt(const std::optional<std::string>& v) { return v ? *v : "-"; }
std::string opt(const std::optional<float>& v) { return v ? fmt_num(*v, 6) : "-"; }
std::string opt_fraction(const std::optional<double>& v) { return v ? fmt_fraction(*v) : "-"; }

// In the order of the wide table; the default table leaves out the wide_only ones. The error
// figures keep 4 significant digits (rel_l2 orders the rows); 1-space gaps keep the default table
// within 120 columns.
const std::vector<Column>& columns() {
  static const std::vector<Column> cols = {
      {"layer", false, [](const EvalRow& r) { return std::to_string(r.layer); }},
      {"recipe", false, [](const EvalRow& r) { return r.recipe; }},
      {"disp", false, [](const EvalRow& r) { return opt(r.dispatch_format); }},
      {"comb", false, [](const EvalRow& r) { return opt(r.combine_format); }},
      // "p99.99" for "percentile 99.99": the column stays narrow.
      {"calib", false,
       [](const EvalRow& r) {
         if (r.calibration.empty()) return std::string("-");
         return r.calibration.rfind("percentile ", 0) == 0 ? "p" + r.calibration.substr(11) : r.calibration;
       },
       Only::kCalibration},
      {"disp_amax", true, [](const EvalRow& r) { return opt(r.dispatch_amax); }},
      {"comb_amax", true, [](const EvalRow& r) { return opt(r.combine_amax); }},
      {"rel_l2", false, [](const EvalRow& r) { return fmt_num(r.metrics.rel_l2); }},
      {"tok_p50", true, [](const EvalRow& r) { return fmt_num(r.rel_l2_token_p50); }},
      {"tok_p99", false, [](const EvalRow& r) { return fmt_num(r.rel_l2_token_p99); }},
      {"tok_max", false, [](const EvalRow& r) { return fmt_num(r.rel_l2_token_max); }},
      // Without outlier channels the figure would repeat rel_l2 and look like a finding.
      {"no_outl", false,
       [](const EvalRow& r) { return r.num_outlier_channels > 0 ? fmt_num(r.rel_l2_non_outlier) : std::string("-"); }},
      {"cosine", false, [](const EvalRow& r) { return fmt_fixed(r.metrics.cosine, 6); }},
      {"calc_diff", true, [](const EvalRow& r) { return fmt_num(r.metrics.calc_diff); }},
      {"snr_db", true, [](const EvalRow& r) { return fmt_fixed(r.metrics.snr_db, 2); }},
      {"clip_d", false, [](const EvalRow& r) { return opt_fraction(r.dispatch_clipped_fraction); }},
      {"clip_c", false, [](const EvalRow& r) { return opt_fraction(r.combine_clipped_fraction); }},
      {"B/token", false,
       [](const EvalRow& r) { return fmt_num(r.dispatch_wire_bytes_per_token + r.combine_wire_bytes_per_token, 6); }},
      {"saving", false, [](const EvalRow& r) { return fmt_fixed(100.0 * r.wire_saving, 1) + "%"; }},
      {"cast_d", false, [](const EvalRow& r) { return opt_fraction(r.dispatch_cast_fraction); }, Only::kCast},
      {"cast_c", false, [](const EvalRow& r) { return opt_fraction(r.combine_cast_fraction); }, Only::kCast},
      {"d_us", true, [](const EvalRow& r) { return fmt_fixed(r.dispatch_us, 1); }, Only::kLink},
      {"c_us", true, [](const EvalRow& r) { return fmt_fixed(r.combine_us, 1); }, Only::kLink},
      {"saved_us", false, [](const EvalRow& r) { return fmt_fixed(r.saved_us, 1); }, Only::kLink},
      {"layout", false, [](const EvalRow& r) { return r.layout_check; }},
  };
  return cols;
}

// "found: 0 in layer 0", "found: 2 in each layer", "found: 0 to 3 per layer".
std::string outliers_found(const EvalResult& r) {
  if (r.rows.empty()) return "";
  int64_t lo = r.rows.front().num_outlier_channels, hi = lo;
  for (const EvalRow& row : r.rows) {
    lo = std::min(lo, row.num_outlier_channels);
    hi = std::max(hi, row.num_outlier_channels);
  }
  const std::string of = " of " + std::to_string(r.setup.config.hidden);
  if (r.setup.layers.size() == 1) return "found: " + std::to_string(lo) + of + " in layer " + std::to_string(r.rows.front().layer);
  if (lo == hi) return "found: " + std::to_string(lo) + of + " in each layer";
  return "found: " + std::to_string(lo) + " to " + std::to_string(hi) + of + " per layer";
}

}  // namespace

std::vector<std::string> eval_wide_only_columns() {
  std::vector<std::string> names;
  for (const Column& c : columns())
    if (c.wide_only && c.only == Only::kAlways) names.push_back(c.header);
  return names;
}

std::string fmt_fraction(double v) {
  if (!std::isfinite(v)) return fmt_num(v);
  char buf[64];
  if (v == 0 || std::fabs(v) >= 0.01) {
    std::snprintf(buf, sizeof buf, "%.2g", v);
    return buf;
  }
  // "6.0e-08" -> "6.0e-8": the exponent without its sign padding.
  std::snprintf(buf, sizeof buf, "%.1e", v);
  std::string s = buf;
  const size_t e = s.find('e');
  std::string exp = s.substr(e + 1);
  const bool neg = exp[0] == '-';
  exp = exp.substr(1);
  while (exp.size() > 1 && exp[0] == '0') exp.erase(0, 1);
  return s.substr(0, e) + (neg ? "e-" : "e") + exp;
}

bool column_applies(const Column& c, const EvalResult& r) {
  switch (c.only) {
    case Only::kAlways: return true;
    case Only::kLink: return r.setup.link.enabled();
    case Only::kCast:
      return std::any_of(r.rows.begin(), r.rows.end(),
                         [](const EvalRow& x) { return x.dispatch_cast_fraction || x.combine_cast_fraction; });
    case Only::kCalibration: return r.setup.calibration != "max";
  }
  return true;
}

std::vector<std::string> eval_table_lines(const EvalResult& r, bool wide) {
  const bool budget = r.setup.max_rel_l2.has_value();
  std::vector<const Column*> cols;
  for (const Column& c : columns())
    if ((wide || !c.wide_only) && column_applies(c, r)) cols.push_back(&c);
  std::vector<std::string> head;
  for (const Column* c : cols) head.push_back(c->header);
  if (budget) head.push_back("budget");
  Table t(head, 1);
  for (const EvalRow& row : r.rows) {
    std::vector<std::string> cells;
    for (const Column* c : cols) cells.push_back(c->cell(row));
    if (budget) cells.push_back(row.over_budget ? "OVER" : "ok");
    t.add(cells);
  }
  return t.lines();
}

std::vector<std::string> eval_footer_lines(const EvalResult& r, bool wide) {
  std::vector<std::string> out;
  if (r.setup.layers.size() > 1) {
    out.push_back("");
    out.push_back("over " + std::to_string(r.setup.layers.size()) + " layers, best first:");
    Table sum({"recipe", "mean_rel_l2", "max_rel_l2", "min_cosine", "B/token"});
    for (const RecipeSummary& s : r.summary)
      sum.add({s.recipe, fmt_num(s.mean_rel_l2), fmt_num(s.max_rel_l2), fmt_fixed(s.min_cosine, 6),
               fmt_num(s.wire_bytes_per_token, 6)});
    for (const std::string& line : sum.lines()) out.push_back(line);
  }

  std::vector<std::pair<std::string, std::string>> legend = {
      {"rows", "per layer, best first by rel_l2, the relative L2 error against the unquantized layer"},
      {"disp/comb", "the dispatch and combine formats on the wire (-: bf16, not quantized)"}};
  if (wide)
    legend.push_back({"*_amax", "the global amax each quantizer used (-: none: a block-scaled format, or not "
                                "quantized)"});
  legend.push_back({"tok_*", std::string("rel_l2 of each evaluation token: ") +
                                 (wide ? "its median (p50), 99th percentile and max" : "its 99th percentile and max")});
  char rule[160];
  std::snprintf(rule, sizeof rule, "more than %gx the median channel's, at most %g%% of the channels",
                kOutlierChannelFactor, 100 * kOutlierChannelMaxFraction);
  legend.push_back({"no_outl", "rel_l2 outside the layer's outlier output channels: RMS over the reference output " +
                                   std::string(rule) + " (the largest); " + outliers_found(r) +
                                   ". -: the layer has none (the figure would be rel_l2)"});
  if (wide) {
    legend.push_back({"calc_diff", "1 - 2 sum(y'r') / sum(y'^2 + r'^2) with y' = y + 1, r' = r + 1"});
    legend.push_back({"snr_db", "10 log10(sum r^2 / sum (y - r)^2)"});
  }
  legend.push_back({"clip_*", "fraction of the elements beyond the quantizer's global amax, saturated (-: none)"});
  legend.push_back({"B/token", "dispatch + combine bytes per token per destination rank, scales included; saving: "
                               "vs bf16"});
  if (r.setup.calibration != "max")
    legend.push_back({"calib", "the calibration method of the row's amax (" + r.setup.calibration +
                                   "; pP: percentile P; -: the recipe has no calibrated amax)"});
  if (std::any_of(r.rows.begin(), r.rows.end(),
                  [](const EvalRow& x) { return x.dispatch_cast_fraction || x.combine_cast_fraction; }))
    legend.push_back({"cast_*", "logfmt10: the fraction of cast groups actually cast (calibration data); the rest go "
                                "as bf16 and B/token counts them so"});
  if (r.setup.link.enabled())
    legend.push_back({"saved_us", "dispatch + combine transfer time saved per batch against bf16 on " +
                                      r.setup.link.describe() + (wide ? "; d_us, c_us: each one's time" : "") +
                                      " (docs/eval.md: the model)"});
  legend.push_back({"layout", "pass: combine rows read from the engine's buffer, layout checked; n/a: combine off"});
  if (r.setup.max_rel_l2) legend.push_back({"budget", "OVER: rel_l2 > " + fmt_num(*r.setup.max_rel_l2, 6)});
  legend.push_back({"more", wide ? "--out DIR writes every figure at full precision (JSON, CSV, HTML)"
                                 : "--wide adds " + join(eval_wide_only_columns(), ", ") +
                                       "; --out DIR: JSON, CSV, HTML"});
  size_t key = 0;
  for (const auto& [k, v] : legend) key = std::max(key, k.size() + 2);
  out.push_back("");
  for (const auto& [k, v] : legend) {
    std::string first = k + ":";
    first.resize(key, ' ');
    for (std::string& line : wrap_text(first, std::string(key, ' '), v, kLegendWidth)) out.push_back(std::move(line));
  }

  if (r.setup.max_rel_l2) {
    const std::string within = "within rel_l2 <= " + fmt_num(*r.setup.max_rel_l2, 6) + " on every layer";
    out.push_back("");
    out.push_back(r.cheapest_within_budget ? "answer: " + *r.cheapest_within_budget + " is the cheapest recipe " + within
                                           : "answer: no recipe stays " + within);
  }
  char done[64];
  std::snprintf(done, sizeof done, "done in %.1f s", r.wall_seconds);
  out.push_back(done);
  return out;
}

}  // namespace moefq::cli
