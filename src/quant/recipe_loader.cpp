// The recipe file loader (recipe_loader.h): files and documents, the preamble, imports and the
// recipe roots, `$import` expansion and cycles. Limits on sizes, nesting and import counts keep
// hostile input (a fuzzer, an alias bomb, a diamond of imports) cheap; every problem is a
// moefq::Error naming the file.
#include "quant/recipe_loader.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <new>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include "moefq/errors.h"
#include "moefq/fileio.h"

#ifndef MOEFQ_RECIPE_DIR
#define MOEFQ_RECIPE_DIR "recipes"
#endif

namespace moefq::recipe {
namespace {

namespace fs = std::filesystem;

constexpr size_t kMaxFileBytes = size_t{1} << 20;
constexpr int kMaxNesting = 64;          // YAML nesting inside one file
constexpr size_t kMaxNodes = 200000;     // nodes of one file, aliases expanded
constexpr size_t kMaxImportDepth = 32;   // files importing files
constexpr int kMaxFileLoads = 2000;      // files read by one load (a diamond of imports re-reads)
constexpr size_t kMaxListItems = 100000;  // entries of one list after splicing

constexpr const char* kImportKey = "$import";
constexpr const char* kUnitsDir = "configs/ptq/units";

// ---------------------------------------------------------------------------------------------
// Reading a file into documents

std::vector<std::string> split_path_list(const char* list) {
  std::vector<std::string> out;
  if (!list) return out;
  std::string_view s = list;
  while (!s.empty()) {
    const size_t colon = s.find(':');
    const std::string_view part = s.substr(0, colon);
    if (!part.empty()) out.emplace_back(part);
    if (colon == std::string_view::npos) break;
    s.remove_prefix(colon + 1);
  }
  return out;
}

bool is_regular(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

std::string canonical_key(const fs::path& p) {
  std::error_code ec;
  fs::path c = fs::weakly_canonical(p, ec);
  if (ec) c = fs::absolute(p, ec).lexically_normal();
  return c.string();
}

// A regular file only (a FIFO or device is refused by name, without a blocking open), at most
// kMaxFileBytes.
std::string read_text(const fs::path& path, const std::string& display) {
  return read_regular_file(path.string(), kMaxFileBytes, "recipe " + display);
}

// The value of a `# modelopt-schema: NAME` line among the comments before the first YAML line.
std::string schema_preamble(std::string_view text, const std::string& display) {
  std::string schema;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.front()))) line.remove_prefix(1);
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.remove_suffix(1);
    if (line.empty()) continue;
    if (line.front() != '#') break;
    line.remove_prefix(1);
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.front()))) line.remove_prefix(1);
    constexpr std::string_view kTag = "modelopt-schema:";
    if (line.substr(0, kTag.size()) != kTag) continue;
    line.remove_prefix(kTag.size());
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.front()))) line.remove_prefix(1);
    if (line.empty() || line.find_first_of(" \t") != std::string_view::npos) continue;  // not the form
    if (!schema.empty()) fail_plain(display + ": more than one modelopt-schema comment; keep one");
    schema = std::string(line);
  }
  return schema;
}

// Parses documents without building them (counting them).
class IgnoreEvents : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

