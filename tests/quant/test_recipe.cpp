// Recipes: the shipped units, override order, the cfg -> QuantSpec mapping, enable at entry level
// and inside cfg, the dict form, entries for quantizers moefq does not have (ignored, one notice),
// both spellings of a quantizer name, wildcards, and one test per error path (each message must
// name the file and the key). Files in Model Optimizer's layout: test_recipe_files.cpp.
#include "moefq/recipe.h"

#include <fnmatch.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "moefq/errors.h"
#include "moefq/moe_quantizers.h"
#include "test_util.h"

namespace moefq {
namespace {

using test::error_of;

std::string parse_error(const std::string& text, const std::string& origin = "my.yaml") {
  return error_of([&] { parse_recipe_text(text, origin); });
}

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

// One entry for the combine quantizers with the given cfg.
std::string combine_cfg(const std::string& cfg_yaml) {
  return "quant_cfg:\n  - quantizer_name: '*combine_quantizer'\n    cfg: " + cfg_yaml + "\n";
}

QuantSpec parse_one_cfg(const std::string& cfg_yaml) {
  const Recipe r = parse_recipe_text(combine_cfg(cfg_yaml), "cfg.yaml");
  EXPECT_EQ(r.entries.size(), 1u);
  EXPECT_TRUE(r.entries.at(0).cfg.has_value());
  return r.entries.at(0).cfg.value_or(QuantSpec{});
}

std::string cfg_error(const std::string& cfg_yaml) { return parse_error(combine_cfg(cfg_yaml)); }

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
      {"moe_dispatch_fp8_block128", "*dispatch_quantizer", Format::kFp8Block128, 128},
      {"moe_combine_fp8_block128", "*combine_quantizer", Format::kFp8Block128, 128},
      {"moe_dispatch_fp8_block128_ue8m0", "*dispatch_quantizer", Format::kFp8Block128Ue8m0, 128},
      {"moe_combine_fp8_block128_ue8m0", "*combine_quantizer", Format::kFp8Block128Ue8m0, 128},
      {"moe_combine_logfmt10", "*combine_quantizer", Format::kLogfmt10, 0},
      {"moe_combine_fp8_cast", "*combine_quantizer", Format::kFp8Cast, 0},
      {"moe_combine_fp8_cast_nan", "*combine_quantizer", Format::kFp8CastNan, 0},
      {"moe_combine_fp8_block128_ue8m0_nofloor", "*combine_quantizer", Format::kFp8Block128Ue8m0NoFloor, 0},
      {"moe_combine_fp8_block128_mori", "*combine_quantizer", Format::kFp8Block128Mori, 0},
      {"moe_combine_fp4_block128_mori", "*combine_quantizer", Format::kFp4Block128Mori, 0},
      {"moe_dispatch_fp8_block128_deepgemm", "*dispatch_quantizer", Format::kFp8Block128DeepGemm, 0},
      {"moe_dispatch_fp8_block128_vllm", "*dispatch_quantizer", Format::kFp8Block128Vllm, 0},
      {"moe_combine_fp4_block16_flashinfer", "*combine_quantizer", Format::kFp4Block16FlashInfer, 0},
  };
  const std::vector<std::string> units = list_recipe_units();
  EXPECT_EQ(units.size(), std::size(cases));
  for (const Case& c : cases) {
    SCOPED_TRACE(c.unit);
    EXPECT_NE(std::find(units.begin(), units.end(), c.unit), units.end());
    for (const std::string& spelling : {std::string(c.unit), std::string(c.unit) + ".yaml"}) {
      const Recipe r = load_recipe(spelling);
      EXPECT_EQ(r.name, c.unit);
      EXPECT_EQ(r.algorithm, "max");
      EXPECT_TRUE(r.ignored.empty());
      ASSERT_EQ(r.entries.size(), 1u);
      const RecipeEntry& e = r.entries[0];
      EXPECT_EQ(e.pattern, c.pattern);
      EXPECT_FALSE(e.enable.has_value());  // the cfg enables
      ASSERT_TRUE(e.cfg.has_value());
      EXPECT_EQ(e.cfg->format, c.format);
      EXPECT_EQ(e.cfg->block_size, c.block);
      EXPECT_EQ(e.cfg->amax_source, AmaxSource::kCalibrated);
      EXPECT_HAS(e.origin, std::string("recipes/configs/ptq/units/") + c.unit + ".yaml: [0]");
      // Applied to a model, the unit enables exactly its side.
      for (const auto& [name, qc] : apply_recipe(r, four_layers())) {
        const bool mine = wildcard_match(c.pattern, name);
        EXPECT_EQ(qc.enable, mine) << name;
        EXPECT_EQ(qc.configured, mine) << name;
        if (mine) {
          EXPECT_EQ(qc.spec.format, c.format) << name;
        }
      }
    }
  }
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
  EXPECT_HAS(r.entries[0].origin, "moe_dispatch_fp8.yaml: [0]");
  EXPECT_HAS(r.entries[1].origin, "moe_combine_nvfp4.yaml: [0]");
  EXPECT_HAS(r.entries[2].origin, "moe_combine_mxfp8.yaml: [0]");
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
    cfg: {num_bits: e4m3, type: dynamic}
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
  for (const auto& [name, qc] : apply_recipe(r, four_layers())) {
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

TEST(RecipeApply, BothSpellingsOfAQuantizerName) {
  const Recipe r = parse_recipe_text(R"(
quant_cfg:
  - quantizer_name: '*.experts.*dispatch_quantizer'
    cfg: {num_bits: e4m3}
  - quantizer_name: 'model.layers.3.mlp.experts.combine_quantizer'
    cfg: {num_bits: 8}
  - quantizer_name: 'model.layers.[01].*'
    enable: false
  - quantizer_name: 'layers.2.mlp.experts.combine_quantizer'
    cfg: {num_bits: e4m3}
)",
                                     "names.yaml");
  EXPECT_TRUE(r.ignored.empty());
  const auto c = apply_recipe(r, four_layers());
  EXPECT_FALSE(c.at(dq(0)).enable);
  EXPECT_FALSE(c.at(dq(1)).enable);
  EXPECT_TRUE(c.at(dq(2)).enable);
  EXPECT_TRUE(c.at(dq(3)).enable);
  EXPECT_EQ(c.at(cq(3)).spec.format, Format::kInt8);
  EXPECT_EQ(c.at(cq(2)).spec.format, Format::kFp8);
  EXPECT_FALSE(c.at(cq(1)).configured);
  // The serving stack's spelling that names no layer of this model is an error like any other.
  const Recipe wrong = parse_recipe_text(
      "quant_cfg:\n  - {quantizer_name: 'model.layers.7.mlp.experts.combine_quantizer', enable: false}\n", "w.yaml");
  EXPECT_HAS(error_of([&] { apply_recipe(wrong, four_layers()); }), "or the same with a 'model.' prefix");
}

// ---------------------------------------------------------------------------------------------
// Entries for quantizers moefq does not have

TEST(RecipeIgnored, WeightAndKvEntriesAreSetAsideWithOneNotice) {
  const Recipe r = parse_recipe_text(R"(
quant_cfg:
  - quantizer_name: '*'
    enable: false
  - quantizer_name: '*weight_quantizer'
    cfg: {num_bits: 4, block_sizes: {-1: 128, type: static}}
  - quantizer_name: '*input_quantizer'
    cfg: {num_bits: [5, 2], axis: 0, calibrator: histogram}
  - quantizer_name: '*output_quantizer'
    enable: false
  - quantizer_name: '*[kv]_bmm_quantizer'
    cfg: {num_bits: e4m3, use_constant_amax: true}
  - quantizer_name: '*lm_head*'
    enable: false
  - quantizer_name: '*'
    parent_class: nn.BatchNorm2d
    enable: false
  - quantizer_name: '*weight_quantizer'
    cfg: [{num_bits: 4, block_sizes: {-1: 128, type: static}}, {num_bits: e4m3}]
  - quantizer_name: '*combine_quantizer'
    cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}}
)",
                                     "whole.yaml");
  ASSERT_EQ(r.entries.size(), 2u);
  EXPECT_EQ(r.entries[0].pattern, "*");
  EXPECT_EQ(r.entries[1].pattern, "*combine_quantizer");
  ASSERT_EQ(r.ignored.size(), 7u);
  EXPECT_EQ(r.ignored[0].pattern, "*weight_quantizer");
  EXPECT_EQ(r.ignored[0].origin, "whole.yaml: quant_cfg[1]");
  EXPECT_EQ(r.ignored[5].pattern, "* (parent_class nn.BatchNorm2d)");
  const std::string notice = ignored_entries_notice(r);
  EXPECT_EQ(notice, "whole: ignored 7 entries for quantizers moefq does not simulate (only the MoE dispatch and "
                    "combine quantizers exist here): '*weight_quantizer', '*input_quantizer', '*output_quantizer', "
                    "'*[kv]_bmm_quantizer', '*lm_head*', '* (parent_class nn.BatchNorm2d)'");
  const auto c = apply_recipe(r, four_layers());
  EXPECT_TRUE(c.at(cq(0)).enable);
  EXPECT_FALSE(c.at(dq(0)).enable);
  // Their keys are still checked: a typo is an error wherever it is.
  EXPECT_HAS(parse_error("quant_cfg:\n  - {quantizer_name: '*weight_quantizer', cfg: {num_bit: 4}}\n"),
             "my.yaml: quant_cfg[0].cfg: unknown key 'num_bit'");
  EXPECT_HAS(parse_error("quant_cfg:\n  - {quantizer_name: '*weight_quantizer', enable: 'no'}\n"),
             "my.yaml: quant_cfg[0].enable: must be true or false");
}

