// Recipe files in Model Optimizer's own layout (tests/quant/data/modelopt_layout, written for
// these tests in that framework's format: numerics snippets, units, presets, complete recipes) load
// unchanged; the loader's `$import` forms, nested imports, cycles, recipe roots and its errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "moefq/errors.h"
#include "moefq/recipe.h"
#include "test_util.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;
using test::error_of;

const std::string kRoot = std::string(MOEFQ_SOURCE_DIR) + "/tests/quant/data/modelopt_layout";

std::string at_root(const std::string& rel) { return kRoot + "/" + rel; }

std::string dq(int layer) { return "layers." + std::to_string(layer) + ".mlp.experts.dispatch_quantizer"; }
std::string cq(int layer) { return "layers." + std::to_string(layer) + ".mlp.experts.combine_quantizer"; }

std::vector<std::string> four_layers() {
  std::vector<std::string> names;
  for (int i = 0; i < 4; ++i) {
    names.push_back(dq(i));
    names.push_back(cq(i));
  }
  return names;
}

std::vector<std::string> ignored_patterns(const Recipe& r) {
  std::vector<std::string> out;
  for (const IgnoredEntry& e : r.ignored) out.push_back(e.pattern);
  return out;
}

bool has(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// A fresh directory, removed at the end of the test.
struct TempDir : test::TempDir {
  TempDir() : test::TempDir("moefq_recipe_files_") {}
};

constexpr const char* kAttr = "# modelopt-schema: modelopt.torch.quantization.config.QuantizerAttributeConfig\n";
constexpr const char* kList = "# modelopt-schema: modelopt.torch.quantization.config.QuantizerCfgListConfig\n";
constexpr const char* kEntry = "# modelopt-schema: modelopt.torch.quantization.config.QuantizerCfgEntry\n";

// ---------------------------------------------------------------------------------------------
// The framework's files, unchanged

TEST(ModelOptLayout, EveryNumericsFileOfMoefqsFormatsGivesItsSpec) {
  struct Case {
    const char* file;
    Format format;
    int block;
  };
  const Case cases[] = {
      {"fp8", Format::kFp8, 0},     {"int8", Format::kInt8, 0},    {"nvfp4", Format::kNvfp4, 16},
      {"mxfp8", Format::kMxfp8, 32}, {"mxfp4", Format::kMxfp4, 32},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.file);
    const Recipe r = parse_recipe_text(std::string("imports:\n  x: configs/numerics/") + c.file +
                                           "\nquant_cfg:\n  - quantizer_name: '*combine_quantizer'\n    cfg:\n"
                                           "      $import: x\n",
                                       "numerics.yaml", kRoot);
    ASSERT_EQ(r.entries.size(), 1u);
    ASSERT_TRUE(r.entries[0].cfg.has_value());
    EXPECT_EQ(r.entries[0].cfg->format, c.format);
    EXPECT_EQ(r.entries[0].cfg->block_size, c.block);
    EXPECT_EQ(r.entries[0].cfg->amax_source, AmaxSource::kCalibrated);
    EXPECT_FALSE(r.entries[0].enable.has_value());  // a cfg without enable enables
    // A numerics snippet is not a recipe by itself.
    EXPECT_HAS(error_of([&] { load_recipe(at_root(std::string("configs/numerics/") + c.file + ".yaml")); }),
               "is a numerics snippet (QuantizerAttributeConfig), not a recipe");
  }
  // The numerics files of formats moefq does not simulate load as files but fail when applied.
  const std::string m = error_of([&] {
    parse_recipe_text("imports:\n  x: configs/numerics/nvfp4_static\nquant_cfg:\n  - quantizer_name: "
                      "'*combine_quantizer'\n    cfg: {$import: x}\n",
                      "static.yaml", kRoot);
  });
  EXPECT_HAS(m, "static.yaml: quant_cfg[0].cfg: block_sizes type: static is not supported");
}

