// Recipes: the shipped units, import expansion, override order, the cfg -> QuantSpec mapping,
// wildcard matching, and one test per error path (each message must name the file and the key).
#include "moefq/recipe.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "moefq/errors.h"
#include "test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;

using test::error_of;

std::string parse_error(const std::string& text, const std::string& origin = "my.yaml") {
  return error_of([&] { parse_recipe_text(text, origin); });
}

#define EXPECT_HAS(message, part)                                                  \
  EXPECT_NE(std::string(message).find(part), std::string::npos)                    \
      << "expected \"" << (part) << "\" in: " << (message)

// A fresh directory, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("moefq_recipe_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  std::string write(const std::string& name, const std::string& text) const {
    const fs::path p = path_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }

 private:
  fs::path path_;
};

// Sets MOEFQ_RECIPE_PATH for one test and restores it afterwards.
class ScopedRecipePath {
 public:
  explicit ScopedRecipePath(const std::string& value) {
    if (const char* old = std::getenv("MOEFQ_RECIPE_PATH")) old_ = old;
    ::setenv("MOEFQ_RECIPE_PATH", value.c_str(), 1);
  }
  ~ScopedRecipePath() {
    if (old_) ::setenv("MOEFQ_RECIPE_PATH", old_->c_str(), 1);
    else ::unsetenv("MOEFQ_RECIPE_PATH");
  }

 private:
  std::optional<std::string> old_;
};

std::vector<std::string> four_layers() {
  std::vector<std::string> names;
  for (int i = 0; i < 4; ++i) {
    names.push_back("layers." + std::to_string(i) + ".mlp.experts.dispatch_quantizer");
    names.push_back("layers." + std::to_string(i) + ".mlp.experts.combine_quantizer");
  }
  return names;
}

std::string dq(int layer) { return "layers." + std::to_string(layer) + ".mlp.experts.dispatch_quantizer"; }
std::string cq(int layer) { return "layers." + std::to_string(layer) + ".mlp.experts.combine_quantizer"; }

QuantSpec parse_one_cfg(const std::string& cfg_yaml) {
  const Recipe r = parse_recipe_text(
      "quant_cfg:\n  - quantizer_name: '*'\n    cfg: " + cfg_yaml + "\n", "cfg.yaml");
  EXPECT_EQ(r.entries.size(), 1u);
  EXPECT_TRUE(r.entries.at(0).cfg.has_value());
  return r.entries.at(0).cfg.value_or(QuantSpec{});
}

// ---------------------------------------------------------------------------------------------
// Shipped units

TEST(RecipeUnits, EveryShippedUnitLoadsAndMapsToItsFormat) {
  struct Case {
    const char* unit;
    const char* pattern;
    Format format;
    int block;
  };
  const Case cases[] = {
      {"moe_dispatch_fp8", "*dispatch_quantizer", Format::kFp8, 0},
      {"moe_combine_fp8", "*combine_quantizer", Format::kFp8, 0},
      {"moe_dispatch_nvfp4", "*dispatch_quantizer", Format::kNvfp4, 16},
      {"moe_combine_nvfp4", "*combine_quantizer", Format::kNvfp4, 16},
      {"moe_dispatch_mxfp8", "*dispatch_quantizer", Format::kMxfp8, 32},
      {"moe_combine_mxfp8", "*combine_quantizer", Format::kMxfp8, 32},
      {"moe_dispatch_mxfp4", "*dispatch_quantizer", Format::kMxfp4, 32},
      {"moe_combine_mxfp4", "*combine_quantizer", Format::kMxfp4, 32},
  };
  const std::vector<std::string> units = list_recipe_units();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.unit);
    EXPECT_NE(std::find(units.begin(), units.end(), c.unit), units.end());
    const Recipe r = load_recipe(c.unit);
    EXPECT_EQ(r.name, c.unit);
    EXPECT_EQ(r.algorithm, "max");
    ASSERT_EQ(r.entries.size(), 1u);
    const RecipeEntry& e = r.entries[0];
    EXPECT_EQ(e.pattern, c.pattern);
    EXPECT_EQ(e.enable, std::optional<bool>(true));
    ASSERT_TRUE(e.cfg.has_value());
    EXPECT_EQ(e.cfg->format, c.format);
    EXPECT_EQ(e.cfg->block_size, c.block);
    EXPECT_EQ(e.cfg->amax_source, AmaxSource::kCalibrated);
    EXPECT_HAS(e.origin, std::string(c.unit) + ".yaml: quant_cfg[0]");

    // Applied to a model, the unit enables exactly its side.
    const auto configs = apply_recipe(r, four_layers());
    for (const auto& [name, qc] : configs) {
      const bool mine = wildcard_match(c.pattern, name);
      EXPECT_EQ(qc.enable, mine) << name;
      EXPECT_EQ(qc.configured, mine) << name;
      if (mine) {
        EXPECT_EQ(qc.spec.format, c.format) << name;
      }
    }
  }
}

