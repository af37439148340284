// Applying a recipe to a model's quantizer names: fnmatch(3) wildcards over both spellings of a
// name, entries in order with later ones overriding, and the test that decides which entries are
// for moefq's quantizers at all (a pattern that cannot match any dispatch/combine quantizer name,
// for any layer, belongs to a quantizer moefq does not simulate).
#include <fnmatch.h>

#include <set>

#include "moefq/errors.h"
#include "moefq/recipe.h"
#include "quant/recipe_tree.h"

namespace moefq {
namespace {

using recipe::in_quotes;

// The serving stack's module path of a moefq quantizer name ("model." + name).
constexpr std::string_view kServingPrefix = "model.";

// moefq's quantizer names for any layer, in both spellings; '#' stands for one or more digits.
// They must stay the names src/fakequant/moe_quantizers.cpp gives (a test ties them).
constexpr std::string_view kNameTemplates[] = {
    "layers.#.mlp.experts.dispatch_quantizer",
    "layers.#.mlp.experts.combine_quantizer",
    "model.layers.#.mlp.experts.dispatch_quantizer",
    "model.layers.#.mlp.experts.combine_quantizer",
};

// One position of a glob: a literal, '?', '*' or a bracket class, read the way glibc's fnmatch
// reads it ('[' then '!' or '^' negates, a ']' right after is literal, an unclosed '[' is a
// literal).
struct Token {
  enum Kind { kLiteral, kAny, kStar, kClass } kind;
  char c = 0;
  bool negate = false;
  std::string_view set;  // class body without the negation mark

  bool matches(char ch) const {
    switch (kind) {
      case kLiteral: return c == ch;
      case kAny: return true;
      case kStar: return false;
      case kClass: {
        bool in = false;
        for (size_t k = 0; k < set.size() && !in; ++k) {
          if (k + 2 < set.size() && set[k + 1] == '-') {
            in = set[k] <= ch && ch <= set[k + 2];
            k += 2;
          } else {
            in = set[k] == ch;
          }
        }
        return in != negate;
      }
    }
    return false;
  }
};

std::vector<Token> tokenize(std::string_view p) {
  std::vector<Token> tokens;
  const size_t n = p.size();
  for (size_t i = 0; i < n;) {
    const char c = p[i];
    if (c == '*') {
      if (tokens.empty() || tokens.back().kind != Token::kStar) tokens.push_back({Token::kStar, 0, false, {}});
      ++i;
    } else if (c == '?') {
      tokens.push_back({Token::kAny, 0, false, {}});
      ++i;
    } else if (c == '[') {
      size_t j = i + 1;
      const bool negate = j < n && (p[j] == '!' || p[j] == '^');
      if (negate) ++j;
      const size_t body = j;
      if (j < n && p[j] == ']') ++j;
      j = p.find(']', j);
      if (j == std::string_view::npos) {
        tokens.push_back({Token::kLiteral, '[', false, {}});
        ++i;
      } else {
        tokens.push_back({Token::kClass, 0, negate, p.substr(body, j - body)});
        i = j + 1;
      }
    } else {
      tokens.push_back({Token::kLiteral, c, false, {}});
      ++i;
    }
  }
  return tokens;
}

// Whether the tokens can match some string of the template: a search over (token, template
// position) pairs, the digit run '#' taking one or more digits.
bool may_match(const std::vector<Token>& tokens, std::string_view tmpl) {
  const size_t n = tmpl.size(), hash = tmpl.find('#');
  const size_t in_digits = n + 1, num_states = n + 2;
  std::vector<char> seen((tokens.size() + 1) * num_states, 0);
  std::vector<std::pair<size_t, size_t>> stack{{0, 0}};
  // The characters template state s can consume, and the state each leads to.
  const auto steps = [&](size_t s, auto&& visit) {
    if (s == hash || s == in_digits) {
      for (char d = '0'; d <= '9'; ++d) visit(d, in_digits);
    } else if (s < n) {
      visit(tmpl[s], s + 1);
    }
  };
  while (!stack.empty()) {
    // Plain copies, not a structured binding: the lambdas below capture them.
    const size_t i = stack.back().first, s = stack.back().second;
    stack.pop_back();
    char& mark = seen[i * num_states + s];
    if (mark) continue;
    mark = 1;
    if (i == tokens.size() && s == n) return true;
    const auto push = [&](size_t ni, size_t ns) {
      if (!seen[ni * num_states + ns]) stack.emplace_back(ni, ns);
    };
    if (s == in_digits) push(i, hash + 1);  // the digit run ends
    if (i == tokens.size()) continue;
    const Token& t = tokens[i];
    if (t.kind == Token::kStar) {
      push(i + 1, s);
      steps(s, [&](char, size_t ns) { push(i, ns); });
    } else {
      steps(s, [&](char ch, size_t ns) {
        if (t.matches(ch)) push(i + 1, ns);
      });
    }
  }
  return false;
}

std::string join_few(const std::vector<std::string>& names, size_t few) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < few; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > few) s += " and " + std::to_string(names.size() - few) + " more";
  return s;
}

}  // namespace

