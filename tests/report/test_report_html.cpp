// The reports of `moefq eval`: the HTML page loads in headless Chromium (Debian's chromium
// package) with no console message, its screenshot shows the charts and its DOM holds the SVG
// elements; a deliberately broken page proves the checker catches console errors. Also: the page
// is self-contained, and the JSON/CSV writers spell non-finite numbers and quote CSV fields.
//
// Chromium is required: a missing browser FAILS (CI installs it via scripts/install_deps.sh);
// set MOEFQ_SKIP_BROWSER=1 to skip the browser tests on a machine without it.
#include <limits>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/cli_test_util.h"
#include "moefq/errors.h"
#include "moefq/link_model.h"
#include "moefq/report.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;

using test::quote, test::read_text, test::RunResult;

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

// A result like a 3-layer run of the default sweep (values made up, one layer with a NaN).
EvalResult sample_result(int num_layers = 3) {
  EvalResult r;
  EvalSetup& s = r.setup;
  s.config.name = "tiny";
  s.config.hidden = 512;
  s.config.intermediate = 256;
  s.config.num_experts = 32;
  s.config.top_k = 8;
  s.config.num_shared = 1;
  s.model_source = "preset tiny";
  s.weights_source = "synthetic e4m3 (seed 1)";
  s.activations_source = "synthetic <&> \"quoted\"";
  for (int l = 0; l < num_layers; ++l) s.layers.push_back(3 + l);
  s.ranks = 4;
  s.tokens = 256;
  s.calib_batches = 2;
  s.eval_batches = 2;
  s.seed = 1;
  s.backend_kind = "mega_moe";
  s.device = "cpu (2 threads)";
  s.version = MOEFQ_VERSION;
  r.calibration.source = "max calibration on 2 batches";
  const char* formats[] = {"fp8", "nvfp4", "mxfp8", "mxfp4"};
  s.recipe_names.push_back("none");
  for (const char* f : formats)
    for (const char* side : {"dispatch", "combine", "both"}) s.recipe_names.push_back(std::string(side) + "_" + f);
  for (int64_t l : s.layers) {
    LayerCalibration c;
    c.layer = l;
    c.dispatch_rank_amax = {7072, 11968, 8960, 52480};
    c.combine_rank_amax = {6.0e7f, 2.3e8f, 6.6e7f, 4.4e9f};
    c.dispatch_amax = 52480;
    c.combine_amax = 4.4e9f;
    r.calibration.layers.push_back(c);
    for (size_t i = 0; i < s.recipe_names.size(); ++i) {
      EvalRow row;
      row.layer = l;
      row.recipe = s.recipe_names[i];
      if (i > 0) {
        const std::string f = formats[(i - 1) / 3];
        const int side = int((i - 1) % 3);
        if (side != 1) row.dispatch_format = f;
        if (side != 0) row.combine_format = f;
        if (f == "fp8" || f == "nvfp4") {
          if (row.dispatch_format) row.dispatch_amax = 52480;
          if (row.combine_format) row.combine_amax = 4.4e9f;
        }
        row.metrics.rel_l2 = 0.01 * double(i) * (1.0 + 0.1 * double(l));
        row.metrics.cosine = 1 - row.metrics.rel_l2 * row.metrics.rel_l2 / 2;
        row.metrics.snr_db = -20 * std::log10(row.metrics.rel_l2);
      } else {
        row.metrics.snr_db = INFINITY;
      }
      row.metrics.count = 1 << 20;
      row.layout_check = row.combine_format ? "pass" : "n/a";
      r.rows.push_back(row);
    }
  }
  for (const std::string& n : s.recipe_names) r.summary.push_back({n, 0.05, 0.06, 0.99});
  r.summary[0].mean_rel_l2 = r.summary[0].max_rel_l2 = 0;
  r.wall_seconds = 12.5;
  return r;
}

// ------------------------------------------------------------------------------------------------
// Headless Chromium.

std::string find_chromium() {
  for (const char* name : {"chromium", "chromium-browser", "google-chrome"})
    for (const char* dir : {"/usr/bin", "/usr/local/bin", "/snap/bin"}) {
      const fs::path p = fs::path(dir) / name;
      if (fs::exists(p)) return p.string();
    }
  return "";
}

struct PageLoad {
  int status = -1;
  std::string log;                    // chromium's stderr
  std::vector<std::string> console;   // console messages and uncaught exceptions
  std::vector<uint8_t> png;           // the screenshot
  std::string dom;                    // --dump-dom
};

class BrowserTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* skip = std::getenv("MOEFQ_SKIP_BROWSER");
    if (skip && std::string(skip) == "1") GTEST_SKIP() << "MOEFQ_SKIP_BROWSER=1: browser tests skipped";
    chromium_ = find_chromium();
    ASSERT_FALSE(chromium_.empty()) << "headless Chromium is required for the HTML report tests: install the Debian "
                                       "package 'chromium' (scripts/install_deps.sh does), or set MOEFQ_SKIP_BROWSER=1";
    root_ = test::unique_temp_path("moefq_html_");
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ec;
    if (!root_.empty()) fs::remove_all(root_, ec);
  }

  // Runs headless Chromium with args (shell-quoted), stdout and stderr captured to root_/NAME.out
  // and root_/NAME.err. A private profile per run, so parallel test processes do not share
  // Chromium's profile lock.
  RunResult run_chromium(const std::string& args, const std::string& name) const {
    return test::run_captured("timeout 120 " + quote(chromium_) +
                                  " --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run "
                                  "--enable-logging=stderr --v=0 --user-data-dir=" +
                                  quote((root_ / ("profile" + std::to_string(runs_++))).string()) + " " + args,
                              root_ / (name + ".out"), root_ / (name + ".err"));
  }

  // Loads the page twice: a screenshot (1280 x 2000, or the window given) with the console log, and
  // a DOM dump in a window of the same size.
  PageLoad load(const fs::path& html, const std::string& window = "1280,2000") const {
    PageLoad p;
    const std::string url = "file://" + fs::absolute(html).string();
    const fs::path shot = root_ / (html.stem().string() + ".png");
    const RunResult shot_run =
        run_chromium("--screenshot=" + quote(shot.string()) + " --window-size=" + window + " " + quote(url), "shot");
    p.status = shot_run.status;
    p.log = shot_run.err;
    for (const std::string& line : test::split_lines(p.log))
      if (line.find(":CONSOLE") != std::string::npos || line.find("Uncaught") != std::string::npos)
        p.console.push_back(line);
    p.png = test::read_bytes(shot);
    const RunResult dom_run = run_chromium("--window-size=" + window + " --dump-dom " + quote(url), "dom");
    if (dom_run.status != 0) p.status = dom_run.status;
    p.dom = dom_run.out;
    return p;
  }

  fs::path write_page(const std::string& name, const std::string& html) const {
    const fs::path p = root_ / name;
    std::ofstream(p) << html;
    return p;
  }

  std::string chromium_;
  fs::path root_;
  mutable int runs_ = 0;
};

uint32_t be32(const std::vector<uint8_t>& b, size_t at) {
  return uint32_t(b[at]) << 24 | uint32_t(b[at + 1]) << 16 | uint32_t(b[at + 2]) << 8 | uint32_t(b[at + 3]);
}

// A PNG of the window's size (signature, then the IHDR chunk's width and height).
::testing::AssertionResult is_png(const std::vector<uint8_t>& b, uint32_t w, uint32_t h) {
  static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (b.size() < 33 || !std::equal(sig, sig + 8, b.begin()))
    return ::testing::AssertionFailure() << "not a PNG (" << b.size() << " bytes)";
  if (std::string(b.begin() + 12, b.begin() + 16) != "IHDR") return ::testing::AssertionFailure() << "no IHDR chunk";
  if (be32(b, 16) != w || be32(b, 20) != h)
    return ::testing::AssertionFailure() << "size " << be32(b, 16) << " x " << be32(b, 20) << ", want " << w << " x " << h;
  return ::testing::AssertionSuccess();
}

