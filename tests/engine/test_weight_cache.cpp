// The synthetic weights' disk cache (weight_cache.h): a second run reads what the first made, bit
// for bit; any change of what the bytes depend on misses; a truncated, corrupt or foreign file is
// never used but made again; concurrent writers leave one valid file; the settings come from the
// environment with an off switch; the size cap evicts the least recently used files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "moefq/errors.h"
#include "moefq/moe_config.h"
#include "moefq/weight_cache.h"

namespace moefq {
namespace {

namespace fs = std::filesystem;

bool same(const LayerWeights& a, const LayerWeights& b) {
  const auto eq = [](const ExpertWeights& x, const ExpertWeights& y) {
    return x.hidden == y.hidden && x.intermediate == y.intermediate && x.format == y.format &&
           x.gate_up_e4m3 == y.gate_up_e4m3 && x.down_e4m3 == y.down_e4m3 && x.gate_up_scale == y.gate_up_scale &&
           x.down_scale == y.down_scale && x.gate_up_bf16.size() == y.gate_up_bf16.size() &&
           std::equal(x.gate_up_bf16.begin(), x.gate_up_bf16.end(), y.gate_up_bf16.begin(),
                      [](bf16 p, bf16 q) { return p.bits == q.bits; }) &&
           std::equal(x.down_bf16.begin(), x.down_bf16.end(), y.down_bf16.begin(), y.down_bf16.end(),
                      [](bf16 p, bf16 q) { return p.bits == q.bits; });
  };
  if (a.first_expert != b.first_expert || a.experts.size() != b.experts.size() || a.shared.size() != b.shared.size() ||
      a.gate != b.gate || a.gate_bias != b.gate_bias)
    return false;
  for (size_t i = 0; i < a.experts.size(); ++i)
    if (!eq(a.experts[i], b.experts[i])) return false;
  for (size_t i = 0; i < a.shared.size(); ++i)
    if (!eq(a.shared[i], b.shared[i])) return false;
  return true;
}

class WeightCache : public ::testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    root_ = fs::temp_directory_path() / ("moefq_wcache_" + std::to_string(::getpid()) + "_" + std::to_string(rd()));
    s_.enabled = true;
    s_.dir = (root_ / "cache").string();
    s_.min_bytes = 0;
    cfg_ = preset("tiny");
    layer_ = synthetic_layer(cfg_, 7, SyntheticKind::kModel, true);
  }
  void TearDown() override { fs::remove_all(root_); }

  LayerWeights get(bool* hit, const WeightCacheSettings* s = nullptr) {
    return cached_synthetic_layer_weights(layer_, cfg_, WeightFormat::kE4m3, 2, 3, 1, {}, s ? *s : s_, hit);
  }
  std::string path() const {
    return weight_cache_path(s_, weight_cache_key(layer_, cfg_, WeightFormat::kE4m3, 2, 3));
  }
  size_t files() const {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator(s_.dir)) n += e.path().extension() == ".bin" ? 1 : 0;
    return n;
  }

  fs::path root_;
  WeightCacheSettings s_;
  MoeConfig cfg_;
  SyntheticLayer layer_;
};

TEST_F(WeightCache, SecondRunReadsTheSameBytes) {
  bool hit = true;
  const LayerWeights made = get(&hit);
  EXPECT_FALSE(hit);
  EXPECT_TRUE(same(made, synthetic_layer_weights(layer_, cfg_, WeightFormat::kE4m3, 2, 3, 1)));
  ASSERT_TRUE(fs::is_regular_file(path()));
  const LayerWeights read = get(&hit);
  EXPECT_TRUE(hit);
  EXPECT_TRUE(same(made, read));
  EXPECT_EQ(files(), 1u);
}

