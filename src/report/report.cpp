// Report writers of `moefq eval` (include/moefq/report.h). The HTML page draws its charts as
// inline SVG computed here, so it needs no script, font or file besides itself.
#include "moefq/report.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "moefq/errors.h"
#include "moefq/fileio.h"

namespace moefq {
namespace {

using json = nlohmann::json;

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

std::string fmt(double v, const char* spec = "%.4g") {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, spec, v);
  return buf;
}

std::string utc_now() {
  const std::time_t t = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

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

// ---- SVG helpers.

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      case '\'': o += "&#39;"; break;
      default: o += c;
    }
  }
  return o;
}

std::string px(double v) { return fmt(v, "%.1f"); }

// A log10 axis covering the positive finite values (whole decades), within [1e-30, 1e30]: a
// value beyond (a denormal error, an overflow) sits at the axis' end, so the number of decades
// stays bounded whatever the data.
struct LogAxis {
  static constexpr double kMin = 1e-30, kMax = 1e30;
  double lo = 1e-4, hi = 1;
  explicit LogAxis(const std::vector<double>& values) {
    double mn = INFINITY, mx = 0;
    for (double v : values)
      if (std::isfinite(v) && v > 0) {
        mn = std::min(mn, std::clamp(v, kMin, kMax));
        mx = std::max(mx, std::clamp(v, kMin, kMax));
      }
    if (mx > 0) {
      lo = std::pow(10.0, std::floor(std::log10(mn)));
      hi = std::pow(10.0, std::ceil(std::log10(mx)));
      if (hi <= lo) hi = lo * 10;
    }
  }
  // 0 at lo, 1 at hi (clamped).
  double frac(double v) const {
    const double f = (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo));
    return std::clamp(f, 0.0, 1.0);
  }
  std::vector<double> decades() const {
    std::vector<double> d;
    for (int e = int(std::lround(std::log10(lo))); e <= int(std::lround(std::log10(hi))); ++e) d.push_back(std::pow(10.0, e));
    return d;
  }
};

std::string decade_label(double v) {
  const int e = int(std::lround(std::log10(v)));
  return e == 0 ? "1" : "1e" + std::to_string(e);
}

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

struct Bar {
  std::string label, colour;
  double value;
};

// Horizontal bars on a log10 axis; zero values say "0 (exact)".
std::string bar_chart(const std::string& title, const std::string& axis_label, const std::vector<Bar>& bars) {
  std::vector<double> values;
  for (const Bar& b : bars) values.push_back(b.value);
  const LogAxis ax(values);
  const double left = 170, right = 110, top = 34, row = 24, width = 920, plot = width - left - right;
  const double height = top + row * double(bars.size()) + 44;
  std::string s = "<svg class=\"chart\" role=\"img\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" + px(width) +
                  "\" height=\"" + px(height) + "\" viewBox=\"0 0 " + px(width) + " " + px(height) + "\">\n";
  s += "<title>" + esc(title) + "</title>\n";
  s += "<text x=\"" + px(left) + "\" y=\"20\" class=\"ct\">" + esc(title) + "</text>\n";
  const double bottom = top + row * double(bars.size());
  for (double d : ax.decades()) {
    const double x = left + ax.frac(d) * plot;
    s += "<line x1=\"" + px(x) + "\" y1=\"" + px(top) + "\" x2=\"" + px(x) + "\" y2=\"" + px(bottom) +
         "\" class=\"grid\"/>\n";
    s += "<text x=\"" + px(x) + "\" y=\"" + px(bottom + 16) + "\" class=\"tick\" text-anchor=\"middle\">" +
         decade_label(d) + "</text>\n";
  }
  s += "<text x=\"" + px(left + plot / 2) + "\" y=\"" + px(bottom + 36) + "\" class=\"tick\" text-anchor=\"middle\">" +
       esc(axis_label) + "</text>\n";
  for (size_t i = 0; i < bars.size(); ++i) {
    const Bar& b = bars[i];
    const double y = top + row * double(i);
    s += "<text x=\"" + px(left - 8) + "\" y=\"" + px(y + row * 0.65) + "\" class=\"lbl\" text-anchor=\"end\">" +
         esc(b.label) + "</text>\n";
    std::string value_text = fmt(b.value);
    double end = left;
    if (std::isfinite(b.value) && b.value > 0) {
      end = left + std::max(2.0, ax.frac(b.value) * plot);
      s += "<rect class=\"bar\" x=\"" + px(left) + "\" y=\"" + px(y + 3) + "\" width=\"" + px(end - left) +
           "\" height=\"" + px(row - 6) + "\" fill=\"" + b.colour + "\"><title>" + esc(b.label) + ": " + value_text +
           "</title></rect>\n";
    } else if (b.value == 0) {
      value_text = "0 (exact)";
    }
    s += "<text x=\"" + px(end + 6) + "\" y=\"" + px(y + row * 0.65) + "\" class=\"val\">" + esc(value_text) +
         "</text>\n";
  }
  s += "<line x1=\"" + px(left) + "\" y1=\"" + px(top) + "\" x2=\"" + px(left) + "\" y2=\"" + px(bottom) +
       "\" class=\"axis\"/>\n</svg>\n";
  return s;
}