TEST_F(BrowserTest, ReportLoadsWithoutConsoleErrorsAndShowsTheCharts) {
  const EvalResult r = sample_result();
  write_eval_reports(r, (root_ / "rep").string());
  const PageLoad page = load(root_ / "rep" / "report.html");
  ASSERT_EQ(page.status, 0) << page.log;
  EXPECT_TRUE(page.console.empty()) << "console messages:\n" << ::testing::PrintToString(page.console);
  ASSERT_TRUE(is_png(page.png, 1280, 2000));

  // The control: a blank page's screenshot compresses to almost nothing; the report's charts,
  // bars and text do not.
  const PageLoad blank = load(write_page("blank.html", "<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
                                                       "<title>blank</title></head><body></body></html>\n"));
  ASSERT_EQ(blank.status, 0) << blank.log;
  ASSERT_TRUE(is_png(blank.png, 1280, 2000));
  EXPECT_GT(page.png.size(), 4 * blank.png.size())
      << "the screenshot looks empty: " << page.png.size() << " bytes vs a blank page's " << blank.png.size();

  // The DOM as the browser built it: bar chart, error against bytes, line chart (3 layers), amax
  // per rank (2 per layer).
  EXPECT_EQ(count(page.dom, "<svg"), 1u + 1u + 1u + 2u * 3u) << page.dom.substr(0, 2000);
  EXPECT_EQ(count(page.dom, "class=\"point\""), 12u) << "one point per quantized recipe (none is exact: 0)";
  EXPECT_EQ(count(page.dom, "class=\"bar\""), 12u + 2u * 3u * 4u) << "12 recipe bars (none is exact) and 4 bars per amax chart";
  EXPECT_EQ(count(page.dom, "<polyline"), 12u) << "one line per quantized recipe";
  EXPECT_EQ(count(page.dom, "<tr>"), 1u + 13u * 3u) << "the results table";
  EXPECT_NE(page.dom.find("synthetic &lt;&amp;&gt; \"quoted\""), std::string::npos) << "text is escaped";
}

TEST_F(BrowserTest, TheCheckerCatchesABrokenPage) {
  const PageLoad page = load(write_page(
      "broken.html", "<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>broken</title></head><body>"
                     "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"10\" height=\"10\"></svg>"
                     "<script>throw new Error(\"moefq-broken-page\");</script></body></html>\n"));
  ASSERT_EQ(page.status, 0) << page.log;
  ASSERT_FALSE(page.console.empty()) << "the uncaught exception must be seen:\n" << page.log;
  bool named = false;
  for (const std::string& l : page.console) named |= l.find("moefq-broken-page") != std::string::npos;
  EXPECT_TRUE(named) << ::testing::PrintToString(page.console);
}

TEST_F(BrowserTest, SingleLayerPageHasNoLineChart) {
  const EvalResult r = sample_result(1);
  const PageLoad page = load(write_page("one.html", eval_report_html(r)));
  ASSERT_EQ(page.status, 0) << page.log;
  EXPECT_TRUE(page.console.empty()) << ::testing::PrintToString(page.console);
  EXPECT_EQ(count(page.dom, "<svg"), 1u + 1u + 2u);
  EXPECT_EQ(count(page.dom, "<polyline"), 0u);
}

// A result with everything the widest page has: long recipe names (several calibration methods),
// a link's times, logfmt10's cast fractions, derived calibrations and a budget.
EvalResult wide_result() {
  EvalResult r = sample_result(3);
  r.setup.max_rel_l2 = 0.03;
  r.setup.link = make_link_model("ib400", 0);
  r.setup.calibration = "max, percentile 99.999, mse";
  std::map<std::string, std::string> renamed;
  for (EvalRow& row : r.rows) {
    const std::string old_name = row.recipe;
    if (row.dispatch_amax || row.combine_amax) {
      row.calibration = "percentile 99.999";
      row.recipe += "@p99.999";
    }
    if (row.recipe.rfind("combine_mxfp8", 0) == 0) {
      row.recipe = "moe_combine_fp8_block128_ue8m0";
      row.combine_cast_fraction = 0.3125;
    }
    row.dispatch_us = 123.4;
    row.combine_us = 87.6;
    row.saved_us = 1234.5;
    row.over_budget = row.metrics.rel_l2 > 0.03;
    renamed[old_name] = row.recipe;
  }
  for (RecipeSummary& x : r.summary) x.recipe = renamed.at(x.recipe);
  r.setup.recipe_names.clear();
  for (const RecipeSummary& x : r.summary) r.setup.recipe_names.push_back(x.recipe);
  for (LayerCalibration& c : r.calibration.layers)
    for (const char* m : {"max", "percentile 99.999", "mse"})
      c.derived.push_back({"dispatch", m, "fp8", DerivedAmax{52480, 1e-5, 0.0123}});
  return r;
}

