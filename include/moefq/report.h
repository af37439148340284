// Reports of `moefq eval`: JSON (every figure, the configuration, version and device), CSV (one
// line per layer and recipe) and one self-contained HTML page with inline SVG charts (no scripts,
// no external resources). Non-finite numbers are written as the strings "inf", "-inf", "nan" in
// JSON and as those words in CSV.
#pragma once

#include <string>

#include "moefq/eval.h"

namespace moefq {

std::string eval_report_json(const EvalResult& result);
std::string eval_report_csv(const EvalResult& result);
std::string eval_report_html(const EvalResult& result);

// Creates `dir` (and its parents) if needed and writes report.json, report.csv and report.html,
// each through a temporary file and a rename (never a half-written file).
void write_eval_reports(const EvalResult& result, const std::string& dir);

}  // namespace moefq