// An upper estimate of the nesting of a YAML text, from the text alone: the chain of ever deeper
// indentations, the indicators that open a level within one line ("- - x", "? k", ": v") and flow
// brackets, outside quotes, comments and block scalars. yaml-cpp recurses once per level while it
// parses, before the Converter's depth check sees the tree, so a deep document would overflow a
// small stack first: this scan runs before it.
int yaml_nesting_estimate(std::string_view text) {
  constexpr size_t kNone = std::string_view::npos;
  std::vector<size_t> indents;
  int flow = 0, deepest = 0;
  char quote = 0;
  size_t block_scalar = kNone;  // the indentation of the line that opened a | or > block
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == kNone) end = text.size();
    const std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    size_t indent = 0;
    while (indent < line.size() && line[indent] == ' ') ++indent;
    std::string_view content = line.substr(indent);
    while (!content.empty() && (content.back() == '\r' || content.back() == ' ' || content.back() == '\t'))
      content.remove_suffix(1);
    int depth = int(indents.size());
    size_t i = 0;
    if (quote == 0 && flow == 0) {
      if (block_scalar != kNone) {
        if (content.empty() || indent > block_scalar) continue;
        block_scalar = kNone;
      }
      if (content.empty() || content[0] == '#') continue;
      while (!indents.empty() && indents.back() >= indent) indents.pop_back();
      indents.push_back(indent);
      depth = int(indents.size());
      while (i < content.size() && (content[i] == '-' || content[i] == '?' || content[i] == ':') &&
             (i + 1 == content.size() || content[i + 1] == ' ')) {
        ++depth;
        i += 2;
        while (i < content.size() && content[i] == ' ') ++i;
      }
    }
    deepest = std::max(deepest, depth + flow);
    size_t last = kNone;  // the last character outside quotes and comments
    for (; i < content.size(); ++i) {
      const char c = content[i];
      if (quote == '\'') {
        if (c == '\'') {
          if (i + 1 < content.size() && content[i + 1] == '\'') ++i;
          else quote = 0;
        }
        continue;
      }
      if (quote == '"') {
        if (c == '\\') ++i;
        else if (c == '"') quote = 0;
        continue;
      }
      const char before = i == 0 ? ' ' : content[i - 1];
      const bool token_start = before == ' ' || before == '\t' || before == '[' || before == '{' || before == ',' ||
                               before == ':' || before == '-';
      if (c == '#' && (before == ' ' || before == '\t')) break;
      if ((c == '\'' || c == '"') && token_start) {
        quote = c;
        continue;
      }
      if (c == '[' || c == '{') deepest = std::max(deepest, depth + ++flow);
      if ((c == ']' || c == '}') && flow > 0) --flow;
      last = i;
    }
    // A literal or folded block scalar (| or >, with its indicators): its lines are text.
    if (quote == 0 && flow == 0 && last != kNone) {
      size_t k = last;
      while (k > 0 && (std::isdigit(static_cast<unsigned char>(content[k])) || content[k] == '+' || content[k] == '-'))
        --k;
      if ((content[k] == '|' || content[k] == '>') && (k == 0 || content[k - 1] == ' ')) block_scalar = indent;
    }
  }
  return deepest;
}

// One or two documents. The documents are counted first with an event parser that stops at
// three: YAML::LoadAll never returns on some malformed input (a stray ',' reads as endless empty
// documents), so it only runs once the count is known to be small.
std::vector<YAML::Node> parse_documents(std::string_view text, const std::string& display) {
  if (text.size() > kMaxFileBytes)
    fail_plain(display + ": " + std::to_string(text.size()) + " bytes is too large for a recipe (limit 1 MiB)");
  if (yaml_nesting_estimate(text) > kMaxNesting)
    fail_plain(display + ": the document nests more than " + std::to_string(kMaxNesting) + " levels deep");
  std::vector<YAML::Node> docs;
  int num_docs = 0;
  try {
    std::istringstream in{std::string(text)};
    YAML::Parser parser(in);
    IgnoreEvents ignore;
    while (num_docs < 3 && parser.HandleNextDocument(ignore)) ++num_docs;
    if (num_docs <= 2) docs = YAML::LoadAll(std::string(text));
  } catch (const YAML::Exception& e) {
    std::string m = display + ": not valid YAML: " + e.msg;
    if (e.mark.line >= 0)
      m += " (line " + std::to_string(e.mark.line + 1) + ", column " + std::to_string(e.mark.column + 1) + ")";
    if (e.msg.find("anchor") != std::string::npos)
      m += "; a pattern that starts with '*' must be quoted: quantizer_name: '*combine_quantizer'";
    fail_plain(m);
  }
  if (num_docs > 2)
    fail_plain(display + ": holds more than two YAML documents, or text after them that is not YAML (a stray "
                         "',' or ']'); a recipe file is one document, or an imports: header, '---' and one "
                         "document");
  return docs;
}

// yaml-cpp's tree to ours, with provenance. Aliases are expanded, so the node count is bounded.
class Converter {
 public:
  explicit Converter(std::shared_ptr<const Source> source) : source_(std::move(source)) {}

