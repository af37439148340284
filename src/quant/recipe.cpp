#include "moefq/recipe.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <set>
#include <sstream>

#include "moefq/errors.h"
#include "moefq/fileio.h"

#ifndef MOEFQ_RECIPE_DIR
#define MOEFQ_RECIPE_DIR "recipes"
#endif

namespace moefq {
namespace {

namespace fs = std::filesystem;

// A recipe is a few hundred bytes; the limits keep hostile input (a fuzzer, a wrong file) cheap.
constexpr size_t kMaxRecipeBytes = size_t{1} << 20;
constexpr size_t kMaxEntries = 100000;
constexpr size_t kMaxImportDepth = 64;

constexpr const char* kTopKeys = "$import, quant_cfg, algorithm";
constexpr const char* kEntryKeys = "quantizer_name, enable, cfg, $import";
constexpr const char* kCfgKeys = "num_bits, axis, block_sizes, constant_amax, amax";
constexpr const char* kBlockKeys = "-1, type, scale_bits";
constexpr const char* kNumBitsChoices = "e4m3, e2m1, 8, [4, 3] or [2, 1]";
constexpr const char* kScaleBitsChoices = "e4m3, e8m0, [4, 3] or [8, 0]";
constexpr const char* kSupportedCombos =
    "e4m3 (fp8), 8 (int8), e2m1 with {-1: 16, scale_bits: e4m3} (nvfp4), e4m3 with {-1: 32, "
    "scale_bits: e8m0} (mxfp8), e2m1 with {-1: 32, scale_bits: e8m0} (mxfp4)";

[[noreturn]] void fail(const std::string& message) { MOEFQ_FAIL(ErrorKind::kBadInput, message); }

// User text echoed in a message: at most 60 characters, non-printables escaped.
std::string printable(std::string_view s) {
  std::string out;
  const size_t n = std::min<size_t>(s.size(), 60);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7F) {
      out += static_cast<char>(c);
    } else {
      static const char* kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (s.size() > n) out += "...";
  return out;
}

std::string in_quotes(std::string_view s) { return "'" + printable(s) + "'"; }

std::string line_of(const YAML::Node& n) {
  if (!n.IsDefined()) return "";
  const YAML::Mark m = n.Mark();
  return m.line >= 0 ? " (line " + std::to_string(m.line + 1) + ")" : "";
}

// "null", "a list", "a mapping" or the quoted scalar, for "got ..." in messages.
std::string show(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "null";
  if (n.IsScalar()) return in_quotes(n.Scalar());
  if (n.IsSequence()) {
    std::string s = "[";
    size_t i = 0;
    for (const auto& el : n) {
      if (i) s += ", ";
      if (i++ == 4) return s + "...]";
      s += el.IsScalar() ? printable(el.Scalar()) : show(el);
    }
    return s + "]";
  }
  return "a mapping";
}

std::optional<long> to_int(const YAML::Node& n) {
  if (!n.IsScalar()) return std::nullopt;
  std::string_view s = n.Scalar();
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  long v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

// A YAML float (1.5, 1e3, .inf, .nan); nullopt when the scalar is not a number.
std::optional<double> to_double(const YAML::Node& n) {
  if (!n.IsScalar()) return std::nullopt;
  std::string s = n.Scalar();
  bool neg = false;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
    neg = s[0] == '-';
    s.erase(0, 1);
  }
  std::string lower = s;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == ".inf") return neg ? -HUGE_VAL : HUGE_VAL;
  if (lower == ".nan") return std::nan("");
  if (s.empty() || !(std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.')) return std::nullopt;
  double v = 0.0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ptr != s.data() + s.size()) return std::nullopt;
  if (ec == std::errc::result_out_of_range) v = HUGE_VAL;  // too large (or too small) for double
  else if (ec != std::errc()) return std::nullopt;
  return neg ? -v : v;
}

// Parses a document without building it (counting documents).
class IgnoreEvents : public YAML::EventHandler {
 public:
  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

// A map's items in document order, with the keys as strings.
struct Item {
  std::string key;
  YAML::Node key_node;
  YAML::Node value;
};

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

// Where `$import` names are looked for after the importing file's own directory.
std::vector<fs::path> search_dirs() {
  std::vector<fs::path> dirs;
  for (const std::string& d : split_path_list(std::getenv("MOEFQ_RECIPE_PATH"))) dirs.emplace_back(d);
  dirs.emplace_back(MOEFQ_RECIPE_DIR);
  return dirs;
}

void add_units_in(const fs::path& dir, std::set<std::string>& names) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    std::error_code ec2;
    if (it->path().extension() == ".yaml" && it->is_regular_file(ec2))
      names.insert(it->path().stem().string());
  }
}

std::string join_few(const std::vector<std::string>& names, size_t few) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < few; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > few) s += " and " + std::to_string(names.size() - few) + " more";
  return s;
}

