// Quantization recipes: YAML in the layout of NVIDIA Model Optimizer's quant_cfg lists, reusable
// units imported by name, and the resolution of a recipe against a model's quantizer names.
// Invariants: parsing never lets a yaml-cpp exception escape (every problem is a moefq::Error of
// kind kBadInput naming the file and the key), and imports are fully expanded in a Recipe.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moefq/quant_spec.h"

namespace moefq {

// One quant_cfg entry after import expansion. `enable` and `cfg` are both optional but at least
// one is present. A cfg replaces a matching quantizer's spec as a whole.
struct RecipeEntry {
  std::string pattern;            // quantizer_name wildcard (wildcard_match)
  std::optional<bool> enable;     // absent with a cfg: the entry enables
  std::optional<QuantSpec> cfg;   // absent: only the enabled flag changes
  std::string origin;             // where it was written, e.g. "my.yaml: quant_cfg[3]"
};

struct Recipe {
  std::string name;                  // the file stem (the unit name)
  std::vector<RecipeEntry> entries;  // imports expanded, in application order
  std::string algorithm = "max";     // calibration algorithm; only "max" exists
};

// Parses one recipe document. `origin` names the text in messages (a file name). `$import`
// names are looked up in the current directory, then MOEFQ_RECIPE_PATH, then the shipped units.
Recipe parse_recipe_text(std::string_view yaml_text, std::string_view origin);

// Loads a recipe file, or a unit by name ("moe_dispatch_fp8") when no such file exists. `$import`
// names are looked up in the importing file's directory, then each directory of the
// colon-separated MOEFQ_RECIPE_PATH, then the shipped units (MOEFQ_RECIPE_DIR).
Recipe load_recipe(const std::string& path_or_unit_name);

// Names of the units (file stems of *.yaml) on MOEFQ_RECIPE_PATH and in the shipped directory,
// sorted, without duplicates.
std::vector<std::string> list_recipe_units();

// fnmatch-style whole-name match, as Python's fnmatch.fnmatchcase (which Model Optimizer uses):
// '*' any run of characters (dots included), '?' one character, '[abc]' '[a-z]' '[!a-z]' one
// character of a class; an unclosed '[' is a literal. Case-sensitive; no escapes.
bool wildcard_match(std::string_view pattern, std::string_view name);

struct QuantizerConfig {
  bool enable = false;
  QuantSpec spec;           // meaningful when configured
  bool configured = false;  // some entry gave this quantizer a cfg
};

// Applies the entries in order to every quantizer their pattern matches; every quantizer starts
// disabled and unconfigured, later entries override earlier ones. Throws moefq::Error when an
// entry matches no quantizer, when an enabled quantizer never got a cfg, or when a resulting
// spec fails QuantSpec::validate. The result has one element per name.
std::map<std::string, QuantizerConfig> apply_recipe(const Recipe& recipe,
                                                    const std::vector<std::string>& quantizer_names);

}  // namespace moefq