bool wildcard_match(std::string_view pattern, std::string_view name) {
  // fnmatch reads NUL-terminated strings; names never hold a NUL, so a pattern with one never matches.
  if (pattern.find('\0') != std::string_view::npos || name.find('\0') != std::string_view::npos) return false;
  return ::fnmatch(std::string(pattern).c_str(), std::string(name).c_str(), FNM_NOESCAPE) == 0;
}

bool pattern_targets_moe_quantizers(std::string_view pattern) {
  if (pattern.find("dispatch_quantizer") != std::string_view::npos ||
      pattern.find("combine_quantizer") != std::string_view::npos)
    return true;
  // Bracket expressions with POSIX classes ([[:digit:]]) are not modelled: taken as targeting, so
  // such an entry is applied (and must match) rather than ignored.
  for (std::string_view posix : {"[:", "[=", "[."})
    if (pattern.find(posix) != std::string_view::npos) return true;
  const std::vector<Token> tokens = tokenize(pattern);
  for (std::string_view t : kNameTemplates)
    if (may_match(tokens, t)) return true;
  return false;
}

std::string ignored_entries_notice(const Recipe& recipe) {
  if (recipe.ignored.empty()) return "";
  std::vector<std::string> patterns;
  std::set<std::string> seen;
  for (const IgnoredEntry& e : recipe.ignored)
    if (seen.insert(e.pattern).second) patterns.push_back(in_quotes(e.pattern));
  const size_t n = recipe.ignored.size();
  return recipe.name + ": ignored " + std::to_string(n) + (n == 1 ? " entry" : " entries") +
         " for quantizers moefq does not simulate (only the MoE dispatch and combine quantizers exist here): " +
         join_few(patterns, 10);
}

std::map<std::string, QuantizerConfig> apply_recipe(const Recipe& recipe,
                                                    const std::vector<std::string>& quantizer_names) {
  MOEFQ_CHECK(recipe.algorithm == "max" || recipe.algorithm == "mse" || recipe.algorithm == "percentile" ||
                  recipe.algorithm == "none",
              recipe.name, ": algorithm ", in_quotes(recipe.algorithm),
              " is not supported (max, mse, percentile, or none for no calibration)");
  std::map<std::string, QuantizerConfig> out;
  std::vector<std::string> serving;  // the "model."-prefixed spelling of each name
  for (const std::string& q : quantizer_names) {
    MOEFQ_CHECK(out.emplace(q, QuantizerConfig{}).second, "apply_recipe: quantizer ", in_quotes(q),
                " is listed twice");
    serving.push_back(std::string(kServingPrefix) + q);
  }
  std::map<std::string, std::string> enabled_by;  // quantizer -> origin of the entry enabling it
  for (const RecipeEntry& e : recipe.entries) {
    MOEFQ_CHECK(e.enable || e.cfg, e.origin, ": the entry for ", in_quotes(e.pattern),
                " sets neither enable nor cfg");
    size_t matched = 0;
    for (size_t i = 0; i < quantizer_names.size(); ++i) {
      const std::string& q = quantizer_names[i];
      if (!wildcard_match(e.pattern, q) && !wildcard_match(e.pattern, serving[i])) continue;
      ++matched;
      QuantizerConfig& c = out[q];
      if (e.cfg) {
        c.spec = *e.cfg;  // a cfg replaces the spec as a whole
        c.configured = true;
      }
      c.enable = e.enable.value_or(true);
      if (c.enable) enabled_by[q] = e.origin;
    }
    MOEFQ_CHECK(matched > 0, e.origin, ": quantizer_name ", in_quotes(e.pattern), " matches no quantizer (",
                quantizer_names.empty() ? std::string("there are none")
                                        : "available: " + join_few(quantizer_names, 4) +
                                              ", or the same with a 'model.' prefix",
                "); fix the pattern or remove the entry");
  }
  for (const std::string& q : quantizer_names) {
    const QuantizerConfig& c = out[q];
    MOEFQ_CHECK(!c.enable || c.configured, q, ": enabled by ", enabled_by[q],
                " but no entry gives it a cfg; add a cfg (num_bits, ...) or import a unit such as "
                "moe_dispatch_fp8");
    if (c.configured) c.spec.validate(q);
    MOEFQ_CHECK(!(recipe.algorithm == "none" && c.enable && c.configured && format_has_global_amax(c.spec.format) &&
                  c.spec.amax_source == AmaxSource::kCalibrated),
                q, ": ", recipe.name, " has algorithm: null (no calibration), but its ", format_name(c.spec.format),
                " spec takes a calibrated amax; write algorithm: max, or give the cfg constant_amax or type: dynamic");
  }
  return out;
}

}  // namespace moefq
