// The YAML tree the recipe loader hands to the recipe schema: plain values (null, scalar, list,
// mapping in document order) where every node remembers the file it was written in, its place
// there ("quant_cfg[2].cfg") and its line, so an error about a spliced or merged node names the
// file the user has to change. Internal to src/quant.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace moefq::recipe {

// A file of a load: the name messages use, and the import that brought it in ("" for the file
// the user named).
struct Source {
  std::string file;         // display name, e.g. "recipes/configs/ptq/units/moe_combine_nvfp4.yaml"
  std::string imported_by;  // e.g. "my.yaml: imports.nvfp4" (itself followed by its own chain)
};

struct Node;

struct MapItem {
  std::string key;
  int key_line = 0;  // 1-based, 0 unknown
  std::shared_ptr<Node> value;
};

struct Node {
  enum class Kind { kNull, kScalar, kList, kMap };
  Kind kind = Kind::kNull;
  std::string scalar;  // kScalar: the text as written
  bool quoted = false;  // kScalar: quoted or tagged (never a bool, a number or null)
  std::vector<std::shared_ptr<Node>> list;  // kList
  std::vector<MapItem> map;                 // kMap: keys unique, document order

  std::shared_ptr<const Source> source;
  std::string where;  // place inside its file: "" for the root, "quant_cfg[2].cfg"
  int line = 0;       // 1-based, 0 unknown

  bool is_null() const { return kind == Kind::kNull; }
  bool is_scalar() const { return kind == Kind::kScalar; }
  bool is_list() const { return kind == Kind::kList; }
  bool is_map() const { return kind == Kind::kMap; }
  // The value of a mapping's key, or nullptr.
  const Node* find(std::string_view key) const;
};

using NodePtr = std::shared_ptr<Node>;

// User text echoed in a message: at most 60 characters, non-printables escaped, in quotes.
std::string in_quotes(std::string_view s);
// "null", "a list", "a mapping" or the quoted scalar, for "got ..." in messages.
std::string show(const Node& n);
// "<file>: <where>" of a node (its own file and place), for messages and entry origins.
std::string origin_of(const Node& n);

// Throws moefq::Error (bad input): "<file>: <where>: <what> (line N) (imported by ...)".
[[noreturn]] void fail_at(const Node& n, const std::string& what);
// The same, about a key of a mapping node (its line, and `where` extended by nothing).
[[noreturn]] void fail_at_key(const Node& map, const MapItem& item, const std::string& what);
[[noreturn]] void fail_plain(const std::string& message);

}  // namespace moefq::recipe