  NodePtr convert(const YAML::Node& y, const std::string& where, int depth) {
    if (depth > kMaxNesting)
      fail_plain(source_->file + ": " + (where.empty() ? std::string("the document") : where) + " nests more than " +
                 std::to_string(kMaxNesting) + " levels deep");
    if (++count_ > kMaxNodes)
      fail_plain(source_->file + ": more than " + std::to_string(kMaxNodes) +
                 " YAML nodes (aliases expanded); a recipe is far smaller");
    auto n = std::make_shared<Node>();
    n->source = source_;
    n->where = where;
    const YAML::Mark mark = y.Mark();
    n->line = mark.line >= 0 ? mark.line + 1 : 0;
    if (!y.IsDefined() || y.IsNull()) {
      n->kind = Node::Kind::kNull;
    } else if (y.IsScalar()) {
      n->kind = Node::Kind::kScalar;
      n->scalar = y.Scalar();
      n->quoted = y.Tag() != "?";  // plain scalars carry "?"; quoted ones "!", explicit tags theirs
    } else if (y.IsSequence()) {
      n->kind = Node::Kind::kList;
      size_t i = 0;
      for (const auto& el : y) n->list.push_back(convert(el, where + "[" + std::to_string(i++) + "]", depth + 1));
    } else if (y.IsMap()) {
      n->kind = Node::Kind::kMap;
      std::set<std::string> seen;
      for (const auto& kv : y) {
        const YAML::Node key = kv.first;
        MapItem item;
        const YAML::Mark km = key.Mark();
        item.key_line = km.line >= 0 ? km.line + 1 : 0;
        if (!key.IsScalar()) {
          Node at;
          at.source = source_;
          at.where = where;
          at.line = item.key_line;
          fail_at(at, "a key must be a plain name, got " + std::string(key.IsSequence() ? "a list" : "a mapping"));
        }
        item.key = key.Scalar();
        if (!seen.insert(item.key).second) {
          Node at;
          at.source = source_;
          at.where = where;
          at.line = item.key_line;
          fail_at(at, "duplicate key " + in_quotes(item.key) + "; keep one");
        }
        item.value = convert(kv.second, where.empty() ? item.key : where + "." + item.key, depth + 1);
        n->map.push_back(std::move(item));
      }
    }
    return n;
  }

 private:
  std::shared_ptr<const Source> source_;
  size_t count_ = 0;
};

// A mapping without the given key (a new node; the children are shared).
NodePtr without_key(const Node& map, std::string_view key) {
  auto n = std::make_shared<Node>(map);
  n->map.erase(std::remove_if(n->map.begin(), n->map.end(), [&](const MapItem& it) { return it.key == key; }),
               n->map.end());
  return n;
}

// Builds a mapping by setting keys: a key already there is replaced in place (document order
// kept), a new one appended, as a Python dict update does. The keys are indexed, so that merging
// mappings of many keys stays linear.
class MapSetter {
 public:
  explicit MapSetter(Node& map) : map_(map) {
    for (size_t i = 0; i < map_.map.size(); ++i) at_.emplace(map_.map[i].key, i);
  }
  void set(MapItem item) {
    const auto [it, added] = at_.emplace(item.key, map_.map.size());
    if (added)
      map_.map.push_back(std::move(item));
    else
      map_.map[it->second] = std::move(item);
  }

 private:
  Node& map_;
  std::unordered_map<std::string, size_t> at_;
};

bool plain_unit_name(const std::string& name) {
  return !name.empty() && name[0] != '.' && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

std::string strip_yaml_suffix(std::string name) {
  for (const char* suffix : {".yaml", ".yml"}) {
    const size_t n = std::strlen(suffix);
    if (name.size() > n && name.compare(name.size() - n, n, suffix) == 0) return name.substr(0, name.size() - n);
  }
  return name;
}

bool has_yaml_suffix(const std::string& p) { return strip_yaml_suffix(p) != p; }

// How many unit names a "no such unit" message lists: every shipped unit (the peers' formats made
// them 21), so that a mistyped name's neighbours are there to see; a recipe root with many more
// units gets the first ones and a count.
constexpr size_t kUnitsNamed = 40;

std::string join_few(const std::vector<std::string>& names, size_t few) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < few; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > few) s += " and " + std::to_string(names.size() - few) + " more";
  return s.empty() ? std::string("none") : s;
}

// The nearest ancestor directory of `dir` (itself included) that holds a configs/ directory.
std::optional<fs::path> root_above(fs::path dir) {
  std::error_code ec;
  dir = fs::absolute(dir, ec).lexically_normal();
  for (int guard = 0; guard < 256 && !dir.empty(); ++guard) {
    if (is_dir(dir / "configs")) return dir;
    const fs::path parent = dir.parent_path();
    if (parent == dir) break;
    dir = parent;
  }
  return std::nullopt;
}