TEST(RecipeIgnored, WhichPatternsTargetTheMoeQuantizers) {
  for (const char* p : {"*", "*dispatch_quantizer", "*combine*", "layers.9.*", "model.layers.*", "*.experts.*",
                        "layers.1[0-9].mlp.*", "*mlp*", "??????.*", "layers.123456.mlp.experts.combine_quantizer",
                        "*block_sparse_moe.experts.combine_quantizer", "*[[:digit:]]*",
                        "layers.1.mlp.experts.dispatch_quantizerx"})
    EXPECT_TRUE(pattern_targets_moe_quantizers(p)) << p;
  for (const char* p : {"*weight_quantizer", "*input_quantizer", "*output_quantizer", "*[kv]_bmm_quantizer",
                        "*lm_head*", "*router*", "*mlp.gate.*", "mtp.*", "output.*", "*visual*", "layers.x.*",
                        "layers.3.self_attn.*", "*.experts.*weight_quantizer", "model.layers.3.mlp.gate",
                        "*experts", "layers.1.mlp.experts.dispatch_quantize"})
    EXPECT_FALSE(pattern_targets_moe_quantizers(p)) << p;
  // moefq's own names, as the fake-quantized layer spells them, are targets of themselves.
  for (int64_t l : {0, 7, 60, 123}) {
    EXPECT_TRUE(pattern_targets_moe_quantizers(MoeQuantizers::dispatch_name(l)));
    EXPECT_TRUE(pattern_targets_moe_quantizers("model." + MoeQuantizers::combine_name(l)));
  }
}

TEST(RecipeIgnored, NoPatternThatMatchesAMoeQuantizerIsIgnored) {
  // Random globs over the names' alphabet: whenever fnmatch matches one of moefq's names, the
  // pattern must count as targeting them (else a real entry would be set aside).
  std::vector<std::string> names;
  for (int l : {0, 3, 12, 61, 105}) {
    names.push_back(MoeQuantizers::dispatch_name(l));
    names.push_back(MoeQuantizers::combine_name(l));
    names.push_back("model." + MoeQuantizers::combine_name(l));
  }
  std::mt19937 rng(7);
  const std::string pieces[] = {"*", "?", "layers.", "model.", "mlp.", "experts.", "combine", "dispatch", "_quantizer",
                                "[0-3]", "[!1]", "[^2]", "[13]", "[]]", "1", "2", ".", "*.", "e", "[a-z]", "[!.]"};
  int targeted = 0, matched = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string p;
    const int n = 1 + static_cast<int>(rng() % 7);
    for (int k = 0; k < n; ++k) p += pieces[rng() % std::size(pieces)];
    bool any = false;
    for (const std::string& name : names) any = any || ::fnmatch(p.c_str(), name.c_str(), FNM_NOESCAPE) == 0;
    const bool t = pattern_targets_moe_quantizers(p);
    matched += any;
    targeted += t;
    if (any) {
      EXPECT_TRUE(t) << p;
    }
  }
  EXPECT_GT(matched, 100);
  EXPECT_GT(targeted, matched);  // and some that match no name here still target other layers
}

