// The HTML report's charts, each one self-contained inline <svg> (no script, font or file): bars on
// a log10 axis, lines per layer, bars per rank, and the error against wire bytes trade-off. Labels
// and titles are HTML-escaped here; callers pass plain text.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moefq::report {

struct Bar {
  std::string label, colour;
  double value;
};

// Horizontal bars on a log10 axis; zero values say "0 (exact)".
std::string bar_chart(const std::string& title, const std::string& axis_label, const std::vector<Bar>& bars);

struct Series {
  std::string label, colour, dash;
  std::vector<double> values;  // one per layer
};

// rel_l2 per layer, one line per recipe, log10 y axis.
std::string line_chart(const std::string& title, const std::vector<int64_t>& layers, const std::vector<Series>& series);

// Vertical bars per rank on a linear axis, with the reduced MAX as a dashed line.
std::string rank_chart(const std::string& title, const std::vector<float>& values, float reduced, const std::string& colour);

struct Point {
  std::string label, colour;
  double x, y;  // wire bytes per token, rel_l2
};

// The trade-off a user chooses on: rel_l2 (log10 y) against the wire bytes per token (linear x),
// one labelled point per recipe; the budget as a dashed line when there is one.
std::string tradeoff_chart(const std::string& title, const std::vector<Point>& points, std::optional<double> budget);

}  // namespace moefq::report
