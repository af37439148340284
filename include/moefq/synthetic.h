// Seeded synthetic data that looks like what a MoE layer really carries.
#pragma once

#include <cstdint>
#include <vector>

namespace moefq {

// [rows, cols] hidden states like an LLM's: a heavy-tailed body (Student-t, 3 degrees of freedom)
// and a few outlier channels (about 1 in 97 columns) scaled by 100 to 1000. Deterministic in seed.
std::vector<float> synthetic_activations(int64_t rows, int64_t cols, uint64_t seed);

}  // namespace moefq