TEST(RecipeUnits, LoadsByFilePathAndByNameWithSuffix) {
  const Recipe by_path = load_recipe(std::string(MOEFQ_SOURCE_DIR) + "/recipes/moe_combine_nvfp4.yaml");
  EXPECT_EQ(by_path.name, "moe_combine_nvfp4");
  ASSERT_EQ(by_path.entries.size(), 1u);
  EXPECT_EQ(by_path.entries[0].cfg->format, Format::kNvfp4);
  const Recipe by_name = load_recipe("moe_combine_nvfp4.yaml");
  ASSERT_EQ(by_name.entries.size(), 1u);
  EXPECT_EQ(by_name.entries[0].cfg, by_path.entries[0].cfg);
}

// ---------------------------------------------------------------------------------------------
// Imports, splices, override order

TEST(RecipeApply, ImportsSplicesAndOverridesOnFourLayers) {
  const Recipe r = parse_recipe_text(R"(
$import: [moe_dispatch_fp8, moe_combine_nvfp4]
quant_cfg:
  - $import: moe_combine_mxfp8
  - quantizer_name: 'layers.3.*combine_quantizer'
    enable: false
  - quantizer_name: '*dispatch_quantizer'
    cfg: {num_bits: e4m3, constant_amax: 6.5}
algorithm: max
)",
                                     "user.yaml");
  EXPECT_EQ(r.name, "user");
  ASSERT_EQ(r.entries.size(), 5u);
  // Top-level imports first, in order, then the splice at its position, then the entries.
  EXPECT_HAS(r.entries[0].origin, "moe_dispatch_fp8.yaml: quant_cfg[0]");
  EXPECT_HAS(r.entries[1].origin, "moe_combine_nvfp4.yaml: quant_cfg[0]");
  EXPECT_HAS(r.entries[2].origin, "moe_combine_mxfp8.yaml: quant_cfg[0]");
  EXPECT_EQ(r.entries[3].origin, "user.yaml: quant_cfg[1]");
  EXPECT_EQ(r.entries[4].origin, "user.yaml: quant_cfg[2]");
  EXPECT_EQ(r.entries[3].enable, std::optional<bool>(false));
  EXPECT_FALSE(r.entries[3].cfg.has_value());
  EXPECT_FALSE(r.entries[4].enable.has_value());

  const auto c = apply_recipe(r, four_layers());
  ASSERT_EQ(c.size(), 8u);
  for (int i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    const QuantizerConfig& d = c.at(dq(i));
    EXPECT_TRUE(d.enable);  // a cfg without enable enables
    EXPECT_TRUE(d.configured);
    EXPECT_EQ(d.spec.format, Format::kFp8);
    EXPECT_EQ(d.spec.amax_source, AmaxSource::kConstant);  // the later cfg replaced the unit's
    EXPECT_EQ(d.spec.constant_amax, 6.5f);
    const QuantizerConfig& k = c.at(cq(i));
    EXPECT_EQ(k.spec.format, Format::kMxfp8);  // the splice came after the nvfp4 import
    EXPECT_TRUE(k.configured);
    EXPECT_EQ(k.enable, i != 3);               // the layer-specific disable
  }
}

