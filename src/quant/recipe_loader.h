// The recipe file loader: reads Model Optimizer-layout YAML files (a `# modelopt-schema:` preamble,
// one document, or an `imports:` header and `---` before a mapping or a list), resolves their
// `imports:` against the recipe roots, expands every `$import` (spliced into a list, appended to
// it, or merged into a mapping under its sibling keys), reports import cycles, and hands back one
// plain tree with the provenance of every node. It knows nothing of what the keys mean, except
// moefq's own unit names (an `$import` of a name no `imports:` declares), which stand for lists of
// quant_cfg entries. Internal to src/quant.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "quant/recipe_tree.h"

namespace moefq::recipe {

// A loaded file or text: its root with every import expanded and `imports:` consumed.
struct Document {
  NodePtr root;        // never null; kNull only for an empty document (rejected by the schema)
  std::string schema;  // the `# modelopt-schema:` value, "" when the file has none
  std::string name;    // the file stem ("moe_combine_nvfp4"), or the origin's stem for text
};

// The recipe roots searched for an import path, in order: `recipe_root` when not empty, the
// nearest ancestor directory of the importing file that holds `configs/`, the shipped recipes
// (MOEFQ_RECIPE_DIR).
class Loader {
 public:
  explicit Loader(std::string recipe_root);

  // A file path, a path relative to a recipe root (suffix optional), or a unit name.
  Document load(const std::string& path_or_name);
  // Text that is not a file: `origin` names it in messages; unit names are looked up from the
  // current directory; import paths under the explicit and shipped roots.
  Document load_text(std::string_view text, const std::string& origin);

  // Unit names (file stems) found on MOEFQ_RECIPE_PATH and under each root's configs/ptq/units.
  std::vector<std::string> unit_names() const;

 private:
  std::string explicit_root_;
  int files_loaded_ = 0;
};

}  // namespace moefq::recipe