TEST(ModelOptLayout, TheMoeUnitsLoadUnchangedAndApplyToTheirSide) {
  for (const char* side : {"dispatch", "combine"}) {
    SCOPED_TRACE(side);
    const std::string file = at_root(std::string("configs/ptq/units/moe_") + side + "_nvfp4.yaml");
    const Recipe r = load_recipe(file);
    EXPECT_EQ(r.name, std::string("moe_") + side + "_nvfp4");
    EXPECT_TRUE(r.ignored.empty());
    ASSERT_EQ(r.entries.size(), 1u);
    EXPECT_EQ(r.entries[0].pattern, std::string("*") + side + "_quantizer");
    EXPECT_EQ(r.entries[0].origin, file + ": [0]");
    ASSERT_TRUE(r.entries[0].cfg.has_value());
    EXPECT_EQ(r.entries[0].cfg->format, Format::kNvfp4);
    const auto c = apply_recipe(r, four_layers());
    for (int l = 0; l < 4; ++l) {
      const bool dispatch = std::string(side) == "dispatch";
      EXPECT_EQ(c.at(dq(l)).enable, dispatch);
      EXPECT_EQ(c.at(cq(l)).enable, !dispatch);
      EXPECT_EQ(c.at(dispatch ? dq(l) : cq(l)).spec.format, Format::kNvfp4);
    }
  }
}

TEST(ModelOptLayout, AWholeModelPresetKeepsOnlyWhatConcernsTheMoeQuantizers) {
  for (const char* preset : {"fp8", "nvfp4", "int8"}) {
    SCOPED_TRACE(preset);
    const Recipe r = load_recipe(at_root(std::string("configs/ptq/presets/model/") + preset + ".yaml"));
    EXPECT_EQ(r.algorithm, "max");
    // base_disable_all ('*', enable: false) is the one entry for moefq's quantizers.
    ASSERT_EQ(r.entries.size(), 1u);
    EXPECT_EQ(r.entries[0].pattern, "*");
    EXPECT_EQ(r.entries[0].enable, std::optional<bool>(false));
    EXPECT_HAS(r.entries[0].origin, "configs/ptq/units/base_disable_all.yaml");
    const std::vector<std::string> ign = ignored_patterns(r);
    EXPECT_TRUE(has(ign, "*weight_quantizer"));
    EXPECT_TRUE(has(ign, "*input_quantizer"));
    EXPECT_TRUE(has(ign, "*lm_head*"));
    EXPECT_TRUE(has(ign, "*mlp.gate.*"));
    EXPECT_TRUE(has(ign, "* (parent_class nn.BatchNorm1d)"));
    EXPECT_EQ(r.ignored.size(), 2u + 13u);
    for (const auto& [name, qc] : apply_recipe(r, four_layers())) EXPECT_FALSE(qc.enable || qc.configured) << name;
  }
  // A partial preset (the KV cache only) holds nothing for moefq.
  const Recipe kv = load_recipe(at_root("configs/ptq/presets/kv/fp8.yaml"));
  EXPECT_TRUE(kv.entries.empty());
  EXPECT_EQ(ignored_patterns(kv), std::vector<std::string>{"*[kv]_bmm_quantizer"});
  // The MX preset has algorithm: null (no calibration); nothing here needs an amax.
  const Recipe mx = load_recipe(at_root("configs/ptq/presets/model/mxfp8.yaml"));
  EXPECT_EQ(mx.algorithm, "none");
  EXPECT_NO_THROW(apply_recipe(mx, four_layers()));
}

