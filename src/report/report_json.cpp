// report.json of `moefq eval` (report.h): every figure, the configuration, version and device.
#include "moefq/report.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "report/report_text.h"

namespace moefq {
namespace {

using json = nlohmann::json;
using report::utc_now;

json number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}
json opt_number(const std::optional<float>& v) { return v ? number(*v) : json(); }
json opt_number(const std::optional<double>& v) { return v ? number(*v) : json(); }
json numbers(const std::vector<float>& v) {
  json a = json::array();
  for (float x : v) a.push_back(number(x));
  return a;
}
json opt_string(const std::optional<std::string>& v) { return v ? json(*v) : json(); }

json model_json(const MoeConfig& c) {
  return {{"name", c.name},
          {"hidden", c.hidden},
          {"intermediate", c.intermediate},
          {"num_experts", c.num_experts},
          {"top_k", c.top_k},
          {"num_shared", c.num_shared},
          {"n_group", c.n_group},
          {"topk_group", c.topk_group},
          {"routed_scaling", c.routed_scaling},
          {"scoring", scoring_name(c.scoring)},
          {"norm_topk_prob", c.norm_topk_prob},
          {"noaux_tc", c.noaux_tc},
          {"swiglu_clamp", c.swiglu_clamp ? json(*c.swiglu_clamp) : json()}};
}

json link_json(const EvalSetup& s) {
  if (!s.link.enabled()) return json();
  return {{"name", s.link.name},
          {"gbit_per_s", s.link.gbit_per_s},
          {"latency_us", s.link.latency_us},
          {"expert_parallel_ranks", s.ranks},
          {"tokens_per_rank", s.tokens},
          {"mean_destination_ranks", mean_destination_ranks(s.ranks, s.config.top_k)},
          {"model", "per batch: tokens x D x (R - 1) / R rows x bytes per row / bandwidth + latency"}};
}

}  // namespace