// ---------------------------------------------------------------------------------------------
// The dict form and single-key entries

TEST(RecipeDictForm, PatternsToAttributes) {
  const Recipe r = parse_recipe_text(R"(
quant_cfg:
  default: {enable: false}
  '*weight_quantizer': {num_bits: 8, axis: 0}
  '*dispatch_quantizer': {num_bits: e4m3, axis: null}
  '*combine_quantizer': {num_bits: e4m3, enable: false}
  'layers.2.*': {enable: true}
  nn.Linear:
    '*input_quantizer': {num_bits: 8, enable: false}
algorithm: max
)",
                                     "dict.yaml");
  ASSERT_EQ(r.entries.size(), 4u);
  EXPECT_EQ(r.entries[0].pattern, "*");  // "default"
  EXPECT_EQ(r.entries[0].enable, std::optional<bool>(false));
  EXPECT_FALSE(r.entries[0].cfg.has_value());
  EXPECT_EQ(r.entries[0].origin, "dict.yaml: quant_cfg.default");
  EXPECT_FALSE(r.entries[1].enable.has_value());
  EXPECT_EQ(r.entries[2].enable, std::optional<bool>(false));  // enable in the value is the entry's
  EXPECT_TRUE(r.entries[2].cfg.has_value());
  ASSERT_EQ(r.ignored.size(), 2u);
  EXPECT_EQ(r.ignored[1].pattern, "*input_quantizer (parent_class nn.Linear)");
  const auto c = apply_recipe(r, four_layers());
  EXPECT_TRUE(c.at(dq(0)).enable);
  EXPECT_FALSE(c.at(cq(0)).enable);
  EXPECT_TRUE(c.at(cq(0)).configured);
  EXPECT_TRUE(c.at(cq(2)).enable);  // re-enabled with the spec it was given while off
}

TEST(RecipeDictForm, SingleKeyEntriesInAList) {
  const Recipe r = parse_recipe_text(R"(
quant_cfg:
  - {'*': {enable: false}}
  - {'*combine_quantizer': {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}}}
  - quantizer_name: 'layers.0.*'
    enable: false
  - {nn.Embedding: {'*': {enable: false}}, '*weight_quantizer': {num_bits: 8}}
)",
                                     "single.yaml");
  ASSERT_EQ(r.entries.size(), 3u);
  EXPECT_EQ(r.entries[1].cfg->format, Format::kNvfp4);
  EXPECT_EQ(r.entries[1].origin, "single.yaml: quant_cfg[1].*combine_quantizer");
  EXPECT_EQ(r.ignored.size(), 2u);
  EXPECT_HAS(parse_error("quant_cfg:\n  - {'*combine_quantizer': e4m3}\n"),
             "my.yaml: quant_cfg[0].*combine_quantizer: the entry for '*combine_quantizer' must map to quantizer "
             "attributes");
  EXPECT_HAS(parse_error("quant_cfg:\n  - {enable: false, cfg: {num_bits: 8}}\n"),
             "my.yaml: quant_cfg[0]: missing quantizer_name");
  // An empty entry (found by fuzz_recipe: it read the first key of an empty mapping).
  EXPECT_HAS(parse_error("quant_cfg:\n  - {}\n"),
             "my.yaml: quant_cfg[0]: an entry must have quantizer_name (a wildcard such as '*combine_quantizer'), "
             "got an empty mapping");
}

// ---------------------------------------------------------------------------------------------
// cfg -> QuantSpec

TEST(RecipeCfg, AmaxSources) {
  QuantSpec s = parse_one_cfg(
      "{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}, constant_amax: 2688}");
  EXPECT_EQ(s.format, Format::kNvfp4);
  EXPECT_EQ(s.amax_source, AmaxSource::kConstant);
  EXPECT_EQ(s.constant_amax, 2688.0f);
  s = parse_one_cfg("{num_bits: e4m3, amax: constant, constant_amax: 1.5e2}");
  EXPECT_EQ(s.amax_source, AmaxSource::kConstant);
  EXPECT_EQ(s.constant_amax, 150.0f);
  s = parse_one_cfg("{num_bits: e4m3, use_constant_amax: true}");  // the e4m3 range
  EXPECT_EQ(s.amax_source, AmaxSource::kConstant);
  EXPECT_EQ(s.constant_amax, 448.0f);
  EXPECT_EQ(parse_one_cfg("{num_bits: e4m3, use_constant_amax: false}").amax_source, AmaxSource::kCalibrated);
  EXPECT_EQ(parse_one_cfg("{num_bits: e4m3, amax: dynamic}").amax_source, AmaxSource::kDynamic);
  EXPECT_EQ(parse_one_cfg("{num_bits: e4m3, type: dynamic}").amax_source, AmaxSource::kDynamic);
  EXPECT_EQ(parse_one_cfg("{num_bits: e4m3, type: static, amax: calibrated}").amax_source, AmaxSource::kCalibrated);
  EXPECT_EQ(parse_one_cfg("{num_bits: e4m3}").amax_source, AmaxSource::kCalibrated);
}

TEST(RecipeCfg, SpellingsDefaultsAndNeutralAttributes) {
  EXPECT_EQ(parse_one_cfg("{num_bits: [4, 3], axis: null}").format, Format::kFp8);
  EXPECT_EQ(parse_one_cfg("{num_bits: E4M3}").format, Format::kFp8);
  EXPECT_EQ(parse_one_cfg("{num_bits: 8, axis: }").format, Format::kInt8);
  EXPECT_EQ(parse_one_cfg("{axis: null}").format, Format::kInt8);  // num_bits defaults to 8, as in Model Optimizer
  EXPECT_EQ(parse_one_cfg("{num_bits: [2, 1], block_sizes: {-1: 16, type: dynamic, scale_bits: [4, 3]}}").format,
            Format::kNvfp4);
  EXPECT_EQ(parse_one_cfg("{num_bits: [4, 3], block_sizes: {-1: 32, type: dynamic, scale_bits: [8, 0]}}").format,
            Format::kMxfp8);
  EXPECT_EQ(parse_one_cfg("{num_bits: e2m1, block_sizes: {-1: 32, type: dynamic, scale_bits: E8M0}}").format,
            Format::kMxfp4);
  EXPECT_EQ(parse_one_cfg("{num_bits: e4m3, block_sizes: null}").format, Format::kFp8);
  const QuantSpec s = parse_one_cfg(
      "{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3, scale_block_sizes: null, "
      "four_over_six: false}, effective_bits: 4.5, fake_quant: true, unsigned: false, narrow_range: false, "
      "learn_amax: false, trt_high_precision_dtype: BFloat16, calibrator: max, rotate: {enable: false}, "
      "pass_through_bwd: true, backend: null, backend_extra_args: {x: 1}, bias: null, enable: true}");
  EXPECT_EQ(s.format, Format::kNvfp4);
}

