// What `moefq eval` prints on stdout below its header: the results table, the summary over the
// layers, the legend and the answer to the budget. The default table keeps the columns that say
// what each recipe costs and saves and fits 120 columns for the default sweep; wide adds every
// other figure of the rows (the amax used, tok_p50, calc_diff, snr_db). Legend lines are at most
// kLegendWidth characters. Every figure is also in the reports (src/report) at full precision.
#pragma once

#include <string>
#include <vector>

#include "moefq/eval.h"

namespace moefq::cli {

inline constexpr size_t kLegendWidth = 100;

// The results table: the header, its rule and one line per row.
std::vector<std::string> eval_table_lines(const EvalResult& r, bool wide);

// Everything after the table: the summary (several layers), the legend, the answer to
// --max-rel-l2 and "done in S s".
std::vector<std::string> eval_footer_lines(const EvalResult& r, bool wide);

// The columns only the wide table has, in its order.
std::vector<std::string> eval_wide_only_columns();

// A clipped fraction in at most 6 characters, 2 significant digits: "0", "0.012", "6.0e-8".
std::string fmt_fraction(double v);

}  // namespace moefq::cli