TEST(RecipeApply, EachCfgReplacesTheWholeSpecAndEnableKeepsIt) {
  const Recipe r = parse_recipe_text(R"(
quant_cfg:
  - quantizer_name: '*'
    cfg: {num_bits: e4m3, amax: dynamic}
  - quantizer_name: '*combine_quantizer'
    cfg: {num_bits: 8}
  - quantizer_name: 'layers.[12].*'
    enable: false
  - quantizer_name: 'layers.2.*dispatch*'
    enable: true
)",
                                     "replace.yaml");
  const auto c = apply_recipe(r, four_layers());
  // dispatch: the first cfg only.
  EXPECT_EQ(c.at(dq(0)).spec.amax_source, AmaxSource::kDynamic);
  EXPECT_EQ(c.at(dq(0)).spec.format, Format::kFp8);
  // combine: the second cfg replaced the first as a whole; its amax is back to calibrated.
  EXPECT_EQ(c.at(cq(0)).spec.format, Format::kInt8);
  EXPECT_EQ(c.at(cq(0)).spec.amax_source, AmaxSource::kCalibrated);
  // Layers 1 and 2 disabled; layer 2's dispatch re-enabled with the spec it already had.
  EXPECT_TRUE(c.at(dq(0)).enable);
  EXPECT_FALSE(c.at(dq(1)).enable);
  EXPECT_FALSE(c.at(cq(1)).enable);
  EXPECT_FALSE(c.at(cq(2)).enable);
  EXPECT_TRUE(c.at(cq(3)).enable);
  EXPECT_TRUE(c.at(dq(2)).enable);
  EXPECT_EQ(c.at(dq(2)).spec.amax_source, AmaxSource::kDynamic);
  EXPECT_TRUE(c.at(cq(1)).configured);  // disabled, the spec is kept
}

TEST(RecipeApply, CfgWithEnableFalseConfiguresButLeavesDisabled) {
  const Recipe r = parse_recipe_text(
      "quant_cfg:\n  - {quantizer_name: '*', enable: false, cfg: {num_bits: e4m3}}\n", "off.yaml");
  const auto c = apply_recipe(r, four_layers());
  for (const auto& [name, qc] : c) {
    EXPECT_FALSE(qc.enable) << name;
    EXPECT_TRUE(qc.configured) << name;
  }
}

TEST(RecipeApply, EmptyRecipeLeavesEverythingDisabled) {
  const Recipe r = parse_recipe_text("quant_cfg: []\n", "empty.yaml");
  const auto c = apply_recipe(r, four_layers());
  ASSERT_EQ(c.size(), 8u);
  for (const auto& [name, qc] : c) EXPECT_FALSE(qc.enable || qc.configured) << name;
}

TEST(RecipeImport, ResolvesBesideTheFileThenPathThenShipped) {
  TempDir dir, other;
  // A file beside the importer shadows the shipped unit of the same name.
  dir.write("moe_dispatch_fp8.yaml",
            "quant_cfg:\n  - {quantizer_name: '*dispatch_quantizer', cfg: {num_bits: 8}}\n");
  other.write("team_combine.yaml", "$import: moe_combine_mxfp4\n");
  const std::string main = dir.write("main.yaml", "$import: [moe_dispatch_fp8, team_combine, moe_combine_fp8]\n");
  ScopedRecipePath env(other.path().string() + ":/nonexistent");
  const Recipe r = load_recipe(main);
  EXPECT_EQ(r.name, "main");
  ASSERT_EQ(r.entries.size(), 3u);
  EXPECT_EQ(r.entries[0].cfg->format, Format::kInt8);   // beside the file
  EXPECT_EQ(r.entries[1].cfg->format, Format::kMxfp4);  // via MOEFQ_RECIPE_PATH, nested import
  EXPECT_EQ(r.entries[2].cfg->format, Format::kFp8);    // shipped
  EXPECT_HAS(r.entries[0].origin, (dir.path() / "moe_dispatch_fp8.yaml").string());
  // A unit name given to load_recipe is found on MOEFQ_RECIPE_PATH too.
  EXPECT_EQ(load_recipe("team_combine").entries.at(0).cfg->format, Format::kMxfp4);
}

TEST(RecipeImport, TheSameUnitTwiceIsNotACycle) {
  const Recipe r = parse_recipe_text(
      "$import: [moe_dispatch_fp8, moe_dispatch_nvfp4]\nquant_cfg:\n  - $import: "
      "moe_dispatch_fp8\n",
      "twice.yaml");
  ASSERT_EQ(r.entries.size(), 3u);
  const auto c = apply_recipe(r, four_layers());
  EXPECT_EQ(c.at(dq(1)).spec.format, Format::kFp8);  // the last import wins
}

// ---------------------------------------------------------------------------------------------
// cfg -> QuantSpec

TEST(RecipeCfg, ConstantAndDynamicAmax) {
  QuantSpec s = parse_one_cfg(
      "{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}, constant_amax: 2688}");
  EXPECT_EQ(s.format, Format::kNvfp4);
  EXPECT_EQ(s.amax_source, AmaxSource::kConstant);
  EXPECT_EQ(s.constant_amax, 2688.0f);
  s = parse_one_cfg("{num_bits: e4m3, amax: constant, constant_amax: 1.5e2}");
  EXPECT_EQ(s.amax_source, AmaxSource::kConstant);
  EXPECT_EQ(s.constant_amax, 150.0f);
  s = parse_one_cfg("{num_bits: e4m3, amax: dynamic}");
  EXPECT_EQ(s.amax_source, AmaxSource::kDynamic);
  s = parse_one_cfg("{num_bits: e4m3, amax: calibrated}");
  EXPECT_EQ(s.amax_source, AmaxSource::kCalibrated);
}

