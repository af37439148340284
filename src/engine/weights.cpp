#include "moefq/weights.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <sstream>

#include "moefq/errors.h"
#include "moefq/fileio.h"
#include "moefq/safetensors.h"

namespace moefq {

namespace fs = std::filesystem;

// Scales and bf16 values are copied straight out of the mapped files.
static_assert(std::endian::native == std::endian::little, "weights: little-endian hosts only");

namespace {

constexpr int64_t kBlock = 128;  // weight scales cover 128 x 128 blocks

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// Dequantization

// [rows, cols] e4m3 codes with [ceil(rows/128), ceil(cols/128)] fp32 block scales -> fp32.
std::vector<float> dequant_e4m3(const std::vector<uint8_t>& codes, const std::vector<float>& scales,
                                int64_t rows, int64_t cols, const char* what) {
  const int64_t scale_cols = ceil_div(cols, kBlock);
  MOEFQ_ASSERT(rows >= 0 && cols >= 0 && codes.size() == size_t(rows * cols), what, ": ",
               codes.size(), " e4m3 codes for a [", rows, ", ", cols, "] matrix");
  MOEFQ_ASSERT(scales.size() == size_t(ceil_div(rows, kBlock) * scale_cols), what, ": ",
               scales.size(), " block scales for a [", rows, ", ", cols, "] matrix (expected [",
               ceil_div(rows, kBlock), ", ", scale_cols, "])");
  // e4m3_decode of every code, looked up: the values are the same, the decode per element is not.
  static const auto decoded = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = e4m3_decode(uint8_t(c));
    return t;
  }();
  std::vector<float> out(codes.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scales.data() + (r / kBlock) * scale_cols;
    const uint8_t* crow = codes.data() + r * cols;
    float* orow = out.data() + r * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const float s = srow[c0 / kBlock];
      const int64_t c1 = std::min(cols, c0 + kBlock);
      for (int64_t c = c0; c < c1; ++c) orow[c] = mul_rn(decoded[crow[c]], s);
    }
  }
  return out;
}

std::vector<float> dequant_bf16(const std::vector<bf16>& w, int64_t rows, int64_t cols,
                                const char* what) {
  MOEFQ_ASSERT(rows >= 0 && cols >= 0 && w.size() == size_t(rows * cols), what, ": ", w.size(),
               " bf16 values for a [", rows, ", ", cols, "] matrix");
  std::vector<float> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = to_f32(w[i]);
  return out;
}

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

// ---------------------------------------------------------------------------------------------
// Checkpoint loading

std::string shape_str(std::span<const int64_t> shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
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

 private:
  void read_index(const std::string& path) {
    index_path_ = path;
    const std::string text = read_regular_file(path, kMaxIndexBytes, "checkpoint index " + path);
    nlohmann::json root;
    try {
      root = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      MOEFQ_FAIL(ErrorKind::kBadInput, path, ": malformed checkpoint index (not JSON): ", e.what());
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

// One expert (routed or shared) under `prefix` ("model.layers.3.mlp.experts.7."): gate and up
// concatenated into gate_up, their scales likewise (I is a multiple of 128, so the up rows start
// a new row of blocks).
ExpertWeights load_expert(Checkpoint& ckpt, const std::string& prefix, int64_t hidden,
                          int64_t inter, std::optional<WeightFormat>& format) {
  ExpertWeights w;
  w.hidden = hidden;
  w.intermediate = inter;
  const char* kProj[] = {"gate_proj", "up_proj", "down_proj"};
  for (const char* proj : kProj) {
    const bool down = std::strcmp(proj, "down_proj") == 0;
    const int64_t rows = down ? hidden : inter, cols = down ? inter : hidden;
    const std::string name = prefix + proj + ".weight";
    const auto t = ckpt.require(name, "expert weight");
    if (!format.has_value()) {
      // The first expert weight decides the format; every other one must agree.
      MOEFQ_CHECK(t.info->dtype == StDtype::kF8E4M3 || t.info->dtype == StDtype::kBF16,
                  "tensor ", name, " in ", t.file->path(), ": dtype ",
                  st_dtype_name(t.info->dtype), ", expected F8_E4M3 (with weight_scale_inv) or BF16");
      format = t.info->dtype == StDtype::kF8E4M3 ? WeightFormat::kE4m3 : WeightFormat::kBf16;
    }
    w.format = *format;
    if (*format == WeightFormat::kE4m3) {
      check_tensor(t, name, {StDtype::kF8E4M3}, {rows, cols});
      const std::string sname = prefix + proj + ".weight_scale_inv";
      const auto s = ckpt.require(sname, "block scales of an e4m3 expert weight");
      check_tensor(s, sname, {StDtype::kF32}, {ceil_div(rows, kBlock), ceil_div(cols, kBlock)});
      append_tensor(down ? w.down_e4m3 : w.gate_up_e4m3, t);
      append_tensor(down ? w.down_scale : w.gate_up_scale, s);
    } else {
      check_tensor(t, name, {StDtype::kBF16}, {rows, cols});
      append_tensor(down ? w.down_bf16 : w.gate_up_bf16, t);
    }
  }
  return w;
}

}  // namespace

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kE4m3:
      return "e4m3";
    case WeightFormat::kBf16:
      return "bf16";
  }
  return "unknown";
}

