// Writes the three reports of `moefq eval` (report.h) into their directory as one unit. Each writer
// has its file: report_json.cpp, report_csv.cpp, report_html.cpp (charts in svg_charts.cpp).
#include "moefq/report.h"

#include <string>

#include "moefq/fileio.h"

namespace moefq {

void write_eval_reports(const EvalResult& result, const std::string& dir) {
  // Everything is rendered before the first file is written.
  const std::string j = eval_report_json(result), c = eval_report_csv(result), h = eval_report_html(result);
  AtomicDirectory out(dir, kEvalReportFiles);
  out.write("report.json", j);
  out.write("report.csv", c);
  out.write("report.html", h);
  out.commit();
}

}  // namespace moefq