TEST(RecipeCfg, ModelOptListFormsAndInt8) {
  EXPECT_EQ(parse_one_cfg("{num_bits: [4, 3], axis: null}").format, Format::kFp8);
  EXPECT_EQ(parse_one_cfg("{num_bits: 8, axis: }").format, Format::kInt8);
  EXPECT_EQ(parse_one_cfg("{num_bits: [2, 1], block_sizes: {-1: 16, type: dynamic, scale_bits: [4, 3]}}").format,
            Format::kNvfp4);
  EXPECT_EQ(parse_one_cfg("{num_bits: [4, 3], block_sizes: {-1: 32, type: dynamic, scale_bits: [8, 0]}}").format,
            Format::kMxfp8);
  EXPECT_EQ(parse_one_cfg("{num_bits: [2, 1], block_sizes: {-1: 32, type: dynamic, scale_bits: [8, 0]}}").format,
            Format::kMxfp4);
  // block_sizes: null is the same as no block_sizes.
  EXPECT_EQ(parse_one_cfg("{num_bits: e4m3, block_sizes: null}").format, Format::kFp8);
}

TEST(RecipeCfg, EnableSpellingsAndFlowEntries) {
  const Recipe r = parse_recipe_text(
      "quant_cfg: [{quantizer_name: a, enable: True}, {quantizer_name: b, enable: off}]\n", "e.yaml");
  ASSERT_EQ(r.entries.size(), 2u);
  EXPECT_EQ(r.entries[0].enable, std::optional<bool>(true));
  EXPECT_EQ(r.entries[1].enable, std::optional<bool>(false));
  EXPECT_EQ(parse_recipe_text("quant_cfg:\n", "n.yaml").entries.size(), 0u);
}

// ---------------------------------------------------------------------------------------------
// Wildcards

TEST(RecipeWildcard, FnmatchCases) {
  const std::string d3 = dq(3);
  EXPECT_TRUE(wildcard_match("*", d3));
  EXPECT_TRUE(wildcard_match("*dispatch_quantizer", d3));
  EXPECT_FALSE(wildcard_match("*combine_quantizer", d3));
  EXPECT_TRUE(wildcard_match("layers.3.*", d3));       // '*' crosses dots
  EXPECT_FALSE(wildcard_match("layers.3.*", dq(13)));
  EXPECT_FALSE(wildcard_match("layers.1*", "layers.0.x"));
  EXPECT_TRUE(wildcard_match("layers.1*", "layers.13.x"));
  EXPECT_TRUE(wildcard_match("layers.?.mlp*", d3));
  EXPECT_FALSE(wildcard_match("layers.?.mlp*", "layers.12.mlp.x"));
  EXPECT_TRUE(wildcard_match("layers.[0-3].*", d3));
  EXPECT_FALSE(wildcard_match("layers.[!0-3].*", d3));
  EXPECT_TRUE(wildcard_match("layers.[!0-2].*", d3));
  EXPECT_TRUE(wildcard_match("layers.[13].*", d3));
  EXPECT_TRUE(wildcard_match("a[]]b", "a]b"));          // ']' first in a class is literal
  EXPECT_TRUE(wildcard_match("a[!]]b", "axb"));
  EXPECT_FALSE(wildcard_match("a[!]]b", "a]b"));
  EXPECT_TRUE(wildcard_match("a[-x]b", "a-b"));         // '-' at an end is literal
  EXPECT_TRUE(wildcard_match("a[x-]b", "a-b"));
  EXPECT_TRUE(wildcard_match("a[b", "a[b"));            // an unclosed '[' is literal
  EXPECT_FALSE(wildcard_match("a[b", "ab"));
  EXPECT_FALSE(wildcard_match("dispatch_quantizer", d3));  // whole-name match
  EXPECT_FALSE(wildcard_match("layers.3", d3));
  EXPECT_TRUE(wildcard_match("", ""));
  EXPECT_FALSE(wildcard_match("", "a"));
  EXPECT_TRUE(wildcard_match("**a**", "a"));
  EXPECT_TRUE(wildcard_match("*a*b*c", "xxaxxbxxc"));
  EXPECT_FALSE(wildcard_match("*a*b*c", "xxaxxbxxcx"));
  EXPECT_FALSE(wildcard_match("Layers.*", d3));         // case-sensitive
  // Many stars against a long non-matching name stays cheap (no exponential backtracking).
  EXPECT_FALSE(wildcard_match("*a*a*a*a*a*a*a*a*a*a*b", std::string(20000, 'a')));
}