bool is_regular(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

std::string canonical_key(const fs::path& p) {
  std::error_code ec;
  fs::path c = fs::weakly_canonical(p, ec);
  if (ec) c = fs::absolute(p, ec).lexically_normal();
  return c.string();
}

// A regular file only (a FIFO or device is refused by name, without a blocking open), at most
// kMaxRecipeBytes.
std::string read_file_text(const fs::path& path, const std::string& display) {
  return read_regular_file(path.string(), kMaxRecipeBytes, "recipe " + display);
}

// State shared by one load: finished files (a unit imported twice is read once) and the chain
// of files being parsed, for cycle detection.
struct Loader {
  std::map<std::string, std::vector<RecipeEntry>> done;  // canonical path -> expanded entries
  std::vector<std::pair<std::string, std::string>> chain;  // (canonical path, display name)

  Recipe parse_text(std::string_view text, const std::string& origin, const fs::path& base_dir);
  const std::vector<RecipeEntry>& load_file(const fs::path& path, const std::string& display);
};

// Parses one document. Error messages read "<origin>: <where>: <what> (line N)".
class DocParser {
 public:
  DocParser(Loader& loader, std::string origin, fs::path base_dir)
      : loader_(loader), origin_(std::move(origin)), base_dir_(std::move(base_dir)) {}

  Recipe parse(std::string_view text) {
    try {
      return parse_root(load_document(text));
    } catch (const Error&) {
      throw;
    } catch (const std::bad_alloc&) {
      throw;
    } catch (const YAML::Exception& e) {
      fail(origin_ + ": cannot read the YAML: " + e.msg);
    } catch (const std::exception& e) {
      fail(origin_ + ": cannot read the recipe: " + e.what());
    }
  }

 private:
  [[noreturn]] void fail_at(const YAML::Node& at, const std::string& where,
                            const std::string& what) const {
    fail(origin_ + (where.empty() ? "" : ": " + where) + ": " + what + line_of(at));
  }

  YAML::Node load_document(std::string_view text) const {
    if (text.size() > kMaxRecipeBytes)
      fail(origin_ + ": " + std::to_string(text.size()) +
           " bytes is too large for a recipe (limit 1 MiB)");
    // Count the documents with an event parser that stops at two: YAML::LoadAll never returns
    // on some malformed input (a stray ',' makes it yield empty documents forever).
    int num_docs = 0;
    YAML::Node root;
    try {
      std::istringstream in{std::string(text)};
      YAML::Parser parser(in);
      IgnoreEvents ignore;
      while (num_docs < 2 && parser.HandleNextDocument(ignore)) ++num_docs;
      root = YAML::Load(std::string(text));
    } catch (const YAML::Exception& e) {
      std::string m = origin_ + ": not valid YAML: " + e.msg;
      if (e.mark.line >= 0)
        m += " (line " + std::to_string(e.mark.line + 1) + ", column " +
             std::to_string(e.mark.column + 1) + ")";
      if (e.msg.find("anchor") != std::string::npos)
        m += "; a pattern that starts with '*' must be quoted: quantizer_name: '*combine_quantizer'";
      fail(m);
    }
    if (num_docs > 1)
      fail(origin_ + ": holds more than one YAML document, or text after the first that is not "
                     "YAML (a stray ',' or ']'); a recipe is one mapping (remove any '---')");
    if (num_docs == 0 || root.IsNull())
      fail(origin_ + ": is empty; a recipe must be a mapping with quant_cfg (and optionally "
                     "$import, algorithm)");
    return root;
  }

  std::vector<Item> items(const YAML::Node& map, const std::string& where) const {
    std::vector<Item> out;
    std::set<std::string> seen;
    for (const auto& kv : map) {
      const YAML::Node key = kv.first;
      if (!key.IsScalar())
        fail_at(key, where, "a key must be a plain name, got " + show(key));
      if (!seen.insert(key.Scalar()).second)
        fail_at(key, where, "duplicate key " + in_quotes(key.Scalar()) + "; keep one");
      out.push_back({key.Scalar(), key, kv.second});
    }
    return out;
  }

  Recipe parse_root(const YAML::Node& root) {
    if (!root.IsMap())
      fail_at(root, "", "a recipe must be a mapping with quant_cfg (and optionally $import, "
                        "algorithm), got " + (root.IsSequence() ? std::string("a list") : show(root)));
    Recipe recipe;
    recipe.name = fs::path(origin_).stem().string();
    const std::vector<Item> top = items(root, "");
    const Item* imports = nullptr;
    const Item* quant_cfg = nullptr;
    for (const Item& it : top) {
      if (it.key == "$import") {
        imports = &it;
      } else if (it.key == "quant_cfg") {
        quant_cfg = &it;
      } else if (it.key == "algorithm") {
        if (!it.value.IsScalar() || it.value.Scalar() != "max")
          fail_at(it.value, "algorithm", show(it.value) +
                                             " is not supported; the only calibration algorithm "
                                             "is max (write algorithm: max or leave it out)");
        recipe.algorithm = "max";
      } else {
        fail_at(it.key_node, "", "unknown top-level key " + in_quotes(it.key) + " (expected " +
                                     kTopKeys + ")");
      }
    }
    // Top-level imports come first, whatever the key order in the file.
    if (imports) splice_imports(imports->value, "$import", recipe.entries);
    if (quant_cfg) parse_quant_cfg(quant_cfg->value, recipe.entries);
    return recipe;
  }

  void parse_quant_cfg(const YAML::Node& list, std::vector<RecipeEntry>& out) {
    if (list.IsNull()) return;
    if (!list.IsSequence())
      fail_at(list, "quant_cfg",
              "must be a list of entries (- quantizer_name: '...'), got " +
                  (list.IsMap() ? std::string("a mapping; the dict form of quant_cfg is not "
                                              "supported, write one list entry per pattern")
                                : show(list)));
    size_t idx = 0;
    for (const auto& el : list) {
      parse_entry(el, "quant_cfg[" + std::to_string(idx) + "]", out);
      ++idx;
    }
  }

  void parse_entry(const YAML::Node& node, const std::string& where,
                   std::vector<RecipeEntry>& out) {
    if (!node.IsMap())
      fail_at(node, where, "an entry must be a mapping with quantizer_name and enable and/or cfg "
                           "(or $import), got " +
                               (node.IsSequence() ? std::string("a list") : show(node)));
    const std::vector<Item> keys = items(node, where);
    const Item* name = nullptr;
    const Item* enable = nullptr;
    const Item* cfg = nullptr;
    const Item* import = nullptr;
    for (const Item& it : keys) {
      if (it.key == "quantizer_name") name = &it;
      else if (it.key == "enable") enable = &it;
      else if (it.key == "cfg") cfg = &it;
      else if (it.key == "$import") import = &it;
      else
        fail_at(it.key_node, where, "unknown key " + in_quotes(it.key) + " (expected " + kEntryKeys +
                                        ")");
    }
    if (import) {
      if (keys.size() != 1)
        fail_at(node, where, "an $import entry takes no other keys; put quantizer_name, enable "
                             "and cfg in an entry of their own");
      splice_imports(import->value, where + ".$import", out);
      return;
    }
    if (!name) fail_at(node, where, "missing quantizer_name (a wildcard such as '*combine_quantizer')");
    if (!name->value.IsScalar() || name->value.Scalar().empty())
      fail_at(name->value, where + ".quantizer_name",
              "must be a non-empty wildcard pattern such as '*combine_quantizer', got " +
                  show(name->value));
    RecipeEntry entry;
    entry.pattern = name->value.Scalar();
    entry.origin = origin_ + ": " + where;
    if (enable) entry.enable = parse_bool(enable->value, where + ".enable");
    if (cfg) entry.cfg = parse_cfg(cfg->value, where + ".cfg");
    if (!enable && !cfg)
      fail_at(node, where, "the entry for " + in_quotes(entry.pattern) +
                               " sets neither enable nor cfg; add enable: true|false or a cfg");
    push(out, std::move(entry));
  }

  void push(std::vector<RecipeEntry>& out, RecipeEntry entry) const {
    if (out.size() >= kMaxEntries)
      fail(origin_ + ": the recipe expands to more than " + std::to_string(kMaxEntries) +
           " entries; check its imports");
    out.push_back(std::move(entry));
  }

  bool parse_bool(const YAML::Node& n, const std::string& where) const {
    if (n.IsScalar() && n.Tag() != "!") {
      std::string v = n.Scalar();
      for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (v == "true" || v == "yes" || v == "on") return true;
      if (v == "false" || v == "no" || v == "off") return false;
    }
    fail_at(n, where, "must be true or false (unquoted), got " + show(n));
  }

  // ---- cfg -----------------------------------------------------------------------------------
  // num_bits and scale_bits both name an element format; the canonical spelling is returned.
  std::string parse_bits(const YAML::Node& n, const std::string& where, bool scale) const {
    const char* choices = scale ? kScaleBitsChoices : kNumBitsChoices;
    std::string got;
    if (n.IsScalar()) {
      got = n.Scalar();
      if (got == "e4m3") return "e4m3";
      if (!scale && got == "e2m1") return "e2m1";
      if (!scale && to_int(n) == 8) return "8";
      if (scale && got == "e8m0") return "e8m0";
    } else if (n.IsSequence() && n.size() == 2) {
      const auto e = to_int(n[0]);
      const auto m = to_int(n[1]);
      if (e && m) {
        if (*e == 4 && *m == 3) return "e4m3";
        if (!scale && *e == 2 && *m == 1) return "e2m1";
        if (scale && *e == 8 && *m == 0) return "e8m0";
      }
    }
    fail_at(n, where, "unknown format " + show(n) + " (expected " + choices + ")");
  }

  struct Blocks {
    long size = 0;
    std::string scale_bits;
    YAML::Node node;
  };

  std::optional<Blocks> parse_blocks(const YAML::Node& n, const std::string& where) const {
    if (n.IsNull()) return std::nullopt;
    if (!n.IsMap())
      fail_at(n, where, "must be a mapping such as {-1: 16, type: dynamic, scale_bits: e4m3}, got " +
                            (n.IsSequence() ? std::string("a list") : show(n)));
    Blocks b;
    b.node = n;
    bool has_type = false;
    for (const Item& it : items(n, where)) {
      if (it.key == "-1") {
        const auto v = to_int(it.value);
        if (!v || (*v != 16 && *v != 32))
          fail_at(it.value, where + ".-1", "block size " + show(it.value) +
                                               " is not supported (16 for nvfp4, 32 for mxfp8 "
                                               "and mxfp4)");
        b.size = *v;
      } else if (it.key == "type") {
        if (!it.value.IsScalar() || it.value.Scalar() != "dynamic")
          fail_at(it.value, where + ".type",
                  show(it.value) + " is not supported; write type: dynamic (block scales are "
                                   "computed from each block; static block scales do not exist "
                                   "here)");
        has_type = true;
      } else if (it.key == "scale_bits") {
        b.scale_bits = parse_bits(it.value, where + ".scale_bits", true);
      } else if (to_int(it.key_node)) {
        fail_at(it.key_node, where, "only the last dimension can be blocked: use key -1, not " +
                                        in_quotes(it.key));
      } else {
        fail_at(it.key_node, where, "unknown key " + in_quotes(it.key) + " (expected " + kBlockKeys +
                                        ")");
      }
    }
    if (b.size == 0) fail_at(n, where, "missing the block size: add -1: 16 or -1: 32");
    if (!has_type) fail_at(n, where, "missing type: dynamic");
    if (b.scale_bits.empty()) fail_at(n, where, "missing scale_bits: e4m3 (nvfp4) or e8m0 (mx)");
    return b;
  }

  QuantSpec parse_cfg(const YAML::Node& n, const std::string& where) const {
    if (!n.IsMap())
      fail_at(n, where, "must be a mapping with num_bits (and optionally axis, block_sizes, "
                        "constant_amax, amax), got " +
                            (n.IsSequence() ? std::string("a list") : show(n)));
    std::string bits;
    std::optional<Blocks> blocks;
    std::optional<float> constant_amax;
    std::optional<std::string> amax;
    YAML::Node amax_node;
    for (const Item& it : items(n, where)) {
      const std::string at = where + "." + it.key;
      if (it.key == "num_bits") {
        bits = parse_bits(it.value, at, false);
      } else if (it.key == "axis") {
        if (!it.value.IsNull())
          fail_at(it.value, at, "per-channel quantization (axis " + show(it.value) +
                                    ") is unsupported; remove axis or write axis: null "
                                    "(per-tensor)");
      } else if (it.key == "block_sizes") {
        blocks = parse_blocks(it.value, at);
      } else if (it.key == "constant_amax") {
        const auto v = to_double(it.value);
        if (!v) fail_at(it.value, at, show(it.value) + " is not a number; give a finite number > 0 "
                                                       "(e.g. 2688)");
        if (!(std::isfinite(*v) && *v > 0.0 && *v <= 3.4028234663852886e38) ||
            !(static_cast<float>(*v) > 0.0f))
          fail_at(it.value, at, "must be a finite number > 0 (a float32), got " + show(it.value));
        constant_amax = static_cast<float>(*v);
      } else if (it.key == "amax") {
        if (!it.value.IsScalar() || (it.value.Scalar() != "calibrated" &&
                                     it.value.Scalar() != "dynamic" &&
                                     it.value.Scalar() != "constant"))
          fail_at(it.value, at, "unknown amax source " + show(it.value) +
                                    " (expected calibrated or dynamic; for a fixed value set "
                                    "constant_amax)");
        amax = it.value.Scalar();
        amax_node = it.value;
      } else {
        fail_at(it.key_node, where,
                "unknown key " + in_quotes(it.key) + " (expected " + kCfgKeys + ")" +
                    (it.key == "enable" ? "; enable goes beside cfg in the entry, not inside it"
                                        : ""));
      }
    }
    if (bits.empty()) fail_at(n, where, std::string("missing num_bits (") + kNumBitsChoices + ")");

    QuantSpec spec;
    const long bsize = blocks ? blocks->size : 0;
    const std::string scale = blocks ? blocks->scale_bits : "";
    if (!blocks && bits == "e4m3") spec.format = Format::kFp8;
    else if (!blocks && bits == "8") spec.format = Format::kInt8;
    else if (bits == "e2m1" && bsize == 16 && scale == "e4m3") spec.format = Format::kNvfp4;
    else if (bits == "e4m3" && bsize == 32 && scale == "e8m0") spec.format = Format::kMxfp8;
    else if (bits == "e2m1" && bsize == 32 && scale == "e8m0") spec.format = Format::kMxfp4;
    else
      fail_at(n, where, "unsupported combination: num_bits " + bits +
                            (blocks ? " with block_sizes {-1: " + std::to_string(bsize) +
                                          ", scale_bits: " + scale + "}"
                                    : std::string(" without block_sizes")) +
                            " (supported: " + kSupportedCombos + ")");
    spec.block_size = static_cast<int>(bsize);

    if (constant_amax) {
      if (amax && *amax != "constant")
        fail_at(amax_node, where + ".amax",
                "constant_amax and amax: " + *amax + " contradict each other; remove one");
      if (!format_has_global_amax(spec.format))
        fail_at(n, where + ".constant_amax",
                std::string("has no effect on ") + format_name(spec.format) +
                    " (block scales only, no global amax); remove it");
      spec.amax_source = AmaxSource::kConstant;
      spec.constant_amax = *constant_amax;
    } else if (amax && *amax == "constant") {
      fail_at(amax_node, where + ".amax", "amax: constant needs constant_amax: <value>; set it");
    } else if (amax && *amax == "dynamic") {
      spec.amax_source = AmaxSource::kDynamic;
    }
    spec.validate(origin_ + ": " + where);
    return spec;
  }

  // ---- imports -------------------------------------------------------------------------------
  void splice_imports(const YAML::Node& n, const std::string& where, std::vector<RecipeEntry>& out) {
    if (n.IsScalar()) {
      splice_one(n, where, out);
    } else if (n.IsSequence()) {
      size_t idx = 0;
      for (const auto& el : n) {
        const std::string at = where + "[" + std::to_string(idx++) + "]";
        if (!el.IsScalar()) fail_at(el, at, "must be a unit name, got " + show(el));
        splice_one(el, at, out);
      }
    } else {
      fail_at(n, where, "must be a unit name or a list of unit names, got " + show(n));
    }
  }

  void splice_one(const YAML::Node& n, const std::string& where, std::vector<RecipeEntry>& out) {
    std::string name = n.Scalar();
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".yaml") == 0) name.resize(name.size() - 5);
    const bool plain = !name.empty() && name[0] != '.' &&
                       std::all_of(name.begin(), name.end(), [](char c) {
                         return std::isalnum(static_cast<unsigned char>(c)) || c == '_' ||
                                c == '-' || c == '.';
                       });
    if (!plain)
      fail_at(n, where, show(n) + " is not a unit name; name a unit by its file stem (such as "
                                  "moe_dispatch_fp8) and add its directory to MOEFQ_RECIPE_PATH");
    std::vector<fs::path> dirs{base_dir_};
    for (const fs::path& d : search_dirs()) dirs.push_back(d);
    fs::path found;
    for (const fs::path& d : dirs) {
      const fs::path candidate = (d / (name + ".yaml")).lexically_normal();
      if (is_regular(candidate)) {
        found = candidate;
        break;
      }
    }
    if (found.empty()) {
      std::set<std::string> units;
      std::string looked;
      for (const fs::path& d : dirs) {
        add_units_in(d, units);
        looked += (looked.empty() ? "" : ", ") + d.string();
      }
      fail_at(n, where, "unknown unit " + in_quotes(name) + " (looked for " + name + ".yaml in " +
                            looked + "; available: " +
                            join_few({units.begin(), units.end()}, 12) + ")");
    }
    const std::string key = canonical_key(found);
    for (size_t i = 0; i < loader_.chain.size(); ++i) {
      if (loader_.chain[i].first != key) continue;
      std::string cycle;
      for (size_t j = i; j < loader_.chain.size(); ++j) cycle += loader_.chain[j].second + " -> ";
      fail_at(n, where, "import cycle: " + cycle + found.string() + "; remove one of the imports");
    }
    if (loader_.chain.size() >= kMaxImportDepth)
      fail_at(n, where, "imports nest more than " + std::to_string(kMaxImportDepth) + " deep");
    const std::vector<RecipeEntry>* entries = nullptr;
    try {
      entries = &loader_.load_file(found, found.string());
    } catch (const Error& e) {
      throw Error(e.kind(), std::string(e.what()) + " (imported by " + origin_ + ": " + where + ")");
    }
    for (const RecipeEntry& e : *entries) push(out, e);
  }

  Loader& loader_;
  std::string origin_;
  fs::path base_dir_;
};

