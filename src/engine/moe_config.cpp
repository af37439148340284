// MoE presets, their validation and the Hugging Face config.json loader (docs/models.md; the
// shape limits are docs/engine.md's).
#include "moefq/moe_config.h"

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "moefq/errors.h"
#include "moefq/fileio.h"

namespace moefq {

namespace {

using Json = nlohmann::json;

// The names a validation error uses for each field: MoeConfig's own names for a config built in
// code, the config.json keys (and the file) for one read from disk, so the message points at the
// thing the user has to change.
struct FieldNames {
  const char* hidden;
  const char* intermediate;
  const char* num_experts;
  const char* top_k;
  const char* num_shared;
  const char* n_group;
  const char* topk_group;
  const char* routed_scaling;
  const char* swiglu_clamp;
};
constexpr FieldNames kStructNames = {"hidden", "intermediate", "num_experts", "top_k", "num_shared",
                                     "n_group", "topk_group", "routed_scaling", "swiglu_clamp"};
constexpr FieldNames kHfNames = {"hidden_size", "moe_intermediate_size", "n_routed_experts",
                                 "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group",
                                 "routed_scaling_factor", "swiglu_limit"};

constexpr int64_t kMaxTopK = 32;
// Bounds no real MoE model comes near (the largest today: hidden 7168, intermediate 3072, 896
// experts, 2 shared), so that a typo or a hostile config.json is refused with a message instead of
// sizing allocations that cannot succeed.
constexpr int64_t kMaxHidden = 65536, kMaxIntermediate = 131072, kMaxExperts = 8192, kMaxShared = 64;

void validate_fields(const MoeConfig& c, const FieldNames& n, const std::string& where) {
  const std::string w = where.empty() ? std::string("moe config") : where;
  MOEFQ_CHECK(c.hidden > 0 && c.hidden % 128 == 0, w, ": ", n.hidden, " = ", c.hidden,
              " must be a positive multiple of 128");
  MOEFQ_CHECK(c.hidden <= kMaxHidden, w, ": ", n.hidden, " = ", c.hidden, " is larger than ", kMaxHidden,
              ", more than any MoE model has");
  MOEFQ_CHECK(c.intermediate > 0 && c.intermediate % 128 == 0, w, ": ", n.intermediate, " = ",
              c.intermediate, " must be a positive multiple of 128");
  MOEFQ_CHECK(c.intermediate <= kMaxIntermediate, w, ": ", n.intermediate, " = ", c.intermediate,
              " is larger than ", kMaxIntermediate, ", more than any MoE model has");
  MOEFQ_CHECK(c.num_experts >= 1, w, ": ", n.num_experts, " = ", c.num_experts, " must be at least 1");
  MOEFQ_CHECK(c.num_experts <= kMaxExperts, w, ": ", n.num_experts, " = ", c.num_experts, " is larger than ",
              kMaxExperts, ", more than any MoE model has");
  MOEFQ_CHECK(c.top_k >= 1 && c.top_k <= kMaxTopK, w, ": ", n.top_k, " = ", c.top_k,
              " must be in [1, ", kMaxTopK, "]");
  MOEFQ_CHECK(c.top_k <= c.num_experts, w, ": ", n.top_k, " = ", c.top_k, " exceeds ", n.num_experts,
              " = ", c.num_experts);
  MOEFQ_CHECK(c.num_shared >= 0 && c.num_shared <= kMaxShared, w, ": ", n.num_shared, " = ", c.num_shared,
              " must be in [0, ", kMaxShared, "]");
  MOEFQ_CHECK(c.n_group >= 1, w, ": ", n.n_group, " = ", c.n_group, " must be at least 1");
  MOEFQ_CHECK(c.num_experts % c.n_group == 0, w, ": ", n.n_group, " = ", c.n_group, " must divide ",
              n.num_experts, " = ", c.num_experts);
  MOEFQ_CHECK(c.topk_group >= 1 && c.topk_group <= c.n_group, w, ": ", n.topk_group, " = ",
              c.topk_group, " must be in [1, ", n.n_group, " = ", c.n_group, "]");
  MOEFQ_CHECK(c.top_k <= c.topk_group * (c.num_experts / c.n_group), w, ": ", n.top_k, " = ", c.top_k,
              " exceeds the experts of the kept groups (", n.topk_group, " = ", c.topk_group, " of ",
              c.num_experts / c.n_group, " experts each)");
  MOEFQ_CHECK(std::isfinite(c.routed_scaling) && c.routed_scaling > 0.0f, w, ": ", n.routed_scaling,
              " = ", c.routed_scaling, " must be finite and positive");
  MOEFQ_CHECK(!c.swiglu_clamp || (std::isfinite(*c.swiglu_clamp) && *c.swiglu_clamp > 0.0f), w, ": ",
              n.swiglu_clamp, " = ", c.swiglu_clamp ? *c.swiglu_clamp : 0.0f,
              " must be finite and positive");
  MOEFQ_CHECK(c.scoring == ScoringFunc::kSigmoid || c.scoring == ScoringFunc::kSoftmax ||
                  c.scoring == ScoringFunc::kSqrtSoftplus,
              w, ": scoring = ", int(c.scoring), " is not a scoring function");
}

MoeConfig make_preset(const char* name, const char* model_type, int64_t h, int64_t i, int64_t e, int64_t k,
                      int64_t s, ScoringFunc scoring, bool noaux_tc, int64_t n_group, int64_t topk_group,
                      float scaling, bool norm_topk_prob, std::optional<float> clamp) {
  MoeConfig c;
  c.name = name;
  c.model_type = model_type;
  c.hidden = h;
  c.intermediate = i;
  c.num_experts = e;
  c.top_k = k;
  c.num_shared = s;
  c.scoring = scoring;
  c.noaux_tc = noaux_tc;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.routed_scaling = scaling;
  c.norm_topk_prob = norm_topk_prob;
  c.swiglu_clamp = clamp;
  return c;
}

// The values of each model's published config.json (hidden_size, the routed expert's intermediate
// size, experts, top-k, shared experts, groups, routed_scaling_factor, norm_topk_prob), except
// deepseek-v4-flash, deepseek-v4-pro and kimi-k3, whose sources docs/models.md names.
std::vector<MoeConfig> all_presets() {
  using S = ScoringFunc;
  constexpr auto none = std::nullopt;
  return {
      make_preset("deepseek-v3", "deepseek_v3", 7168, 2048, 256, 8, 1, S::kSigmoid, true, 8, 4, 2.5f, true, none),
      make_preset("deepseek-v4-flash", "deepseek_v4", 4096, 2048, 256, 6, 1, S::kSqrtSoftplus, true, 1, 1, 1.5f, true,
                  10.0f),
      // No published routed scaling factor of v4-pro is known here: 1.0 is a placeholder until a
      // checkpoint's config.json gives one (docs/models.md).
      make_preset("deepseek-v4-pro", "deepseek_v4", 7168, 3072, 384, 6, 1, S::kSqrtSoftplus, true, 1, 1, 1.0f, true,
                  10.0f),
      // DeepSeek-V3's layout with 384 experts, one group and a scaling factor of 2.827.
      make_preset("kimi-k2", "kimi_k2", 7168, 2048, 384, 8, 1, S::kSigmoid, true, 1, 1, 2.827f, true, none),
      make_preset("kimi-k3", "", 3584, 3072, 896, 16, 2, S::kSigmoid, true, 1, 1, 1.0f, true, none),
      // GLM-4.5: sigmoid scores with the correction bias, one shared expert.
      make_preset("glm-4.5", "glm4_moe", 5120, 1536, 160, 8, 1, S::kSigmoid, true, 1, 1, 2.5f, true, none),
      make_preset("glm-4.5-air", "glm4_moe", 4096, 1408, 128, 8, 1, S::kSigmoid, true, 1, 1, 1.0f, true, none),
      // Qwen3-MoE: softmax over all experts, the top 8 renormalised, no shared expert.
      make_preset("qwen3-30b-a3b", "qwen3_moe", 2048, 768, 128, 8, 0, S::kSoftmax, false, 1, 1, 1.0f, true, none),
      make_preset("qwen3-235b-a22b", "qwen3_moe", 4096, 1536, 128, 8, 0, S::kSoftmax, false, 1, 1, 1.0f, true, none),
      // Mixtral: softmax, the top 2 renormalised.
      make_preset("mixtral-8x7b", "mixtral", 4096, 14336, 8, 2, 0, S::kSoftmax, false, 1, 1, 1.0f, true, none),
      // OLMoE: softmax, the top 8 not renormalised.
      make_preset("olmoe-1b-7b", "olmoe", 2048, 1024, 64, 8, 0, S::kSoftmax, false, 1, 1, 1.0f, false, none),
      // The built-in default: DeepSeek-V3's structure (shared expert, groups, K = 8) at CPU size.
      make_preset("tiny", "", 1024, 256, 32, 8, 1, S::kSigmoid, true, 4, 2, 2.5f, true, none),
  };
}

// How one architecture's config.json spells the MoE fields, and the routing its modeling code
// fixes or defaults to.
struct Architecture {
  const char* model_type;
  const char* experts_key;       // the number of routed experts
  const char* intermediate_key;  // one routed expert's intermediate size
  bool deepseek_fields;          // reads n_shared_experts, n_group, topk_group, routed_scaling_factor,
                                 // scoring_func, topk_method, swiglu_limit (else: none of them exist)
  ScoringFunc scoring;           // scoring_func's default, or the rule when it is not read
  const char* topk_method;       // topk_method's default
  bool reads_norm;               // norm_topk_prob is read (else norm_default is the rule)
  bool norm_default;
};

constexpr Architecture kArchitectures[] = {
    {"deepseek_v2", "n_routed_experts", "moe_intermediate_size", true, ScoringFunc::kSoftmax, "greedy", true, false},
    {"deepseek_v3", "n_routed_experts", "moe_intermediate_size", true, ScoringFunc::kSigmoid, "noaux_tc", true, true},
    {"deepseek_v4", "n_routed_experts", "moe_intermediate_size", true, ScoringFunc::kSqrtSoftplus, "noaux_tc", true,
     true},
    {"glm4_moe", "n_routed_experts", "moe_intermediate_size", true, ScoringFunc::kSigmoid, "noaux_tc", true, true},
    {"kimi_k2", "n_routed_experts", "moe_intermediate_size", true, ScoringFunc::kSigmoid, "noaux_tc", true, true},
    // Mixtral's block always renormalises its top-k weights; its config has no norm_topk_prob.
    {"mixtral", "num_local_experts", "intermediate_size", false, ScoringFunc::kSoftmax, "greedy", false, true},
    {"olmoe", "num_experts", "intermediate_size", false, ScoringFunc::kSoftmax, "greedy", true, false},
    {"qwen3_moe", "num_experts", "moe_intermediate_size", false, ScoringFunc::kSoftmax, "greedy", true, false},
};
// What the engine lacks for GPT-OSS's MoE layer (docs/models.md), in the refusal of its config.
constexpr const char* kGptOssMissing =
    "(1) a router bias added to the logits before the top-k (mlp.router.bias; the engine's only bias, "
    "e_score_correction_bias, changes the selection, never the weights), (2) per-expert biases on the "
    "gate/up and down projections (gate_up_proj_bias, down_proj_bias), (3) its SwiGLU variant "
    "(gate clamped above and up clamped on both sides at swiglu_limit 7, out = (up + 1) * gate * "
    "sigmoid(1.702 * gate); the engine's SwiGLU is silu(gate) * up with a symmetric clamp), (4) reading "
    "its fused expert tensors (experts.gate_up_proj_blocks/_scales with interleaved gate and up rows, "
    "experts.down_proj_blocks/_scales; moefq decodes the same MXFP4 encoding from per-expert tensors), "
    "and (5) hidden and intermediate sizes of 2880, which are not multiples of the engine's 128-element "
    "weight block";

// A config without model_type: DeepSeek's field names with the generic defaults.
constexpr Architecture kNoModelType = {"", "n_routed_experts", "moe_intermediate_size", true, ScoringFunc::kSoftmax,
                                       "greedy", true, false};

std::string supported_model_types() {
  std::string s;
  for (const Architecture& a : kArchitectures) s += (s.empty() ? "" : ", ") + std::string(a.model_type);
  return s;
}

// --- config.json reading ---------------------------------------------------------------------

// A field of the file; absent and JSON null both count as missing.
const Json* find_field(const Json& root, const char* key) {
  auto it = root.find(key);
  if (it == root.end() || it->is_null()) return nullptr;
  return &*it;
}

int64_t read_int(const Json& root, const char* key, const std::string& file, std::optional<int64_t> dflt) {
  const Json* v = find_field(root, key);
  if (!v) {
    MOEFQ_CHECK(dflt.has_value(), file, ": missing required field ", key);
    return *dflt;
  }
  MOEFQ_CHECK(v->is_number_integer(), file, ": field ", key, " must be an integer, got ", v->dump());
  if (v->is_number_unsigned())
    MOEFQ_CHECK(v->get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()), file, ": field ", key,
                " = ", v->dump(), " is out of range");
  return v->get<int64_t>();
}

float read_float(const Json& root, const char* key, const std::string& file, float dflt, bool* present) {
  const Json* v = find_field(root, key);
  if (present) *present = v != nullptr;
  if (!v) return dflt;
  MOEFQ_CHECK(v->is_number(), file, ": field ", key, " must be a number, got ", v->dump());
  const double d = v->get<double>();
  MOEFQ_CHECK(std::isfinite(d) && std::fabs(d) <= double(std::numeric_limits<float>::max()), file,
              ": field ", key, " = ", v->dump(), " is out of range");
  return float(d);
}

bool read_bool(const Json& root, const char* key, const std::string& file, bool dflt) {
  const Json* v = find_field(root, key);
  if (!v) return dflt;
  MOEFQ_CHECK(v->is_boolean(), file, ": field ", key, " must be true or false, got ", v->dump());
  return v->get<bool>();
}

std::optional<std::string> read_string(const Json& root, const char* key, const std::string& file) {
  const Json* v = find_field(root, key);
  if (!v) return std::nullopt;
  MOEFQ_CHECK(v->is_string(), file, ": field ", key, " must be a string, got ", v->dump());
  return v->get<std::string>();
}

std::string model_name_of(const std::string& path) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(path, ec);
  if (ec) p = path;
  std::string name = p.lexically_normal().parent_path().filename().string();
  return name.empty() ? std::string("config") : name;
}

}  // namespace