TEST(RecipeCfg, EnableBesideAndInsideCfg) {
  const Recipe r = parse_recipe_text(R"(
quant_cfg:
  - {quantizer_name: 'layers.0.*', cfg: {num_bits: e4m3, enable: true}}
  - {quantizer_name: 'layers.1.*', enable: false, cfg: {num_bits: e4m3, enable: false}}
  - {quantizer_name: 'layers.2.*', enable: true, cfg: {num_bits: e4m3, enable: false}}
  - {quantizer_name: 'layers.3.*', enable: false, cfg: {}}
)",
                                     "en.yaml");
  ASSERT_EQ(r.entries.size(), 4u);
  EXPECT_FALSE(r.entries[3].cfg.has_value());  // an empty cfg on a disable is no cfg
  const auto c = apply_recipe(r, four_layers());
  EXPECT_TRUE(c.at(dq(0)).enable);
  EXPECT_FALSE(c.at(dq(1)).enable);
  EXPECT_TRUE(c.at(dq(1)).configured);
  EXPECT_TRUE(c.at(dq(2)).enable);  // the entry's enable overrides the cfg's, as in Model Optimizer
  EXPECT_FALSE(c.at(dq(3)).enable || c.at(dq(3)).configured);
  // Model Optimizer would enable these: moefq asks for the unambiguous spelling.
  EXPECT_HAS(cfg_error("{num_bits: e4m3, enable: false}"),
             "my.yaml: quant_cfg[0].cfg.enable: enable: false inside cfg with no enable beside it");
  EXPECT_HAS(cfg_error("{enable: true}"), "my.yaml: quant_cfg[0].cfg: cfg sets only enable: true");
  EXPECT_HAS(cfg_error("{}"), "my.yaml: quant_cfg[0].cfg: must set at least one quantizer attribute");
  EXPECT_HAS(parse_error("quant_cfg:\n  - {quantizer_name: '*', enable: true, cfg: [{}]}\n"),
             "must set at least one quantizer attribute");
}

// The wire formats of the expert-parallel libraries: blocks of 128 with fp32 scales when
// scale_bits is absent, ue8m0 scales with e8m0, and the logfmt10 extension without blocks.
TEST(RecipeCfg, WireFormats) {
  QuantSpec s = parse_one_cfg("{num_bits: e4m3, block_sizes: {-1: 128, type: dynamic}}");
  EXPECT_EQ(s.format, Format::kFp8Block128);
  EXPECT_EQ(s.block_size, 128);
  EXPECT_EQ(parse_one_cfg("{num_bits: [4, 3], block_sizes: {-1: 128, type: dynamic, scale_bits: [8, 0]}}").format,
            Format::kFp8Block128Ue8m0);
  s = parse_one_cfg("{num_bits: logfmt10}");
  EXPECT_EQ(s.format, Format::kLogfmt10);
  EXPECT_EQ(s.block_size, 0);
  // No global amax: a constant one is refused, as for the mx formats.
  EXPECT_HAS(cfg_error("{num_bits: logfmt10, constant_amax: 1}"), "has no effect on logfmt10");
  EXPECT_HAS(cfg_error("{num_bits: e4m3, block_sizes: {-1: 128, type: dynamic}, constant_amax: 1}"),
             "has no effect on fp8_block128");
  EXPECT_HAS(cfg_error("{num_bits: e4m3, block_sizes: {-1: 128, type: dynamic, scale_bits: e8m0}, constant_amax: 1}"),
             "has no effect on fp8_block128_ue8m0");
}

TEST(RecipeCfg, EnableSpellingsAndFlowEntries) {
  const Recipe r = parse_recipe_text(
      "quant_cfg: [{quantizer_name: '*dispatch*', enable: True}, {quantizer_name: '*combine*', enable: off}]\n",
      "e.yaml");
  ASSERT_EQ(r.entries.size(), 2u);
  EXPECT_EQ(r.entries[0].enable, std::optional<bool>(true));
  EXPECT_EQ(r.entries[1].enable, std::optional<bool>(false));
  EXPECT_EQ(parse_recipe_text("quant_cfg:\n", "n.yaml").entries.size(), 0u);
}

TEST(RecipeCfg, Algorithms) {
  EXPECT_EQ(parse_recipe_text("quant_cfg: []\nalgorithm: {method: max, layerwise: {enable: false}, "
                              "moe_calib_experts_ratio: 0.5, sync_expert_weight_amax: false, shared_states: null, "
                              "skip_forward_without_activation_calib: false, distributed_sync: true}\n",
                              "a.yaml")
                .algorithm,
            "max");
  // algorithm: null (no calibration) suits formats without a calibrated amax only.
  const Recipe none =
      parse_recipe_text("algorithm:\nquant_cfg:\n  - {quantizer_name: '*combine_quantizer', cfg: {num_bits: e4m3, "
                        "block_sizes: {-1: 32, type: dynamic, scale_bits: e8m0}}}\n  - {quantizer_name: "
                        "'*dispatch_quantizer', cfg: {num_bits: e4m3, type: dynamic}}\n",
                        "none.yaml");
  EXPECT_EQ(none.algorithm, "none");
  EXPECT_NO_THROW(apply_recipe(none, four_layers()));
  const Recipe calibrated = parse_recipe_text(
      "algorithm: null\nquant_cfg:\n  - {quantizer_name: '*combine_quantizer', cfg: {num_bits: e4m3}}\n", "nc.yaml");
  EXPECT_HAS(error_of([&] { apply_recipe(calibrated, four_layers()); }),
             cq(0) + ": nc has algorithm: null (no calibration), but its fp8 spec takes a calibrated amax");
  for (const char* algo : {"awq_lite", "{method: smoothquant}", "MAX", "[max]"}) {
    SCOPED_TRACE(algo);
    const std::string m = parse_error(std::string("quant_cfg: []\nalgorithm: ") + algo + "\n");
    EXPECT_HAS(m, "my.yaml: algorithm");
    EXPECT_HAS(m, "is not supported; the calibration algorithms are max, mse and percentile");
  }
  // mse and percentile (calibration_stats.h), with their own keys only.
  EXPECT_EQ(parse_recipe_text("quant_cfg: []\nalgorithm: {method: mse}\n", "a.yaml").algorithm, "mse");
  EXPECT_HAS(parse_error("algorithm: {method: mse, layerwise: true}\n"),
             "my.yaml: algorithm: unknown key 'layerwise' of mse calibration (expected method, step_size, "
             "start_multiplier, stop_multiplier)");
  EXPECT_HAS(parse_error("algorithm: {method: percentile, percentile: 0}\n"), "percentile 0 must be in (0, 100]");
  EXPECT_HAS(parse_error("algorithm: {layerwise: {}}\n"), "my.yaml: algorithm: missing method (max, mse or percentile)");
  EXPECT_HAS(parse_error("algorithm: {method: max, step_size: 2}\n"),
             "my.yaml: algorithm: unknown key 'step_size' of max calibration");
  EXPECT_HAS(parse_error("algorithm: {method: max, distributed_sync: false}\n"),
             "my.yaml: algorithm.distributed_sync: false is not supported");
  Recipe r;
  r.name = "handmade";
  r.algorithm = "smoothquant";
  EXPECT_HAS(error_of([&] { apply_recipe(r, four_layers()); }), "handmade: algorithm 'smoothquant'");
}