Recipe Loader::parse_text(std::string_view text, const std::string& origin,
                          const fs::path& base_dir) {
  return DocParser(*this, origin.empty() ? "<recipe>" : origin, base_dir).parse(text);
}

const std::vector<RecipeEntry>& Loader::load_file(const fs::path& path, const std::string& display) {
  const std::string key = canonical_key(path);
  if (auto it = done.find(key); it != done.end()) return it->second;
  const std::string text = read_file_text(path, display);
  fs::path base = path.parent_path();
  if (base.empty()) base = ".";
  chain.emplace_back(key, display);
  Recipe r;
  try {
    r = parse_text(text, display, base);
  } catch (...) {
    chain.pop_back();
    throw;
  }
  chain.pop_back();
  return done.emplace(key, std::move(r.entries)).first->second;
}

}  // namespace

Recipe parse_recipe_text(std::string_view yaml_text, std::string_view origin) {
  Loader loader;
  return loader.parse_text(yaml_text, std::string(origin), ".");
}

Recipe load_recipe(const std::string& path_or_unit_name) {
  MOEFQ_CHECK(!path_or_unit_name.empty(), "load_recipe: empty recipe name; give a file or a unit "
                                          "name such as moe_dispatch_fp8");
  fs::path path = path_or_unit_name;
  std::error_code ec;
  // Something that exists but is not a regular file (a FIFO, a directory) is refused by
  // read_file_text, naming what it is, rather than taken for a unit name.
  if (!fs::exists(fs::status(path, ec))) {
    // Not a file: a unit name, looked up like an import from the current directory.
    std::string name = path_or_unit_name;
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".yaml") == 0) name.resize(name.size() - 5);
    path.clear();
    if (name.find('/') == std::string::npos) {
      std::vector<fs::path> dirs{"."};
      for (const fs::path& d : search_dirs()) dirs.push_back(d);
      for (const fs::path& d : dirs) {
        const fs::path candidate = (d / (name + ".yaml")).lexically_normal();
        if (is_regular(candidate)) {
          path = candidate;
          break;
        }
      }
    }
    if (path.empty())
      fail(in_quotes(path_or_unit_name) + " is neither a recipe file nor a unit (available units: " +
           join_few(list_recipe_units(), 12) + ")");
  }
  // The file itself starts the import chain, so a file that imports itself is a cycle.
  Loader loader;
  const std::string display = path.string();
  const std::string text = read_file_text(path, display);
  fs::path base = path.parent_path();
  if (base.empty()) base = ".";
  loader.chain.emplace_back(canonical_key(path), display);
  Recipe recipe = loader.parse_text(text, display, base);
  recipe.name = path.stem().string();
  return recipe;
}

