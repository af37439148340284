#include "moefq/metrics.h"

#include <cmath>
#include <limits>

namespace moefq {

void MetricSums::add(double y, double r) {
  if (!std::isfinite(r)) {
    ++skipped;
    return;
  }
  ++count;
  if (!std::isfinite(y)) ++nonfinite_out;
  const double d = y - r;
  err2 += d * d;
  ref2 += r * r;
  out2 += y * y;
  dot += y * r;
  dot1 += (y + 1) * (r + 1);
  sq1 += (y + 1) * (y + 1) + (r + 1) * (r + 1);
  const double ad = std::fabs(d);
  if (!(ad <= max_abs)) max_abs = ad;  // NaN propagates
}

void MetricSums::merge(const MetricSums& o) {
  err2 += o.err2;
  ref2 += o.ref2;
  out2 += o.out2;
  dot += o.dot;
  dot1 += o.dot1;
  sq1 += o.sq1;
  if (!(o.max_abs <= max_abs)) max_abs = o.max_abs;
  count += o.count;
  skipped += o.skipped;
  nonfinite_out += o.nonfinite_out;
}

ErrorMetrics finalize_metrics(const MetricSums& s) {
  ErrorMetrics m;
  m.count = s.count;
  m.skipped_nonfinite = s.skipped;
  m.max_abs = s.max_abs;
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  if (s.count == 0 || s.nonfinite_out > 0) {
    // Nothing compared, or an output that is not finite where the reference is: no figure may
    // look perfect.
    m.rel_l2 = m.cosine = m.calc_diff = m.snr_db = m.max_abs = nan;
    return m;
  }
  m.rel_l2 = s.ref2 > 0 ? std::sqrt(s.err2 / s.ref2) : (s.err2 > 0 ? inf : 0.0);
  m.cosine = (s.ref2 > 0 && s.out2 > 0) ? s.dot / std::sqrt(s.ref2 * s.out2) : (s.ref2 == s.out2 ? 1.0 : 0.0);
  m.calc_diff = s.sq1 > 0 ? 1.0 - 2.0 * s.dot1 / s.sq1 : 0.0;
  m.snr_db = s.err2 > 0 ? 10.0 * std::log10(s.ref2 / s.err2) : inf;
  return m;
}

namespace {

template <typename T>
ErrorMetrics metrics_impl(const T* y, const T* r, int64_t n) {
  MetricSums s;
  for (int64_t i = 0; i < n; ++i) s.add(to_f32(y[i]), to_f32(r[i]));
  return finalize_metrics(s);
}

}  // namespace

ErrorMetrics compute_metrics(const bf16* y, const bf16* r, int64_t n) { return metrics_impl(y, r, n); }
ErrorMetrics compute_metrics(const float* y, const float* r, int64_t n) { return metrics_impl(y, r, n); }

}  // namespace moefq