void add_root(std::vector<fs::path>& roots, const fs::path& r) {
  const std::string key = canonical_key(r);
  for (const fs::path& have : roots)
    if (canonical_key(have) == key) return;
  roots.push_back(r);
}

// Where unit names are looked for after the importing directory: MOEFQ_RECIPE_PATH, then each
// root's configs/ptq/units.
std::vector<fs::path> unit_dirs(const std::vector<fs::path>& roots) {
  std::vector<fs::path> dirs;
  for (const std::string& d : split_path_list(std::getenv("MOEFQ_RECIPE_PATH"))) dirs.emplace_back(d);
  for (const fs::path& r : roots) dirs.push_back(r / kUnitsDir);
  return dirs;
}

void add_units_in(const fs::path& dir, std::set<std::string>& names) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    std::error_code ec2;
    const std::string ext = it->path().extension().string();
    if ((ext == ".yaml" || ext == ".yml") && it->is_regular_file(ec2)) names.insert(it->path().stem().string());
  }
}

std::optional<fs::path> find_unit(const std::string& name, const std::vector<fs::path>& dirs) {
  for (const fs::path& d : dirs)
    for (const char* suffix : {".yaml", ".yml"}) {
      const fs::path p = (d / (name + suffix)).lexically_normal();
      if (is_regular(p)) return p;
    }
  return std::nullopt;
}

// An imported value and the schema its file declares.
struct Imported {
  NodePtr data;
  std::string schema;
};

// One file (or text) being resolved.
struct FileCtx {
  std::shared_ptr<const Source> source;
  fs::path dir;                // unit names are looked up here first
  std::vector<fs::path> roots;  // import paths are resolved against these, in order
  std::map<std::string, Imported> imports;
};

constexpr const char* kListSchema = "modelopt.torch.quantization.config.QuantizerCfgListConfig";
constexpr const char* kEntrySchema = "modelopt.torch.quantization.config.QuantizerCfgEntry";

std::string short_schema(const std::string& s) {
  const size_t dot = s.rfind('.');
  return dot == std::string::npos ? s : s.substr(dot + 1);
}

// ---------------------------------------------------------------------------------------------
// Resolution of one load: the chain of files being resolved (for cycles) and the counters.

class Resolver {
 public:
  Resolver(const std::string& explicit_root, int& files_loaded)
      : explicit_root_(explicit_root), files_loaded_(files_loaded) {}

  std::vector<fs::path> roots_for(const std::optional<fs::path>& file_dir) const {
    std::vector<fs::path> roots;
    if (!explicit_root_.empty()) add_root(roots, explicit_root_);
    if (file_dir)
      if (auto r = root_above(*file_dir)) add_root(roots, *r);
    add_root(roots, MOEFQ_RECIPE_DIR);
    return roots;
  }

  Document file(const fs::path& path, const std::string& display, const std::string& imported_by) {
    // A file read again in one load (a diamond of imports: two units importing one numerics file)
    // resolves to the same tree: it is parsed and resolved once. Its nodes keep the provenance of
    // the first import (the importing chain shown in messages).
    const std::string key = canonical_key(path);
    if (const auto cached = cache_.find(key); cached != cache_.end()) {
      Document d = cached->second;
      d.name = path.stem().string();
      return d;
    }
    if (++files_loaded_ > kMaxFileLoads)
      fail_plain(display + ": the recipe reads more than " + std::to_string(kMaxFileLoads) +
                 " files through its imports; check them for repeated imports");
    auto source = std::make_shared<Source>(Source{display, imported_by});
    const std::string text = read_text(path, display);
    fs::path dir = path.parent_path();
    if (dir.empty()) dir = ".";
    chain_.emplace_back(canonical_key(path), display);
    Document d;
    try {
      d = parse(text, source, dir, roots_for(dir));
    } catch (...) {
      chain_.pop_back();
      throw;
    }
    chain_.pop_back();
    d.name = path.stem().string();
    cache_.emplace(key, d);
    return d;
  }

  Document text(std::string_view text, const std::string& origin) {
    auto source = std::make_shared<Source>(Source{origin, ""});
    Document d = parse(text, source, ".", roots_for(std::nullopt));
    d.name = fs::path(origin).stem().string();
    return d;
  }

