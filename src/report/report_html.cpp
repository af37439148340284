// report.html of `moefq eval` (report.h): one self-contained page, its charts inline SVG
// (svg_charts.h), so it needs no script, font or file besides itself.
#include "moefq/report.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "report/report_text.h"
#include "report/svg_charts.h"

namespace moefq {
namespace {

using report::Bar, report::Point, report::Series, report::esc, report::fmt, report::utc_now;
using report::bar_chart, report::line_chart, report::rank_chart, report::tradeoff_chart;

// Colour of a recipe: by the format it quantizes (the sweep's families), else a palette slot.
std::string recipe_colour(const std::string& format, size_t index) {
  static const std::map<std::string, std::string> by_format = {
      {"fp8", "#4e79a7"}, {"nvfp4", "#f28e2b"}, {"mxfp8", "#59a14f"}, {"mxfp4", "#e15759"}, {"int8", "#b07aa1"}};
  static const char* palette[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
                                  "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac", "#1b9e77", "#7570b3"};
  const auto it = by_format.find(format);
  return it != by_format.end() ? it->second : palette[index % 12];
}

std::string row_format(const EvalRow& r) {
  if (r.dispatch_format) return *r.dispatch_format;
  if (r.combine_format) return *r.combine_format;
  return "";
}

// Dash pattern of a recipe's side: dispatch solid, combine dashed, both dotted.
std::string recipe_dash(const EvalRow& r) {
  if (r.dispatch_format && r.combine_format) return "2 3";
  if (r.combine_format) return "7 4";
  return "";
}

std::string cell(const std::optional<std::string>& v) { return v ? esc(*v) : "&ndash;"; }
std::string cell(const std::optional<double>& v) { return v ? fmt(*v, "%.3g") : "&ndash;"; }
std::string cell(const std::optional<float>& v) { return v ? fmt(*v, "%.6g") : "&ndash;"; }

const char* kStyle = R"(body{font-family:sans-serif;margin:24px;color:#222;max-width:1340px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
dl.meta{display:grid;grid-template-columns:max-content auto;gap:2px 16px;font-size:13px}
dl.meta dt{font-weight:bold}dl.meta dd{margin:0}
table{border-collapse:collapse;font-size:12px}th,td{padding:3px 8px;border-bottom:1px solid #eee}
th{background:#f4f4f4;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
svg.chart{display:block;margin:8px 0;background:#fff}
.ct{font-size:14px;font-weight:bold;fill:#222}.tick{font-size:11px;fill:#555}.lbl{font-size:12px;fill:#222}
.val{font-size:11px;fill:#333}.grid{stroke:#e4e4e4;stroke-width:1}.axis{stroke:#888}
.frame{fill:none;stroke:#bbb}.leader{stroke:#aaa;stroke-width:0.8}.maxline{stroke:#222;stroke-width:1.5;stroke-dasharray:5 4}
.pair{display:flex;flex-wrap:wrap;gap:12px}p.note{font-size:13px;color:#444}ul.warn{font-size:13px;color:#8a4b00}
div.scroll{overflow-x:auto}th,td{white-space:nowrap}
table.results th:nth-child(-n+2),table.results td:nth-child(-n+2){position:sticky;background:#fff;z-index:1}
table.results th:nth-child(-n+2){background:#f4f4f4}
table.results th:first-child,table.results td:first-child{left:0;box-sizing:border-box;width:52px;min-width:52px}
table.results th:nth-child(2),table.results td:nth-child(2){left:52px;box-shadow:inset -1px 0 #ccc})";

// The peers' recipes (moefq eval --sweep peers) grouped by system: each recipe's formats, mean and
// worst rel_l2 over the layers and wire bytes per token; "" when the run has none.
std::string peers_section(const EvalResult& r) {
  std::vector<std::string> peers;
  for (const RecipeSummary& x : r.summary) {
    const std::string p = peer_of(x.recipe);
    if (!p.empty() && std::find(peers.begin(), peers.end(), p) == peers.end()) peers.push_back(p);
  }
  if (peers.empty()) return "";
  std::string h = "<h2>By peer</h2>\n<div class=\"scroll\"><table>\n<thead><tr><th>peer</th><th>recipe</th>"
                  "<th>dispatch</th><th>combine</th><th>mean rel_l2</th><th>max rel_l2</th><th>B/token</th></tr>"
                  "</thead>\n<tbody>\n";
  for (const std::string& p : peers)
    for (const RecipeSummary& x : r.summary) {
      if (peer_of(x.recipe) != p) continue;
      const auto row = std::find_if(r.rows.begin(), r.rows.end(), [&](const EvalRow& e) { return e.recipe == x.recipe; });
      if (row == r.rows.end()) continue;
      h += "<tr><td>" + esc(p) + "</td><td>" + esc(x.recipe) + "</td><td>" + cell(row->dispatch_format) + "</td><td>" +
           cell(row->combine_format) + "</td><td class=\"n\">" + fmt(x.mean_rel_l2) + "</td><td class=\"n\">" +
           fmt(x.max_rel_l2) + "</td><td class=\"n\">" + fmt(x.wire_bytes_per_token, "%.0f") + "</td></tr>\n";
    }
  return h + "</tbody>\n</table></div>\n<p class=\"note\">Each system's dispatch and combine as it computes them, "
             "its router weight where it applies it (docs/numerics.md); B/token: dispatch + combine bytes per token on "
             "the wire, bf16 where a side is not quantized.</p>\n";
}

}  // namespace

std::string eval_report_html(const EvalResult& r) {
  const EvalSetup& s = r.setup;
  const bool several = s.layers.size() > 1;
  std::string layers;
  for (int64_t l : s.layers) layers += (layers.empty() ? "" : ", ") + std::to_string(l);
  std::string h = "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>moefq eval: " +
                  esc(s.config.name) + "</title>\n<style>\n" + kStyle + "\n</style>\n</head>\n<body>\n";
  h += "<h1>moefq eval: " + esc(s.config.name) + "</h1>\n";
  h += "<p class=\"note\">Error of the MoE layer output with quantized dispatch/combine traffic against the same "
       "layer unquantized, per recipe (docs/numerics.md's metrics over the whole evaluation set).</p>\n";
  h += "<dl class=\"meta\">\n";
  const auto meta = [&](const std::string& k, const std::string& v) { h += "<dt>" + esc(k) + "</dt><dd>" + esc(v) + "</dd>\n"; };
  meta("model", s.model_source + " (H " + std::to_string(s.config.hidden) + ", I " + std::to_string(s.config.intermediate) +
                    ", E " + std::to_string(s.config.num_experts) + ", top-k " + std::to_string(s.config.top_k) +
                    ", shared " + std::to_string(s.config.num_shared) + ")");
  meta("weights", s.weights_source);
  meta("activations", s.activations_source);
  meta("layers", layers);
  meta("ranks x tokens", std::to_string(s.ranks) + " x " + std::to_string(s.tokens) + " per batch");
  meta("batches", std::to_string(s.calib_batches) + " calibration, " + std::to_string(s.eval_batches) + " evaluation (held out)");
  meta("calibration", r.calibration.source);
  if (s.link.enabled())
    meta("link", s.link.describe() + ", " + std::to_string(s.ranks) + " expert-parallel ranks x " +
                     std::to_string(s.tokens) + " tokens per batch");
  meta("router weight", std::string("applied ") + combine_weighting_name(s.combine_weighting) + " the combine");
  meta("baseline", std::string("staging ") + staging_name(s.staging) + ": " + staging_baseline(s.staging));
  meta("device", s.device + " (back-end " + s.backend_kind + ")");
  meta("version", "moefq " + s.version);
  meta("generated", utc_now() + ", " + fmt(r.wall_seconds, "%.1f") + " s");
  h += "</dl>\n";

  // Error per recipe: the single layer's rows, or the mean over layers.
  h += "<h2>Error per recipe</h2>\n";
  std::vector<Bar> bars;
  std::map<std::string, std::string> colour_of;
  std::map<std::string, const EvalRow*> first_row;
  for (const EvalRow& row : r.rows)
    if (!first_row.count(row.recipe)) first_row[row.recipe] = &row;
  for (size_t i = 0; i < s.recipe_names.size(); ++i) {
    const std::string& name = s.recipe_names[i];
    colour_of[name] = first_row.count(name) ? recipe_colour(row_format(*first_row[name]), i) : recipe_colour("", i);
  }
  for (const RecipeSummary& x : r.summary) bars.push_back({x.recipe, colour_of[x.recipe], x.mean_rel_l2});
  h += bar_chart(several ? "relative L2 error per recipe (mean over " + std::to_string(s.layers.size()) + " layers)"
                         : "relative L2 error per recipe (layer " + layers + ")",
                 "relative L2 error (log scale)", bars);
  h += "<p class=\"note\">Colour: the format (fp8 blue, nvfp4 orange, mxfp8 green, mxfp4 red). The unquantized "
       "recipe reproduces the reference exactly (0).</p>\n";

  h += "<h2>Error against bytes on the wire</h2>\n";
  std::vector<Point> points;
  // The worst layer's error: what the budget judges (a recipe is within it on every layer or not).
  for (const RecipeSummary& x : r.summary) points.push_back({x.recipe, colour_of[x.recipe], x.wire_bytes_per_token, x.max_rel_l2});
  h += tradeoff_chart(several ? "relative L2 error (worst of " + std::to_string(s.layers.size()) +
                                    " layers) against wire bytes per token"
                              : "relative L2 error against wire bytes per token",
                      points, s.max_rel_l2);
  h += "<p class=\"note\">Bytes per token per destination rank, dispatch plus combine, scales included (bf16: " +
       std::to_string(4 * s.config.hidden) + "). Lower left is better: the recipes on the lower-left edge are the "
       "ones worth considering.";
  if (s.max_rel_l2)
    h += r.cheapest_within_budget ? " Within rel_l2 &le; " + fmt(*s.max_rel_l2) + " on every layer, the cheapest is <b>" +
                                        esc(*r.cheapest_within_budget) + "</b>."
                                  : " No recipe stays within rel_l2 &le; " + fmt(*s.max_rel_l2) + " on every layer.";
  h += "</p>\n";
  if (!r.warnings.empty()) {
    h += "<h2>Warnings</h2>\n<ul class=\"warn\">\n";
    for (const std::string& w : r.warnings) h += "<li>" + esc(w) + "</li>\n";
    h += "</ul>\n";
  }

  if (several) {
    h += "<h2>Error per layer</h2>\n";
    std::vector<Series> series;
    for (size_t i = 0; i < s.recipe_names.size(); ++i) {
      const std::string& name = s.recipe_names[i];
      Series ser{name, colour_of[name], first_row.count(name) ? recipe_dash(*first_row[name]) : "", {}};
      for (int64_t l : s.layers) {
        double v = NAN;
        for (const EvalRow& row : r.rows)
          if (row.layer == l && row.recipe == name) v = row.metrics.rel_l2;
        ser.values.push_back(v);
      }
      series.push_back(std::move(ser));
    }
    h += line_chart("relative L2 error per layer (log scale)", s.layers, series);
    h += "<p class=\"note\">Solid: dispatch only; dashed: combine only; dotted: both.</p>\n";
  }

  h += "<h2>Per-expert-rank amax (max calibration, before the MAX reduction)</h2>\n";
  h += "<p class=\"note\">Each rank's max |x| over what its quantizer saw; the dashed line is the value every rank "
       "uses after the MAX reduction. " + esc(r.calibration.source) + ".</p>\n";
  for (const LayerCalibration& c : r.calibration.layers) {
    h += "<div class=\"pair\">\n";
    h += rank_chart("layer " + std::to_string(c.layer) + ": dispatch amax per rank", c.dispatch_rank_amax, c.dispatch_amax,
                    "#4e79a7");
    h += rank_chart("layer " + std::to_string(c.layer) + ": combine amax per rank", c.combine_rank_amax, c.combine_amax,
                    "#f28e2b");
    h += "</div>\n";
  }

  h += peers_section(r);
  // Methods beyond max: each quantizer's amax per method and format, with its cost on the
  // calibration data.
  bool derived = false;
  for (const LayerCalibration& c : r.calibration.layers) derived = derived || !c.derived.empty();
  if (derived) {
    h += "<h2>Calibration methods</h2>\n<div class=\"scroll\"><table>\n<thead><tr><th>layer</th><th>quantizer</th>"
         "<th>method</th><th>format</th><th>amax</th><th>clipped (calibration data)</th>"
         "<th>QDQ rel_l2 (calibration data)</th></tr></thead>\n<tbody>\n";
    for (const LayerCalibration& c : r.calibration.layers)
      for (const DerivedCalibration& d : c.derived)
        h += "<tr><td class=\"n\">" + std::to_string(c.layer) + "</td><td>" + esc(d.quantizer) + "</td><td>" +
             esc(d.method) + "</td><td>" + esc(d.format) + "</td><td class=\"n\">" + fmt(d.amax.amax, "%.6g") +
             "</td><td class=\"n\">" + fmt(d.amax.clipped_fraction, "%.3g") + "</td><td class=\"n\">" +
             cell(d.amax.rel_error) + "</td></tr>\n";
    h += "</tbody>\n</table></div>\n<p class=\"note\">Every method's amax comes from one calibration pass per "
         "layer (an exact histogram of the bf16 magnitudes); percentile P: the smallest magnitude with at least P% of "
         "the elements at or below it; mse: the candidate amax (0.25 to 4 times the max) with the least QDQ error. "
         "The QDQ error is given for the element-wise formats.</p>\n";
  }

  bool any_calibration = false, any_cast = false;
  for (const EvalRow& row : r.rows) {
    any_calibration = any_calibration || !row.calibration.empty();
    any_cast = any_cast || row.dispatch_cast_fraction || row.combine_cast_fraction;
  }
  const bool link = s.link.enabled();
  h += "<h2>Results</h2>\n<div class=\"scroll\"><table class=\"results\">\n<thead><tr><th>layer</th><th>recipe</th>"
       "<th>dispatch</th><th>combine</th>" + std::string(any_calibration ? "<th>calibration</th>" : "") +
       "<th>dispatch amax</th><th>combine amax</th><th>rel_l2</th><th>token p50</th><th>token p99</th>"
       "<th>token max</th><th>outside outliers</th><th>outlier channels</th><th>cosine</th><th>calc_diff</th>"
       "<th>max_abs</th>"
       "<th>snr_db</th><th>clipped (d)</th><th>clipped (c)</th><th>B/token</th><th>saving</th>" +
       (any_cast ? "<th>cast (d)</th><th>cast (c)</th>" : "") +
       (link ? "<th>dispatch &micro;s</th><th>combine &micro;s</th><th>saved &micro;s</th>" : "") + "<th>layout check</th>" +
       std::string(s.max_rel_l2 ? "<th>budget</th>" : "") + "</tr></thead>\n<tbody>\n";
  for (const EvalRow& row : r.rows) {
    const ErrorMetrics& m = row.metrics;
    h += "<tr><td class=\"n\">" + std::to_string(row.layer) + "</td><td>" + esc(row.recipe) + "</td><td>" +
         cell(row.dispatch_format) + "</td><td>" + cell(row.combine_format) + "</td>" +
         (any_calibration ? "<td>" + (row.calibration.empty() ? std::string("&ndash;") : esc(row.calibration)) + "</td>"
                          : std::string()) +
         "<td class=\"n\">" + cell(row.dispatch_amax) + "</td><td class=\"n\">" + cell(row.combine_amax) +
         "</td><td class=\"n\">" + fmt(m.rel_l2) + "</td><td class=\"n\">" + fmt(row.rel_l2_token_p50) +
         "</td><td class=\"n\">" + fmt(row.rel_l2_token_p99) + "</td><td class=\"n\">" + fmt(row.rel_l2_token_max) +
         "</td><td class=\"n\">" +
         (row.num_outlier_channels > 0 ? fmt(row.rel_l2_non_outlier) : std::string("&ndash;")) +
         "</td><td class=\"n\">" + std::to_string(row.num_outlier_channels) + "</td><td class=\"n\">" +
         fmt(m.cosine, "%.6f") + "</td><td class=\"n\">" + fmt(m.calc_diff) +
         "</td><td class=\"n\">" + fmt(m.max_abs) + "</td><td class=\"n\">" + fmt(m.snr_db, "%.2f") +
         "</td><td class=\"n\">" + cell(row.dispatch_clipped_fraction) + "</td><td class=\"n\">" +
         cell(row.combine_clipped_fraction) + "</td><td class=\"n\">" +
         fmt(row.dispatch_wire_bytes_per_token + row.combine_wire_bytes_per_token, "%.0f") + "</td><td class=\"n\">" +
         fmt(100.0 * row.wire_saving, "%.1f") + "%</td>" +
         (any_cast ? "<td class=\"n\">" + cell(row.dispatch_cast_fraction) + "</td><td class=\"n\">" +
                         cell(row.combine_cast_fraction) + "</td>"
                   : std::string()) +
         (link ? "<td class=\"n\">" + fmt(row.dispatch_us, "%.1f") + "</td><td class=\"n\">" +
                     fmt(row.combine_us, "%.1f") + "</td><td class=\"n\">" + fmt(row.saved_us, "%.1f") + "</td>"
               : std::string()) +
         "<td>" + esc(row.layout_check) + "</td>" +
         (s.max_rel_l2 ? std::string("<td>") + (row.over_budget ? "<b>over</b>" : "ok") + "</td>" : std::string()) +
         "</tr>\n";
  }
  h += "</tbody>\n</table></div>\n";
  h += "<p class=\"note\">rel_l2 = ||y - r|| / ||r||; calc_diff = 1 - 2&Sigma;(y'r') / &Sigma;(y'&sup2; + r'&sup2;) "
       "with y' = y + 1, r' = r + 1; snr_db = 10 log10(&Sigma;r&sup2; / &Sigma;(y - r)&sup2;). Rows: per layer, best "
       "first by rel_l2. Layout check: pass = the combine quantizer read the rows the engine summed (checked bit for "
       "bit); n/a = combine quantization off. Outside outliers: rel_l2 over the channels other than the layer's "
       "outlier output channels (RMS over the reference output more than " + fmt(kOutlierChannelFactor) +
       " times the median channel's, at most " + fmt(100 * kOutlierChannelMaxFraction) + "% of the channels; their "
       "number is the next column); &ndash; where the layer has none (it would equal rel_l2)." +
       (any_cast ? std::string(" Cast: the fraction of logfmt10's cast groups that were cast (measured on the "
                               "calibration data); the others go as bf16, and B/token counts what is actually sent.")
                 : std::string()) +
       (link ? " &micro;s: transfer time of one batch's dispatch and combine on " + esc(s.link.describe()) +
                   " with " + std::to_string(s.ranks) + " expert-parallel ranks (tokens x D x (R - 1)/R rows x bytes "
                   "per row / bandwidth + latency, D = " + fmt(mean_destination_ranks(s.ranks, s.config.top_k), "%.3g") +
                   " destination ranks per token); saved: against bf16 both ways."
             : std::string()) +
       "</p>\n";
  h += "</body>\n</html>\n";
  return h;
}

}  // namespace moefq
