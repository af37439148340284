// Loading one MoE layer from a checkpoint directory (checkpoint.h): the index or the single
// file, each shard opened once, every tensor checked for its name, dtype and shape before its bytes
// are copied out.
#include "moefq/checkpoint.h"

#include <bit>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string_view>

#include "moefq/errors.h"
#include "moefq/fileio.h"
#include "moefq/host_memory.h"
#include "moefq/safetensors.h"

namespace moefq {

namespace fs = std::filesystem;

// Scales and bf16 values are copied straight out of the mapped files.
static_assert(std::endian::native == std::endian::little, "checkpoint: little-endian hosts only");

namespace {

constexpr int64_t kBlock = 128;  // weight scales cover 128 x 128 blocks

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_shapes_and_range(const MoeConfig& cfg, int64_t first_expert, int64_t num_local,
                            const std::string& where) {
  MOEFQ_CHECK(cfg.hidden > 0 && cfg.hidden % kBlock == 0, where, ": hidden size ", cfg.hidden,
              " must be a positive multiple of 128");
  MOEFQ_CHECK(cfg.intermediate > 0 && cfg.intermediate % kBlock == 0, where,
              ": intermediate size ", cfg.intermediate, " must be a positive multiple of 128");
  MOEFQ_CHECK(cfg.num_experts > 0, where, ": num_experts is ", cfg.num_experts,
              ", must be positive");
  MOEFQ_CHECK(cfg.num_shared >= 0, where, ": num_shared is ", cfg.num_shared,
              ", must be >= 0");
  MOEFQ_CHECK(first_expert >= 0 && num_local >= 0 && num_local <= cfg.num_experts &&
                  first_expert <= cfg.num_experts - num_local,
              where, ": expert range [", first_expert, ", ", first_expert + num_local,
              ") (first_expert ", first_expert, ", num_local ", num_local,
              ") is outside the routed experts [0, ", cfg.num_experts, ")");
}

// The tensors of a checkpoint directory: the index's weight map (or the single file's tensors)
// and the shards opened so far, each opened once.
class Checkpoint {
 public:
  // DeepSeek-V3's index is about 9 MB; the cap keeps a hostile one (or a link to /dev/zero) bounded.
  static constexpr size_t kMaxIndexBytes = size_t(256) << 20;

  explicit Checkpoint(const std::string& dir) : dir_(dir) {
    const fs::path index = fs::path(dir) / "model.safetensors.index.json";
    std::error_code ec;
    if (fs::exists(fs::symlink_status(index, ec))) {  // a link that leads nowhere is reported, not skipped
      read_index(index.string());
      return;
    }
    const fs::path single = fs::path(dir) / "model.safetensors";
    MOEFQ_CHECK(fs::exists(single, ec), dir,
                ": not a checkpoint directory: neither model.safetensors.index.json nor "
                "model.safetensors is there");
    single_ = single.string();
  }

  // The tensor's info and file, or nullptr when the checkpoint has no tensor of that name.
  struct Found {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };
  std::optional<Found> find(const std::string& name) {
    std::string shard_path;
    if (single_.empty()) {
      const auto it = weight_map_.find(name);
      if (it == weight_map_.end()) return std::nullopt;
      shard_path = (fs::path(dir_) / it->second).string();
    } else {
      shard_path = single_;
    }
    const SafetensorsFile& file = open_shard(shard_path, name);
    const TensorInfo* info = file.find(name);
    if (single_.empty())
      MOEFQ_CHECK(info != nullptr, "tensor ", name, ": the index ", index_path_, " maps it to ",
                  shard_path, ", which has no tensor of that name");
    if (info == nullptr) return std::nullopt;
    return Found{&file, info};
  }

  // The tensor, which must exist.
  Found require(const std::string& name, const char* role) {
    const auto found = find(name);
    MOEFQ_CHECK(found.has_value(), "missing tensor ", name, " (", role, ") in checkpoint ",
                where());
    return *found;
  }