  std::vector<std::string> units(const std::vector<fs::path>& roots) const {
    std::set<std::string> names;
    for (const fs::path& d : unit_dirs(roots)) add_units_in(d, names);
    return {names.begin(), names.end()};
  }

 private:
  Document parse(std::string_view text, std::shared_ptr<const Source> source, const fs::path& dir,
                 std::vector<fs::path> roots) {
    Document doc;
    doc.schema = schema_preamble(text, source->file);
    std::vector<YAML::Node> docs = parse_documents(text, source->file);
    Converter conv(source);
    FileCtx ctx{source, dir, std::move(roots), {}};
    NodePtr body;
    NodePtr imports;
    try {
      if (docs.empty()) {
        body = std::make_shared<Node>();
        body->source = source;
      } else if (docs.size() == 1) {
        body = conv.convert(docs[0], "", 0);
        if (body->is_map())
          if (const Node* im = body->find("imports")) {
            imports = std::make_shared<Node>(*im);
            body = without_key(*body, "imports");
          }
      } else {
        // An imports header, then the body: a mapping (the header's keys come first, the body's
        // win) or a list (then only imports may stand in the header).
        NodePtr header = conv.convert(docs[0], "", 0);
        NodePtr content = conv.convert(docs[1], "", 0);
        if (!header->is_map())
          fail_at(*header, "the first of two YAML documents must be a mapping (imports: ...), got " + show(*header));
        if (const Node* im = header->find("imports")) imports = std::make_shared<Node>(*im);
        if (content->is_list()) {
          for (const MapItem& it : header->map)
            if (it.key != "imports")
              fail_at_key(*header, it, "unknown key " + in_quotes(it.key) +
                                           " before a list body (only imports: may stand there)");
          body = content;
        } else if (content->is_map() || content->is_null()) {
          auto merged = std::make_shared<Node>(*without_key(*header, "imports"));
          merged->kind = Node::Kind::kMap;
          MapSetter setter(*merged);
          for (const MapItem& it : content->map) setter.set(it);
          body = merged;
        } else {
          fail_at(*content, "the second YAML document must be a mapping or a list, got " + show(*content));
        }
      }
    } catch (const YAML::Exception& e) {
      fail_plain(source->file + ": cannot read the YAML: " + e.msg);
    }
    if (imports) read_imports(*imports, ctx);
    doc.root = resolve(body, ctx, /*at_root=*/true);
    return doc;
  }

  // `imports: {name: path, ...}`: each path found under the roots, loaded and resolved.
  void read_imports(const Node& imports, FileCtx& ctx) {
    if (imports.is_null()) return;
    if (!imports.is_map())
      fail_at(imports, "must be a mapping of names to config paths (nvfp4: configs/numerics/nvfp4), got " +
                           show(imports));
    for (const MapItem& it : imports.map) {
      const Node& v = *it.value;
      if (!v.is_scalar() || v.scalar.empty())
        fail_at(v, "must be a config path such as configs/numerics/nvfp4, got " + show(v));
      const fs::path found = find_import(v, ctx);
      Document d = import_file(found, v, ctx);
      if (d.schema.empty())
        fail_at(v, found.string() + " has no '# modelopt-schema: ...' comment; an imported snippet must "
                                    "declare its schema (e.g. modelopt.torch.quantization.config."
                                    "QuantizerAttributeConfig)");
      ctx.imports[it.key] = Imported{d.root, d.schema};
    }
  }

  fs::path find_import(const Node& v, const FileCtx& ctx) const {
    const std::string p = v.scalar;
    std::vector<std::string> candidates;
    if (has_yaml_suffix(p)) candidates = {p};
    else candidates = {p + ".yml", p + ".yaml"};
    std::vector<fs::path> bases;
    if (fs::path(p).is_absolute()) bases.emplace_back();
    else bases = ctx.roots;
    for (const fs::path& b : bases)
      for (const std::string& c : candidates) {
        const fs::path f = b.empty() ? fs::path(c) : (b / c).lexically_normal();
        if (is_regular(f)) return f;
      }
    std::string looked;
    for (const fs::path& b : bases) looked += (looked.empty() ? "" : ", ") + (b.empty() ? p : b.string());
    fail_at(v, "cannot find " + in_quotes(p) + " (.yml or .yaml) under the recipe roots (" + looked +
                   "); give --recipe-root DIR, the directory that holds configs/");
  }