// ---------------------------------------------------------------------------------------------
// Errors: each names the origin and the key

TEST(RecipeErrors, UnknownTopLevelKey) {
  const std::string m = parse_error("quant_cfg: []\nquant_config: []\n");
  EXPECT_HAS(m, "my.yaml: unknown top-level key 'quant_config'");
  EXPECT_HAS(m, "expected $import, quant_cfg, algorithm");
  EXPECT_HAS(m, "line 2");
}

TEST(RecipeErrors, UnknownEntryKey) {
  const std::string m = parse_error(
      "quant_cfg:\n  - quantizer_name: '*'\n    enable: false\n  - quantizer_name: x\n    "
      "parent_class: Linear\n    enable: false\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[1]: unknown key 'parent_class'");
  EXPECT_HAS(m, "expected quantizer_name, enable, cfg, $import");
}

TEST(RecipeErrors, UnknownCfgKey) {
  const std::string m = parse_error(
      "quant_cfg:\n  - quantizer_name: a\n    enable: false\n  - quantizer_name: b\n    enable: "
      "false\n  - quantizer_name: '*'\n    cfg: {num_bit: e4m3}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[2].cfg: unknown key 'num_bit' (expected num_bits, axis, "
                "block_sizes, constant_amax, amax)");
  const std::string m2 = parse_error("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: 8, enable: true}}\n");
  EXPECT_HAS(m2, "quant_cfg[0].cfg: unknown key 'enable'");
  EXPECT_HAS(m2, "beside cfg");
}

TEST(RecipeErrors, UnknownNumBits) {
  for (const char* bits : {"e5m2", "4", "[5, 2]", "fp8", "[4]", "{a: 1}", "null"}) {
    SCOPED_TRACE(bits);
    const std::string m =
        parse_error(std::string("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: ") + bits + "}}\n");
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.num_bits: unknown format");
    EXPECT_HAS(m, "expected e4m3, e2m1, 8");
  }
  EXPECT_HAS(parse_error("quant_cfg:\n  - {quantizer_name: a, cfg: {axis: null}}\n"),
             "my.yaml: quant_cfg[0].cfg: missing num_bits");
}

TEST(RecipeErrors, BadBlockSize) {
  for (const char* size : {"64", "0", "-16", "sixteen", "[16]"}) {
    SCOPED_TRACE(size);
    const std::string m = parse_error(std::string("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e2m1, "
                                                  "block_sizes: {-1: ") +
                                      size + ", type: dynamic, scale_bits: e4m3}}}\n");
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.block_sizes.-1: block size");
    EXPECT_HAS(m, "16 for nvfp4, 32 for mxfp8");
  }
  std::string m = parse_error(
      "quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e2m1, block_sizes: {-2: 16, type: dynamic, "
      "scale_bits: e4m3}}}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.block_sizes: only the last dimension can be blocked");
  EXPECT_HAS(m, "'-2'");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e2m1, block_sizes: {type: dynamic, "
                  "scale_bits: e4m3}}}\n");
  EXPECT_HAS(m, "quant_cfg[0].cfg.block_sizes: missing the block size");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: static, "
                  "scale_bits: e4m3}}}\n");
  EXPECT_HAS(m, "quant_cfg[0].cfg.block_sizes.type: 'static' is not supported");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e2m1, block_sizes: {-1: 16, "
                  "scale_bits: e4m3}}}\n");
  EXPECT_HAS(m, "quant_cfg[0].cfg.block_sizes: missing type: dynamic");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, "
                  "scale_bits: e4m3, scale_block_sizes: {-1: 16}}}}\n");
  EXPECT_HAS(m, "quant_cfg[0].cfg.block_sizes: unknown key 'scale_block_sizes' (expected -1, type, scale_bits)");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e2m1, block_sizes: 16}}\n");
  EXPECT_HAS(m, "quant_cfg[0].cfg.block_sizes: must be a mapping");
}