  std::string where() const { return single_.empty() ? index_path_ : single_; }

  // The index and every shard it names (each once, sorted), or the single file.
  std::vector<std::string> files() const {
    if (!single_.empty()) return {single_};
    std::set<std::string> shards;
    for (const auto& [name, shard] : weight_map_) shards.insert((fs::path(dir_) / shard).string());
    std::vector<std::string> v = {index_path_};
    v.insert(v.end(), shards.begin(), shards.end());
    return v;
  }

 private:
  void read_index(const std::string& path) {
    index_path_ = path;
    const std::string text = read_regular_file(path, kMaxIndexBytes, "checkpoint index " + path);
    // An index nests 3 deep (root, weight_map or metadata, a value).
    check_json_text(text, "checkpoint index " + path, 16);
    nlohmann::json root;
    try {
      root = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      MOEFQ_FAIL(ErrorKind::kBadInput, path, ": malformed checkpoint index (not JSON): ", e.what());
    } catch (const std::bad_alloc&) {
      MOEFQ_FAIL(ErrorKind::kBadInput, "checkpoint index ", path, ": ran out of memory while reading this ",
                 format_bytes(text.size()), " file");
    }
    MOEFQ_CHECK(root.is_object(), path, ": malformed checkpoint index: the top level is a JSON ",
                root.type_name(), ", expected an object with \"weight_map\"");
    const auto wm = root.find("weight_map");
    MOEFQ_CHECK(wm != root.end(), path, ": malformed checkpoint index: no \"weight_map\"");
    MOEFQ_CHECK(wm->is_object(), path, ": malformed checkpoint index: \"weight_map\" is a JSON ",
                wm->type_name(), ", expected an object {tensor name: shard file}");
    for (const auto& [name, file] : wm->items()) {
      MOEFQ_CHECK(file.is_string(), path, ": malformed checkpoint index: \"weight_map\" entry \"",
                  name, "\" is a JSON ", file.type_name(), ", expected a shard file name");
      const std::string shard = file.get<std::string>();
      const fs::path p(shard);
      bool escapes = shard.empty() || p.is_absolute();
      for (const auto& part : p) escapes = escapes || part == "..";
      MOEFQ_CHECK(!escapes, path, ": malformed checkpoint index: \"weight_map\" entry \"", name,
                  "\" names shard \"", shard, "\", which is not a file inside the directory");
      weight_map_.emplace(name, shard);
    }
  }

  const SafetensorsFile& open_shard(const std::string& path, const std::string& tensor) {
    auto it = shards_.find(path);
    if (it != shards_.end()) return it->second;
    const std::string what = "tensor " + tensor + ": shard file " + path +
                             (single_.empty() ? " (named by " + index_path_ + ")" : std::string());
    return shards_.emplace(path, SafetensorsFile::open(path, what)).first->second;
  }