// The peer recipes (recipes/configs/ptq/presets/peers, docs/numerics.md): each loads by its path
// under the shipped root, enables exactly the peer's quantizers with its formats and says where the
// peer applies the router weight (DeepEP at the receiver: after; the others before).
TEST(RecipeUnits, PeerRecipesLoadWithTheirWeighting) {
  struct Case {
    const char* name;
    std::optional<Format> dispatch, combine;
    CombineWeighting weighting;
  };
  const auto before = CombineWeighting::kBefore, after = CombineWeighting::kAfter;
  const Case cases[] = {
      {"deepep_ll_fp8", Format::kFp8Block128, std::nullopt, after},
      {"deepep_ll_logfmt10", Format::kFp8Block128, Format::kLogfmt10, after},
      {"deepep_ll_fp8_ue8m0", Format::kFp8Block128Ue8m0, std::nullopt, after},
      {"sglang_deepgemm_fp8_combine", std::nullopt, Format::kFp8Block128Ue8m0NoFloor, before},
      {"mori_fp8_direct", std::nullopt, Format::kFp8CastNan, before},
      {"mori_fp8_direct_sat", std::nullopt, Format::kFp8Cast, before},
      {"mori_fp8_blockwise", std::nullopt, Format::kFp8Block128Mori, before},
      {"mori_fp4_blockwise", std::nullopt, Format::kFp4Block128Mori, before},
      {"vllm_fp8_dispatch", Format::kFp8Block128Vllm, std::nullopt, before},
      {"deepgemm_fp8_dispatch", Format::kFp8Block128DeepGemm, std::nullopt, before},
      {"flashinfer_mxfp8_combine", std::nullopt, Format::kMxfp8, before},
      {"flashinfer_fp4_combine", std::nullopt, Format::kFp4Block16FlashInfer, before},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Recipe r = load_recipe(std::string("configs/ptq/presets/peers/") + c.name);
    EXPECT_EQ(r.combine_weighting, c.weighting);
    EXPECT_EQ(r.algorithm, "max");
    for (const auto& [name, qc] : apply_recipe(r, four_layers())) {
      const bool dispatch = name.find("dispatch") != std::string::npos;
      const std::optional<Format>& want = dispatch ? c.dispatch : c.combine;
      EXPECT_EQ(qc.enable, want.has_value()) << name;
      if (want && qc.enable) EXPECT_EQ(qc.spec.format, *want) << name;
    }
  }
}

// moefq's combine_weighting beside algorithm, in a preset and in a complete recipe's quantize.
TEST(RecipeCfg, CombineWeighting) {
  EXPECT_FALSE(parse_recipe_text("quant_cfg: []\nalgorithm: max\n", "p.yaml").combine_weighting.has_value());
  EXPECT_EQ(parse_recipe_text("quant_cfg: []\ncombine_weighting: after\n", "p.yaml").combine_weighting,
            CombineWeighting::kAfter);
  EXPECT_EQ(parse_recipe_text("quant_cfg: []\ncombine_weighting: before\n", "p.yaml").combine_weighting,
            CombineWeighting::kBefore);
  EXPECT_EQ(parse_recipe_text("metadata: {recipe_type: ptq}\nquantize:\n  algorithm: max\n  combine_weighting: after\n"
                              "  quant_cfg: []\n",
                              "r.yaml")
                .combine_weighting,
            CombineWeighting::kAfter);
  for (const char* bad : {"sideways", "After", "[after]", "1"}) {
    const std::string m = parse_error(std::string("quant_cfg: []\ncombine_weighting: ") + bad + "\n");
    EXPECT_HAS(m, "my.yaml: combine_weighting");
    EXPECT_HAS(m, "must be before or after");
  }
  EXPECT_HAS(parse_error("quant_cfg: []\ncombine_weighting: sideways\n"), "'sideways'");
}

// ---------------------------------------------------------------------------------------------
// Wildcards