TEST(RecipeErrors, BadScaleBits) {
  for (const char* bits : {"e5m2", "[8, 1]", "ue8m0", "e2m1"}) {
    SCOPED_TRACE(bits);
    const std::string m = parse_error(
        std::string("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e2m1, block_sizes: {-1: 16, "
                    "type: dynamic, scale_bits: ") +
        bits + "}}}\n");
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.block_sizes.scale_bits: unknown format");
    EXPECT_HAS(m, "expected e4m3, e8m0");
  }
  const std::string m = parse_error(
      "quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic}}}\n");
  EXPECT_HAS(m, "quant_cfg[0].cfg.block_sizes: missing scale_bits");
}

TEST(RecipeErrors, UnsupportedCombination) {
  struct Case {
    const char* cfg;
    const char* named;
  };
  const Case cases[] = {
      {"{num_bits: e2m1}", "num_bits e2m1 without block_sizes"},
      {"{num_bits: 8, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}}",
       "num_bits 8 with block_sizes {-1: 16, scale_bits: e4m3}"},
      {"{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e8m0}}",
       "num_bits e2m1 with block_sizes {-1: 16, scale_bits: e8m0}"},
      {"{num_bits: e4m3, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}}",
       "num_bits e4m3 with block_sizes {-1: 16, scale_bits: e4m3}"},
      {"{num_bits: e2m1, block_sizes: {-1: 32, type: dynamic, scale_bits: e4m3}}",
       "num_bits e2m1 with block_sizes {-1: 32, scale_bits: e4m3}"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.cfg);
    const std::string m =
        parse_error(std::string("quant_cfg:\n  - {quantizer_name: a, cfg: ") + c.cfg + "}\n");
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg: unsupported combination: ");
    EXPECT_HAS(m, c.named);
    EXPECT_HAS(m, "(nvfp4)");
  }
}

TEST(RecipeErrors, AxisNotNull) {
  for (const char* axis : {"0", "-1", "[0, 1]", "'null'"}) {
    SCOPED_TRACE(axis);
    const std::string m =
        parse_error(std::string("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e4m3, axis: ") + axis + "}}\n");
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.axis: per-channel quantization");
    EXPECT_HAS(m, "unsupported");
    EXPECT_HAS(m, "axis: null");
  }
}

TEST(RecipeErrors, BadAlgorithm) {
  for (const char* algo : {"awq_lite", "null", "{method: max}", "MAX"}) {
    SCOPED_TRACE(algo);
    const std::string m = parse_error(std::string("quant_cfg: []\nalgorithm: ") + algo + "\n");
    EXPECT_HAS(m, "my.yaml: algorithm: ");
    EXPECT_HAS(m, "is not supported; the only calibration algorithm is max");
  }
  Recipe r;
  r.name = "handmade";
  r.algorithm = "smoothquant";
  EXPECT_HAS(error_of([&] { apply_recipe(r, four_layers()); }), "handmade: algorithm 'smoothquant'");
}

TEST(RecipeErrors, ConstantAmaxNotPositiveOrNotANumber) {
  for (const char* v : {"0", "-1", "-0.0", ".inf", "-.inf", ".nan", "1e39", "1e-50"}) {
    SCOPED_TRACE(v);
    const std::string m = parse_error(
        std::string("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e4m3, constant_amax: ") + v + "}}\n");
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.constant_amax: must be a finite number > 0");
  }
  for (const char* v : {"abc", "'six'", "[1]", "null", "1.5x", "0x10"}) {
    SCOPED_TRACE(v);
    const std::string m = parse_error(
        std::string("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e4m3, constant_amax: ") + v + "}}\n");
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.constant_amax: ");
    EXPECT_HAS(m, "is not a number");
  }
}

TEST(RecipeErrors, ConstantAmaxConflictsAndMx) {
  std::string m = parse_error(
      "quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e4m3, constant_amax: 2, amax: dynamic}}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.amax: constant_amax and amax: dynamic contradict");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e4m3, amax: constant}}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.amax: amax: constant needs constant_amax");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e4m3, amax: max}}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.amax: unknown amax source 'max'");
  m = parse_error(
      "quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e4m3, constant_amax: 2, block_sizes: {-1: 32, "
      "type: dynamic, scale_bits: e8m0}}}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.constant_amax: has no effect on mxfp8");
}

