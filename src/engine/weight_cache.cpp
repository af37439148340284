// The synthetic weights' disk cache (include/moefq/weight_cache.h). File layout, little-endian:
//   "MOEFQWC1", u64 key length, key bytes, then the payload: u64 first_expert, u64 experts, u64
//   shared, each expert (u64 hidden, u64 intermediate, u8 format, its six vectors), gate, gate_bias
//   (every vector as u64 element count + raw elements), then u64 payload bytes and u64 checksum
//   (a 64-bit multiplicative hash of the payload).
#include "moefq/weight_cache.h"


#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <vector>

#include "moefq/errors.h"
#include "moefq/fileio.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;

constexpr char kMagic[8] = {'M', 'O', 'E', 'F', 'Q', 'W', 'C', '1'};

// A running hash of the bytes written or read, 8 bytes at a time (the tail bytewise).
struct Hash {
  uint64_t h = 0xcbf29ce484222325ull, bytes = 0;
  void add(const void* p, size_t n) {
    const auto* c = static_cast<const uint8_t*>(p);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      uint64_t w;
      std::memcpy(&w, c + i, 8);
      h = (h ^ w) * 0x100000001b3ull;
      h ^= h >> 29;
    }
    for (; i < n; ++i) h = (h ^ c[i]) * 0x100000001b3ull;
    bytes += n;
  }
};

uint64_t hash_text(const std::string& s) {
  Hash h;
  h.add(s.data(), s.size());
  return h.h;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)v);
  return buf;
}

// Writes through an AtomicFile (fileio.h: a temporary the signal handlers remove, renamed into
// place when complete); a failed write throws.
class Writer {
 public:
  explicit Writer(AtomicFile& f) : f_(f) {}
  void raw(const void* p, size_t n) { f_.write(p, n); }
  void payload(const void* p, size_t n) {
    raw(p, n);
    hash_.add(p, n);
  }
  void u64(uint64_t v) { payload(&v, 8); }
  template <typename T>
  void vec(const std::vector<T>& v) {
    u64(v.size());
    payload(v.data(), v.size() * sizeof(T));
  }
  Hash hash_;

 private:
  AtomicFile& f_;
};

class Reader {
 public:
  Reader(std::FILE* f, uint64_t size) : f_(f), left_(size) {}
  bool raw(void* p, size_t n) {
    if (!ok_ || n > left_ || (n && std::fread(p, 1, n, f_) != n)) return ok_ = false;
    left_ -= n;
    return true;
  }
  bool payload(void* p, size_t n) {
    if (!raw(p, n)) return false;
    hash_.add(p, n);
    return true;
  }
  uint64_t u64() {
    uint64_t v = 0;
    payload(&v, 8);
    return v;
  }
  template <typename T>
  void vec(std::vector<T>& v) {
    const uint64_t n = u64();
    if (!ok_ || n > left_ / sizeof(T)) {  // a count the rest of the file cannot hold: corrupt
      ok_ = false;
      return;
    }
    v.resize(size_t(n));
    payload(v.data(), size_t(n) * sizeof(T));
  }
  bool ok() const { return ok_; }
  uint64_t left() const { return left_; }
  Hash hash_;

 private:
  std::FILE* f_;
  uint64_t left_;
  bool ok_ = true;
};

// An expert's six vectors in file order, through a Reader (filling them) or a Writer.
template <typename IO, typename Expert>
void expert_vectors(IO& io, Expert& e) {
  io.vec(e.gate_up_e4m3);
  io.vec(e.down_e4m3);
  io.vec(e.gate_up_scale);
  io.vec(e.down_scale);
  io.vec(e.gate_up_bf16);
  io.vec(e.down_bf16);
}

bool off(const char* v) {
  if (!v) return false;
  const std::string s = v;
  return s == "off" || s == "0" || s == "no" || s == "false";
}

// The variable's value times unit, or fallback (already in the unit's multiples) when it is unset.
uint64_t env_u64(const char* name, uint64_t fallback, uint64_t unit) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const double d = std::strtod(v, &end);
  MOEFQ_CHECK(end && *end == '\0' && d >= 0 && d < 1e15, name, ": expected a number >= 0, got '", v, "'");
  return uint64_t(d * double(unit));
}