const char* scoring_name(ScoringFunc s) {
  switch (s) {
    case ScoringFunc::kSigmoid: return "sigmoid";
    case ScoringFunc::kSoftmax: return "softmax";
    case ScoringFunc::kSqrtSoftplus: return "sqrtsoftplus";
  }
  return "unknown";
}

void MoeConfig::validate() const {
  validate_fields(*this, kStructNames, name.empty() ? std::string() : "moe config " + name);
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const MoeConfig& c : all_presets()) names.push_back(c.name);
  return names;
}

MoeConfig preset(std::string_view name) {
  std::string known;
  for (MoeConfig& c : all_presets()) {
    if (c.name == name) return c;
    known += (known.empty() ? "" : ", ") + c.name;
  }
  MOEFQ_FAIL(ErrorKind::kBadInput, "unknown model preset '", name, "'; the presets are: ", known);
}

std::vector<std::string> hf_model_types() {
  std::vector<std::string> names;
  for (const Architecture& a : kArchitectures) names.emplace_back(a.model_type);
  return names;
}

MoeConfig load_hf_config(const std::string& path) {
  // A config.json is a few KiB; the cap bounds a hostile one.
  const std::string text = read_regular_file(path, size_t(16) << 20, "model config " + path);
  check_json_text(text, "model config " + path, 64);  // before the parser recurses into it
  Json doc;
  try {
    doc = Json::parse(text);
  } catch (const Json::exception& e) {
    MOEFQ_FAIL(ErrorKind::kBadInput, path, ": not valid JSON (", e.what(), ")");
  }
  MOEFQ_CHECK(doc.is_object(), path, ": a model config must be a JSON object");
  // Multimodal wrappers keep the language model's fields (and its model_type) under text_config.
  const Json* root = &doc;
  if (!doc.contains("hidden_size") && doc.contains("text_config") && doc["text_config"].is_object())
    root = &doc["text_config"];
  std::optional<std::string> model_type = read_string(*root, "model_type", path);
  if (!model_type && root != &doc) model_type = read_string(doc, "model_type", path);

  const Architecture* arch = &kNoModelType;
  // GPT-OSS is a MoE the engine cannot express yet: refused with what is missing, not as unknown.
  MOEFQ_CHECK(model_type != "gpt_oss", path, ": model_type 'gpt_oss' (GPT-OSS) is not supported: its MoE layer needs ",
              kGptOssMissing);
  if (model_type) {
    arch = nullptr;
    for (const Architecture& a : kArchitectures)
      if (*model_type == a.model_type) arch = &a;
    MOEFQ_CHECK(arch != nullptr, path, ": model_type '", *model_type, "' is not a MoE architecture moefq reads; ",
                "the supported ones are ", supported_model_types(),
                " (a config without model_type is read with DeepSeek-V3's field names)");
  }
  FieldNames names = kHfNames;
  names.num_experts = arch->experts_key;
  names.intermediate = arch->intermediate_key;

  MoeConfig c;
  c.name = model_name_of(path);
  c.model_type = model_type.value_or("");
  c.hidden = read_int(*root, "hidden_size", path, std::nullopt);
  c.intermediate = read_int(*root, arch->intermediate_key, path, std::nullopt);
  c.num_experts = read_int(*root, arch->experts_key, path, std::nullopt);
  c.top_k = read_int(*root, "num_experts_per_tok", path, std::nullopt);
  c.norm_topk_prob = arch->reads_norm ? read_bool(*root, "norm_topk_prob", path, arch->norm_default)
                                      : arch->norm_default;
  c.scoring = arch->scoring;
  std::optional<std::string> method;
  if (arch->deepseek_fields) {
    c.num_shared = read_int(*root, "n_shared_experts", path, 0);
    c.n_group = read_int(*root, "n_group", path, 1);
    c.topk_group = read_int(*root, "topk_group", path, 1);
    c.routed_scaling = read_float(*root, "routed_scaling_factor", path, 1.0f, nullptr);
    if (const std::optional<std::string> scoring = read_string(*root, "scoring_func", path)) {
      if (*scoring == "sigmoid") c.scoring = ScoringFunc::kSigmoid;
      else if (*scoring == "softmax") c.scoring = ScoringFunc::kSoftmax;
      else if (*scoring == "sqrtsoftplus") c.scoring = ScoringFunc::kSqrtSoftplus;
      else MOEFQ_FAIL(ErrorKind::kBadInput, path, ": field scoring_func = '", *scoring,
                      "' is not one of sigmoid, softmax, sqrtsoftplus");
    }
    method = read_string(*root, "topk_method", path).value_or(arch->topk_method);
    MOEFQ_CHECK(*method == "noaux_tc" || *method == "greedy" || *method == "group_limited_greedy", path,
                ": field topk_method = '", *method, "' is not one of noaux_tc, greedy, group_limited_greedy");
    c.noaux_tc = *method == "noaux_tc";
    bool has_clamp = false;
    const float clamp = read_float(*root, "swiglu_limit", path, 0.0f, &has_clamp);
    if (has_clamp) c.swiglu_clamp = clamp;
  }

  validate_fields(c, names, path);
  // "greedy" (DeepSeek-V2-Lite) ignores the groups: plain top-k over all experts. Checked above
  // like any other config, then dropped.
  if (method && *method == "greedy") c.n_group = c.topk_group = 1;
  return c;
}

}  // namespace moefq