std::vector<std::string> list_recipe_units() {
  std::set<std::string> names;
  for (const fs::path& d : search_dirs()) add_units_in(d, names);
  return {names.begin(), names.end()};
}

bool wildcard_match(std::string_view pattern, std::string_view name) {
  // One token per pattern position: a literal, '?', '*' or a class. A class is found the way
  // fnmatch does: '[', an optional '!', an optional leading ']', then up to the next ']'.
  struct Token {
    enum Kind { kLiteral, kAny, kStar, kClass } kind;
    char c = 0;
    bool negate = false;
    std::string_view set;  // class body without '!'
  };
  std::vector<Token> tokens;
  const size_t n = pattern.size();
  // next_close[i]: the first ']' at or after i (n if none), so each class is found in O(1).
  std::vector<size_t> next_close(n + 1, n);
  for (size_t i = n; i-- > 0;) next_close[i] = pattern[i] == ']' ? i : next_close[i + 1];
  for (size_t i = 0; i < n;) {
    const char c = pattern[i];
    if (c == '*') {
      if (tokens.empty() || tokens.back().kind != Token::kStar) tokens.push_back({Token::kStar, 0, false, {}});
      ++i;
    } else if (c == '?') {
      tokens.push_back({Token::kAny, 0, false, {}});
      ++i;
    } else if (c == '[') {
      size_t j = i + 1;
      const bool negate = j < n && pattern[j] == '!';
      if (negate) ++j;
      const size_t body = j;
      if (j < n && pattern[j] == ']') ++j;
      j = next_close[std::min(j, n)];
      if (j >= n) {
        tokens.push_back({Token::kLiteral, '[', false, {}});
        ++i;
      } else {
        tokens.push_back({Token::kClass, 0, negate, pattern.substr(body, j - body)});
        i = j + 1;
      }
    } else {
      tokens.push_back({Token::kLiteral, c, false, {}});
      ++i;
    }
  }
  const auto one = [](const Token& t, char ch) {
    switch (t.kind) {
      case Token::kLiteral: return t.c == ch;
      case Token::kAny: return true;
      case Token::kClass: {
        bool in = false;
        const std::string_view s = t.set;
        for (size_t k = 0; k < s.size() && !in; ++k) {
          if (k + 2 < s.size() && s[k + 1] == '-') {
            in = s[k] <= ch && ch <= s[k + 2];
            k += 2;
          } else {
            in = s[k] == ch;
          }
        }
        return in != t.negate;
      }
      case Token::kStar: break;
    }
    return false;
  };
  // Greedy match with backtracking to the last star: O(|tokens| * |name|).
  size_t ti = 0, ni = 0, star_ti = SIZE_MAX, star_ni = 0;
  while (ni < name.size()) {
    if (ti < tokens.size() && tokens[ti].kind == Token::kStar) {
      star_ti = ++ti;
      star_ni = ni;
    } else if (ti < tokens.size() && one(tokens[ti], name[ni])) {
      ++ti;
      ++ni;
    } else if (star_ti != SIZE_MAX) {
      ti = star_ti;
      ni = ++star_ni;
    } else {
      return false;
    }
  }
  while (ti < tokens.size() && tokens[ti].kind == Token::kStar) ++ti;
  return ti == tokens.size();
}

