#include "moefq/synthetic.h"

#include <random>

namespace moefq {

std::vector<float> synthetic_activations(int64_t rows, int64_t cols, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::student_t_distribution<float> heavy(3.0f);
  std::vector<float> col_scale(size_t(cols), 1.0f);
  for (auto& s : col_scale)
    if (rng() % 97 == 0) s = float(100 + rng() % 900);
  std::vector<float> x(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) x[size_t(r * cols + c)] = heavy(rng) * col_scale[size_t(c)];
  return x;
}

}  // namespace moefq
