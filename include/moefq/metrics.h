// Error metrics of docs/numerics.md for an output y against a reference r, in float64.
// Positions where the reference is not finite are left out (and counted); a non-finite y where
// the reference is finite makes the metrics non-finite (NaN), so it cannot go unnoticed; so does
// having nothing to compare (count 0: every reference position non-finite, or no positions).
// The metrics are finalised from sums (MetricSums) that any device can accumulate over any part
// of the data and that add up: the eval reduces them per token on the CPU or the GPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// The sums the metrics are made of, over the positions with a finite reference.
struct MetricSums {
  double err2 = 0, ref2 = 0, out2 = 0, dot = 0;  // sum (y-r)^2, r^2, y^2, y r
  double dot1 = 0, sq1 = 0;                      // sum (y+1)(r+1), (y+1)^2 + (r+1)^2
  double max_abs = 0;                            // max |y - r| (NaN when y is not finite)
  int64_t count = 0, skipped = 0;
  int64_t nonfinite_out = 0;  // positions whose output is NaN or inf where the reference is finite

  void add(double y, double r);
  void merge(const MetricSums& o);
};

// rel_l2, cosine, calc_diff, SNR and max_abs from the sums; NaN when an output was not finite or
// when no position was compared (count 0), never the figures of a perfect match.
ErrorMetrics finalize_metrics(const MetricSums& s);

ErrorMetrics compute_metrics(const bf16* y, const bf16* r, int64_t n);
ErrorMetrics compute_metrics(const float* y, const float* r, int64_t n);

}  // namespace moefq