TEST_F(WeightCache, EveryKeyChangeMisses) {
  const std::string base = weight_cache_key(layer_, cfg_, WeightFormat::kE4m3, 2, 3);
  ASSERT_TRUE(weight_cache_store(s_, base, synthetic_layer_weights(layer_, cfg_, WeightFormat::kE4m3, 2, 3, 1)));
  ASSERT_TRUE(weight_cache_load(s_, base).has_value());
  MoeConfig other_cfg = cfg_;
  other_cfg.intermediate *= 2;
  MoeConfig other_scoring = cfg_;
  other_scoring.routed_scaling += 1;
  MoeConfig other_name = cfg_;
  other_name.name = "tiny2";
  SyntheticLayer edited = layer_;
  edited.out_gain[5] *= 2;  // a generator change the seed does not show
  const std::vector<std::pair<std::string, std::string>> keys = {
      {"seed", weight_cache_key(synthetic_layer(cfg_, 8, SyntheticKind::kModel, true), cfg_, WeightFormat::kE4m3, 2, 3)},
      {"early layer", weight_cache_key(synthetic_layer(cfg_, 7, SyntheticKind::kModel, false), cfg_, WeightFormat::kE4m3, 2, 3)},
      {"kind", weight_cache_key(synthetic_layer(cfg_, 7, SyntheticKind::kGaussian, true), cfg_, WeightFormat::kE4m3, 2, 3)},
      {"format", weight_cache_key(layer_, cfg_, WeightFormat::kBf16, 2, 3)},
      {"first expert", weight_cache_key(layer_, cfg_, WeightFormat::kE4m3, 3, 3)},
      {"expert count", weight_cache_key(layer_, cfg_, WeightFormat::kE4m3, 2, 2)},
      {"config shape", weight_cache_key(layer_, other_cfg, WeightFormat::kE4m3, 2, 3)},
      {"config routing", weight_cache_key(layer_, other_scoring, WeightFormat::kE4m3, 2, 3)},
      {"model name", weight_cache_key(layer_, other_name, WeightFormat::kE4m3, 2, 3)},
      {"layer parameters", weight_cache_key(edited, cfg_, WeightFormat::kE4m3, 2, 3)},
  };
  for (const auto& [what, key] : keys) {
    SCOPED_TRACE(what);
    EXPECT_NE(key, base);
    EXPECT_NE(weight_cache_path(s_, key), weight_cache_path(s_, base));
    EXPECT_FALSE(weight_cache_load(s_, key).has_value());
  }
  // A file found under another key's name (a hash collision) is not that key's.
  const std::string foreign = weight_cache_path(s_, keys[0].second);
  fs::copy_file(weight_cache_path(s_, base), foreign);
  EXPECT_FALSE(weight_cache_load(s_, keys[0].second).has_value());
}

TEST_F(WeightCache, TruncatedOrCorruptFilesAreMadeAgain) {
  bool hit = false;
  const LayerWeights made = get(&hit);
  const uintmax_t size = fs::file_size(path());
  const std::string good = [&] {
    std::ifstream in(path(), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  const auto damage = [&](const std::string& bytes) {
    std::ofstream(path(), std::ios::binary | std::ios::trunc) << bytes;
  };
  std::string flipped = good;
  flipped[good.size() / 2] ^= 0x10;
  std::string flipped_sum = good;
  flipped_sum.back() ^= 0x01;
  for (const auto& [what, bytes] : std::vector<std::pair<std::string, std::string>>{
           {"truncated", good.substr(0, good.size() - 100)},
           {"truncated in the header", good.substr(0, 12)},
           {"empty", ""},
           {"a flipped payload bit", flipped},
           {"a flipped checksum bit", flipped_sum},
           {"trailing bytes", good + "x"},
           {"garbage", std::string(4096, '\x7f')}}) {
    SCOPED_TRACE(what);
    damage(bytes);
    EXPECT_FALSE(weight_cache_load(s_, weight_cache_key(layer_, cfg_, WeightFormat::kE4m3, 2, 3)).has_value());
    const LayerWeights again = get(&hit);
    EXPECT_FALSE(hit);
    EXPECT_TRUE(same(made, again));
    EXPECT_EQ(fs::file_size(path()), size) << "rewritten whole";
    (void)get(&hit);
    EXPECT_TRUE(hit);
  }
}

TEST_F(WeightCache, ConcurrentWritersLeaveOneValidFile) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      bool hit = false;
      for (int i = 0; i < 3; ++i) (void)get(&hit);
    });
  for (std::thread& t : threads) t.join();
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(s_.dir)) {
    ++entries;
    EXPECT_EQ(e.path().extension(), ".bin") << "no temporary file is left: " << e.path();
  }
  EXPECT_EQ(entries, 1u);
  bool hit = false;
  (void)get(&hit);
  EXPECT_TRUE(hit);
}

