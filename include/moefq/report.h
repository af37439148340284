// Reports of `moefq eval`: JSON (every figure, the configuration, version and device), CSV (one
// line per layer and recipe) and one self-contained HTML page with inline SVG charts (no scripts,
// no external resources). Non-finite numbers are written as the strings "inf", "-inf", "nan" in
// JSON and as those words in CSV.
#pragma once

#include <array>
#include <string>
#include <string_view>

#include "moefq/eval.h"

namespace moefq {

std::string eval_report_json(const EvalResult& result);
std::string eval_report_csv(const EvalResult& result);
std::string eval_report_html(const EvalResult& result);

// The files of an eval report directory.
inline constexpr std::array<std::string_view, 3> kEvalReportFiles = {"report.json", "report.csv", "report.html"};

// Publishes `dir` holding report.json, report.csv and report.html as one AtomicDirectory
// (fileio.h): the three appear together or not at all, and replace an earlier report directory
// whole. Check `dir` first with check_output_dir(dir, ..., kEvalReportFiles).
void write_eval_reports(const EvalResult& result, const std::string& dir);

}  // namespace moefq