  std::string dir_, index_path_, single_;
  std::map<std::string, std::string> weight_map_;
  std::map<std::string, SafetensorsFile> shards_;
};

void check_tensor(const Checkpoint::Found& t, const std::string& name,
                  std::initializer_list<StDtype> dtypes, const std::vector<int64_t>& shape) {
  bool dtype_ok = false;
  std::string expected;
  for (const StDtype d : dtypes) {
    dtype_ok = dtype_ok || t.info->dtype == d;
    expected += (expected.empty() ? "" : " or ") + std::string(st_dtype_name(d));
  }
  MOEFQ_CHECK(dtype_ok, "tensor ", name, " in ", t.file->path(), ": dtype ",
              st_dtype_name(t.info->dtype), ", expected ", expected);
  MOEFQ_CHECK(t.info->shape == shape, "tensor ", name, " in ", t.file->path(), ": shape ",
              shape_str(t.info->shape), ", expected ", shape_str(shape));
}

template <typename T>
void append_tensor(std::vector<T>& out, const Checkpoint::Found& t) {
  const size_t old = out.size(), n = size_t(t.info->end - t.info->begin);
  MOEFQ_ASSERT(n % sizeof(T) == 0, "tensor ", t.info->name, ": ", n, " bytes is not a whole number of elements");
  out.resize(old + n / sizeof(T));
  t.file->read_into(*t.info, {reinterpret_cast<uint8_t*>(out.data() + old), n});
}

// A weight or block scale that is NaN or infinite would only surface later, as NaN in the
// calibration data of a rank; name the tensor and its file instead. `values` are the elements of
// t as read (e4m3 codes, bf16 bits or fp32 values); `first` skips those read before.
template <typename T>
void check_finite(const Checkpoint::Found& t, const std::vector<T>& values, size_t first) {
  for (size_t i = first; i < values.size(); ++i) {
    bool finite;
    if constexpr (std::is_same_v<T, float>) finite = std::isfinite(values[i]);
    else if constexpr (std::is_same_v<T, bf16>) finite = (values[i].bits & 0x7f80) != 0x7f80;
    else finite = (uint8_t(values[i]) & 0x7f) != 0x7f;  // e4m3 has NaN only: S.1111.111
    if (finite) continue;
    std::string shown;
    if constexpr (std::is_same_v<T, float>) shown = detail::concat(values[i]);
    else if constexpr (std::is_same_v<T, bf16>) shown = detail::concat(to_f32(values[i]));
    else shown = "NaN";
    MOEFQ_FAIL(ErrorKind::kBadInput, "tensor ", t.info->name, " in ", t.file->path(), ": element ", i - first, " is ",
               shown, "; a checkpoint's weights and block scales must be finite");
  }
}

// "<name minus .weight>" + suffix: where a weight's scales are.
std::string beside(const std::string& weight_name, const char* suffix) {
  return weight_name.substr(0, weight_name.size() - std::string_view(".weight").size()) + suffix;
}

// The supported formats, for the refusals.
constexpr const char* kSupportedFormats =
    "the supported expert weight formats are e4m3 (F8_E4M3 with 128x128 block scales, fp32 in weight_scale_inv or "
    "F8_E8M0 in .scale), bf16 (BF16) and mxfp4 (U8 or I8 packed e2m1 pairs with an F8_E8M0 or U8 .scale per 32 "
    "elements)";

// The format an expert weight is stored in, from its dtype and the tensors beside it; a format
// moefq does not read is refused with its name.
StoredWeightFormat format_of(Checkpoint& ckpt, const Checkpoint::Found& t, const std::string& name) {
  const StDtype d = t.info->dtype;
  if (d == StDtype::kF8E4M3) return StoredWeightFormat::kE4m3;
  if (d == StDtype::kBF16) return StoredWeightFormat::kBf16;
  const std::string where = "tensor " + name + " in " + t.file->path();
  if (d == StDtype::kU8 || d == StDtype::kI8) {
    if (ckpt.find(beside(name, ".scale"))) return StoredWeightFormat::kMxfp4;
    const auto ws = ckpt.find(beside(name, ".weight_scale"));
    MOEFQ_CHECK(!(ws && ws->info->dtype == StDtype::kF8E4M3), where, ": NVFP4 expert weights (e2m1 with F8_E4M3 ",
                "scales per 16 in weight_scale and a global weight_scale_2, as NVIDIA ModelOpt writes them) are not ",
                "supported; ", kSupportedFormats);
    MOEFQ_FAIL(ErrorKind::kBadInput, where, ": dtype ", st_dtype_name(d), " with no ", beside(name, ".scale"),
               " beside it: a packed format moefq does not read; ", kSupportedFormats);
  }
  MOEFQ_FAIL(ErrorKind::kBadInput, where, ": expert weights of dtype ", st_dtype_name(d), " (",
             d == StDtype::kF16 ? "fp16" : d == StDtype::kF32 ? "fp32" : d == StDtype::kF8E5M2 ? "fp8 e5m2" : "not a weight format",
             ") are not supported; ", kSupportedFormats);
}

// The expert weight `name`, which must exist; a quantized format whose tensors are named otherwise
// (GPTQ/AWQ qweight, compressed-tensors weight_packed) is refused with its name.
Checkpoint::Found require_weight(Checkpoint& ckpt, const std::string& name) {
  if (!ckpt.find(name)) {
    const std::string base = beside(name, "");
    MOEFQ_CHECK(!ckpt.find(base + ".qweight"), "tensor ", base, ".qweight: GPTQ/AWQ int4 expert weights (qweight, ",
                "scales, qzeros) are not supported; ", kSupportedFormats);
    MOEFQ_CHECK(!ckpt.find(base + ".weight_packed"), "tensor ", base, ".weight_packed: compressed-tensors packed ",
                "int4 expert weights are not supported; ", kSupportedFormats);
  }
  return ckpt.require(name, "expert weight");
}

// One expert's tensors (routed or shared, under `prefix`, e.g. "model.layers.3.mlp.experts.7."),
// found and checked for dtype and shape from the headers: gate, up and down weights and, for
// e4m3 and mxfp4, their scales.
struct ExpertTensors {
  std::vector<Checkpoint::Found> weights, scales;  // [gate, up, down]; scales empty for bf16
};

ExpertTensors find_expert(Checkpoint& ckpt, const LayerTensorNames& names, const std::string& prefix, int64_t hidden,
                          int64_t inter, std::optional<StoredWeightFormat>& format) {
  ExpertTensors t;
  for (const std::string* proj : {&names.gate_proj, &names.up_proj, &names.down_proj}) {
    const bool down = proj == &names.down_proj;
    const int64_t rows = down ? hidden : inter, cols = down ? inter : hidden;
    const std::string name = prefix + *proj + ".weight";
    const auto w = require_weight(ckpt, name);
    // The first expert weight decides the format; every other one must agree.
    if (!format.has_value()) format = format_of(ckpt, w, name);
    if (*format == StoredWeightFormat::kE4m3) {
      check_tensor(w, name, {StDtype::kF8E4M3}, {rows, cols});
      // fp32 scales in weight_scale_inv (DeepSeek-V3's Hugging Face names), or ue8m0 ones in .scale
      // (DeepSeek-V4's own names).
      const std::string inv = beside(name, ".weight_scale_inv"), ue = beside(name, ".scale");
      const bool own = !ckpt.find(inv) && ckpt.find(ue);
      const std::string sname = own ? ue : inv;
      const auto s = ckpt.require(sname, "block scales of an e4m3 expert weight");
      check_tensor(s, sname, {own ? StDtype::kF8E8M0 : StDtype::kF32}, {ceil_div(rows, kBlock), ceil_div(cols, kBlock)});
      t.scales.push_back(s);
    } else if (*format == StoredWeightFormat::kMxfp4) {
      // cols is a multiple of 128: whole bytes, whole 32-element blocks.
      check_tensor(w, name, {StDtype::kU8, StDtype::kI8}, {rows, cols / 2});
      const std::string sname = beside(name, ".scale");
      const auto s = ckpt.require(sname, "ue8m0 scales of an mxfp4 expert weight");
      check_tensor(s, sname, {StDtype::kF8E8M0, StDtype::kU8}, {rows, cols / 32});
      t.scales.push_back(s);
    } else {
      check_tensor(w, name, {StDtype::kBF16}, {rows, cols});
    }
    t.weights.push_back(w);
  }
  return t;
}

// The expert's weights read: gate and up concatenated into gate_up, their scales likewise (I is a
// multiple of 128, so the up rows start a new row of blocks). MXFP4 is decoded to bf16 here, one
// tensor at a time (the packed bytes of one tensor are the only transient copy).
ExpertWeights load_expert(Checkpoint& ckpt, const LayerTensorNames& names, const std::string& prefix, int64_t hidden,
                          int64_t inter, std::optional<StoredWeightFormat>& format) {
  const ExpertTensors t = find_expert(ckpt, names, prefix, hidden, inter, format);
  ExpertWeights w;
  w.hidden = hidden;
  w.intermediate = inter;
  w.format = loaded_weight_format(*format);
  for (size_t i = 0; i < 3; ++i) {
    const bool down = i == 2;
    if (*format == StoredWeightFormat::kE4m3) {
      auto& codes = down ? w.down_e4m3 : w.gate_up_e4m3;
      auto& scales = down ? w.down_scale : w.gate_up_scale;
      const size_t codes_before = codes.size(), scales_before = scales.size();
      append_tensor(codes, t.weights[i]);
      if (t.scales[i].info->dtype == StDtype::kF8E8M0) {
        std::vector<uint8_t> ue;
        append_tensor(ue, t.scales[i]);
        for (const uint8_t c : ue) scales.push_back(ue8m0_decode(c));  // 2^(c - 127), exact in fp32
      } else {
        append_tensor(scales, t.scales[i]);
      }
      check_finite(t.weights[i], codes, codes_before);
      check_finite(t.scales[i], scales, scales_before);
      continue;
    }
    auto& values = down ? w.down_bf16 : w.gate_up_bf16;
    const size_t before = values.size();
    if (*format == StoredWeightFormat::kBf16) {
      append_tensor(values, t.weights[i]);
    } else {
      const int64_t rows = down ? hidden : inter, cols = down ? inter : hidden;
      std::vector<uint8_t> packed, scales;
      append_tensor(packed, t.weights[i]);
      append_tensor(scales, t.scales[i]);
      const std::vector<bf16> decoded = decode_mxfp4(packed.data(), scales.data(), rows, cols);
      values.insert(values.end(), decoded.begin(), decoded.end());
    }
    // MXFP4: a NaN scale (0xFF) or a value beyond bf16's range is named here, by its decoded index.
    check_finite(t.weights[i], values, before);
  }
  return w;
}

// An expert held as bf16 where it was loaded in e4m3: the shared expert of a layer whose routed
// experts are MXFP4 (DeepSeek-V4 ships it in e4m3 with ue8m0 block scales), so that the layer holds
// one format. Each value is float(e4m3) * scale rounded to bf16: exact with power-of-two (ue8m0)
// scales down to bf16's subnormals, rounded to nearest with fp32 ones.
ExpertWeights as_bf16(ExpertWeights w) {
  if (w.format == WeightFormat::kBf16) return w;
  const auto round = [](const std::vector<float>& f) {
    std::vector<bf16> b(f.size());
    for (size_t i = 0; i < f.size(); ++i) b[i].bits = bf16_round(f[i]);
    return b;
  };
  w.gate_up_bf16 = round(w.gate_up_f32());
  w.down_bf16 = round(w.down_f32());
  w.gate_up_e4m3 = {};
  w.down_e4m3 = {};
  w.gate_up_scale = {};
  w.down_scale = {};
  w.format = WeightFormat::kBf16;
  return w;
}

// The format the shared expert is read in: the routed experts' (one layer, one format), except
// beside MXFP4 routed experts, where it is found from its own tensors (and held as bf16 like them).
std::optional<StoredWeightFormat> shared_format_given(const std::optional<StoredWeightFormat>& routed) {
  if (routed == StoredWeightFormat::kMxfp4) return std::nullopt;
  return routed;
}

// The router weight and, under noaux_tc, its correction bias, checked (no bias without noaux_tc:
// the router ignores it there). A layer that routes by token id (DeepSeek-V4's hash-routed layers,
// with a gate.tid2eid table) is refused: the engine routes by the router's scores.
std::pair<Checkpoint::Found, std::optional<Checkpoint::Found>> find_router(Checkpoint& ckpt,
                                                                          const LayerTensorNames& names,
                                                                          const MoeConfig& cfg) {
  const std::string tid2eid = beside(names.router, ".tid2eid");
  MOEFQ_CHECK(!ckpt.find(tid2eid), "tensor ", tid2eid, ": this layer routes its tokens by token id (a hash-routed ",
              "layer, as DeepSeek-V4's first layers are), which the engine does not express; evaluate the layers "
              "routed by the router's scores");
  const auto g = ckpt.require(names.router, "router weight");
  check_tensor(g, names.router, {StDtype::kBF16, StDtype::kF32}, {cfg.num_experts, cfg.hidden});
  if (!cfg.noaux_tc) return {g, std::nullopt};
  const auto b = ckpt.find(names.bias);
  MOEFQ_CHECK(b.has_value(), "missing tensor ", names.bias, " in checkpoint ", ckpt.where(),
              ": the config uses noaux_tc routing, which needs the correction bias");
  check_tensor(*b, names.bias, {StDtype::kF32, StDtype::kBF16}, {cfg.num_experts});
  return {g, b};
}

}  // namespace

std::string LayerTensorNames::expert_weight(int64_t e, const std::string& proj) const {
  return experts + std::to_string(e) + "." + proj + ".weight";
}

LayerTensorNames layer_tensor_names(const MoeConfig& cfg, int64_t layer) {
  const std::string base = "model.layers." + std::to_string(layer) + ".";
  LayerTensorNames n;
  if (cfg.model_type == "mixtral") {
    const std::string moe = base + "block_sparse_moe.";
    n.experts = moe + "experts.";
    n.shared = moe + "shared_experts.";  // Mixtral has none; never read (num_shared is 0)
    n.gate_proj = "w1";
    n.up_proj = "w3";
    n.down_proj = "w2";
    n.router = moe + "gate.weight";
    n.bias = moe + "gate.e_score_correction_bias";
  } else {
    const std::string mlp = base + "mlp.";
    n.experts = mlp + "experts.";
    n.shared = mlp + "shared_experts.";
    n.gate_proj = "gate_proj";
    n.up_proj = "up_proj";
    n.down_proj = "down_proj";
    n.router = mlp + "gate.weight";
    n.bias = mlp + "gate.e_score_correction_bias";
  }
  return n;
}

LayerTensorNames deepseek_v4_own_tensor_names(int64_t layer) {
  const std::string ffn = "layers." + std::to_string(layer) + ".ffn.";
  LayerTensorNames n;
  n.experts = ffn + "experts.";
  n.shared = ffn + "shared_experts.";
  n.gate_proj = "w1";
  n.up_proj = "w3";
  n.down_proj = "w2";
  n.router = ffn + "gate.weight";
  n.bias = ffn + "gate.bias";
  return n;
}

namespace {

// The names the checkpoint uses for the layer: layer_tensor_names', or for DeepSeek-V4 its own
// names where the Hugging Face ones are absent and its own router is there.
LayerTensorNames names_in(Checkpoint& ckpt, const MoeConfig& cfg, int64_t layer) {
  LayerTensorNames n = layer_tensor_names(cfg, layer);
  if (cfg.model_type != "deepseek_v4" || ckpt.find(n.router)) return n;
  LayerTensorNames own = deepseek_v4_own_tensor_names(layer);
  if (ckpt.find(own.router) || ckpt.find(beside(own.router, ".tid2eid"))) return own;
  return n;
}

}  // namespace

std::vector<std::string> checkpoint_files(const std::string& dir) { return Checkpoint(dir).files(); }

StoredWeightFormat checkpoint_stored_format(const std::string& dir, int64_t layer, const MoeConfig& cfg) {
  MOEFQ_CHECK(layer >= 0, dir, ": layer ", layer, " must be >= 0");
  Checkpoint ckpt(dir);
  const LayerTensorNames names = names_in(ckpt, cfg, layer);
  const std::string name = names.expert_weight(0, names.gate_proj);
  return format_of(ckpt, require_weight(ckpt, name), name);
}

WeightFormat checkpoint_weight_format(const std::string& dir, int64_t layer, const MoeConfig& cfg) {
  return loaded_weight_format(checkpoint_stored_format(dir, layer, cfg));
}

WeightFormat check_checkpoint_layers(const std::string& dir, const std::vector<int64_t>& layers, const MoeConfig& cfg,
                                     StoredWeightFormat* stored) {
  check_shapes_and_range(cfg, 0, cfg.num_experts, dir);
  MOEFQ_CHECK(!layers.empty(), dir, ": no layers to check");
  Checkpoint ckpt(dir);
  std::optional<StoredWeightFormat> format;
  for (const int64_t layer : layers) {
    MOEFQ_CHECK(layer >= 0, dir, ": layer ", layer, " must be >= 0");
    try {
      const LayerTensorNames names = names_in(ckpt, cfg, layer);
      for (int64_t e = 0; e < cfg.num_experts; ++e)
        (void)find_expert(ckpt, names, names.experts + std::to_string(e) + ".", cfg.hidden, cfg.intermediate, format);
      std::optional<StoredWeightFormat> shared_format = shared_format_given(format);
      if (cfg.num_shared > 0)
        (void)find_expert(ckpt, names, names.shared, cfg.hidden, cfg.intermediate * cfg.num_shared, shared_format);
      (void)find_router(ckpt, names, cfg);
    } catch (const Error& e) {
      throw Error(e.kind(), "layer " + std::to_string(layer) + ": " + e.what());
    }
  }
  if (stored) *stored = *format;
  return loaded_weight_format(*format);
}

LayerWeights load_checkpoint_layer(const std::string& dir, int64_t layer, const MoeConfig& cfg,
                                   int64_t first_expert, int64_t num_local, const ExpertProgress& on_progress) {
  check_shapes_and_range(cfg, first_expert, num_local, dir);
  MOEFQ_CHECK(layer >= 0, dir, ": layer ", layer, " must be >= 0");
  Checkpoint ckpt(dir);
  const LayerTensorNames names = names_in(ckpt, cfg, layer);

  LayerWeights lw;
  lw.first_expert = first_expert;
  std::optional<StoredWeightFormat> format;
  lw.experts.reserve(size_t(num_local));
  for (int64_t e = first_expert; e < first_expert + num_local; ++e) {
    lw.experts.push_back(load_expert(ckpt, names, names.experts + std::to_string(e) + ".", cfg.hidden,
                                     cfg.intermediate, format));
    if (on_progress) on_progress(e - first_expert + 1);
  }
  if (cfg.num_shared > 0) {
    // The routed experts' format decides (read from expert 0's header when this rank loads none).
    if (!format.has_value()) {
      const std::string first = names.expert_weight(0, names.gate_proj);
      format = format_of(ckpt, require_weight(ckpt, first), first);
    }
    std::optional<StoredWeightFormat> shared_format = shared_format_given(format);
    ExpertWeights shared =
        load_expert(ckpt, names, names.shared, cfg.hidden, cfg.intermediate * cfg.num_shared, shared_format);
    lw.shared.push_back(loaded_weight_format(*format) == WeightFormat::kBf16 ? as_bf16(std::move(shared))
                                                                              : std::move(shared));
    if (on_progress) on_progress(num_local + 1);
  }

  const auto [g, b] = find_router(ckpt, names, cfg);
  if (g.info->dtype == StDtype::kF32) {
    append_tensor(lw.gate, g);
  } else {
    std::vector<bf16> raw;
    append_tensor(raw, g);
    lw.gate.resize(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) lw.gate[i] = to_f32(raw[i]);
  }
  check_finite(g, lw.gate, 0);
  if (b && b->info->dtype == StDtype::kF32) {
    append_tensor(lw.gate_bias, *b);
  } else if (b) {
    std::vector<bf16> raw;
    append_tensor(raw, *b);
    for (const bf16 v : raw) lw.gate_bias.push_back(to_f32(v));
  }
  if (b) check_finite(*b, lw.gate_bias, 0);
  return lw;
}

}  // namespace moefq