// What a 1400-pixel window shows, measured by the browser itself: a test-only script appended to
// the page (the report has none) writes the layout into the DOM for --dump-dom.
constexpr const char* kLayoutProbe = R"(<script>
(function () {
  const out = {pageWidth: document.documentElement.scrollWidth, wrapped: [], overlaps: [], outside: [],
               sticky: '', labels: 0};
  for (const td of document.querySelectorAll('td, th')) {
    const range = document.createRange();
    range.selectNodeContents(td);
    const tops = new Set();
    for (const r of range.getClientRects()) if (r.width > 0) tops.add(Math.round(r.bottom));
    if (tops.size > 1) out.wrapped.push(td.textContent);
  }
  const first = document.querySelector('table.results tbody td:nth-child(2)');
  out.sticky = first ? getComputedStyle(first).position : 'none';
  for (const svg of document.querySelectorAll('svg.chart')) {
    if (!svg.querySelector('title').textContent.includes('against wire bytes')) continue;
    const w = svg.width.baseVal.value, h = svg.height.baseVal.value;
    const boxes = Array.from(svg.querySelectorAll('text.lbl')).map(t => ({t: t.textContent, b: t.getBBox()}));
    out.labels = boxes.length;
    for (const {t, b} of boxes) if (b.x < 0 || b.y < 0 || b.x + b.width > w || b.y + b.height > h) out.outside.push(t);
    for (let i = 0; i < boxes.length; ++i)
      for (let j = i + 1; j < boxes.length; ++j) {
        const a = boxes[i].b, c = boxes[j].b;
        if (a.x < c.x + c.width && c.x < a.x + a.width && a.y < c.y + c.height && c.y < a.y + a.height)
          out.overlaps.push(boxes[i].t + ' / ' + boxes[j].t);
      }
  }
  document.body.setAttribute('data-layout', JSON.stringify(out));
})();
</script>)";

nlohmann::json layout_of(const std::string& dom) {
  const std::string key = "data-layout=\"";
  const size_t at = dom.find(key);
  if (at == std::string::npos) return nullptr;
  std::string v = dom.substr(at + key.size(), dom.find('"', at + key.size()) - at - key.size());
  for (const auto& [from, to] : {std::pair<std::string, std::string>{"&quot;", "\""}, {"&lt;", "<"}, {"&gt;", ">"},
                                 {"&amp;", "&"}})
    for (size_t p = v.find(from); p != std::string::npos; p = v.find(from, p + to.size())) v.replace(p, from.size(), to);
  return nlohmann::json::parse(v);
}

TEST_F(BrowserTest, ResultsFitA1400PixelWindowAndTradeoffLabelsDoNotOverlap) {
  for (const bool wide : {false, true}) {
    SCOPED_TRACE(wide ? "the widest page" : "the default run's page");
    std::string html = eval_report_html(wide ? wide_result() : sample_result(1));
    html.insert(html.rfind("</body>"), kLayoutProbe);
    const PageLoad page = load(write_page(wide ? "wide.html" : "plain.html", html), "1400,900");
    ASSERT_EQ(page.status, 0) << page.log;
    EXPECT_TRUE(page.console.empty()) << ::testing::PrintToString(page.console);
    ASSERT_TRUE(is_png(page.png, 1400, 900));
    const nlohmann::json l = layout_of(page.dom);
    ASSERT_FALSE(l.is_null()) << "the probe did not run:\n" << page.dom.substr(0, 1000);
    EXPECT_LE(l["pageWidth"].get<int>(), 1400) << "the page scrolls sideways; only the results table may";
    EXPECT_TRUE(l["wrapped"].empty()) << "cells whose text wraps: " << l["wrapped"].dump();
    EXPECT_EQ(l["sticky"], "sticky") << "the layer and recipe columns stay while the table scrolls";
    EXPECT_EQ(l["labels"].get<size_t>(), wide ? 12u : 12u);
    EXPECT_TRUE(l["overlaps"].empty()) << l["overlaps"].dump();
    EXPECT_TRUE(l["outside"].empty()) << "labels beyond the chart: " << l["outside"].dump();
  }
}

// ------------------------------------------------------------------------------------------------
// Without a browser.

TEST(ReportHtml, SelfContained) {
  const std::string html = eval_report_html(sample_result());
  for (const char* banned : {"<script", "<link", "<img", "<iframe", "src=", "href=", "@import", "url("})
    EXPECT_EQ(html.find(banned), std::string::npos) << banned;
  // The only URL is the SVG namespace.
  EXPECT_EQ(count(html, "http"), count(html, "http://www.w3.org/2000/svg"));
  EXPECT_EQ(html.find("https:"), std::string::npos);
  EXPECT_NE(html.find("moefq " MOEFQ_VERSION), std::string::npos);
  EXPECT_NE(html.find("cpu (2 threads)"), std::string::npos);
}

