// Error metrics of numerics.md for an output y against a reference r, in float64.
// Positions where the reference is not finite are left out (and counted); a non-finite y where
// the reference is finite makes the metrics non-finite, so it cannot go unnoticed.
#pragma once

#include <cstdint>
#include <string>

#include "moefq/numerics.h"

namespace moefq {

struct ErrorMetrics {
  double rel_l2 = 0;     // ||y - r|| / ||r||
  double cosine = 1;     // cosine similarity
  double calc_diff = 0;  // 1 - 2 sum(y'r') / sum(y'^2 + r'^2), y' = y + 1, r' = r + 1
  double max_abs = 0;    // max |y - r|
  double snr_db = 0;     // 10 log10(sum r^2 / sum (y - r)^2); +inf when y == r
  int64_t count = 0;     // positions compared
  int64_t skipped_nonfinite = 0;  // positions whose reference is NaN or inf
};

ErrorMetrics compute_metrics(const bf16* y, const bf16* r, int64_t n);
ErrorMetrics compute_metrics(const float* y, const float* r, int64_t n);

}  // namespace moefq
