// Quantization recipes in NVIDIA Model Optimizer's own file layout (numerics snippets, quant_cfg
// units, presets, complete PTQ recipes with `imports:` and `$import`), moefq's units by name, and
// the resolution of a recipe against a model's dispatch/combine quantizer names.
// Invariants: loading never lets a yaml-cpp exception escape (every problem is a moefq::Error of
// kind kBadInput naming the file, the key and the line); a Recipe holds its imports expanded; the
// entries a recipe carries for quantizers moefq does not simulate (weights, KV cache, ...) are set
// aside in Recipe::ignored, never applied and never an error.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moefq/calibration_stats.h"
#include "moefq/quant_spec.h"

namespace moefq {

// One quant_cfg entry for moefq's quantizers, imports expanded. `enable` and `cfg` are both
// optional but at least one is present. A cfg replaces a matching quantizer's spec as a whole.
struct RecipeEntry {
  std::string pattern;            // quantizer_name wildcard (wildcard_match)
  std::optional<bool> enable;     // absent with a cfg: the entry enables
  std::optional<QuantSpec> cfg;   // absent: only the enabled flag changes
  std::string origin;             // where it was written, e.g. "my.yaml: quant_cfg[3]"
};

// An entry for quantizers moefq does not have (pattern_targets_moe_quantizers is false, or it is
// restricted to a PyTorch parent_class).
struct IgnoredEntry {
  std::string pattern;  // quantizer_name, with " (parent_class X)" when it has one
  std::string origin;
};

struct Recipe {
  std::string name;                  // the file stem (the unit name)
  std::vector<RecipeEntry> entries;  // imports expanded, in application order
  std::vector<IgnoredEntry> ignored;  // entries for other quantizers, in file order
  std::string algorithm = "max";     // "max", "mse", "percentile", or "none" (algorithm: null)
  CalibrationMethod calibration;     // the method and its parameters (unless "none")
  // moefq's `combine_weighting: before | after` (beside algorithm): where the layer the recipe is
  // meant for applies the router weight; nullopt when the recipe does not say.
  std::optional<CombineWeighting> combine_weighting;
};

// Recipe roots: where `imports:` paths (configs/numerics/nvfp4, ...) are looked for, in order:
// `recipe_root` when not empty, the nearest ancestor directory of the importing file that holds a
// configs/ directory, the shipped recipes (MOEFQ_RECIPE_DIR). `$import` of a name no `imports:`
// declares is a moefq unit: NAME.yaml beside the importing file (the current directory for text),
// on the colon-separated MOEFQ_RECIPE_PATH, or in a root's configs/ptq/units.

// Parses recipe text (any of the layouts above). `origin` names the text in messages.
Recipe parse_recipe_text(std::string_view yaml_text, std::string_view origin,
                         const std::string& recipe_root = "");

// Loads a recipe file, a path relative to a recipe root (general/ptq/x, suffix optional), or a
// unit by name ("moe_dispatch_fp8").
Recipe load_recipe(const std::string& path_or_unit_name, const std::string& recipe_root = "");

// Names of the units (file stems) on MOEFQ_RECIPE_PATH and in the roots' configs/ptq/units, sorted,
// without duplicates.
std::vector<std::string> list_recipe_units(const std::string& recipe_root = "");

// Whole-name match with fnmatch(3) (no flags but FNM_NOESCAPE), as Model Optimizer's Python
// fnmatch: '*' any run of characters (dots included), '?' one character, '[abc]' '[a-z]' '[!a-z]'
// one character of a class. Case-sensitive.
bool wildcard_match(std::string_view pattern, std::string_view name);

// Whether a quantizer_name pattern can match the dispatch or combine quantizer of some layer,
// spelled as moefq names it ("layers.3.mlp.experts.combine_quantizer") or as the serving stack
// does ("model.layers.3.mlp.experts.combine_quantizer"), or names one of them outright (contains
// "dispatch_quantizer" or "combine_quantizer"). Entries whose pattern cannot are ignored.
bool pattern_targets_moe_quantizers(std::string_view pattern);

// One line for the user when a recipe ignored entries ("" when it ignored none).
std::string ignored_entries_notice(const Recipe& recipe);

struct QuantizerConfig {
  bool enable = false;
  QuantSpec spec;           // meaningful when configured
  bool configured = false;  // some entry gave this quantizer a cfg
};

// Applies the entries in order to every quantizer their pattern matches (against the name and its
// "model."-prefixed spelling); every quantizer starts disabled and unconfigured, later entries
// override earlier ones. Throws moefq::Error when an entry matches no quantizer, when an enabled
// quantizer never got a cfg, when a resulting spec fails QuantSpec::validate, or when a recipe
// without calibration (algorithm "none") leaves an enabled quantizer's calibrated amax unset. The
// result has one element per name.
std::map<std::string, QuantizerConfig> apply_recipe(const Recipe& recipe,
                                                    const std::vector<std::string>& quantizer_names);

}  // namespace moefq