TEST(ModelOptLayout, AMoePresetAndItsNotice) {
  const Recipe r = load_recipe("configs/ptq/presets/model/moe_nvfp4", kRoot);  // a path under the root
  ASSERT_EQ(r.entries.size(), 3u);
  const auto c = apply_recipe(r, four_layers());
  for (int l = 0; l < 4; ++l) {
    EXPECT_TRUE(c.at(dq(l)).enable);
    EXPECT_TRUE(c.at(cq(l)).enable);
    EXPECT_EQ(c.at(cq(l)).spec.format, Format::kNvfp4);
  }
  const std::string notice = ignored_entries_notice(r);
  EXPECT_HAS(notice, "moe_nvfp4: ignored 13 entries for quantizers moefq does not simulate");
  EXPECT_HAS(notice, "'*block_sparse_moe.gate*'");
  EXPECT_HAS(notice, "and 3 more");
  EXPECT_EQ(notice.find('\n'), std::string::npos);  // one line
  EXPECT_EQ(ignored_entries_notice(load_recipe("moe_combine_nvfp4")), "");
}

TEST(ModelOptLayout, CompleteRecipesLoadUnchanged) {
  Recipe r = load_recipe(at_root("general/ptq/nvfp4_default-kv_fp8.yaml"));
  EXPECT_EQ(r.name, "nvfp4_default-kv_fp8");
  EXPECT_EQ(r.algorithm, "max");
  ASSERT_EQ(r.entries.size(), 1u);  // base_disable_all
  EXPECT_TRUE(has(ignored_patterns(r), "*[kv]_bmm_quantizer"));

  r = load_recipe(at_root("general/ptq/nvfp4_experts_only-kv_fp8.yaml"));  // algorithm: {method: max, ...}
  EXPECT_EQ(r.algorithm, "max");
  EXPECT_TRUE(has(ignored_patterns(r), "*.experts.*weight_quantizer"));
  EXPECT_HAS(r.ignored[0].origin, "nvfp4_experts_only-kv_fp8.yaml: quantize.quant_cfg[1]");

  r = load_recipe(at_root("general/ptq/moe_dispatch_fp8-combine_nvfp4-kv_fp8.yaml"));
  ASSERT_EQ(r.entries.size(), 4u);
  EXPECT_HAS(r.entries[1].origin, "moe_dispatch_fp8-combine_nvfp4-kv_fp8.yaml: quantize.quant_cfg[2]");
  const auto c = apply_recipe(r, four_layers());
  for (int l = 0; l < 4; ++l) {
    SCOPED_TRACE(l);
    EXPECT_TRUE(c.at(dq(l)).enable);
    EXPECT_EQ(c.at(dq(l)).spec.format, Format::kFp8);
    EXPECT_EQ(c.at(dq(l)).spec.amax_source, AmaxSource::kConstant);  // the sibling of the cfg's $import
    EXPECT_EQ(c.at(dq(l)).spec.constant_amax, 6.5f);
    EXPECT_EQ(c.at(cq(l)).spec.format, Format::kNvfp4);
    EXPECT_EQ(c.at(cq(l)).enable, l != 3);  // the serving stack's spelling of layer 3's name
  }
}