// An upper bound of a .lbl character's width (12 px sans-serif: about 6.7 px for lower case and
// digits, "_" and "m" included), and the box a label's glyphs take around its baseline y (the
// browser's bounding box of 12 px text: y - 12 to y + 3), one label every kLabelLine.
constexpr double kLabelCharWidth = 7.2, kLabelAscent = 12, kLabelDescent = 3, kLabelLine = kLabelAscent + kLabelDescent;

struct Series {
  std::string label, colour, dash;
  std::vector<double> values;  // one per layer
};

// rel_l2 per layer, one line per recipe, log10 y axis.
std::string line_chart(const std::string& title, const std::vector<int64_t>& layers, const std::vector<Series>& series) {
  std::vector<double> all;
  for (const Series& s : series) all.insert(all.end(), s.values.begin(), s.values.end());
  const LogAxis ax(all);
  // Tall enough for the legend: one line per series.
  size_t longest = 0;
  for (const Series& ser : series) longest = std::max(longest, ser.label.size());
  const double left = 70, right = std::max(190.0, 56 + kLabelCharWidth * double(longest)), top = 34, width = 920;
  const double height = std::max(380.0, top + 8 + 18 * double(series.size()) + 10), bottom = height - 50;
  const double plot_w = width - left - right, plot_h = bottom - top;
  const auto xpos = [&](size_t i) {
    return layers.size() == 1 ? left + plot_w / 2 : left + plot_w * double(i) / double(layers.size() - 1);
  };
  const auto ypos = [&](double v) { return bottom - ax.frac(v) * plot_h; };
  std::string s = "<svg class=\"chart\" role=\"img\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" + px(width) +
                  "\" height=\"" + px(height) + "\" viewBox=\"0 0 " + px(width) + " " + px(height) + "\">\n";
  s += "<title>" + esc(title) + "</title>\n";
  s += "<text x=\"" + px(left) + "\" y=\"20\" class=\"ct\">" + esc(title) + "</text>\n";
  for (double d : ax.decades()) {
    const double y = ypos(d);
    s += "<line x1=\"" + px(left) + "\" y1=\"" + px(y) + "\" x2=\"" + px(left + plot_w) + "\" y2=\"" + px(y) +
         "\" class=\"grid\"/>\n";
    s += "<text x=\"" + px(left - 6) + "\" y=\"" + px(y + 4) + "\" class=\"tick\" text-anchor=\"end\">" +
         decade_label(d) + "</text>\n";
  }
  for (size_t i = 0; i < layers.size(); ++i)
    s += "<text x=\"" + px(xpos(i)) + "\" y=\"" + px(bottom + 18) + "\" class=\"tick\" text-anchor=\"middle\">" +
         std::to_string(layers[i]) + "</text>\n";
  s += "<text x=\"" + px(left + plot_w / 2) + "\" y=\"" + px(bottom + 40) +
       "\" class=\"tick\" text-anchor=\"middle\">layer</text>\n";
  s += "<rect x=\"" + px(left) + "\" y=\"" + px(top) + "\" width=\"" + px(plot_w) + "\" height=\"" + px(plot_h) +
       "\" class=\"frame\"/>\n";
  size_t shown = 0;
  for (const Series& ser : series) {
    std::string points;
    for (size_t i = 0; i < ser.values.size(); ++i) {
      const double v = ser.values[i];
      if (!(std::isfinite(v) && v > 0)) continue;
      points += px(xpos(i)) + "," + px(ypos(v)) + " ";
    }
    if (points.empty()) continue;  // an exact recipe (error 0) has nothing to draw on a log axis
    s += "<polyline class=\"series\" fill=\"none\" stroke=\"" + ser.colour + "\" stroke-width=\"2\"" +
         (ser.dash.empty() ? "" : " stroke-dasharray=\"" + ser.dash + "\"") + " points=\"" + points + "\"/>\n";
    for (size_t i = 0; i < ser.values.size(); ++i) {
      const double v = ser.values[i];
      if (!(std::isfinite(v) && v > 0)) continue;
      s += "<circle cx=\"" + px(xpos(i)) + "\" cy=\"" + px(ypos(v)) + "\" r=\"3\" fill=\"" + ser.colour +
           "\"><title>" + esc(ser.label) + ", layer " + std::to_string(layers[i]) + ": " + fmt(v) +
           "</title></circle>\n";
    }
    const double ly = top + 8 + 18 * double(shown++);
    const double lx = left + plot_w + 14;
    s += "<line x1=\"" + px(lx) + "\" y1=\"" + px(ly) + "\" x2=\"" + px(lx + 26) + "\" y2=\"" + px(ly) + "\" stroke=\"" +
         ser.colour + "\" stroke-width=\"2\"" + (ser.dash.empty() ? "" : " stroke-dasharray=\"" + ser.dash + "\"") +
         "/>\n";
    s += "<text x=\"" + px(lx + 32) + "\" y=\"" + px(ly + 4) + "\" class=\"lbl\">" + esc(ser.label) + "</text>\n";
  }
  s += "</svg>\n";
  return s;
}