// Values at the ends of double's range on the log axes (a denormal rel_l2, a huge one, inf, NaN,
// negative): the page is drawn with a bounded number of decades and every label placed.
TEST(ReportHtml, ExtremeValuesOnTheLogAxesStayBounded) {
  for (double v : {std::numeric_limits<double>::denorm_min(), 1e-300, 1e300, double(INFINITY), double(NAN), -1.0}) {
    SCOPED_TRACE(v);
    EvalResult r = sample_result(2);
    for (EvalRow& row : r.rows) row.metrics.rel_l2 = v;
    for (RecipeSummary& x : r.summary) x.mean_rel_l2 = x.max_rel_l2 = v;
    r.setup.max_rel_l2 = v;
    const std::string html = eval_report_html(r);
    EXPECT_LT(html.size(), size_t(1) << 20);
    EXPECT_LE(count(html, "class=\"grid\""), 200);
  }
}

// Points close together on the trade-off chart: each label is moved down past those already
// placed, and placing ends (a label set exactly 13 px below another is no longer an overlap,
// whatever the rounding of y + 13 - y).
TEST(ReportHtml, CrowdedTradeoffLabelsArePlacedAndPlacingEnds) {
  EvalResult r = sample_result(1);
  const size_t labels = count(eval_report_html(r), "class=\"lbl\"");
  for (int k = 0; k < 200; ++k) {
    for (size_t i = 1; i < r.summary.size(); ++i) {
      r.summary[i].mean_rel_l2 = 0.0442 + 1e-5 * double((k * 7 + int(i) * 3) % 17) + 1e-7 * double(k);
      r.summary[i].wire_bytes_per_token = 1000 + double(i % 2);
    }
    const std::string html = eval_report_html(r);
    EXPECT_EQ(count(html, "class=\"lbl\""), labels);
  }
}

// The results table: the outlier output channels' count per row, and the error outside them only
// where there are some (a dash where it would repeat rel_l2); the note says how they are found.
TEST(ReportHtml, OutsideOutliersOnlyWhereTheLayerHasOutlierChannels) {
  EvalResult r = sample_result(1);
  for (EvalRow& row : r.rows) row.rel_l2_token_max = 0.5;  // the cell before: marks where the two start
  r.rows[2].num_outlier_channels = 4;
  r.rows[2].rel_l2_non_outlier = 0.0123;
  const std::string html = eval_report_html(r);
  EXPECT_NE(html.find("<th>outside outliers</th><th>outlier channels</th>"), std::string::npos);
  EXPECT_EQ(count(html, "0.5</td><td class=\"n\">&ndash;</td><td class=\"n\">0</td>"), 12u);
  EXPECT_EQ(count(html, "0.5</td><td class=\"n\">0.0123</td><td class=\"n\">4</td>"), 1u);
  EXPECT_NE(html.find("more than 6 times the median channel's, at most 1% of the channels"), std::string::npos);
}

// A run with peer recipes (moefq eval --sweep peers) gets a table grouped by peer: each peer's
// recipes together, in the order of first appearance; a run without them has none.
TEST(ReportHtml, PeerRecipesAreGroupedByPeer) {
  EvalResult r = sample_result(1);
  EXPECT_EQ(eval_report_html(r).find("<h2>By peer</h2>"), std::string::npos);
  const char* names[] = {"mori_fp8_blockwise", "deepep_ll_logfmt10", "mori_fp4_blockwise"};
  for (size_t i = 0; i < std::size(names); ++i) {
    r.summary[i + 1].recipe = names[i];
    for (EvalRow& row : r.rows)
      if (row.recipe == r.setup.recipe_names[i + 1]) row.recipe = names[i];
    r.setup.recipe_names[i + 1] = names[i];
  }
  const std::string html = eval_report_html(r);
  const size_t at = html.find("<h2>By peer</h2>");
  ASSERT_NE(at, std::string::npos);
  const size_t mori1 = html.find("<tr><td>MoRI</td><td>mori_fp8_blockwise", at);
  const size_t mori2 = html.find("<tr><td>MoRI</td><td>mori_fp4_blockwise", at);
  const size_t deepep = html.find("<tr><td>DeepEP</td><td>deepep_ll_logfmt10", at);
  ASSERT_NE(mori1, std::string::npos);
  ASSERT_NE(mori2, std::string::npos);
  ASSERT_NE(deepep, std::string::npos);
  EXPECT_LT(mori1, mori2);
  EXPECT_LT(mori2, deepep);  // MoRI's rows together, before DeepEP's (its first recipe comes first)
  EXPECT_LT(deepep, html.find("<h2>Results</h2>"));
}