std::map<std::string, QuantizerConfig> apply_recipe(const Recipe& recipe,
                                                    const std::vector<std::string>& quantizer_names) {
  MOEFQ_CHECK(recipe.algorithm == "max", recipe.name, ": algorithm ", in_quotes(recipe.algorithm),
              " is not supported (only max)");
  std::map<std::string, QuantizerConfig> out;
  for (const std::string& q : quantizer_names)
    MOEFQ_CHECK(out.emplace(q, QuantizerConfig{}).second, "apply_recipe: quantizer ", in_quotes(q),
                " is listed twice");
  std::map<std::string, std::string> enabled_by;  // quantizer -> origin of the entry enabling it
  for (const RecipeEntry& e : recipe.entries) {
    MOEFQ_CHECK(e.enable || e.cfg, e.origin, ": the entry for ", in_quotes(e.pattern),
                " sets neither enable nor cfg");
    size_t matched = 0;
    for (const std::string& q : quantizer_names) {
      if (!wildcard_match(e.pattern, q)) continue;
      ++matched;
      QuantizerConfig& c = out[q];
      if (e.cfg) {
        c.spec = *e.cfg;  // a cfg replaces the spec as a whole
        c.configured = true;
      }
      c.enable = e.enable.value_or(true);
      if (c.enable) enabled_by[q] = e.origin;
    }
    MOEFQ_CHECK(matched > 0, e.origin, ": quantizer_name ", in_quotes(e.pattern),
                " matches no quantizer (",
                quantizer_names.empty() ? std::string("there are none")
                                        : "available: " + join_few(quantizer_names, 4),
                "); fix the pattern or remove the entry");
  }
  for (const std::string& q : quantizer_names) {
    const QuantizerConfig& c = out[q];
    MOEFQ_CHECK(!c.enable || c.configured, q, ": enabled by ", enabled_by[q],
                " but no entry gives it a cfg; add a cfg (num_bits, ...) or import a unit such "
                "as moe_dispatch_fp8");
    if (c.configured) c.spec.validate(q);
  }
  return out;
}

}  // namespace moefq
