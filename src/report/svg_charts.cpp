// The SVG charts of the HTML report (svg_charts.h): coordinates in px, text measured by an upper
// bound of its glyphs' width, so labels can be placed apart without a browser.
#include "report/svg_charts.h"

#include <algorithm>
#include <cmath>

#include "report/report_text.h"

namespace moefq::report {
namespace {

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

// An upper bound of a .lbl character's width (12 px sans-serif: about 6.7 px for lower case and
// digits, "_" and "m" included), and the box a label's glyphs take around its baseline y (the
// browser's bounding box of 12 px text: y - 12 to y + 3), one label every kLabelLine.
constexpr double kLabelCharWidth = 7.2, kLabelAscent = 12, kLabelDescent = 3, kLabelLine = kLabelAscent + kLabelDescent;

}  // namespace

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

}  // namespace moefq::report