TEST(RecipeErrors, UnknownImport) {
  std::string m = parse_error("$import: [moe_dispatch_fp8, moe_dispatch_fp16]\n");
  EXPECT_HAS(m, "my.yaml: $import[1]: unknown unit 'moe_dispatch_fp16'");
  EXPECT_HAS(m, "moe_combine_nvfp4");  // the available units are listed
  m = parse_error("quant_cfg:\n  - $import: nope\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].$import: unknown unit 'nope'");
  m = parse_error("$import: ../etc/passwd\n");
  EXPECT_HAS(m, "my.yaml: $import: '../etc/passwd' is not a unit name");
  m = parse_error("$import: {a: 1}\n");
  EXPECT_HAS(m, "my.yaml: $import: must be a unit name or a list");
  m = parse_error("quant_cfg:\n  - {$import: moe_dispatch_fp8, quantizer_name: '*'}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0]: an $import entry takes no other keys");
  m = error_of([] { load_recipe("no_such_recipe_anywhere"); });
  EXPECT_HAS(m, "'no_such_recipe_anywhere' is neither a recipe file nor a unit");
  EXPECT_HAS(m, "moe_dispatch_fp8");
}

TEST(RecipeErrors, ImportCycle) {
  TempDir dir;
  dir.write("a.yaml", "$import: b\n");
  dir.write("b.yaml", "quant_cfg:\n  - $import: c\n");
  dir.write("c.yaml", "$import: [moe_dispatch_fp8, a]\n");
  const std::string m = error_of([&] { load_recipe((dir.path() / "a.yaml").string()); });
  EXPECT_HAS(m, "c.yaml: $import[1]: import cycle: ");
  EXPECT_HAS(m, "a.yaml -> ");
  EXPECT_HAS(m, "b.yaml -> ");
  EXPECT_HAS(m, "imported by");
  dir.write("self.yaml", "quant_cfg:\n  - $import: self\n");
  EXPECT_HAS(error_of([&] { load_recipe((dir.path() / "self.yaml").string()); }),
             "self.yaml: quant_cfg[0].$import: import cycle");
}

TEST(RecipeErrors, ErrorInAnImportedUnitNamesBothFiles) {
  TempDir dir;
  dir.write("broken.yaml", "quant_cfg:\n  - {quantizer_name: a, cfg: {num_bits: e4m4}}\n");
  const std::string main = dir.write("main.yaml", "quant_cfg:\n  - $import: broken\n");
  const std::string m = error_of([&] { load_recipe(main); });
  EXPECT_HAS(m, "broken.yaml: quant_cfg[0].cfg.num_bits: unknown format 'e4m4'");
  EXPECT_HAS(m, "imported by " + main + ": quant_cfg[0].$import");
}

TEST(RecipeErrors, UnmatchedPattern) {
  const Recipe r = parse_recipe_text(
      "$import: moe_dispatch_fp8\nquant_cfg:\n  - quantizer_name: 'layers.9.*'\n    enable: false\n",
      "u.yaml");
  const std::string m = error_of([&] { apply_recipe(r, four_layers()); });
  EXPECT_HAS(m, "u.yaml: quant_cfg[0]: quantizer_name 'layers.9.*' matches no quantizer");
  EXPECT_HAS(m, "available: " + dq(0));
  EXPECT_HAS(m, "and 4 more");
  // A unit's pattern that matches nothing in this model is an error too, naming the unit.
  const std::string m2 = error_of([] { apply_recipe(load_recipe("moe_combine_fp8"), {dq(0)}); });
  EXPECT_HAS(m2, "moe_combine_fp8.yaml: quant_cfg[0]: quantizer_name '*combine_quantizer' matches no");
  EXPECT_HAS(error_of([&] { apply_recipe(r, {}); }), "there are none");
}

TEST(RecipeErrors, MalformedYaml) {
  std::string m = parse_error("quant_cfg: [\n  - a\n");
  EXPECT_HAS(m, "my.yaml: not valid YAML: ");
  m = parse_error("quant_cfg:\n  - quantizer_name: *combine_quantizer\n    enable: true\n");
  EXPECT_HAS(m, "my.yaml: not valid YAML: ");
  EXPECT_HAS(m, "must be quoted");
  m = parse_error("quant_cfg: []\n---\nquant_cfg: []\n");
  EXPECT_HAS(m, "my.yaml: holds more than one YAML document");
  m = parse_error(",\n");  // yaml-cpp's LoadAll never returns on this
  EXPECT_HAS(m, "my.yaml: holds more than one YAML document");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, enable: true}\n  - {quantizer_name: a, enable: true, "
                  "enable: false}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[1]: duplicate key 'enable'");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, enable: true}\n  - {[x]: 1}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[1]: a key must be a plain name");
}

