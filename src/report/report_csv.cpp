// report.csv of `moefq eval` (report.h): one line per layer and recipe, numbers to 17 digits.
#include "moefq/report.h"

#include <optional>
#include <string>

#include "report/report_text.h"

namespace moefq {
namespace {
using report::fmt;
}  // namespace

std::string eval_report_csv(const EvalResult& r) {
  const auto quote = [](const std::string& v) {
    if (v.find_first_of(",\"\n") == std::string::npos) return v;
    std::string q = "\"";
    for (char c : v) q += c == '"' ? std::string("\"\"") : std::string(1, c);
    return q + "\"";
  };
  const auto full = [](double v) { return fmt(v, "%.17g"); };
  std::string out =
      "layer,recipe,dispatch_format,combine_format,dispatch_amax,combine_amax,rel_l2,cosine,calc_diff,max_abs,"
      "snr_db,count,rel_l2_token_p50,rel_l2_token_p99,rel_l2_token_max,rel_l2_non_outlier,dispatch_clipped_fraction,"
      "combine_clipped_fraction,dispatch_wire_bytes_per_token,combine_wire_bytes_per_token,wire_saving_vs_bf16,"
      "over_budget,layout_check,combine_weighting,num_outlier_channels,calibration,dispatch_cast_fraction,"
      "combine_cast_fraction,dispatch_us,combine_us,saved_us\n";
  const auto opt_full = [&](const std::optional<double>& v) { return v ? fmt(*v, "%.17g") : std::string(); };
  const bool link = r.setup.link.enabled();
  for (const EvalRow& row : r.rows) {
    const ErrorMetrics& m = row.metrics;
    out += std::to_string(row.layer) + "," + quote(row.recipe) + "," + quote(row.dispatch_format.value_or("")) + "," +
           quote(row.combine_format.value_or("")) + "," + (row.dispatch_amax ? full(*row.dispatch_amax) : "") + "," +
           (row.combine_amax ? full(*row.combine_amax) : "") + "," + full(m.rel_l2) + "," + full(m.cosine) + "," +
           full(m.calc_diff) + "," + full(m.max_abs) + "," + full(m.snr_db) + "," + std::to_string(m.count) + "," +
           full(row.rel_l2_token_p50) + "," + full(row.rel_l2_token_p99) + "," + full(row.rel_l2_token_max) + "," +
           full(row.rel_l2_non_outlier) + "," + opt_full(row.dispatch_clipped_fraction) + "," +
           opt_full(row.combine_clipped_fraction) + "," + full(row.dispatch_wire_bytes_per_token) + "," +
           full(row.combine_wire_bytes_per_token) + "," + full(row.wire_saving) + "," +
           (r.setup.max_rel_l2 ? (row.over_budget ? "true" : "false") : "") + "," + row.layout_check + "," +
           combine_weighting_name(r.setup.combine_weighting) + "," + std::to_string(row.num_outlier_channels) + "," +
           quote(row.calibration) + "," + opt_full(row.dispatch_cast_fraction) + "," +
           opt_full(row.combine_cast_fraction) + "," + (link ? full(row.dispatch_us) : "") + "," +
           (link ? full(row.combine_us) : "") + "," + (link ? full(row.saved_us) : "") + "\n";
  }
  return out;
}

}  // namespace moefq
