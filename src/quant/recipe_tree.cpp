// Messages about recipe tree nodes (recipe_tree.h).
#include "quant/recipe_tree.h"

#include <algorithm>

#include "moefq/errors.h"

namespace moefq::recipe {

const Node* Node::find(std::string_view key) const {
  for (const MapItem& it : map)
    if (it.key == key) return it.value.get();
  return nullptr;
}

std::string in_quotes(std::string_view s) {
  std::string out = "'";
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
  return out + "'";
}

std::string show(const Node& n) {
  switch (n.kind) {
    case Node::Kind::kNull: return "null";
    case Node::Kind::kScalar: return in_quotes(n.scalar);
    case Node::Kind::kMap: return "a mapping";
    case Node::Kind::kList: {
      std::string s = "[";
      for (size_t i = 0; i < n.list.size(); ++i) {
        if (i) s += ", ";
        if (i == 4) return s + "...]";
        const Node& el = *n.list[i];
        s += el.is_scalar() ? el.scalar.substr(0, 20) : show(el);
      }
      return s + "]";
    }
  }
  return "?";
}

std::string origin_of(const Node& n) {
  const std::string file = n.source ? n.source->file : std::string("<recipe>");
  return n.where.empty() ? file : file + ": " + n.where;
}

void fail_plain(const std::string& message) { MOEFQ_FAIL(ErrorKind::kBadInput, message); }

void fail_at(const Node& n, const std::string& what) {
  std::string m = origin_of(n) + ": " + what;
  if (n.line > 0) m += " (line " + std::to_string(n.line) + ")";
  if (n.source && !n.source->imported_by.empty()) m += " (imported by " + n.source->imported_by + ")";
  fail_plain(m);
}

void fail_at_key(const Node& map, const MapItem& item, const std::string& what) {
  Node at;
  at.source = map.source;
  at.where = map.where;
  at.line = item.key_line;
  fail_at(at, what);
}

}  // namespace moefq::recipe
