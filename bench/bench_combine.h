// `moefq bench combine`: the GPU combine kernels (docs/engine.md's combine and docs/fake_quant.md's combine
// quantizer with its layout check) against the device copy bandwidth. No CUDA types here;
// run_bench_combine exists in CUDA builds only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefq::bench {

struct CombineBenchOptions {
  int64_t tokens = 4096;  // T = num_tokens
  int64_t top_k = 8;      // K
  int64_t hidden = 7168;  // H
  std::vector<std::string> formats;  // "combine" and any format names (format_choices()); empty: all
  // before: the rows are summed as they are; after: each routed row is multiplied by its router
  // weight in the sum (CombineRows::topk_weights).
  std::string combine_weighting = "before";
  int launches_per_graph = 10;
  int reps = 15;
  std::string json;  // write the results here too
};

// For each format (and "combine", the plain combine) and each variant (all K slots active; plus
// the fused shared slot; ~10% of the routed slots inactive; with the layout check on): time, GB/s
// (rows read + y written, + the engine output read by the check) and the ratio to a
// device-to-device copy measured in the same run; one correctness check per case against the
// CPU on the first tokens. Returns 0, or 1 when a check failed.
int run_bench_combine(const CombineBenchOptions& options);

}  // namespace moefq::bench