TEST(RecipeWildcard, FnmatchCases) {
  const std::string d3 = dq(3);
  EXPECT_TRUE(wildcard_match("*", d3));
  EXPECT_TRUE(wildcard_match("*dispatch_quantizer", d3));
  EXPECT_FALSE(wildcard_match("*combine_quantizer", d3));
  EXPECT_TRUE(wildcard_match("layers.3.*", d3));  // '*' crosses dots
  EXPECT_FALSE(wildcard_match("layers.3.*", dq(13)));
  EXPECT_FALSE(wildcard_match("layers.1*", "layers.0.x"));
  EXPECT_TRUE(wildcard_match("layers.1*", "layers.13.x"));
  EXPECT_TRUE(wildcard_match("layers.?.mlp*", d3));
  EXPECT_FALSE(wildcard_match("layers.?.mlp*", "layers.12.mlp.x"));
  EXPECT_TRUE(wildcard_match("layers.[0-3].*", d3));
  EXPECT_FALSE(wildcard_match("layers.[!0-3].*", d3));
  EXPECT_TRUE(wildcard_match("layers.[!0-2].*", d3));
  EXPECT_TRUE(wildcard_match("layers.[13].*", d3));
  EXPECT_TRUE(wildcard_match("a[]]b", "a]b"));  // ']' first in a class is literal
  EXPECT_TRUE(wildcard_match("a[!]]b", "axb"));
  EXPECT_FALSE(wildcard_match("a[!]]b", "a]b"));
  EXPECT_TRUE(wildcard_match("a[-x]b", "a-b"));  // '-' at an end is literal
  EXPECT_TRUE(wildcard_match("a[x-]b", "a-b"));
  EXPECT_TRUE(wildcard_match("a[b", "a[b"));  // an unclosed '[' is literal
  EXPECT_FALSE(wildcard_match("a[b", "ab"));
  EXPECT_TRUE(wildcard_match("a\\b", "a\\b"));  // no escapes
  EXPECT_FALSE(wildcard_match("dispatch_quantizer", d3));  // whole-name match
  EXPECT_FALSE(wildcard_match("layers.3", d3));
  EXPECT_TRUE(wildcard_match("", ""));
  EXPECT_FALSE(wildcard_match("", "a"));
  EXPECT_TRUE(wildcard_match("**a**", "a"));
  EXPECT_TRUE(wildcard_match("*a*b*c", "xxaxxbxxc"));
  EXPECT_FALSE(wildcard_match("*a*b*c", "xxaxxbxxcx"));
  EXPECT_FALSE(wildcard_match("Layers.*", d3));  // case-sensitive
  EXPECT_FALSE(wildcard_match(std::string("*\0*", 3), d3));  // a NUL never matches
  // Many stars against a long non-matching name stays cheap.
  EXPECT_FALSE(wildcard_match("*a*a*a*a*a*a*a*a*a*a*b", std::string(20000, 'a')));
}

// ---------------------------------------------------------------------------------------------
// Errors: each names the origin and the key