std::string eval_report_json(const EvalResult& r) {
  const EvalSetup& s = r.setup;
  json config = {{"model", model_json(s.config)},
                 {"model_source", s.model_source},
                 {"weights", s.weights_source},
                 {"activations", s.activations_source},
                 {"synthetic", s.synthetic},
                 {"layers", s.layers},
                 {"ranks", s.ranks},
                 {"tokens_per_rank", s.tokens},
                 {"calib_batches", s.calib_batches},
                 {"eval_batches", s.eval_batches},
                 {"seed", s.seed},
                 {"recipes", s.recipe_names},
                 {"backend", s.backend_kind},
                 {"combine_weighting", combine_weighting_name(s.combine_weighting)},
                 {"shared_expert", "unfused (added to the routed output, computed on the unquantized x)"},
                 {"calibration", r.calibration.source},
                 {"calibration_methods", s.calibration},
                 {"link", link_json(s)},
                 {"max_rel_l2", s.max_rel_l2 ? json(*s.max_rel_l2) : json()}};
  json calibration = json::array();
  for (const LayerCalibration& c : r.calibration.layers) {
    json derived = json::array();
    for (const DerivedCalibration& d : c.derived)
      derived.push_back({{"quantizer", d.quantizer},
                         {"method", d.method},
                         {"format", d.format},
                         {"amax", number(d.amax.amax)},
                         {"clipped_fraction", number(d.amax.clipped_fraction)},
                         {"qdq_rel_l2", opt_number(d.amax.rel_error)}});
    json entry = {{"layer", c.layer},
                  {"dispatch_amax", number(c.dispatch_amax)},
                  {"combine_amax", number(c.combine_amax)},
                  {"dispatch_rank_amax", numbers(c.dispatch_rank_amax)},
                  {"combine_rank_amax", numbers(c.combine_rank_amax)},
                  {"methods", derived}};
    if (c.dispatch_logfmt.total || c.combine_logfmt.total)
      entry["logfmt10_cast_groups"] = {{"dispatch", {c.dispatch_logfmt.cast, c.dispatch_logfmt.total}},
                                       {"combine", {c.combine_logfmt.cast, c.combine_logfmt.total}}};
    calibration.push_back(entry);
  }
  json results = json::array();
  for (const EvalRow& row : r.rows) {
    const ErrorMetrics& m = row.metrics;
    results.push_back({{"layer", row.layer},
                       {"recipe", row.recipe},
                       {"dispatch_format", opt_string(row.dispatch_format)},
                       {"combine_format", opt_string(row.combine_format)},
                       {"dispatch_amax", opt_number(row.dispatch_amax)},
                       {"combine_amax", opt_number(row.combine_amax)},
                       {"rel_l2", number(m.rel_l2)},
                       {"cosine", number(m.cosine)},
                       {"calc_diff", number(m.calc_diff)},
                       {"max_abs", number(m.max_abs)},
                       {"snr_db", number(m.snr_db)},
                       {"count", m.count},
                       {"skipped_nonfinite", m.skipped_nonfinite},
                       {"rel_l2_token_p50", number(row.rel_l2_token_p50)},
                       {"rel_l2_token_p99", number(row.rel_l2_token_p99)},
                       {"rel_l2_token_max", number(row.rel_l2_token_max)},
                       {"rel_l2_non_outlier", number(row.rel_l2_non_outlier)},
                       {"num_outlier_channels", row.num_outlier_channels},
                       {"dispatch_clipped_fraction", opt_number(row.dispatch_clipped_fraction)},
                       {"combine_clipped_fraction", opt_number(row.combine_clipped_fraction)},
                       {"dispatch_wire_bytes_per_token", number(row.dispatch_wire_bytes_per_token)},
                       {"combine_wire_bytes_per_token", number(row.combine_wire_bytes_per_token)},
                       {"wire_saving_vs_bf16", number(row.wire_saving)},
                       {"over_budget", s.max_rel_l2 ? json(row.over_budget) : json()},
                       {"layout_check", row.layout_check},
                       {"combine_weighting", combine_weighting_name(s.combine_weighting)},
                       {"calibration", row.calibration.empty() ? json() : json(row.calibration)},
                       {"dispatch_cast_fraction", opt_number(row.dispatch_cast_fraction)},
                       {"combine_cast_fraction", opt_number(row.combine_cast_fraction)},
                       {"dispatch_us", s.link.enabled() ? number(row.dispatch_us) : json()},
                       {"combine_us", s.link.enabled() ? number(row.combine_us) : json()},
                       {"saved_us", s.link.enabled() ? number(row.saved_us) : json()}});
  }
  json summary = json::array();
  for (const RecipeSummary& x : r.summary)
    summary.push_back({{"recipe", x.recipe},
                       {"mean_rel_l2", number(x.mean_rel_l2)},
                       {"max_rel_l2", number(x.max_rel_l2)},
                       {"min_cosine", number(x.min_cosine)},
                       {"wire_bytes_per_token", number(x.wire_bytes_per_token)}});
  json stages = json::array();
  for (const StageTimes& t : r.stage_times)
    stages.push_back({{"layer", t.layer}, {"load_s", t.load}, {"calibrate_s", t.calibrate},
                      {"reference_s", t.reference}, {"recipes_s", t.recipes}, {"metrics_s", t.metrics},
                      {"total_s", t.total}});
  const json j = {{"tool", "moefq eval"},
                  {"version", s.version},
                  {"device", s.device},
                  {"generated", utc_now()},
                  {"staging", staging_name(s.staging)},
                  {"baseline", staging_baseline(s.staging)},
                  {"config", config},
                  {"calibration", calibration},
                  {"results", results},
                  {"summary", summary},
                  {"cheapest_within_budget", r.cheapest_within_budget ? json(*r.cheapest_within_budget) : json()},
                  {"warnings", r.warnings},
                  {"stage_seconds", stages},
                  {"sort", "per layer, best first by rel_l2"},
                  {"wall_seconds", r.wall_seconds}};
  return j.dump(2) + "\n";
}

}  // namespace moefq