  // Loads an imported file, checking the chain for a cycle first. `site` is the node that names it.
  Document import_file(const fs::path& path, const Node& site, const FileCtx& ctx) {
    const std::string key = canonical_key(path);
    for (size_t i = 0; i < chain_.size(); ++i) {
      if (chain_[i].first != key) continue;
      std::string cycle;
      for (size_t j = i; j < chain_.size(); ++j) cycle += chain_[j].second + " -> ";
      fail_at(site, "import cycle: " + cycle + path.string() + "; remove one of the imports");
    }
    if (chain_.size() >= kMaxImportDepth)
      fail_at(site, "imports nest more than " + std::to_string(kMaxImportDepth) + " files deep");
    std::string by = origin_of(site);
    if (!ctx.source->imported_by.empty()) by += ", imported by " + ctx.source->imported_by;
    return file(path, path.string(), by);
  }

  // A moefq unit by name: always a list of quant_cfg entries.
  NodePtr unit_entries(const Node& site, const FileCtx& ctx) {
    if (!site.is_scalar())
      fail_at(site, "must be a unit name (such as moe_dispatch_fp8) or a name declared under imports:, got " +
                        show(site));
    const std::string name = strip_yaml_suffix(site.scalar);
    if (!plain_unit_name(name))
      fail_at(site, in_quotes(site.scalar) + " is not a unit name; name a unit by its file stem (such as "
                                         "moe_dispatch_fp8), or declare a path under imports:");
    std::vector<fs::path> dirs{ctx.dir};
    for (const fs::path& d : unit_dirs(ctx.roots)) dirs.push_back(d);
    const std::optional<fs::path> found = find_unit(name, dirs);
    if (!found) {
      std::set<std::string> units;
      std::string looked;
      for (const fs::path& d : dirs) {
        add_units_in(d, units);
        looked += (looked.empty() ? "" : ", ") + d.string();
      }
      std::string declared;
      for (const auto& [k, v] : ctx.imports) declared += (declared.empty() ? "" : ", ") + k;
      fail_at(site, "unknown unit " + in_quotes(name) + " (not declared under imports:" +
                        (declared.empty() ? std::string(" (none are)") : " (declared: " + declared + ")") +
                        "; looked for " + name + ".yaml in " + looked +
                        "; units: " + join_few({units.begin(), units.end()}, kUnitsNamed) + ")");
    }
    Document d = import_file(*found, site, ctx);
    const Node& r = *d.root;
    if (r.is_list()) return d.root;
    if (r.is_map() && r.find("quantizer_name")) {
      auto l = std::make_shared<Node>();
      l->kind = Node::Kind::kList;
      l->source = r.source;
      l->line = r.line;
      l->list.push_back(d.root);
      return l;
    }
    if (r.is_map())
      if (const Node* qc = r.find("quant_cfg")) {
        if (qc->is_list() || qc->is_null()) {
          auto l = std::make_shared<Node>(*qc);
          l->kind = Node::Kind::kList;
          return l;
        }
        if (qc->is_map()) {
          // The dict form: each pattern becomes a single-key entry, as Model Optimizer reads it.
          auto l = std::make_shared<Node>();
          l->kind = Node::Kind::kList;
          l->source = qc->source;
          l->where = qc->where;
          l->line = qc->line;
          for (const MapItem& it : qc->map) {
            auto e = std::make_shared<Node>();
            e->kind = Node::Kind::kMap;
            e->source = qc->source;
            e->where = qc->where;
            e->line = it.key_line;
            e->map.push_back(it);
            l->list.push_back(e);
          }
          return l;
        }
      }
    fail_at(site, "unit " + found->string() + " is not a list of quant_cfg entries (nor a recipe with quant_cfg)");
  }

  const Imported& lookup(const Node& ref, const FileCtx& ctx) const {
    auto it = ctx.imports.find(ref.scalar);
    MOEFQ_ASSERT(it != ctx.imports.end(), "lookup of an undeclared import");
    return it->second;
  }

  bool declared(const Node& ref, const FileCtx& ctx) const {
    return ref.is_scalar() && ctx.imports.count(ref.scalar) > 0;
  }