TEST(RecipeErrors, UnknownKeys) {
  std::string m = parse_error("quant_cfg: []\nquant_config: []\n");
  EXPECT_HAS(m, "my.yaml: unknown top-level key 'quant_config'");
  EXPECT_HAS(m, "expected quant_cfg, algorithm, effective_bits, combine_weighting (and imports); or metadata and "
                "quantize");
  EXPECT_HAS(m, "line 2");
  m = parse_error("quant_cfg:\n  - quantizer_name: '*'\n    enable: false\n  - quantizer_name: x\n    "
                  "parent_clas: Linear\n    enable: false\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[1]: unknown key 'parent_clas'");
  EXPECT_HAS(m, "expected quantizer_name, enable, cfg, parent_class, $import");
  m = cfg_error("{num_bit: e4m3}");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg: unknown key 'num_bit' (expected num_bits, axis, block_sizes, type,");
  m = parse_error("metadata: {recipe_type: ptq}\nquantize: {quant_cfg: []}\nextra: 1\n");
  EXPECT_HAS(m, "my.yaml: unknown top-level key 'extra' in a complete recipe");
  m = parse_error("metadata: {recipe_type: ptq, author: me}\nquantize: {quant_cfg: []}\n");
  EXPECT_HAS(m, "my.yaml: metadata: unknown key 'author' (expected recipe_type, description)");
  m = parse_error("metadata: {recipe_type: ptq}\nquantize: {quant_cfg: [], algo: max}\n");
  EXPECT_HAS(m, "my.yaml: quantize: unknown key 'algo'");
  m = cfg_error("{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bit: e4m3}}");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.block_sizes: unknown key 'scale_bit'");
}

TEST(RecipeErrors, CompleteRecipeShape) {
  EXPECT_HAS(parse_error("quantize: {quant_cfg: []}\n"), "my.yaml: a complete recipe needs metadata");
  EXPECT_HAS(parse_error("metadata: {recipe_type: ptq}\n"), "my.yaml: a PTQ recipe must contain quantize");
  EXPECT_HAS(parse_error("metadata: {recipe_type: speculative_eagle}\nquantize: {}\n"),
             "my.yaml: metadata.recipe_type: 'speculative_eagle' is not a recipe type moefq reads");
  EXPECT_HAS(parse_error("metadata: {description: x}\nquantize: {}\n"), "my.yaml: metadata: missing recipe_type");
  EXPECT_HAS(parse_error("metadata: {recipe_type: ptq}\nquantize: [1]\n"), "my.yaml: quantize: must be a mapping");
}

TEST(RecipeErrors, NumBitsAndUnsupportedCombinations) {
  struct Case {
    const char* cfg;
    const char* named;
  };
  const Case cases[] = {
      {"{num_bits: e2m1}", "num_bits e2m1 without block_sizes"},
      {"{num_bits: e5m2}", "num_bits e5m2 without block_sizes"},
      {"{num_bits: 4}", "num_bits 4 without block_sizes"},
      {"{num_bits: fp8}", "num_bits 'fp8' without block_sizes"},
      {"{num_bits: 8, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}}",
       "num_bits 8 with block_sizes {-1: 16, type: dynamic, scale_bits: e4m3}"},
      {"{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e8m0}}", "scale_bits: e8m0}"},
      {"{num_bits: e4m3, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}}", "num_bits e4m3 with"},
      {"{num_bits: e2m1, block_sizes: {-1: 32, type: dynamic, scale_bits: e4m3}}", "{-1: 32, type: dynamic"},
      {"{num_bits: e2m1, block_sizes: {-1: 64, type: dynamic, scale_bits: e4m3}}", "{-1: 64"},
      {"{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic}}", "{-1: 16, type: dynamic}"},
      {"{num_bits: e2m1, block_sizes: {type: dynamic, scale_bits: e4m3}}", "{-1: null"},
      {"{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e5m2}}", "scale_bits: e5m2"},
      {"{num_bits: e2m1, block_sizes: {-1: 128, type: dynamic}}", "num_bits e2m1 with block_sizes {-1: 128"},
      {"{num_bits: e4m3, block_sizes: {-1: 128, type: dynamic, scale_bits: e4m3}}", "{-1: 128, type: dynamic, scale_bits: e4m3}"},
      {"{num_bits: logfmt10, block_sizes: {-1: 128, type: dynamic}}", "num_bits 'logfmt10' with block_sizes {-1: 128"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.cfg);
    const std::string m = cfg_error(c.cfg);
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg: unsupported combination: ");
    EXPECT_HAS(m, c.named);
    EXPECT_HAS(m, "e2m1 with block_sizes {-1: 16, type: dynamic, scale_bits: e4m3} (nvfp4)");
  }
  for (const char* bits : {"[4]", "{a: 1}", "null", "0", "-8", "[4, x]", "true"}) {
    SCOPED_TRACE(bits);
    EXPECT_HAS(cfg_error(std::string("{num_bits: ") + bits + "}"),
               "my.yaml: quant_cfg[0].cfg.num_bits: must be a");
  }
}

TEST(RecipeErrors, BlockSizes) {
  std::string m = cfg_error("{num_bits: e2m1, block_sizes: {-2: 16, type: dynamic, scale_bits: e4m3}}");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg: block_sizes blocks only the last dimension here (key -1), not -2: 16");
  m = cfg_error("{num_bits: e2m1, block_sizes: {-1: 16, type: static, scale_bits: e4m3}}");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg: block_sizes type: static is not supported");
  m = cfg_error("{num_bits: e2m1, block_sizes: {-1: 16, scale_bits: e4m3}}");
  EXPECT_HAS(m, "block_sizes type: static (the default) is not supported; block scales are computed from each "
                "block here: write type: dynamic");
  m = cfg_error("{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3, four_over_six: true}}");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg: block_sizes.four_over_six is not supported");
  m = cfg_error("{num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3, scale_block_sizes: "
                "{-1: 16}}}");
  EXPECT_HAS(m, "block_sizes.scale_block_sizes is not supported");
  m = cfg_error("{num_bits: e2m1, block_sizes: 16}");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.block_sizes: must be a mapping");
  m = cfg_error("{num_bits: e2m1, block_sizes: {-1: sixteen, type: dynamic, scale_bits: e4m3}}");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.block_sizes.-1: a block size must be a positive integer");
  m = cfg_error("{num_bits: e2m1, block_sizes: {-1: 16, type: adaptive, scale_bits: e4m3}}");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.block_sizes.type: must be dynamic or static");
}

TEST(RecipeErrors, AxisNotNull) {
  for (const char* axis : {"0", "-1", "[0, 1]"}) {
    SCOPED_TRACE(axis);
    const std::string m = cfg_error(std::string("{num_bits: e4m3, axis: ") + axis + "}");
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg: per-channel quantization (axis ");
    EXPECT_HAS(m, "is not supported; write axis: null");
  }
  EXPECT_HAS(cfg_error("{num_bits: e4m3, axis: 'null'}"), "my.yaml: quant_cfg[0].cfg.axis: must be null");
}

TEST(RecipeErrors, AttributesMoefqDoesNotSimulate) {
  const struct {
    const char* cfg;
    const char* named;
  } cases[] = {
      {"{num_bits: e4m3, fake_quant: false}", "cfg.fake_quant: false (real quantization) is not supported"},
      {"{num_bits: 8, unsigned: true}", "cfg.unsigned: true is not supported"},
      {"{num_bits: 8, narrow_range: true}", "cfg.narrow_range: true is not supported"},
      {"{num_bits: e4m3, learn_amax: true}", "cfg.learn_amax: true is not supported"},
      {"{num_bits: e4m3, calibrator: histogram}", "cfg.calibrator: 'histogram' is not supported"},
      {"{num_bits: e4m3, rotate: true}", "cfg.rotate: input rotation is not supported"},
      {"{num_bits: e4m3, rotate: {enable: true}}", "cfg.rotate: input rotation is not supported"},
      {"{num_bits: e4m3, backend: triton}", "cfg.backend: custom quantization back-ends are not supported"},
      {"{num_bits: e4m3, bias: {enable: true}}", "cfg.bias: affine quantization (bias) is not supported"},
      {"{num_bits: e4m3, trt_high_precision_dtype: Double}", "cfg.trt_high_precision_dtype: must be Float"},
      {"{num_bits: e4m3, effective_bits: 20}", "cfg.effective_bits: must be a number in (0, 16]"},
      {"{num_bits: e4m3, type: adaptive}", "cfg.type: must be static or dynamic"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.cfg);
    EXPECT_HAS(cfg_error(c.cfg), std::string("my.yaml: quant_cfg[0].") + c.named);
  }
  EXPECT_HAS(parse_error("quant_cfg:\n  - {quantizer_name: '*combine_quantizer', cfg: [{num_bits: 4}, {num_bits: "
                         "e4m3}]}\n"),
             "my.yaml: quant_cfg[0].cfg: a list of cfgs (sequential quantization, as for W4A8 weights) is not "
             "supported");
}

TEST(RecipeErrors, ConstantAmaxNotPositiveOrNotANumber) {
  for (const char* v : {"0", "-1", "-0.0", ".inf", "-.inf", ".nan", "1e39", "1e-50"}) {
    SCOPED_TRACE(v);
    EXPECT_HAS(cfg_error(std::string("{num_bits: e4m3, constant_amax: ") + v + "}"),
               "my.yaml: quant_cfg[0].cfg.constant_amax: must be a finite number > 0");
  }
  for (const char* v : {"abc", "'six'", "[1]", "1.5x", "0x10"}) {
    SCOPED_TRACE(v);
    const std::string m = cfg_error(std::string("{num_bits: e4m3, constant_amax: ") + v + "}");
    EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg.constant_amax: ");
    EXPECT_HAS(m, "is not a number");
  }
}

TEST(RecipeErrors, AmaxSourcesThatContradict) {
  EXPECT_HAS(cfg_error("{num_bits: e4m3, constant_amax: 2, amax: dynamic}"),
             "my.yaml: quant_cfg[0].cfg.amax: constant_amax and amax: dynamic contradict");
  EXPECT_HAS(cfg_error("{num_bits: e4m3, constant_amax: 2, type: dynamic}"),
             "my.yaml: quant_cfg[0].cfg.type: type: dynamic (a per-call amax) and a constant amax contradict");
  EXPECT_HAS(cfg_error("{num_bits: e4m3, type: dynamic, amax: calibrated}"),
             "my.yaml: quant_cfg[0].cfg.amax: type: dynamic and amax: calibrated contradict");
  EXPECT_HAS(cfg_error("{num_bits: e4m3, constant_amax: 2, use_constant_amax: true}"),
             "my.yaml: quant_cfg[0].cfg.use_constant_amax: constant_amax and use_constant_amax: true are mutually "
             "exclusive");
  EXPECT_HAS(cfg_error("{num_bits: e4m3, amax: constant}"),
             "my.yaml: quant_cfg[0].cfg.amax: amax: constant needs constant_amax");
  EXPECT_HAS(cfg_error("{num_bits: e4m3, amax: max}"), "my.yaml: quant_cfg[0].cfg.amax: unknown amax source 'max'");
  EXPECT_HAS(cfg_error("{num_bits: e4m3, constant_amax: 2, block_sizes: {-1: 32, type: dynamic, scale_bits: e8m0}}"),
             "my.yaml: quant_cfg[0].cfg.constant_amax: has no effect on mxfp8");
  EXPECT_HAS(cfg_error("{num_bits: e2m1, use_constant_amax: true, block_sizes: {-1: 32, type: dynamic, scale_bits: "
                       "e8m0}}"),
             "my.yaml: quant_cfg[0].cfg.use_constant_amax: has no effect on mxfp4");
}

TEST(RecipeErrors, UnmatchedPattern) {
  const Recipe r = parse_recipe_text(
      "$import: moe_dispatch_fp8\nquant_cfg:\n  - quantizer_name: 'layers.9.*'\n    enable: false\n", "u.yaml");
  const std::string m = error_of([&] { apply_recipe(r, four_layers()); });
  EXPECT_HAS(m, "u.yaml: quant_cfg[0]: quantizer_name 'layers.9.*' matches no quantizer");
  EXPECT_HAS(m, "available: " + dq(0));
  EXPECT_HAS(m, "and 4 more");
  // A unit's pattern that matches nothing in this model is an error too, naming the unit.
  const std::string m2 = error_of([] { apply_recipe(load_recipe("moe_combine_fp8"), {dq(0)}); });
  EXPECT_HAS(m2, "moe_combine_fp8.yaml: [0]: quantizer_name '*combine_quantizer' matches no");
  EXPECT_HAS(error_of([&] { apply_recipe(r, {}); }), "there are none");
  // A pattern that names a combine quantizer in another module path is not ignored: it must match.
  const Recipe other = parse_recipe_text(
      "quant_cfg:\n  - {quantizer_name: '*block_sparse_moe.experts.combine_quantizer', enable: false}\n", "o.yaml");
  EXPECT_HAS(error_of([&] { apply_recipe(other, four_layers()); }), "matches no quantizer");
}

TEST(RecipeErrors, MalformedYaml) {
  std::string m = parse_error("quant_cfg: [\n  - a\n");
  EXPECT_HAS(m, "my.yaml: not valid YAML: ");
  m = parse_error("quant_cfg:\n  - quantizer_name: *combine_quantizer\n    enable: true\n");
  EXPECT_HAS(m, "my.yaml: not valid YAML: ");
  EXPECT_HAS(m, "must be quoted");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, enable: true}\n  - {quantizer_name: a, enable: true, "
                  "enable: false}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[1]: duplicate key 'enable'");
  m = parse_error("quant_cfg:\n  - {quantizer_name: a, enable: true}\n  - {[x]: 1}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[1]: a key must be a plain name");
}

TEST(RecipeErrors, NotARecipe) {
  for (const char* text : {"", "---\n", "# only a comment\n"}) {
    SCOPED_TRACE(text);
    EXPECT_HAS(parse_error(text, "nm.yaml"), "nm.yaml: is empty; a recipe is a mapping with quant_cfg");
  }
  for (const char* text : {"42\n", "'quant_cfg'\n"}) {
    SCOPED_TRACE(text);
    EXPECT_HAS(parse_error(text, "nm.yaml"), "nm.yaml: a recipe must be a mapping with quant_cfg");
  }
  std::string m = parse_error("quant_cfg: 42\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg: must be a list of entries");
  m = parse_error("quant_cfg:\n  - quantizer_name: a\n    enable: true\n  - just_a_string\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[1]: an entry must be a mapping");
  m = parse_error(combine_cfg("e4m3"));
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].cfg: must be a mapping of quantizer attributes");
}

