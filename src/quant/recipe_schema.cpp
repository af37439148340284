// The recipe schema: what the keys of Model Optimizer's quantization configs mean for moefq. A
// loaded document (recipe_loader.h) is a complete PTQ recipe (metadata, quantize), a preset
// (quant_cfg, algorithm), a list of quant_cfg entries (a unit) or one entry; entries come in the
// list form or the older dict form. Entries for moefq's quantizers become RecipeEntry with a
// QuantSpec (recipe_formats.h); entries for quantizers moefq does not have are checked for known
// keys and set aside. Unknown keys are errors everywhere.
#include <cctype>
#include <charconv>
#include <cmath>
#include <new>

#include "moefq/errors.h"
#include "moefq/recipe.h"
#include "quant/recipe_formats.h"
#include "quant/recipe_loader.h"
#include "quant/recipe_tree.h"

namespace moefq {
namespace {

using recipe::Bits;
using recipe::CfgNumerics;
using recipe::Document;
using recipe::fail_at;
using recipe::fail_at_key;
using recipe::MapItem;
using recipe::Node;
using recipe::NodePtr;
using recipe::origin_of;
using recipe::in_quotes;
using recipe::show;

constexpr const char* kAttrSchema = "modelopt.torch.quantization.config.QuantizerAttributeConfig";
constexpr const char* kEntrySchema = "modelopt.torch.quantization.config.QuantizerCfgEntry";
constexpr const char* kListSchema = "modelopt.torch.quantization.config.QuantizerCfgListConfig";
constexpr const char* kQuantizeSchema = "modelopt.torch.quantization.config.QuantizeConfig";
constexpr const char* kPtqRecipeSchema = "modelopt.recipe.config.ModelOptPTQRecipe";

constexpr const char* kQuantizeKeys = "quant_cfg, algorithm, effective_bits, combine_weighting (and imports)";
constexpr const char* kEntryKeys = "quantizer_name, enable, cfg, parent_class, $import";
// Every key of Model Optimizer's QuantizerAttributeConfig, and moefq's amax.
constexpr const char* kCfgKeys[] = {
    "num_bits",  "axis",        "block_sizes", "type",       "constant_amax",
    "use_constant_amax",        "enable",      "effective_bits",          "fake_quant",
    "unsigned",  "narrow_range", "learn_amax", "trt_high_precision_dtype", "calibrator",
    "rotate",    "pass_through_bwd",           "backend",    "backend_extra_args",
    "bias",      "amax"};
constexpr const char* kBlockKeys = "-1, type, scale_bits (and Model Optimizer's scale_block_sizes, four_over_six)";
constexpr const char* kMaxCalibKeys[] = {"method", "moe_calib_experts_ratio", "layerwise", "shared_states",
                                         "distributed_sync", "sync_expert_weight_amax",
                                         "skip_forward_without_activation_calib"};
constexpr float kFp8Max = 448.0f;  // use_constant_amax pins the amax to the e4m3 range

std::string cfg_keys_list() {
  std::string s;
  for (const char* k : kCfgKeys) s += (s.empty() ? "" : ", ") + std::string(k);
  return s;
}

std::optional<long> to_int(const Node& n) {
  if (!n.is_scalar()) return std::nullopt;
  std::string_view s = n.scalar;
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  long v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

// A YAML float (1.5, 1e3, .inf, .nan); nullopt when the scalar is not a number.
std::optional<double> to_double(const Node& n) {
  if (!n.is_scalar()) return std::nullopt;
  std::string s = n.scalar;
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

std::optional<bool> to_bool(const Node& n) {
  if (!n.is_scalar() || n.quoted) return std::nullopt;
  std::string v = n.scalar;
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v == "true" || v == "yes" || v == "on") return true;
  if (v == "false" || v == "no" || v == "off") return false;
  return std::nullopt;
}

bool parse_bool(const Node& n) {
  const auto b = to_bool(n);
  if (!b) fail_at(n, "must be true or false (unquoted), got " + show(n));
  return *b;
}

// num_bits or scale_bits: 8, e4m3 (any case, as Model Optimizer's ExMy), [4, 3], or a name.
Bits parse_bits(const Node& n) {
  if (n.is_scalar()) {
    if (const auto v = to_int(n)) {
      if (*v <= 0 || *v > 64) fail_at(n, "must be a positive number of bits, got " + show(n));
      return Bits::integer(static_cast<int>(*v));
    }
    const std::string& s = n.scalar;
    if (s.size() >= 4 && (s[0] == 'e' || s[0] == 'E')) {
      const size_t m = s.find_first_of("mM", 1);
      if (m != std::string::npos && m > 1 && m + 1 < s.size() && s.size() <= 8) {
        Node e = n, mm = n;
        e.scalar = s.substr(1, m - 1);
        mm.scalar = s.substr(m + 1);
        const auto ev = to_int(e), mv = to_int(mm);
        if (ev && mv && std::isdigit(static_cast<unsigned char>(e.scalar[0])) &&
            std::isdigit(static_cast<unsigned char>(mm.scalar[0])))
          return Bits::fp(static_cast<int>(*ev), static_cast<int>(*mv));
      }
    }
    if (!to_bool(n) && !s.empty()) return {Bits::Kind::kName, 0, 0, 0, s};
  } else if (n.is_list() && n.list.size() == 2) {
    const auto e = to_int(*n.list[0]), m = to_int(*n.list[1]);
    if (e && m && *e >= 0 && *m >= 0 && *e < 64 && *m < 64) return Bits::fp(static_cast<int>(*e), static_cast<int>(*m));
  }
  fail_at(n, "must be a number of bits (8), a float format (e4m3 or [4, 3]) or a format name, got " + show(n));
}

// An entry before classification, in the list form or read from the dict form.
struct RawEntry {
  const Node* at = nullptr;  // the entry (its origin, errors about the whole entry)
  std::string pattern;
  const Node* enable = nullptr;  // the entry-level enable
  NodePtr cfg;                   // nullptr when absent
  std::string parent_class;
};

class Schema {
 public:
  explicit Schema(Recipe& r) : r_(r) {}

  void document(const Document& d) {
    const Node& root = *d.root;
    const std::string& s = d.schema;
    if (s == kAttrSchema)
      fail_at(root, "is a numerics snippet (QuantizerAttributeConfig), not a recipe; import it into an entry's "
                    "cfg from a unit or a recipe (imports: {nvfp4: configs/numerics/nvfp4}, cfg: {$import: nvfp4})");
    if (!s.empty() && s != kEntrySchema && s != kListSchema && s != kQuantizeSchema && s != kPtqRecipeSchema)
      fail_at(root, "modelopt-schema " + in_quotes(s) + " is not one moefq reads (it reads QuantizeConfig presets, "
                    "QuantizerCfgListConfig and QuantizerCfgEntry units and PTQ recipes)");
    if (root.is_null())
      fail_at(root, "is empty; a recipe is a mapping with quant_cfg (a preset), a complete recipe (metadata, "
                    "quantize) or a list of quant_cfg entries (a unit)");
    if (root.is_list()) {
      if (!s.empty() && s != kListSchema)
        fail_at(root, "declares modelopt-schema " + in_quotes(s) + " but holds a list");
      quant_cfg_list(root);
      return;
    }
    if (!root.is_map())
      fail_at(root, "a recipe must be a mapping with quant_cfg (a preset), a complete recipe (metadata, quantize) "
                    "or a list of quant_cfg entries (a unit), got " + show(root));
    if (s == kListSchema) fail_at(root, "declares modelopt-schema QuantizerCfgListConfig but holds a mapping");
    if (s == kEntrySchema || (s.empty() && root.find("quantizer_name"))) {
      list_element(root);
    } else if (s == kPtqRecipeSchema || (s.empty() && (root.find("metadata") || root.find("quantize")))) {
      complete_recipe(root);
    } else {
      quantize_config(root, /*top_level=*/true);
    }
  }

 private:
  void complete_recipe(const Node& root) {
    const Node* metadata = nullptr;
    const Node* quantize = nullptr;
    for (const MapItem& it : root.map) {
      if (it.key == "metadata") metadata = it.value.get();
      else if (it.key == "quantize") quantize = it.value.get();
      else
        fail_at_key(root, it, "unknown top-level key " + in_quotes(it.key) +
                                  " in a complete recipe (expected metadata, quantize and imports)");
    }
    if (!metadata) fail_at(root, "a complete recipe needs metadata: {recipe_type: ptq}");
    if (!metadata->is_map()) fail_at(*metadata, "must be a mapping with recipe_type (ptq), got " + show(*metadata));
    const Node* type = nullptr;
    for (const MapItem& it : metadata->map) {
      if (it.key == "recipe_type") type = it.value.get();
      else if (it.key != "description")
        fail_at_key(*metadata, it, "unknown key " + in_quotes(it.key) + " (expected recipe_type, description)");
    }
    if (!type) fail_at(*metadata, "missing recipe_type (ptq)");
    if (!type->is_scalar() || type->scalar != "ptq")
      fail_at(*type, show(*type) + " is not a recipe type moefq reads; it reads PTQ recipes (recipe_type: ptq)");
    if (!quantize) fail_at(root, "a PTQ recipe must contain quantize: {quant_cfg: [...], algorithm: max}");
    if (!quantize->is_map()) fail_at(*quantize, "must be a mapping with quant_cfg and algorithm, got " + show(*quantize));
    quantize_config(*quantize, /*top_level=*/false);
  }

  void quantize_config(const Node& map, bool top_level) {
    for (const MapItem& it : map.map) {
      if (it.key == "quant_cfg") {
        quant_cfg(*it.value);
      } else if (it.key == "algorithm") {
        algorithm(*it.value);
      } else if (it.key == "combine_weighting") {
        // moefq's own key: where the layer applies the router weight (quant_spec.h).
        const Node& v = *it.value;
        const auto w = v.is_scalar() ? parse_combine_weighting(v.scalar) : std::nullopt;
        if (!w) fail_at(v, "combine_weighting must be before or after, got " + show(v));
        r_.combine_weighting = *w;
      } else if (it.key == "effective_bits") {
        // Model Optimizer's autoquant cost override; it changes nothing moefq computes.
        const auto v = to_double(*it.value);
        if (!it.value->is_null() && !(v && *v > 0.0 && *v <= 16.0))
          fail_at(*it.value, "must be a number in (0, 16], got " + show(*it.value));
      } else {
        fail_at_key(map, it, std::string("unknown ") + (top_level ? "top-level key " : "key ") + in_quotes(it.key) +
                                 " (expected " + kQuantizeKeys +
                                 (top_level ? "; or metadata and quantize for a complete recipe)" : ")"));
      }
    }
  }

  // "max", "mse", "percentile", or {method: max | mse | percentile, ...}: max with the other keys of
  // Model Optimizer's max calibration (they concern weights or how calibration passes run and change
  // nothing moefq computes), mse with MseCalibrator's step_size, start_multiplier, stop_multiplier,
  // percentile with its percentile (calibration_stats.h); or null (no calibration, as Model
  // Optimizer's MX presets write it).
  void algorithm(const Node& n) {
    const std::string not_supported =
        " is not supported; the calibration algorithms are max, mse and percentile (write e.g. algorithm: max)";
    const auto method_of = [&](const Node& m) {
      if (!m.is_scalar() || (m.scalar != "max" && m.scalar != "mse" && m.scalar != "percentile"))
        fail_at(m, show(m) + not_supported);
      r_.algorithm = m.scalar;
      r_.calibration.kind = m.scalar == "max"   ? CalibrationMethod::Kind::kMax
                            : m.scalar == "mse" ? CalibrationMethod::Kind::kMse
                                                : CalibrationMethod::Kind::kPercentile;
    };
    if (n.is_scalar()) return method_of(n);
    if (n.is_null()) {
      r_.algorithm = "none";  // no calibration: fine for formats without a calibrated amax (apply_recipe checks)
      return;
    }
    if (!n.is_map()) fail_at(n, show(n) + not_supported);
    const Node* method = n.find("method");
    if (!method) fail_at(n, "missing method (max, mse or percentile)");
    method_of(*method);
    const bool max = r_.algorithm == "max";
    for (const MapItem& it : n.map) {
      if (it.key == "method") continue;
      double* number = nullptr;
      if (r_.algorithm == "mse" && it.key == "step_size") number = &r_.calibration.step_size;
      if (r_.algorithm == "mse" && it.key == "start_multiplier") number = &r_.calibration.start_multiplier;
      if (r_.algorithm == "mse" && it.key == "stop_multiplier") number = &r_.calibration.stop_multiplier;
      if (r_.algorithm == "percentile" && it.key == "percentile") number = &r_.calibration.percentile;
      if (number) {
        const auto v = to_double(*it.value);
        if (!v) fail_at(*it.value, "must be a number, got " + show(*it.value));
        *number = *v;
        try {
          r_.calibration.validate("algorithm");
        } catch (const Error& e) {
          fail_at(*it.value, e.what());
        }
        continue;
      }
      bool known = false;
      for (const char* k : kMaxCalibKeys) known = known || (max && it.key == k);
      if (!known) {
        std::string keys;
        if (max)
          for (const char* k : kMaxCalibKeys) keys += (keys.empty() ? "" : ", ") + std::string(k);
        else
          keys = r_.algorithm == "mse" ? "method, step_size, start_multiplier, stop_multiplier" : "method, percentile";
        fail_at_key(n, it, "unknown key " + in_quotes(it.key) + " of " + r_.algorithm + " calibration (expected " +
                               keys + ")");
      }
      if (it.key == "distributed_sync" && to_bool(*it.value) == false)
        fail_at(*it.value, "false is not supported: moefq always reduces the calibrated amax over the ranks");
    }
  }


  void quant_cfg(const Node& n) {
    if (n.is_null()) return;
    if (n.is_list()) {
      quant_cfg_list(n);
    } else if (n.is_map()) {
      // The dict form: {pattern: attributes, ...}, one entry per pattern.
      for (const MapItem& it : n.map) dict_pair(n, it);
    } else {
      fail_at(n, "must be a list of entries (- quantizer_name: '...') or a mapping of patterns, got " + show(n));
    }
  }

  void quant_cfg_list(const Node& list) {
    for (const NodePtr& el : list.list) list_element(*el);
  }

  void list_element(const Node& el) {
    if (!el.is_map())
      fail_at(el, "an entry must be a mapping with quantizer_name and enable and/or cfg, got " +
                      (el.is_list() ? std::string("a list") : show(el)));
    if (el.find("quantizer_name")) {
      RawEntry e;
      e.at = &el;
      for (const MapItem& it : el.map) {
        if (it.key == "quantizer_name") e.pattern = pattern_of(*it.value);
        else if (it.key == "enable") e.enable = it.value.get();
        else if (it.key == "cfg") e.cfg = it.value;
        else if (it.key == "parent_class") e.parent_class = parent_class_of(*it.value);
        else fail_at_key(el, it, "unknown key " + in_quotes(it.key) + " (expected " + kEntryKeys + ")");
      }
      entry(e);
      return;
    }
    // Single-key entries of the older form ({pattern: attributes}), and {nn.Class: {...}} groups.
    bool scoped = false;
    for (const MapItem& it : el.map) scoped = scoped || it.key.rfind("nn.", 0) == 0;
    if (el.map.size() == 1 || scoped) {
      for (const MapItem& it : el.map) dict_pair(el, it);
      return;
    }
    for (const MapItem& it : el.map)
      if (it.key == "enable" || it.key == "cfg" || it.key == "parent_class")
        fail_at(el, "missing quantizer_name (a wildcard such as '*combine_quantizer')");
    const std::string got = el.map.empty() ? "an empty mapping"
                                           : "the keys " + in_quotes(el.map.front().key) + " and " +
                                                 std::to_string(el.map.size() - 1) + " more";
    fail_at(el, "an entry must have quantizer_name (a wildcard such as '*combine_quantizer'), got " + got);
  }

  std::string pattern_of(const Node& n) {
    if (!n.is_scalar() || n.scalar.empty())
      fail_at(n, "must be a non-empty wildcard pattern such as '*combine_quantizer', got " + show(n));
    return n.scalar;
  }

  std::string parent_class_of(const Node& n) {
    if (n.is_null()) return "";
    if (!n.is_scalar() || n.scalar.empty()) fail_at(n, "must be a module class name such as nn.Linear, got " + show(n));
    return n.scalar;
  }

  // {pattern: value} of the dict form: a mapping value's enable is the entry's, the rest its cfg;
  // "default" means '*'; nn.Class keys hold such pairs for quantizers of that module class.
  void dict_pair(const Node& owner, const MapItem& item) {
    const Node& v = *item.value;
    if (item.key.rfind("nn.", 0) == 0) {
      if (!v.is_map()) fail_at(v, "must be a mapping of quantizer patterns to attributes, got " + show(v));
      for (const MapItem& sub : v.map) {
        RawEntry e = pair_entry(v, sub);
        e.parent_class = item.key;
        entry(e);
      }
      return;
    }
    entry(pair_entry(owner, item));
  }

  RawEntry pair_entry(const Node& owner, const MapItem& item) {
    (void)owner;
    RawEntry e;
    const Node& v = *item.value;
    e.at = &v;
    e.pattern = item.key == "default" ? "*" : item.key;
    if (e.pattern.empty()) fail_at(v, "an empty quantizer pattern; write one such as '*combine_quantizer'");
    if (v.is_map()) {
      auto cfg = std::make_shared<Node>(v);
      cfg->map.clear();
      for (const MapItem& it : v.map) {
        if (it.key == "enable") e.enable = it.value.get();
        else cfg->map.push_back(it);
      }
      if (!cfg->map.empty()) e.cfg = cfg;
      if (!e.cfg && !e.enable) fail_at(v, "the entry for " + in_quotes(e.pattern) + " sets neither enable nor attributes");
    } else if (v.is_list() || v.is_null()) {
      e.cfg = item.value;
    } else {
      fail_at(v, "the entry for " + in_quotes(e.pattern) + " must map to quantizer attributes ({num_bits: ..., "
                 "enable: ...}), got " + show(v));
    }
    return e;
  }

  static bool empty_cfg(const Node& c) {
    if (c.is_map()) return c.map.empty();
    if (c.is_list()) {
      for (const NodePtr& el : c.list)
        if (!(el->is_map() && el->map.empty())) return false;
      return true;
    }
    return false;
  }

  void entry(RawEntry e) {
    const Node& at = *e.at;
    std::optional<bool> enable;
    if (e.enable) enable = parse_bool(*e.enable);
    NodePtr cfg = e.cfg && !e.cfg->is_null() ? e.cfg : nullptr;
    if (cfg && !cfg->is_map() && !cfg->is_list())
      fail_at(*cfg, "must be a mapping of quantizer attributes (num_bits, block_sizes, ...) or a list of them, got " +
                        show(*cfg));
    if (cfg && empty_cfg(*cfg)) {
      if (enable == false) cfg = nullptr;  // as Model Optimizer: an empty cfg on a disable is no cfg
      else
        fail_at(*cfg, "must set at least one quantizer attribute; to keep the current ones drop cfg, to disable "
                      "write enable: false");
    }
    if (!cfg && !enable)
      fail_at(at, "the entry for " + in_quotes(e.pattern) + " sets neither enable nor cfg; add enable: true|false or a cfg");
    if (cfg && cfg->is_list())
      for (const NodePtr& c : cfg->list)
        if (!c->is_map()) fail_at(*c, "must be a mapping of quantizer attributes, got " + show(*c));

    if (!e.parent_class.empty() || !pattern_targets_moe_quantizers(e.pattern)) {
      if (cfg) {
        if (cfg->is_map()) check_cfg_keys(*cfg);
        else
          for (const NodePtr& c : cfg->list) check_cfg_keys(*c);
      }
      r_.ignored.push_back({e.parent_class.empty() ? e.pattern : e.pattern + " (parent_class " + e.parent_class + ")",
                            origin_of(at)});
      return;
    }
    RecipeEntry out;
    out.pattern = e.pattern;
    out.origin = origin_of(at);
    out.enable = enable;
    if (cfg) {
      if (cfg->is_list())
        fail_at(*cfg, "a list of cfgs (sequential quantization, as for W4A8 weights) is not supported for the "
                      "dispatch and combine quantizers; give one mapping");
      out.cfg = cfg_spec(*cfg, enable.has_value());
    }
    r_.entries.push_back(std::move(out));
  }

  void check_cfg_keys(const Node& cfg) {
    for (const MapItem& it : cfg.map) {
      bool known = false;
      for (const char* k : kCfgKeys) known = known || it.key == k;
      if (!known)
        fail_at_key(cfg, it, "unknown key " + in_quotes(it.key) + " (expected " + cfg_keys_list() + ")");
    }
  }

  // The spec of a cfg for moefq's quantizers. Model Optimizer's attributes that concern export,
  // training or weights are accepted at their neutral values and rejected otherwise.
  QuantSpec cfg_spec(const Node& cfg, bool entry_has_enable) {
    check_cfg_keys(cfg);
    CfgNumerics num;
    std::optional<float> constant_amax;
    bool use_constant_amax = false;
    const Node* constant_node = nullptr;
    const Node* type_node = nullptr;  // "static" / "dynamic"
    const Node* amax_node = nullptr;  // moefq's calibrated / dynamic / constant
    std::optional<bool> cfg_enable;
    const Node* enable_node = nullptr;
    for (const MapItem& it : cfg.map) {
      const Node& v = *it.value;
      const std::string& k = it.key;
      const auto require_value = [&](bool ok, const std::string& what) {
        if (!ok) fail_at(v, what);
      };
      if (k == "num_bits") {
        num.num_bits = parse_bits(v);
      } else if (k == "axis") {
        if (v.is_null()) continue;
        require_value(to_int(v).has_value() || v.is_list(), "must be null (per tensor) or an axis, got " + show(v));
        num.axis = show(v);
        if (v.is_scalar()) num.axis = v.scalar;
      } else if (k == "block_sizes") {
        blocks(v, num);
      } else if (k == "type") {
        require_value(v.is_scalar() && (v.scalar == "static" || v.scalar == "dynamic"),
                      "must be static or dynamic, got " + show(v));
        type_node = &v;
      } else if (k == "constant_amax") {
        if (v.is_null()) continue;
        const auto d = to_double(v);
        if (!d) fail_at(v, show(v) + " is not a number; give a finite number > 0 (e.g. 2688)");
        if (!(std::isfinite(*d) && *d > 0.0 && *d <= 3.4028234663852886e38) || !(static_cast<float>(*d) > 0.0f))
          fail_at(v, "must be a finite number > 0 (a float32), got " + show(v));
        constant_amax = static_cast<float>(*d);
        constant_node = &v;
      } else if (k == "use_constant_amax") {
        use_constant_amax = parse_bool(v);
        if (use_constant_amax) constant_node = &v;
      } else if (k == "amax") {
        require_value(v.is_scalar() && (v.scalar == "calibrated" || v.scalar == "dynamic" || v.scalar == "constant"),
                      "unknown amax source " + show(v) + " (expected calibrated or dynamic; for a fixed value set "
                      "constant_amax)");
        amax_node = &v;
      } else if (k == "enable") {
        cfg_enable = parse_bool(v);
        enable_node = &v;
      } else if (k == "effective_bits") {
        const auto d = to_double(v);
        require_value(v.is_null() || (d && *d > 0.0 && *d <= 16.0), "must be a number in (0, 16], got " + show(v));
      } else if (k == "fake_quant") {
        require_value(parse_bool(v), "false (real quantization) is not supported: moefq simulates fake quantization");
      } else if (k == "unsigned" || k == "narrow_range") {
        require_value(!parse_bool(v), "true is not supported for the dispatch and combine quantizers; remove it");
      } else if (k == "learn_amax") {
        require_value(!parse_bool(v), "true is not supported (Model Optimizer deprecated it too); remove it");
      } else if (k == "trt_high_precision_dtype") {
        require_value(v.is_scalar() && (v.scalar == "Float" || v.scalar == "Half" || v.scalar == "BFloat16"),
                      "must be Float, Half or BFloat16, got " + show(v));
      } else if (k == "calibrator") {
        require_value(v.is_scalar() && v.scalar == "max",
                      show(v) + " is not supported; the only calibrator is max (remove it or write max)");
      } else if (k == "rotate") {
        const bool off = v.is_null() || to_bool(v) == false ||
                         (v.is_map() && (!v.find("enable") || to_bool(*v.find("enable")) == false));
        require_value(off, "input rotation is not supported for the dispatch and combine quantizers; remove it");
      } else if (k == "pass_through_bwd") {
        parse_bool(v);  // backward pass only
      } else if (k == "backend") {
        require_value(v.is_null(), "custom quantization back-ends are not supported; remove backend");
      } else if (k == "bias") {
        require_value(v.is_null(), "affine quantization (bias) is not supported; remove bias");
      }
      // backend_extra_args: read only by a custom back-end.
    }
    if (cfg_enable == false && !entry_has_enable)
      fail_at(*enable_node, "enable: false inside cfg with no enable beside it: Model Optimizer lets the entry's enable "
                            "(true by default) override the cfg's, so it would enable this quantizer; write "
                            "enable: false beside cfg instead");
    if (cfg_enable == true && cfg.map.size() == 1)
      fail_at(cfg, "cfg sets only enable: true; give the quantizer's attributes (num_bits, ...) or drop cfg and "
                   "write enable: true beside it");

    std::string why;
    std::optional<QuantSpec> spec = recipe::spec_of_numerics(num, &why);
    if (!spec) fail_at(cfg, why);

    // The amax source: type (static calibrated, dynamic per call), constant_amax, use_constant_amax
    // (448, the e4m3 range), or moefq's amax key; two that disagree are an error.
    if (constant_amax && use_constant_amax)
      fail_at(*constant_node, "constant_amax and use_constant_amax: true are mutually exclusive; set one");
    std::optional<AmaxSource> from_type, from_amax, from_constant;
    if (type_node) from_type = type_node->scalar == "dynamic" ? AmaxSource::kDynamic : AmaxSource::kCalibrated;
    if (amax_node)
      from_amax = amax_node->scalar == "dynamic"    ? AmaxSource::kDynamic
                  : amax_node->scalar == "constant" ? AmaxSource::kConstant
                                                    : AmaxSource::kCalibrated;
    if (constant_amax || use_constant_amax) from_constant = AmaxSource::kConstant;
    if (from_amax == AmaxSource::kConstant && !from_constant)
      fail_at(*amax_node, "amax: constant needs constant_amax: <value>; set it");
    if (from_constant && from_amax && *from_amax != AmaxSource::kConstant)
      fail_at(*amax_node, "constant_amax and amax: " + amax_node->scalar + " contradict each other; remove one");
    if (from_constant && from_type == AmaxSource::kDynamic)
      fail_at(*type_node, "type: dynamic (a per-call amax) and a constant amax contradict each other; remove one");
    if (from_type && from_amax && from_amax != AmaxSource::kConstant && *from_type != *from_amax)
      fail_at(*amax_node, "type: " + type_node->scalar + " and amax: " + amax_node->scalar +
                              " contradict each other; remove one");
    if (from_constant) {
      if (!format_has_global_amax(spec->format))
        fail_at(*constant_node, std::string("has no effect on ") + format_name(spec->format) +
                                    " (block scales only, no global amax); remove it");
      spec->amax_source = AmaxSource::kConstant;
      spec->constant_amax = constant_amax ? *constant_amax : kFp8Max;
    } else if (from_type == AmaxSource::kDynamic || from_amax == AmaxSource::kDynamic) {
      spec->amax_source = AmaxSource::kDynamic;
    }
    spec->validate(origin_of(cfg));
    return *spec;
  }

  void blocks(const Node& n, CfgNumerics& num) {
    if (n.is_null()) return;
    if (!n.is_map())
      fail_at(n, "must be a mapping such as {-1: 16, type: dynamic, scale_bits: e4m3}, got " +
                     (n.is_list() ? std::string("a list") : show(n)));
    num.blocked = true;
    for (const MapItem& it : n.map) {
      const Node& v = *it.value;
      Node key;
      key.kind = Node::Kind::kScalar;
      key.scalar = it.key;
      if (const auto axis = to_int(key)) {
        const auto size = to_int(v);
        if (!v.is_null() && !(size && *size > 0))
          fail_at(v, "a block size must be a positive integer or null, got " + show(v));
        if (*axis == -1) num.block_size = v.is_null() ? std::nullopt : size;
        else num.other_axes.push_back(it.key + ": " + (v.is_null() ? std::string("null") : v.scalar));
      } else if (it.key == "type") {
        if (!v.is_scalar() || (v.scalar != "dynamic" && v.scalar != "static"))
          fail_at(v, "must be dynamic or static, got " + show(v));
        num.block_type = v.scalar;
      } else if (it.key == "scale_bits") {
        num.scale_bits = parse_bits(v);
      } else if (it.key == "scale_block_sizes") {
        if (!v.is_null()) num.block_extras.push_back(it.key);
      } else if (it.key == "four_over_six") {
        if (parse_bool(v)) num.block_extras.push_back(it.key);
      } else {
        fail_at_key(n, it, "unknown key " + in_quotes(it.key) + " (expected " + kBlockKeys + ")");
      }
    }
  }

  Recipe& r_;
};

Recipe to_recipe(const Document& d) {
  Recipe r;
  r.name = d.name;
  Schema(r).document(d);
  return r;
}

// Runs a load; anything but a moefq::Error (or running out of memory) becomes one naming `what`.
template <typename F>
Recipe guarded(const std::string& what, F&& load) {
  try {
    return load();
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& e) {
    recipe::fail_plain(what + ": cannot read the recipe: " + e.what());
  }
}

}  // namespace

Recipe parse_recipe_text(std::string_view yaml_text, std::string_view origin, const std::string& recipe_root) {
  const std::string name(origin);
  return guarded(name, [&] { return to_recipe(recipe::Loader(recipe_root).load_text(yaml_text, name)); });
}

Recipe load_recipe(const std::string& path_or_unit_name, const std::string& recipe_root) {
  return guarded(path_or_unit_name,
                 [&] { return to_recipe(recipe::Loader(recipe_root).load(path_or_unit_name)); });
}

std::vector<std::string> list_recipe_units(const std::string& recipe_root) {
  return recipe::Loader(recipe_root).unit_names();
}

}  // namespace moefq