// Removes the least recently written files until `incoming` more bytes fit the cap.
void make_room(const WeightCacheSettings& s, uint64_t incoming) {
  std::vector<std::pair<fs::file_time_type, fs::path>> files;
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(s.dir, ec)) {
    if (!e.is_regular_file(ec) || e.path().extension() != ".bin") continue;
    total += e.file_size(ec);
    files.push_back({e.last_write_time(ec), e.path()});
  }
  std::sort(files.begin(), files.end());
  for (const auto& [t, p] : files) {
    if (total + incoming <= s.max_bytes) break;
    const uint64_t size = fs::file_size(p, ec);
    if (fs::remove(p, ec)) total -= std::min(total, size);
  }
}

}  // namespace

WeightCacheSettings WeightCacheSettings::from_env() {
  WeightCacheSettings s;
  s.enabled = !off(std::getenv("MOEFQ_CACHE"));
  if (const char* d = std::getenv("MOEFQ_CACHE_DIR"); d && *d) {
    s.dir = d;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    s.dir = (fs::path(x) / "moefq" / "weights").string();
  } else if (const char* h = std::getenv("HOME"); h && *h) {
    s.dir = (fs::path(h) / ".cache" / "moefq" / "weights").string();
  } else {
    s.enabled = false;  // nowhere to put it
  }
  s.min_bytes = env_u64("MOEFQ_CACHE_MIN_BYTES", s.min_bytes, 1);
  s.max_bytes = env_u64("MOEFQ_CACHE_MAX_GB", s.max_bytes, uint64_t(1) << 30);
  return s;
}

std::string weight_cache_key(const SyntheticLayer& l, const MoeConfig& c, WeightFormat format, int64_t first_expert,
                             int64_t num_local) {
  // The layer's synthetic parameters, hashed: whatever the generator derives from the seed.
  Hash p;
  const auto add_vec = [&](const auto& v) {
    const uint64_t n = v.size();
    p.add(&n, 8);
    p.add(v.data(), v.size() * sizeof(v[0]));
  };
  const float scalars[] = {l.weight_sigma, l.sink_value, l.sink_scale, l.super_up_gain, l.super_down_gain,
                           l.router_sink_super};
  p.add(scalars, sizeof scalars);
  add_vec(l.in_gain);
  add_vec(l.out_gain);
  add_vec(l.outlier_channels);
  add_vec(l.sink_channels);
  add_vec(l.super_experts);
  // Built without iostreams: in a process that also holds another C++ runtime (torch's), an
  // ostream's number formatting can resolve to that runtime's and crash (docs/python.md).
  const auto g9 = [](double v) {
    char buf[40];
    const int n = std::snprintf(buf, sizeof buf, "%.9g", v);
    return std::string(buf, size_t(n > 0 ? n : 0));
  };
  return detail::concat("moefq ", MOEFQ_VERSION, " generator ", kSyntheticGeneratorVersion, "; model ", c.name, " (",
                        c.model_type, ") H ", c.hidden, " I ", c.intermediate, " E ", c.num_experts, " K ", c.top_k,
                        " S ", c.num_shared, " groups ", c.n_group, "/", c.topk_group, " scaling ",
                        g9(c.routed_scaling), " scoring ", int(c.scoring), " norm ", c.norm_topk_prob, " noaux ",
                        c.noaux_tc, " clamp ", c.swiglu_clamp ? g9(*c.swiglu_clamp) : std::string("none"),
                        "; synthetic ", synthetic_kind_name(l.kind), " seed ", l.seed, " params ", hex64(p.h),
                        "; format ", weight_format_name(format), "; experts ", first_expert, "+", num_local);
}

std::string weight_cache_path(const WeightCacheSettings& s, const std::string& key) {
  return (fs::path(s.dir) / (hex64(hash_text(key)) + ".bin")).string();
}

uint64_t layer_weights_bytes(const LayerWeights& w) {
  uint64_t b = (w.gate.size() + w.gate_bias.size()) * 4;
  for (const auto* list : {&w.experts, &w.shared})
    for (const ExpertWeights& e : *list)
      b += e.gate_up_e4m3.size() + e.down_e4m3.size() + 4 * (e.gate_up_scale.size() + e.down_scale.size()) +
           2 * (e.gate_up_bf16.size() + e.down_bf16.size());
  return b;
}