TEST(ReportJson, EveryFigureAndNonFiniteAsStrings) {
  EvalResult r = sample_result(1);
  r.rows[1].metrics.max_abs = NAN;
  const nlohmann::json j = nlohmann::json::parse(eval_report_json(r));
  EXPECT_EQ(j.at("tool"), "moefq eval");
  EXPECT_EQ(j.at("device"), "cpu (2 threads)");
  EXPECT_EQ(j.at("version"), MOEFQ_VERSION);
  ASSERT_EQ(j.at("results").size(), 13u);
  EXPECT_EQ(j.at("results")[0].at("snr_db"), "inf");
  EXPECT_EQ(j.at("results")[1].at("max_abs"), "nan");
  EXPECT_TRUE(j.at("results")[0].at("dispatch_format").is_null());
  EXPECT_EQ(j.at("results")[1].at("dispatch_amax"), 52480.0);
  EXPECT_EQ(j.at("calibration")[0].at("combine_rank_amax").size(), 4u);
  EXPECT_EQ(j.at("config").at("ranks"), 4);
  // A rank whose calibration saw inf: "inf" as for every other figure (a plain number array would
  // write it as null).
  r.calibration.layers[0].combine_rank_amax[2] = INFINITY;
  r.calibration.layers[0].dispatch_amax = INFINITY;
  const nlohmann::json k = nlohmann::json::parse(eval_report_json(r));
  EXPECT_EQ(k.at("calibration")[0].at("combine_rank_amax")[2], "inf");
  EXPECT_EQ(k.at("calibration")[0].at("combine_rank_amax")[1], 2.3e8f);
  EXPECT_EQ(k.at("calibration")[0].at("dispatch_amax"), "inf");
  EXPECT_EQ(j.at("config").at("model").at("hidden"), 512);
  EXPECT_EQ(j.at("summary").size(), 13u);
  // The layer's outlier output channels per row; rel_l2_non_outlier a number either way.
  EXPECT_EQ(j.at("results")[1].at("num_outlier_channels"), 0);
  r.rows[1].num_outlier_channels = 3;
  r.rows[1].rel_l2_non_outlier = 0.25;
  const nlohmann::json o = nlohmann::json::parse(eval_report_json(r));
  EXPECT_EQ(o.at("results")[1].at("num_outlier_channels"), 3);
  EXPECT_EQ(o.at("results")[1].at("rel_l2_non_outlier"), 0.25);
}

TEST(ReportCsv, OneLinePerRowQuotedAndExact) {
  EvalResult r = sample_result(1);
  r.rows[2].recipe = "my, \"odd\" recipe";
  r.rows[3].metrics.rel_l2 = 0.1 + 0.2;  // needs 17 digits to round-trip
  const std::string csv = eval_report_csv(r);
  const std::vector<std::string> lines = test::split_lines(csv);
  ASSERT_EQ(lines.size(), 14u);
  EXPECT_EQ(lines[0], "layer,recipe,dispatch_format,combine_format,dispatch_amax,combine_amax,rel_l2,cosine,"
                      "calc_diff,max_abs,snr_db,count,rel_l2_token_p50,rel_l2_token_p99,rel_l2_token_max,"
                      "rel_l2_non_outlier,dispatch_clipped_fraction,combine_clipped_fraction,"
                      "dispatch_wire_bytes_per_token,combine_wire_bytes_per_token,wire_saving_vs_bf16,over_budget,"
                      "layout_check,combine_weighting,num_outlier_channels,calibration,dispatch_cast_fraction,"
                      "combine_cast_fraction,dispatch_us,combine_us,saved_us");
  EXPECT_EQ(lines[1].substr(0, 9), "3,none,,,");
  // No calibration method, cast fraction or link: the last six fields are empty.
  EXPECT_TRUE(lines[1].ends_with(",before,0,,,,,,")) << lines[1];
  r.setup.combine_weighting = CombineWeighting::kAfter;
  r.rows[1].num_outlier_channels = 7;
  EXPECT_TRUE(test::split_lines(eval_report_csv(r))[1].ends_with(",after,0,,,,,,"));
  EXPECT_TRUE(test::split_lines(eval_report_csv(r))[2].ends_with(",after,7,,,,,,"));
  EXPECT_NE(lines[1].find(",inf,"), std::string::npos) << lines[1];
  EXPECT_EQ(lines[3].substr(0, 24), "3,\"my, \"\"odd\"\" recipe\",,");
  EXPECT_NE(lines[4].find(",0.30000000000000004,"), std::string::npos) << lines[4];
}