TEST(RecipeErrors, EnableNotABool) {
  for (const char* v : {"'true'", "1", "maybe", "[true]", "null"}) {
    SCOPED_TRACE(v);
    EXPECT_HAS(parse_error(std::string("quant_cfg:\n  - {quantizer_name: '*', enable: ") + v + "}\n"),
               "my.yaml: quant_cfg[0].enable: must be true or false");
  }
}

TEST(RecipeErrors, EntryShape) {
  std::string m = parse_error("quant_cfg:\n  - {quantizer_name: '*'}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0]: the entry for '*' sets neither enable nor cfg");
  m = parse_error("quant_cfg:\n  - {quantizer_name: '*', cfg: null}\n");
  EXPECT_HAS(m, "sets neither enable nor cfg");
  m = parse_error("quant_cfg:\n  - {quantizer_name: '', enable: true}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].quantizer_name: must be a non-empty wildcard pattern");
  m = parse_error("quant_cfg:\n  - {quantizer_name: '*', parent_class: [nn.Linear], enable: true}\n");
  EXPECT_HAS(m, "my.yaml: quant_cfg[0].parent_class: must be a module class name");
}

TEST(RecipeErrors, EnabledWithoutCfg) {
  const Recipe r = parse_recipe_text(
      "$import: moe_combine_nvfp4\nquant_cfg:\n  - quantizer_name: 'layers.2.*dispatch_quantizer'\n    "
      "enable: true\n",
      "ewc.yaml");
  EXPECT_HAS(error_of([&] { apply_recipe(r, four_layers()); }),
             dq(2) + ": enabled by ewc.yaml: quant_cfg[0] but no entry gives it a cfg");
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
      "a: &a [1, 2]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b]\n"
      "d: &d [*c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d]\n"
      "f: &f [*e, *e, *e, *e, *e, *e, *e, *e]\ng: [*f, *f, *f, *f, *f, *f, *f, *f]\n",  // an alias bomb
      "imports: {a: /dev/zero}\nquant_cfg: []\n",
      "imports: {a: ../../../../../../../../etc/passwd}\nquant_cfg: []\n",
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