TEST(RecipeErrors, NotAMapping) {
  for (const char* text : {"- quantizer_name: a\n", "42\n", "'quant_cfg'\n", "", "---\n", "# only a comment\n"}) {
    SCOPED_TRACE(text);
    const std::string m = parse_error(text, "nm.yaml");
    EXPECT_HAS(m, "nm.yaml: ");
    EXPECT_HAS(m, "must be a mapping with quant_cfg");
  }
  std::string m = parse_error("quant_cfg:\n  '*': {num_bits: 8}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg: must be a list of entries");
  m = parse_error("quant_cfg:\n  - quantizer_name: a\n    enable: true\n  - just_a_string\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[1]: an entry must be a mapping");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, cfg: e4m3}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg: must be a mapping with num_bits");
}

TEST(RecipeErrors, EnableNotABool) {
  for (const char* v : {"'true'", "1", "maybe", "[true]", "null"}) {
    SCOPED_TRACE(v);
    const std::string m =
        parse_error(std::string("quant_cfg:\n  - {quantizer_name: a, enable: ") + v + "}\n");
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].enable: must be true or false");
  }
}

TEST(RecipeErrors, EntryShape) {
  std::string m = parse_error("quant_cfg:\n  - {quantizer_name: a}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0]: the entry for 'a' sets neither enable nor cfg");
  m = parse_error("quant_cfg:\n  - {enable: true}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0]: missing quantizer_name");
  m = parse_error("quant_cfg:\n  - {quantizer_name: '', enable: true}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].quantizer_name: must be a non-empty wildcard pattern");
}

TEST(RecipeErrors, EnabledWithoutCfg) {
  const Recipe r = parse_recipe_text(
      "$import: moe_combine_nvfp4\nquant_cfg:\n  - quantizer_name: 'layers.2.*dispatch_quantizer'\n    "
      "enable: true\n",
      "ewc.yaml");
  const std::string m = error_of([&] { apply_recipe(r, four_layers()); });
  EXPECT_HAS(m, dq(2) + ": enabled by ewc.yaml: quant_cfg[0] but no entry gives it a cfg");
}

TEST(RecipeErrors, DuplicateQuantizerNames) {
  const Recipe r = load_recipe("moe_dispatch_fp8");
  EXPECT_HAS(error_of([&] { apply_recipe(r, {dq(0), dq(0)}); }), "is listed twice");
}

// ---------------------------------------------------------------------------------------------
// Robustness: odd input gives a moefq::Error or a recipe, never another exception or a crash.

TEST(RecipeRobustness, OddInputsOnlyRaiseMoefqErrors) {
  std::vector<std::string> inputs = {
      std::string("quant_cfg: [\0]\n", 15),
      "\t\tquant_cfg: []\n",
      "&a [*a]\n",
      "a: &a {b: *a}\n",
      "quant_cfg: &x\n  - $import: *x\n",
      "quant_cfg:\n  - quantizer_name: !!binary aGVsbG8=\n    enable: true\n",
      "? [a, b]\n: 1\n",
      "%YAML 1.2\n---\nquant_cfg: []\n",
      "quant_cfg: !!map {}\n",
      "\xff\xfe\x00q\x00",
      std::string(5000, '[') + std::string(5000, ']'),
      std::string(3000, '{'),
      "quant_cfg:\n" + std::string(2000, ' ') + "- a\n",
  };
  std::string deep = "quant_cfg:\n";
  for (int i = 0; i < 300; ++i) deep += std::string(2 * i + 2, ' ') + "- \n";
  inputs.push_back(deep);
  std::mt19937 rng(1234);
  const std::string alphabet = "-:[]{}*&!|>'\"#%@`,?\n\t abc$019.";
  for (int i = 0; i < 2000; ++i) {
    std::string s;
    const int len = static_cast<int>(rng() % 64);
    for (int k = 0; k < len; ++k) s += alphabet[rng() % alphabet.size()];
    inputs.push_back(s);
  }
  int recipes = 0;
  for (const std::string& text : inputs) {
    try {
      parse_recipe_text(text, "odd.yaml");
      ++recipes;
    } catch (const Error& e) {
      EXPECT_HAS(e.what(), "odd.yaml");
    } catch (...) {
      ADD_FAILURE() << "a non-moefq exception escaped for input: " << text;
    }
  }
  EXPECT_LT(recipes, static_cast<int>(inputs.size()));
}

}  // namespace
}  // namespace moefq