// Vertical bars per rank on a linear axis, with the reduced MAX as a dashed line.
std::string rank_chart(const std::string& title, const std::vector<float>& values, float reduced, const std::string& colour) {
  const double left = 70, right = 20, top = 34, width = 440, height = 230, bottom = height - 40;
  const double plot_w = width - left - right, plot_h = bottom - top;
  double mx = reduced;
  for (float v : values) mx = std::max(mx, double(v));
  if (!(mx > 0) || !std::isfinite(mx)) mx = 1;
  mx *= 1.12;
  std::string s = "<svg class=\"chart\" role=\"img\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" + px(width) +
                  "\" height=\"" + px(height) + "\" viewBox=\"0 0 " + px(width) + " " + px(height) + "\">\n";
  s += "<title>" + esc(title) + "</title>\n";
  s += "<text x=\"" + px(left) + "\" y=\"20\" class=\"ct\">" + esc(title) + "</text>\n";
  for (int g = 0; g <= 4; ++g) {
    const double v = mx / 1.12 * g / 4, y = bottom - v / mx * plot_h;
    s += "<line x1=\"" + px(left) + "\" y1=\"" + px(y) + "\" x2=\"" + px(left + plot_w) + "\" y2=\"" + px(y) +
         "\" class=\"grid\"/>\n";
    s += "<text x=\"" + px(left - 6) + "\" y=\"" + px(y + 4) + "\" class=\"tick\" text-anchor=\"end\">" + fmt(v, "%.3g") +
         "</text>\n";
  }
  const size_t n = std::max<size_t>(values.size(), 1);
  const double slot = plot_w / double(n);
  for (size_t r = 0; r < values.size(); ++r) {
    const double h = std::max(0.0, double(values[r]) / mx * plot_h);
    const double x = left + slot * double(r) + slot * 0.15;
    s += "<rect class=\"bar\" x=\"" + px(x) + "\" y=\"" + px(bottom - h) + "\" width=\"" + px(slot * 0.7) +
         "\" height=\"" + px(h) + "\" fill=\"" + colour + "\"><title>rank " + std::to_string(r) + ": " +
         fmt(values[r], "%.6g") + "</title></rect>\n";
    s += "<text x=\"" + px(x + slot * 0.35) + "\" y=\"" + px(bottom + 16) + "\" class=\"tick\" text-anchor=\"middle\">" +
         std::to_string(r) + "</text>\n";
  }
  const double ry = bottom - double(reduced) / mx * plot_h;
  s += "<line x1=\"" + px(left) + "\" y1=\"" + px(ry) + "\" x2=\"" + px(left + plot_w) + "\" y2=\"" + px(ry) +
       "\" class=\"maxline\"/>\n";
  s += "<text x=\"" + px(left + plot_w) + "\" y=\"" + px(ry - 5) + "\" class=\"val\" text-anchor=\"end\">MAX " +
       fmt(reduced, "%.6g") + "</text>\n";
  s += "<text x=\"" + px(left + plot_w / 2) + "\" y=\"" + px(bottom + 34) +
       "\" class=\"tick\" text-anchor=\"middle\">rank</text>\n</svg>\n";
  return s;
}