TEST(ReportFiles, CreatesTheDirectoryAndRefusesAFile) {
  const fs::path root = test::unique_temp_path("moefq_rep_");
  const EvalResult r = sample_result(1);
  write_eval_reports(r, (root / "a" / "b").string());
  for (const char* f : {"report.json", "report.csv", "report.html"}) EXPECT_TRUE(fs::is_regular_file(root / "a" / "b" / f)) << f;
  EXPECT_EQ(read_text(root / "a" / "b" / "report.csv"), eval_report_csv(r));
  std::ofstream(root / "file") << "x";
  try {
    write_eval_reports(r, (root / "file" / "sub").string());
    ADD_FAILURE() << "a path under a file must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBadInput);
    EXPECT_NE(std::string(e.what()).find("cannot create the directory"), std::string::npos) << e.what();
  }
  size_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(root)) n += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(n, 4u) << "three reports and the file; no temporaries";
  fs::remove_all(root);
}

// The trade-off chart plots what the budget judges: each recipe's worst layer.
TEST(ReportHtml, TradeoffPlotsTheWorstLayer) {
  EvalResult r = sample_result(3);
  r.summary[1].mean_rel_l2 = 0.0125;
  r.summary[1].max_rel_l2 = 0.25;
  const std::string html = eval_report_html(r);
  EXPECT_NE(html.find("<title>" + r.summary[1].recipe + ": 0 B/token, rel_l2 0.25</title>"), std::string::npos);
  EXPECT_EQ(html.find("rel_l2 0.0125</title>"), std::string::npos);
  EXPECT_NE(html.find("worst of 3 layers"), std::string::npos);
}

// The new figures in every report: calibration method, cast fraction, transfer times, the link,
// the derived calibrations.
TEST(ReportJson, CalibrationCastAndTransferTimes) {
  const EvalResult r = wide_result();
  const nlohmann::json j = nlohmann::json::parse(eval_report_json(r));
  EXPECT_EQ(j["config"]["link"]["name"], "ib400");
  EXPECT_EQ(j["config"]["link"]["gbit_per_s"], 400);
  EXPECT_EQ(j["config"]["calibration_methods"], "max, percentile 99.999, mse");
  EXPECT_EQ(j["calibration"][0]["methods"].size(), 3u);
  EXPECT_EQ(j["calibration"][0]["methods"][1]["method"], "percentile 99.999");
  EXPECT_EQ(j["calibration"][0]["methods"][1]["qdq_rel_l2"], 0.0123);
  bool cast = false, calibrated = false;
  for (const auto& row : j["results"]) {
    EXPECT_EQ(row["saved_us"], 1234.5);
    EXPECT_EQ(row["dispatch_us"], 123.4);
    cast = cast || row["combine_cast_fraction"] == 0.3125;
    calibrated = calibrated || row["calibration"] == "percentile 99.999";
  }
  EXPECT_TRUE(cast && calibrated);
  const std::string csv = eval_report_csv(r);
  EXPECT_NE(csv.find(",calibration,dispatch_cast_fraction,combine_cast_fraction,dispatch_us,combine_us,saved_us\n"),
            std::string::npos);
  EXPECT_NE(csv.find(",percentile 99.999,,,123.40000000000001,87.599999999999994,1234.5\n"), std::string::npos) << csv;
  EXPECT_NE(csv.find(",,0.3125,123.40000000000001,"), std::string::npos);
  // Without a link the times are empty, not 0.
  const nlohmann::json plain = nlohmann::json::parse(eval_report_json(sample_result(1)));
  EXPECT_TRUE(plain["results"][0]["saved_us"].is_null());
  EXPECT_TRUE(plain["config"]["link"].is_null());
}

}  // namespace
}  // namespace moefq
