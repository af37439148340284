#include "moefq/metrics.h"

#include <cmath>
#include <limits>

namespace moefq {
namespace {

template <typename T>
ErrorMetrics metrics_impl(const T* y, const T* r, int64_t n) {
  ErrorMetrics m;
  double err2 = 0, ref2 = 0, out2 = 0, dot = 0, dot1 = 0, sq1 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double rv = to_f32(r[i]), yv = to_f32(y[i]);
    if (!std::isfinite(rv)) {
      ++m.skipped_nonfinite;
      continue;
    }
    ++m.count;
    const double d = yv - rv;
    err2 += d * d;
    ref2 += rv * rv;
    out2 += yv * yv;
    dot += yv * rv;
    dot1 += (yv + 1) * (rv + 1);
    sq1 += (yv + 1) * (yv + 1) + (rv + 1) * (rv + 1);
    const double ad = std::fabs(d);
    if (!(ad <= m.max_abs)) m.max_abs = ad;  // NaN propagates
  }
  const double inf = std::numeric_limits<double>::infinity();
  if (m.count == 0) return m;
  m.rel_l2 = ref2 > 0 ? std::sqrt(err2 / ref2) : (err2 > 0 ? inf : 0.0);
  m.cosine = (ref2 > 0 && out2 > 0) ? dot / std::sqrt(ref2 * out2) : (ref2 == out2 ? 1.0 : 0.0);
  m.calc_diff = sq1 > 0 ? 1.0 - 2.0 * dot1 / sq1 : 0.0;
  m.snr_db = err2 > 0 ? 10.0 * std::log10(ref2 / err2) : inf;
  return m;
}

}  // namespace

ErrorMetrics compute_metrics(const bf16* y, const bf16* r, int64_t n) { return metrics_impl(y, r, n); }
ErrorMetrics compute_metrics(const float* y, const float* r, int64_t n) { return metrics_impl(y, r, n); }

}  // namespace moefq