  NodePtr resolve(const NodePtr& n, const FileCtx& ctx, bool at_root) {
    if (n->is_map()) return resolve_map(n, ctx, at_root);
    if (n->is_list()) return resolve_list(n, ctx);
    return n;
  }

  // {$import: name or [names], ...}: the imported mappings merged in order, then the mapping's
  // own keys on top. At a document's root, moefq unit names (not declared under imports:) put
  // their entries before quant_cfg's.
  NodePtr resolve_map(const NodePtr& n, const FileCtx& ctx, bool at_root) {
    const Node* ref = n->find(kImportKey);
    auto out = std::make_shared<Node>(*n);
    out->map.clear();
    MapSetter setter(*out);
    std::vector<NodePtr> unit_lists;
    if (ref) {
      std::vector<const Node*> refs;
      if (ref->is_list())
        for (const NodePtr& r : ref->list) refs.push_back(r.get());
      else
        refs.push_back(ref);
      for (const Node* r : refs) {
        if (declared(*r, ctx)) {
          const Imported& im = lookup(*r, ctx);
          if (!im.data->is_map())
            fail_at(*r, "$import " + in_quotes(r->scalar) + " here merges into a mapping, but it is " + show(*im.data) +
                            " (schema " + short_schema(im.schema) + "); import a list where a list is expected");
          for (const MapItem& it : im.data->map) setter.set(it);
        } else if (at_root) {
          unit_lists.push_back(unit_entries(*r, ctx));
        } else {
          if (!r->is_scalar()) fail_at(*r, "must be a name declared under imports:, got " + show(*r));
          std::vector<fs::path> dirs{ctx.dir};
          for (const fs::path& d : unit_dirs(ctx.roots)) dirs.push_back(d);
          if (plain_unit_name(strip_yaml_suffix(r->scalar)) && find_unit(strip_yaml_suffix(r->scalar), dirs))
            fail_at(*r, "the unit " + in_quotes(r->scalar) + " can only be imported as a list entry of its own "
                        "(- $import: " + r->scalar + ") or at the top of a recipe; put quantizer_name, enable and "
                        "cfg in an entry of their own");
          std::string declared_names;
          for (const auto& [k, v] : ctx.imports) declared_names += (declared_names.empty() ? "" : ", ") + k;
          fail_at(*r, "unknown $import reference " + in_quotes(r->scalar) + " (declared under imports: " +
                          (declared_names.empty() ? std::string("none") : declared_names) +
                          "); declare it, e.g. imports: {" + r->scalar + ": configs/numerics/" + r->scalar + "}");
        }
      }
    }
    for (const MapItem& it : n->map) {
      if (it.key == kImportKey) continue;
      MapItem r = it;
      r.value = resolve(it.value, ctx, false);
      setter.set(std::move(r));
    }
    if (!unit_lists.empty()) prepend_to_quant_cfg(*out, unit_lists, *ref);
    return out;
  }

  void prepend_to_quant_cfg(Node& root, const std::vector<NodePtr>& unit_lists, const Node& site) {
    auto list = std::make_shared<Node>();
    list->kind = Node::Kind::kList;
    list->source = root.source;
    list->where = "quant_cfg";
    list->line = site.line;
    for (const NodePtr& l : unit_lists)
      for (const NodePtr& e : l->list) push(*list, e, site);
    for (MapItem& it : root.map) {
      if (it.key != "quant_cfg") continue;
      if (it.value->is_map())
        fail_at(*it.value, "the dict form of quant_cfg cannot follow a top-level $import of units; write "
                           "quant_cfg as a list of entries");
      if (it.value->is_list()) {
        list->where = it.value->where;
        list->line = it.value->line;
        for (const NodePtr& e : it.value->list) push(*list, e, site);
      } else if (!it.value->is_null()) {
        return;  // the schema reports a quant_cfg that is neither a list nor a mapping
      }
      it.value = list;
      return;
    }
    root.map.push_back(MapItem{"quant_cfg", site.line, list});
  }

  void push(Node& list, const NodePtr& e, const Node& site) {
    if (list.list.size() >= kMaxListItems)
      fail_at(site, "the list expands to more than " + std::to_string(kMaxListItems) + " entries; check its imports");
    list.list.push_back(e);
  }