std::vector<float> ExpertWeights::gate_up_f32() const {
  if (format == WeightFormat::kE4m3)
    return dequant_e4m3(gate_up_e4m3, gate_up_scale, 2 * intermediate, hidden, "gate_up");
  return dequant_bf16(gate_up_bf16, 2 * intermediate, hidden, "gate_up");
}

std::vector<float> ExpertWeights::down_f32() const {
  if (format == WeightFormat::kE4m3)
    return dequant_e4m3(down_e4m3, down_scale, hidden, intermediate, "down");
  return dequant_bf16(down_bf16, hidden, intermediate, "down");
}

LayerWeights load_deepseek_layer(const std::string& dir, int64_t layer, const MoeConfig& cfg,
                                 int64_t first_expert, int64_t num_local) {
  check_shapes_and_range(cfg, first_expert, num_local, dir);
  MOEFQ_CHECK(layer >= 0, dir, ": layer ", layer, " must be >= 0");
  Checkpoint ckpt(dir);
  const std::string mlp = "model.layers." + std::to_string(layer) + ".mlp.";

  LayerWeights lw;
  lw.first_expert = first_expert;
  std::optional<WeightFormat> format;
  lw.experts.reserve(size_t(num_local));
  for (int64_t e = first_expert; e < first_expert + num_local; ++e)
    lw.experts.push_back(load_expert(ckpt, mlp + "experts." + std::to_string(e) + ".", cfg.hidden,
                                     cfg.intermediate, format));
  if (cfg.num_shared > 0)
    lw.shared.push_back(load_expert(ckpt, mlp + "shared_experts.", cfg.hidden,
                                    cfg.intermediate * cfg.num_shared, format));

  const std::string gname = mlp + "gate.weight";
  const auto g = ckpt.require(gname, "router weight");
  check_tensor(g, gname, {StDtype::kBF16, StDtype::kF32}, {cfg.num_experts, cfg.hidden});
  if (g.info->dtype == StDtype::kF32) {
    append_tensor(lw.gate, g);
  } else {
    std::vector<bf16> raw;
    append_tensor(raw, g);
    lw.gate.resize(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) lw.gate[i] = to_f32(raw[i]);
  }

  // The correction bias only steers selection under noaux_tc; without it the router ignores it.
  if (cfg.noaux_tc) {
    const std::string bname = mlp + "gate.e_score_correction_bias";
    const auto b = ckpt.find(bname);
    MOEFQ_CHECK(b.has_value(), "missing tensor ", bname, " in checkpoint ", ckpt.where(),
                ": the config uses noaux_tc routing, which needs the correction bias");
    check_tensor(*b, bname, {StDtype::kF32}, {cfg.num_experts});
    append_tensor(lw.gate_bias, *b);
  }
  return lw;
}

}  // namespace moefq