struct Point {
  std::string label, colour;
  double x, y;  // wire bytes per token, rel_l2
};

// The trade-off a user chooses on: rel_l2 (log10 y) against the wire bytes per token (linear x),
// one labelled point per recipe; the budget as a dashed line when there is one.
std::string tradeoff_chart(const std::string& title, const std::vector<Point>& points, std::optional<double> budget) {
  std::vector<double> ys;
  double xmax = 1;
  for (const Point& p : points) {
    ys.push_back(p.y);
    xmax = std::max(xmax, p.x);
  }
  if (budget) ys.push_back(*budget);
  const LogAxis ay(ys);
  const double left = 70, right = 170, top = 34, width = 920, height = 400, bottom = height - 50;
  const double plot_w = width - left - right, plot_h = bottom - top;
  xmax *= 1.05;
  const auto xpos = [&](double v) { return left + v / xmax * plot_w; };
  const auto ypos = [&](double v) { return bottom - ay.frac(v) * plot_h; };
  std::string s = "<svg class=\"chart\" role=\"img\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" + px(width) +
                  "\" height=\"" + px(height) + "\" viewBox=\"0 0 " + px(width) + " " + px(height) + "\">\n";
  s += "<title>" + esc(title) + "</title>\n";
  s += "<text x=\"" + px(left) + "\" y=\"20\" class=\"ct\">" + esc(title) + "</text>\n";
  for (double d : ay.decades()) {
    const double y = ypos(d);
    s += "<line x1=\"" + px(left) + "\" y1=\"" + px(y) + "\" x2=\"" + px(left + plot_w) + "\" y2=\"" + px(y) +
         "\" class=\"grid\"/>\n";
    s += "<text x=\"" + px(left - 6) + "\" y=\"" + px(y + 4) + "\" class=\"tick\" text-anchor=\"end\">" +
         decade_label(d) + "</text>\n";
  }
  for (int g = 0; g <= 4; ++g) {
    const double v = xmax / 1.05 * g / 4, x = xpos(v);
    s += "<text x=\"" + px(x) + "\" y=\"" + px(bottom + 18) + "\" class=\"tick\" text-anchor=\"middle\">" +
         fmt(v, "%.0f") + "</text>\n";
  }
  s += "<text x=\"" + px(left + plot_w / 2) + "\" y=\"" + px(bottom + 40) +
       "\" class=\"tick\" text-anchor=\"middle\">wire bytes per token (dispatch + combine, per destination)</text>\n";
  s += "<rect x=\"" + px(left) + "\" y=\"" + px(top) + "\" width=\"" + px(plot_w) + "\" height=\"" + px(plot_h) +
       "\" class=\"frame\"/>\n";
  if (budget && std::isfinite(*budget) && *budget > 0) {
    const double y = ypos(*budget);
    s += "<line x1=\"" + px(left) + "\" y1=\"" + px(y) + "\" x2=\"" + px(left + plot_w) + "\" y2=\"" + px(y) +
         "\" class=\"maxline\"/>\n";
    s += "<text x=\"" + px(left + plot_w + 6) + "\" y=\"" + px(y + 4) + "\" class=\"val\">budget " + fmt(*budget) +
         "</text>\n";
  }
  // Labels beside their points (right, or left where the right runs out of the chart), each as a
  // box of its estimated width (kLabelCharWidth per character) and kLabelLine high: the first
  // baseline of cy + 4, cy + 4 + 15, cy + 4 - 15, cy + 4 + 30, ... (60 tries a side, the other side
  // next) whose box lies between the title and the x axis and overlaps no label placed before.
  struct Box {
    double x0, x1, y0, y1;
  };
  std::vector<Box> placed;
  for (const Point& p : points) {
    if (!(std::isfinite(p.y) && p.y > 0)) continue;  // exact (0) or not finite: nothing on a log axis
    const double cx = xpos(p.x), cy = ypos(p.y);
    s += "<circle class=\"point\" cx=\"" + px(cx) + "\" cy=\"" + px(cy) + "\" r=\"5\" fill=\"" + p.colour +
         "\"><title>" + esc(p.label) + ": " + fmt(p.x, "%.0f") + " B/token, rel_l2 " + fmt(p.y) + "</title></circle>\n";
    const double w = kLabelCharWidth * double(p.label.size());
    // The preferred side (right where it fits), then the other; the first clear slot wins, else
    // the point's own line on the preferred side.
    const bool fits_right = cx + 8 + w <= width - 4, fits_left = cx - 8 - w >= 0;
    bool right = fits_right;
    double ly = cy + 4, x0 = 0, x1 = 0;
    bool found = false;
    for (int side = 0; side < 2 && !found; ++side) {
      right = side == 0 ? fits_right : !fits_right;
      if (side == 1 && !(right ? fits_right : fits_left)) break;
      x0 = right ? cx + 8 : cx - 8 - w;
      x1 = x0 + w;
      for (int k = 0; k < 60 && !found; ++k) {
        ly = cy + 4 + kLabelLine * double((k + 1) / 2) * (k % 2 ? 1 : -1);
        const double y0 = ly - kLabelAscent, y1 = ly + kLabelDescent;
        found = y0 >= top - 8 && y1 <= bottom && std::none_of(placed.begin(), placed.end(), [&](const Box& b) {
                  return x0 < b.x1 && b.x0 < x1 && y0 < b.y1 && b.y0 < y1;
                });
      }
    }
    if (!found) {
      right = fits_right;
      x0 = right ? cx + 8 : cx - 8 - w;
      x1 = x0 + w;
      ly = cy + 4;
    }
    placed.push_back({x0, x1, ly - kLabelAscent, ly + kLabelDescent});
    // A label moved off its point's line gets a thin leader to the point.
    if (std::fabs(ly - (cy + 4)) > 1)
      s += "<line class=\"leader\" x1=\"" + px(cx) + "\" y1=\"" + px(cy) + "\" x2=\"" + px(right ? x0 - 1 : x1 + 1) +
           "\" y2=\"" + px(ly - 4) + "\"/>\n";
    s += "<text x=\"" + px(right ? x0 : x1) + "\" y=\"" + px(ly) + "\" class=\"lbl\"" +
         (right ? "" : " text-anchor=\"end\"") + ">" + esc(p.label) + "</text>\n";
  }
  s += "</svg>\n";
  return s;
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

namespace {
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