  // A list element {$import: name} (the only key): a list snippet is spliced in, an entry
  // snippet appended. Undeclared names are moefq units (lists of entries).
  NodePtr resolve_list(const NodePtr& n, const FileCtx& ctx) {
    auto out = std::make_shared<Node>(*n);
    out->list.clear();
    for (const NodePtr& el : n->list) {
      if (!(el->is_map() && el->map.size() == 1 && el->map[0].key == kImportKey)) {
        push(*out, resolve(el, ctx, false), *el);
        continue;
      }
      const Node& ref = *el->map[0].value;
      if (!declared(ref, ctx)) {
        const NodePtr entries = unit_entries(ref, ctx);
        for (const NodePtr& e : entries->list) push(*out, e, ref);
        continue;
      }
      const Imported& im = lookup(ref, ctx);
      if (im.schema == kListSchema && im.data->is_list()) {
        for (const NodePtr& e : im.data->list) push(*out, e, ref);
      } else if (im.schema == kEntrySchema && im.data->is_map()) {
        push(*out, im.data, ref);
      } else {
        fail_at(ref, "$import " + in_quotes(ref.scalar) + " in a list has schema " + short_schema(im.schema) +
                         " and is " + show(*im.data) + "; a list takes QuantizerCfgListConfig snippets (spliced) "
                         "or QuantizerCfgEntry snippets (appended)");
      }
    }
    return out;
  }

  std::string explicit_root_;
  int& files_loaded_;
  std::vector<std::pair<std::string, std::string>> chain_;  // (canonical path, display) being resolved
  std::map<std::string, Document> cache_;  // canonical path -> the file resolved, for files read again
};

}  // namespace

Loader::Loader(std::string recipe_root) : explicit_root_(std::move(recipe_root)) {
  if (!explicit_root_.empty() && !is_dir(explicit_root_))
    fail_plain("--recipe-root " + explicit_root_ + ": not a directory");
}

Document Loader::load(const std::string& path_or_name) {
  if (path_or_name.empty())
    fail_plain("empty recipe name; give a file, a path under a recipe root or a unit name such as moe_dispatch_fp8");
  Resolver res(explicit_root_, files_loaded_);
  const fs::path given = path_or_name;
  if (is_dir(given))
    fail_plain(path_or_name + ": is a directory; give a recipe file (the metadata.yml + quantize.yml directory "
                              "form is not read)");
  // Something that exists but is not a regular file (a FIFO, a device) is refused by read_text,
  // naming what it is, rather than taken for a unit name.
  std::error_code ec;
  if (fs::exists(fs::status(given, ec)) && !is_regular(given)) read_text(given, path_or_name);
  std::optional<fs::path> found;
  std::vector<std::string> candidates{path_or_name};
  if (!has_yaml_suffix(path_or_name)) candidates = {path_or_name, path_or_name + ".yml", path_or_name + ".yaml"};
  for (const std::string& c : candidates)
    if (!found && is_regular(c)) found = fs::path(c);
  // A path relative to a recipe root (general/ptq/x, configs/ptq/presets/model/fp8).
  if (!found && !given.is_absolute() && path_or_name.find('/') != std::string::npos)
    for (const fs::path& r : res.roots_for(std::nullopt))
      for (const std::string& c : candidates)
        if (!found && is_regular(r / c)) found = (r / c).lexically_normal();
  // A unit name, looked up from the current directory.
  if (!found && path_or_name.find('/') == std::string::npos) {
    const std::string name = strip_yaml_suffix(path_or_name);
    std::vector<fs::path> dirs{"."};
    for (const fs::path& d : unit_dirs(res.roots_for(std::nullopt))) dirs.push_back(d);
    if (plain_unit_name(name)) found = find_unit(name, dirs);
  }
  if (!found)
    fail_plain(in_quotes(path_or_name) + " is neither a recipe file, nor a path under a recipe root, nor a unit "
                                      "(units: " + join_few(unit_names(), kUnitsNamed) + ")");
  return res.file(*found, found->string(), "");
}

Document Loader::load_text(std::string_view text, const std::string& origin) {
  Resolver res(explicit_root_, files_loaded_);
  return res.text(text, origin.empty() ? std::string("<recipe>") : origin);
}

std::vector<std::string> Loader::unit_names() const {
  int unused = 0;
  Resolver res(explicit_root_, unused);
  return res.units(res.roots_for(std::nullopt));
}

}  // namespace moefq::recipe
