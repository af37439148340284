// An on-disk cache of the synthetic weights the CPU evaluation generates: a full-size layer takes
// minutes to make on a CPU and seconds to read back. One file per (layer, rank's expert range),
// named by a 64-bit hash of its key; the key holds everything the bytes depend on (the model
// config, the synthetic kind, the layer seed and whether the layer is early, the weight format, the
// expert range, the generator version and a fingerprint of the layer's synthetic parameters) and is
// stored in the file, which is read back only when its key, size and checksum all match (a
// truncated, corrupt or colliding file is regenerated and replaced). Files are written to a unique
// temporary name and renamed, so concurrent runs never see a partial file. Settings (environment):
//   MOEFQ_CACHE_DIR        the directory (default $XDG_CACHE_HOME/moefq/weights, else
//                          $HOME/.cache/moefq/weights)
//   MOEFQ_CACHE=off        no cache (also 0, no, false)
//   MOEFQ_CACHE_MIN_BYTES  cache a rank's weights only from this size (default 64 MiB: small layers
//                          are quicker to make than to read)
//   MOEFQ_CACHE_MAX_GB     the directory's size cap (default 64); the least recently used files go
//                          first, and a file larger than the cap is not written
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "moefq/synthetic.h"
#include "moefq/weights.h"

namespace moefq {

struct WeightCacheSettings {
  bool enabled = false;
  std::string dir;
  uint64_t min_bytes = uint64_t(64) << 20;
  uint64_t max_bytes = uint64_t(64) << 30;
  static WeightCacheSettings from_env();
};

// Bump when the synthetic generator's rules change the bytes for the same inputs.
inline constexpr int kSyntheticGeneratorVersion = 1;

// The key of experts [first_expert, first_expert + num_local) of a synthetic layer.
std::string weight_cache_key(const SyntheticLayer& layer, const MoeConfig& cfg, WeightFormat format,
                             int64_t first_expert, int64_t num_local);
// Where that key's file lives.
std::string weight_cache_path(const WeightCacheSettings& s, const std::string& key);

// The bytes a LayerWeights holds (what min_bytes and the cap compare).
uint64_t layer_weights_bytes(const LayerWeights& w);

// The cached weights, or nullopt (no file, another key, a bad size or checksum: never an error).
std::optional<LayerWeights> weight_cache_load(const WeightCacheSettings& s, const std::string& key);
// Writes the file (atomically); false when it was not written (disabled, below min_bytes, over the
// cap, an I/O error).
bool weight_cache_store(const WeightCacheSettings& s, const std::string& key, const LayerWeights& w);

// synthetic_layer_weights through the cache: read when present and valid, else generated and stored.
// hit (may be null) says which.
LayerWeights cached_synthetic_layer_weights(const SyntheticLayer& layer, const MoeConfig& cfg, WeightFormat format,
                                            int64_t first_expert, int64_t num_local, int num_threads,
                                            const ExpertProgress& on_progress, const WeightCacheSettings& s,
                                            bool* hit = nullptr);

}  // namespace moefq