TEST(ModelOptLayout, TheShippedTreeIsInTheSameLayout) {
  const std::string shipped = std::string(MOEFQ_SOURCE_DIR) + "/recipes";
  for (const std::string& unit : list_recipe_units()) {
    SCOPED_TRACE(unit);
    const Recipe by_name = load_recipe(unit);
    const Recipe by_path = load_recipe(shipped + "/configs/ptq/units/" + unit + ".yaml");
    const Recipe by_root_path = load_recipe("configs/ptq/units/" + unit);
    ASSERT_EQ(by_name.entries.size(), 1u);
    EXPECT_EQ(by_name.entries[0].cfg, by_path.entries[0].cfg);
    EXPECT_EQ(by_name.entries[0].cfg, by_root_path.entries[0].cfg);
    // The test tree's unit of the same name (Model Optimizer's file) gives the same spec.
    if (unit.find("nvfp4") != std::string::npos) {
      EXPECT_EQ(load_recipe(at_root("configs/ptq/units/" + unit + ".yaml")).entries.at(0).cfg,
                by_name.entries[0].cfg);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// $import forms

TEST(RecipeImports, ListSpliceEntryAppendAndCfgMerge) {
  TempDir d;
  d.write("configs/numerics/fp8.yaml", std::string(kAttr) + "num_bits: e4m3\naxis:\n");
  d.write("configs/numerics/nvfp4.yaml",
          std::string(kAttr) + "num_bits: e2m1\nblock_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}\n");
  d.write("configs/units/two.yaml", std::string(kList) +
                                        "imports:\n  fp8: configs/numerics/fp8\n---\n"
                                        "- {quantizer_name: '*dispatch_quantizer', cfg: {$import: fp8}}\n"
                                        "- {quantizer_name: '*combine_quantizer', cfg: {$import: fp8}}\n");
  d.write("configs/units/off.yaml", std::string(kEntry) + "quantizer_name: 'layers.1.*'\nenable: false\n");
  const std::string main = d.write("recipes/main.yaml",
                                   "imports:\n  two: configs/units/two\n  off: configs/units/off\n"
                                   "  nvfp4: configs/numerics/nvfp4\n  fp8: configs/numerics/fp8\n"
                                   "quant_cfg:\n"
                                   "  - $import: two\n"  // a list: spliced
                                   "  - $import: off\n"  // an entry: appended
                                   "  - quantizer_name: '*combine_quantizer'\n"
                                   "    cfg:\n"
                                   "      $import: nvfp4\n"
                                   "      block_sizes: {-1: 32, type: dynamic, scale_bits: e8m0}\n"  // sibling wins
                                   "  - quantizer_name: 'layers.0.*dispatch_quantizer'\n"
                                   "    cfg: {$import: [fp8, nvfp4]}\n");  // the later import's keys win
  const Recipe r = load_recipe(main, d.path().string());
  ASSERT_EQ(r.entries.size(), 5u);
  EXPECT_HAS(r.entries[0].origin, "configs/units/two.yaml: [0]");
  EXPECT_HAS(r.entries[1].origin, "configs/units/two.yaml: [1]");
  EXPECT_EQ(r.entries[2].pattern, "layers.1.*");
  EXPECT_HAS(r.entries[2].origin, "configs/units/off.yaml");
  EXPECT_EQ(r.entries[3].cfg->format, Format::kMxfp4);  // e2m1 from nvfp4, blocks of 32 e8m0 from the sibling
  EXPECT_EQ(r.entries[4].cfg->format, Format::kNvfp4);
  EXPECT_EQ(r.entries[3].origin, main + ": quant_cfg[2]");
  const auto c = apply_recipe(r, four_layers());
  EXPECT_FALSE(c.at(dq(1)).enable);
  EXPECT_TRUE(c.at(cq(1)).configured);
  EXPECT_EQ(c.at(dq(0)).spec.format, Format::kNvfp4);
  EXPECT_EQ(c.at(dq(2)).spec.format, Format::kFp8);
  EXPECT_EQ(c.at(cq(2)).spec.format, Format::kMxfp4);
}

TEST(RecipeImports, NestedImportsAndAPresetMergedIntoQuantize) {
  TempDir d;
  d.write("configs/numerics/mx.yaml",
          std::string(kAttr) + "num_bits: e4m3\nblock_sizes: {-1: 32, type: dynamic, scale_bits: e8m0}\n");
  d.write("configs/units/u.yaml",
          std::string(kList) + "imports:\n  mx: configs/numerics/mx\n---\n- {quantizer_name: '*', cfg: {$import: mx}}\n");
  d.write("configs/presets/p.yaml",
          "# modelopt-schema: modelopt.torch.quantization.config.QuantizeConfig\nimports:\n  u: configs/units/u\n"
          "algorithm: max\nquant_cfg:\n  - $import: u\n");
  // The recipe sits below the root: the root is found as the ancestor that holds configs/.
  const std::string main = d.write("general/deep/r.yaml",
                                   "imports:\n  p: configs/presets/p\nmetadata: {recipe_type: ptq}\nquantize:\n"
                                   "  $import: p\n  algorithm: {method: max}\n");
  const Recipe r = load_recipe(main);
  ASSERT_EQ(r.entries.size(), 1u);
  EXPECT_EQ(r.entries[0].cfg->format, Format::kMxfp8);
  EXPECT_HAS(r.entries[0].origin, "configs/units/u.yaml: [0]");
}

TEST(RecipeImports, RecipeRootsInOrder) {
  // A local tree whose configs/numerics/nvfp4 is really mxfp4 shows which root an import used.
  TempDir local;
  local.write("configs/numerics/nvfp4.yaml",
              std::string(kAttr) + "num_bits: e2m1\nblock_sizes: {-1: 32, type: dynamic, scale_bits: e8m0}\n");
  const std::string text =
      "imports:\n  n: configs/numerics/nvfp4\nquant_cfg:\n  - {quantizer_name: '*', cfg: {$import: n}}\n";
  const std::string inside = local.write("recipes/r.yaml", text);
  TempDir outside;
  const std::string alone = outside.write("r.yaml", text);
  // The file's own tree; the shipped tree for a file outside any tree; --recipe-root first of all.
  EXPECT_EQ(load_recipe(inside).entries.at(0).cfg->format, Format::kMxfp4);
  EXPECT_EQ(load_recipe(alone).entries.at(0).cfg->format, Format::kNvfp4);
  EXPECT_EQ(load_recipe(alone, local.path().string()).entries.at(0).cfg->format, Format::kMxfp4);
  EXPECT_EQ(parse_recipe_text(text, "t.yaml").entries.at(0).cfg->format, Format::kNvfp4);
  EXPECT_EQ(parse_recipe_text(text, "t.yaml", local.path().string()).entries.at(0).cfg->format, Format::kMxfp4);
  // Unit names come from the roots' configs/ptq/units too.
  local.write("configs/ptq/units/team_combine.yaml",
              std::string(kList) + "- {quantizer_name: '*combine_quantizer', cfg: {num_bits: 8}}\n");
  EXPECT_EQ(load_recipe("team_combine", local.path().string()).entries.at(0).cfg->format, Format::kInt8);
  const std::vector<std::string> units = list_recipe_units(local.path().string());
  EXPECT_TRUE(has(units, "team_combine"));
  EXPECT_TRUE(has(units, "moe_combine_nvfp4"));
  EXPECT_HAS(error_of([] { load_recipe("moe_combine_fp8", "/no/such/root"); }), "--recipe-root /no/such/root");
}

TEST(RecipeImports, MoefqUnitNamesAndTheOlderRecipeForm) {
  TempDir dir, other;
  // A file beside the importer shadows the shipped unit of the same name (an older-form unit).
  dir.write("moe_dispatch_fp8.yaml", "quant_cfg:\n  - {quantizer_name: '*dispatch_quantizer', cfg: {num_bits: 8}}\n");
  other.write("team_combine.yaml", "$import: moe_combine_mxfp4\n");
  const std::string main = dir.write("main.yaml", "$import: [moe_dispatch_fp8, team_combine, moe_combine_fp8]\n");
  const char* old = std::getenv("MOEFQ_RECIPE_PATH");
  const std::optional<std::string> saved = old ? std::optional<std::string>(old) : std::nullopt;
  ::setenv("MOEFQ_RECIPE_PATH", (other.path().string() + ":/nonexistent").c_str(), 1);
  const Recipe r = load_recipe(main);
  const Recipe by_name = load_recipe("team_combine");
  if (saved) ::setenv("MOEFQ_RECIPE_PATH", saved->c_str(), 1);
  else ::unsetenv("MOEFQ_RECIPE_PATH");
  ASSERT_EQ(r.entries.size(), 3u);
  EXPECT_EQ(r.entries[0].cfg->format, Format::kInt8);   // beside the file
  EXPECT_EQ(r.entries[1].cfg->format, Format::kMxfp4);  // on MOEFQ_RECIPE_PATH, nested
  EXPECT_EQ(r.entries[2].cfg->format, Format::kFp8);    // shipped
  EXPECT_HAS(r.entries[0].origin, (dir.path() / "moe_dispatch_fp8.yaml").string() + ": quant_cfg[0]");
  EXPECT_EQ(by_name.entries.at(0).cfg->format, Format::kMxfp4);
}

TEST(RecipeImports, TheSameFileTwiceIsNotACycleButACycleIsAnError) {
  const Recipe r = parse_recipe_text(
      "$import: [moe_dispatch_fp8, moe_dispatch_nvfp4]\nquant_cfg:\n  - $import: moe_dispatch_fp8\n", "twice.yaml");
  ASSERT_EQ(r.entries.size(), 3u);
  EXPECT_EQ(apply_recipe(r, four_layers()).at(dq(1)).spec.format, Format::kFp8);  // the last import wins

  TempDir d;
  d.write("configs/a.yaml", std::string(kList) + "imports:\n  b: configs/b\n---\n- $import: b\n");
  d.write("configs/b.yaml", std::string(kList) + "imports:\n  c: configs/c\n---\n- $import: c\n");
  d.write("configs/c.yaml", std::string(kList) + "imports:\n  a: configs/a\n---\n- $import: a\n");
  std::string m = error_of([&] { load_recipe((d.path() / "configs/a.yaml").string()); });
  EXPECT_HAS(m, "c.yaml: imports.a: import cycle: ");
  EXPECT_HAS(m, "a.yaml -> ");
  EXPECT_HAS(m, "b.yaml -> ");
  EXPECT_HAS(m, "imported by ");
  // Among older-form units by name, and a file importing itself.
  d.write("u/x.yaml", "$import: y\n");
  d.write("u/y.yaml", "quant_cfg:\n  - $import: x\n");
  m = error_of([&] { load_recipe((d.path() / "u/x.yaml").string()); });
  EXPECT_HAS(m, "y.yaml: quant_cfg[0].$import: import cycle");
  d.write("u/self.yaml", "quant_cfg:\n  - $import: self\n");
  EXPECT_HAS(error_of([&] { load_recipe((d.path() / "u/self.yaml").string()); }),
             "self.yaml: quant_cfg[0].$import: import cycle");
}

TEST(RecipeImports, Errors) {
  TempDir d;
  d.write("configs/n.yaml", std::string(kAttr) + "num_bits: e4m3\n");
  d.write("configs/noschema.yaml", "num_bits: e4m3\n");
  d.write("configs/l.yaml", std::string(kList) + "- {quantizer_name: '*', enable: false}\n");
  const std::string root = d.path().string();
  const auto err = [&](const std::string& text) { return error_of([&] { parse_recipe_text(text, "e.yaml", root); }); };
  // Undeclared names inside a mapping.
  std::string m = err("quant_cfg:\n  - {quantizer_name: '*', cfg: {$import: nvfp4}}\n");
  EXPECT_HAS(m, "e.yaml: quant_cfg[0].cfg.$import: unknown $import reference 'nvfp4'");
  EXPECT_HAS(m, "imports: {nvfp4: configs/numerics/nvfp4}");
  m = err("quant_cfg:\n  - {$import: moe_dispatch_fp8, quantizer_name: '*'}\n");
  EXPECT_HAS(m, "the unit 'moe_dispatch_fp8' can only be imported as a list entry of its own");
  // Paths that are not there, snippets without a schema, the wrong kind of snippet.
  m = err("imports:\n  x: configs/nothing\nquant_cfg: []\n");
  EXPECT_HAS(m, "e.yaml: imports.x: cannot find 'configs/nothing'");
  EXPECT_HAS(m, "--recipe-root");
  m = err("imports:\n  x: configs/noschema\nquant_cfg: []\n");
  EXPECT_HAS(m, "e.yaml: imports.x: ");
  EXPECT_HAS(m, "has no '# modelopt-schema: ...' comment");
  m = err("imports:\n  n: configs/n\nquant_cfg:\n  - $import: n\n");
  EXPECT_HAS(m, "e.yaml: quant_cfg[0].$import: $import 'n' in a list has schema QuantizerAttributeConfig");
  m = err("imports:\n  l: configs/l\nquant_cfg:\n  - {quantizer_name: '*', cfg: {$import: l}}\n");
  EXPECT_HAS(m, "$import 'l' here merges into a mapping, but it is [");
  m = err("imports: [configs/n]\nquant_cfg: []\n");
  EXPECT_HAS(m, "e.yaml: imports: must be a mapping of names to config paths");
  m = err("imports:\n  x: ''\nquant_cfg: []\n");
  EXPECT_HAS(m, "e.yaml: imports.x: must be a config path");
  // Unknown units, and names that are not unit names.
  m = err("$import: [moe_dispatch_fp8, moe_dispatch_fp16]\n");
  EXPECT_HAS(m, "e.yaml: $import[1]: unknown unit 'moe_dispatch_fp16'");
  EXPECT_HAS(m, "moe_combine_nvfp4");
  m = err("quant_cfg:\n  - $import: ../etc/passwd\n");
  EXPECT_HAS(m, "e.yaml: quant_cfg[0].$import: '../etc/passwd' is not a unit name");
  m = err("$import: {a: 1}\n");
  EXPECT_HAS(m, "e.yaml: $import: must be a unit name");
  m = error_of([] { load_recipe("no_such_recipe_anywhere"); });
  EXPECT_HAS(m, "'no_such_recipe_anywhere' is neither a recipe file");
  EXPECT_HAS(m, "moe_dispatch_fp8");  // every shipped unit is named
  // An error inside an imported file names it and the import.
  d.write("configs/bad.yaml", std::string(kList) + "- {quantizer_name: '*combine_quantizer', cfg: {num_bits: e4m4}}\n");
  const std::string main = d.write("r.yaml", "imports:\n  bad: configs/bad\nquant_cfg:\n  - $import: bad\n");
  m = error_of([&] { load_recipe(main); });
  EXPECT_HAS(m, "bad.yaml: [0].cfg: unsupported combination: num_bits e4m4");
  EXPECT_HAS(m, "(imported by " + main + ": imports.bad)");
}

TEST(RecipeImports, DocumentsAndPreamble) {
  const auto err = [](const std::string& text) { return error_of([&] { parse_recipe_text(text, "d.yaml"); }); };
  EXPECT_HAS(err("# modelopt-schema: a.B\n# modelopt-schema: a.C\nquant_cfg: []\n"),
             "d.yaml: more than one modelopt-schema comment");
  EXPECT_HAS(err("quant_cfg: []\n---\nquant_cfg: []\n---\nquant_cfg: []\n"), "d.yaml: holds more than two YAML");
  EXPECT_HAS(err(",\n"), "d.yaml: holds more than two YAML documents");  // yaml-cpp's LoadAll never returns on this
  EXPECT_HAS(err("- a\n---\n- b\n"), "d.yaml: the first of two YAML documents must be a mapping");
  EXPECT_HAS(err("imports: {}\nalgorithm: max\n---\n- {quantizer_name: '*', enable: false}\n"),
             "d.yaml: unknown key 'algorithm' before a list body");
  EXPECT_HAS(err("imports: {}\n---\n42\n"), "d.yaml: the second YAML document must be a mapping or a list");
  EXPECT_HAS(err("# modelopt-schema: modelopt.recipe.config.LayerPatternList\n- a\n"),
             "d.yaml: modelopt-schema 'modelopt.recipe.config.LayerPatternList' is not one moefq reads");
  // A header mapping and a mapping body are one mapping (the body's keys win).
  const Recipe r = parse_recipe_text("algorithm: max\n---\nquant_cfg:\n  - {quantizer_name: '*', enable: false}\n",
                                     "two.yaml");
  EXPECT_EQ(r.entries.size(), 1u);
  // The preamble comment is read only among the leading comments.
  EXPECT_NO_THROW(parse_recipe_text("quant_cfg: []\n# modelopt-schema: x.Y\n", "late.yaml"));
}

}  // namespace
}  // namespace moefq