TEST_F(WeightCache, SettingsFromTheEnvironment) {
  const auto with = [](const char* name, const char* value) {
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  };
  // Unset: the defaults, 64 MiB and 64 GiB.
  for (const char* v : {"MOEFQ_CACHE", "MOEFQ_CACHE_MIN_BYTES", "MOEFQ_CACHE_MAX_GB"}) with(v, nullptr);
  with("MOEFQ_CACHE_DIR", "/d");
  const WeightCacheSettings d = WeightCacheSettings::from_env();
  EXPECT_TRUE(d.enabled);
  EXPECT_EQ(d.min_bytes, uint64_t(64) << 20);
  EXPECT_EQ(d.max_bytes, uint64_t(64) << 30);
  with("MOEFQ_CACHE_DIR", "/some/where");
  with("MOEFQ_CACHE", nullptr);
  with("MOEFQ_CACHE_MIN_BYTES", "1000");
  with("MOEFQ_CACHE_MAX_GB", "2");
  WeightCacheSettings s = WeightCacheSettings::from_env();
  EXPECT_TRUE(s.enabled);
  EXPECT_EQ(s.dir, "/some/where");
  EXPECT_EQ(s.min_bytes, 1000u);
  EXPECT_EQ(s.max_bytes, uint64_t(2) << 30);
  with("MOEFQ_CACHE_DIR", nullptr);
  with("XDG_CACHE_HOME", "/xdg");
  EXPECT_EQ(WeightCacheSettings::from_env().dir, "/xdg/moefq/weights");
  with("XDG_CACHE_HOME", nullptr);
  with("HOME", "/home/u");
  EXPECT_EQ(WeightCacheSettings::from_env().dir, "/home/u/.cache/moefq/weights");
  for (const char* v : {"off", "0", "no", "false"}) {
    with("MOEFQ_CACHE", v);
    EXPECT_FALSE(WeightCacheSettings::from_env().enabled) << v;
  }
  with("MOEFQ_CACHE", nullptr);
  with("MOEFQ_CACHE_MIN_BYTES", "lots");
  EXPECT_THROW((void)WeightCacheSettings::from_env(), Error);
  with("MOEFQ_CACHE_MIN_BYTES", nullptr);
  with("MOEFQ_CACHE_MAX_GB", nullptr);
  // Disabled, or below the size floor: nothing is written.
  WeightCacheSettings offs = s_;
  offs.enabled = false;
  bool hit = true;
  (void)get(&hit, &offs);
  EXPECT_FALSE(fs::exists(s_.dir));
  WeightCacheSettings small = s_;
  small.min_bytes = uint64_t(1) << 40;
  (void)get(&hit, &small);
  EXPECT_FALSE(fs::exists(path()));
}

TEST_F(WeightCache, TheCapEvictsTheLeastRecentlyUsed) {
  bool hit = false;
  (void)get(&hit);
  const uint64_t one = fs::file_size(path());
  WeightCacheSettings capped = s_;
  capped.max_bytes = one + one / 2;  // room for one file
  const SyntheticLayer other = synthetic_layer(cfg_, 9, SyntheticKind::kModel, true);
  const std::string k2 = weight_cache_key(other, cfg_, WeightFormat::kE4m3, 2, 3);
  ASSERT_TRUE(weight_cache_store(capped, k2, synthetic_layer_weights(other, cfg_, WeightFormat::kE4m3, 2, 3, 1)));
  EXPECT_FALSE(fs::exists(path())) << "the older file made room";
  EXPECT_TRUE(weight_cache_load(capped, k2).has_value());
  capped.max_bytes = one / 2;  // a file larger than the cap is not written
  EXPECT_FALSE(weight_cache_store(capped, weight_cache_key(layer_, cfg_, WeightFormat::kE4m3, 2, 3),
                                  synthetic_layer_weights(layer_, cfg_, WeightFormat::kE4m3, 2, 3, 1)));
}

}  // namespace
}  // namespace moefq