std::optional<LayerWeights> weight_cache_load(const WeightCacheSettings& s, const std::string& key) {
  if (!s.enabled) return std::nullopt;
  const std::string path = weight_cache_path(s, key);
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return std::nullopt;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) return std::nullopt;
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return std::nullopt;
  Reader r(f, size);
  LayerWeights w;
  char magic[8];
  bool good = r.raw(magic, 8) && std::memcmp(magic, kMagic, 8) == 0;
  uint64_t klen = 0;
  good = good && r.raw(&klen, 8) && klen == key.size();
  std::string k(good ? size_t(klen) : 0, '\0');
  good = good && r.raw(k.data(), k.size()) && k == key;
  if (good) {
    w.first_expert = int64_t(r.u64());
    const uint64_t ne = r.u64(), ns = r.u64();
    good = r.ok() && ne <= (1u << 20) && ns <= 16;
    for (uint64_t i = 0; good && i < ne + ns; ++i) {
      ExpertWeights e;
      e.hidden = int64_t(r.u64());
      e.intermediate = int64_t(r.u64());
      uint8_t fmt = 0;
      r.payload(&fmt, 1);
      e.format = fmt ? WeightFormat::kBf16 : WeightFormat::kE4m3;
      expert_vectors(r, e);
      good = r.ok();
      (i < ne ? w.experts : w.shared).push_back(std::move(e));
    }
    r.vec(w.gate);
    r.vec(w.gate_bias);
    const Hash h = r.hash_;
    uint64_t bytes = 0, sum = 0;
    good = good && r.ok() && r.raw(&bytes, 8) && r.raw(&sum, 8) && r.left() == 0 && bytes == h.bytes && sum == h.h;
  }
  std::fclose(f);
  if (!good) return std::nullopt;
  fs::last_write_time(path, fs::file_time_type::clock::now(), ec);  // recently used: evicted last
  return w;
}

bool weight_cache_store(const WeightCacheSettings& s, const std::string& key, const LayerWeights& w) {
  if (!s.enabled) return false;
  const uint64_t bytes = layer_weights_bytes(w);
  if (bytes < s.min_bytes || bytes > s.max_bytes) return false;
  std::error_code ec;
  fs::create_directories(s.dir, ec);
  if (!fs::is_directory(s.dir, ec)) return false;
  make_room(s, bytes);
  // A cache that cannot be written (a full disk, a read-only folder) is no error: the run goes on.
  try {
    AtomicFile f(weight_cache_path(s, key));
    Writer wr(f);
    wr.raw(kMagic, 8);
    const uint64_t klen = key.size();
    wr.raw(&klen, 8);
    wr.raw(key.data(), key.size());
    wr.u64(uint64_t(w.first_expert));
    wr.u64(w.experts.size());
    wr.u64(w.shared.size());
    for (const auto* list : {&w.experts, &w.shared})
      for (const ExpertWeights& e : *list) {
        wr.u64(uint64_t(e.hidden));
        wr.u64(uint64_t(e.intermediate));
        const uint8_t fmt = e.format == WeightFormat::kBf16 ? 1 : 0;
        wr.payload(&fmt, 1);
        expert_vectors(wr, e);
      }
    wr.vec(w.gate);
    wr.vec(w.gate_bias);
    const Hash h = wr.hash_;
    wr.raw(&h.bytes, 8);
    wr.raw(&h.h, 8);
    f.commit();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

LayerWeights cached_synthetic_layer_weights(const SyntheticLayer& layer, const MoeConfig& cfg, WeightFormat format,
                                            int64_t first_expert, int64_t num_local, int num_threads,
                                            const ExpertProgress& on_progress, const WeightCacheSettings& s,
                                            bool* hit) {
  const std::string key = s.enabled ? weight_cache_key(layer, cfg, format, first_expert, num_local) : std::string();
  if (s.enabled)
    if (std::optional<LayerWeights> w = weight_cache_load(s, key)) {
      if (hit) *hit = true;
      return std::move(*w);
    }
  if (hit) *hit = false;
  LayerWeights w = synthetic_layer_weights(layer, cfg, format, first_expert, num_local, num_threads, on_progress);
  if (s.enabled) (void)weight_cache_store(s, key, w);
  return w;
}

}  // namespace moefq
