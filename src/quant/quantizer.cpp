#include "moefq/quantizer.h"

#include <cstdio>
#include <cstring>

#include "moefq/errors.h"

namespace moefq {

Quantizer::Quantizer(std::string name, QuantSpec spec, bool enabled)
    : name_(std::move(name)), spec_(spec), enabled_(enabled) {
  MOEFQ_CHECK(!name_.empty(), "a quantizer needs a non-empty name");
  spec_.validate(name_);
}

bool Quantizer::needs_calibration() const {
  return format_has_global_amax(spec_.format) && spec_.amax_source == AmaxSource::kCalibrated;
}

// ---------------------------------------------------------------------------------------------
// Calibration

void Quantizer::set_enabled(bool enabled) {
  const std::unique_lock<std::shared_mutex> state(mu_.state);
  enabled_ = enabled;
}

float Quantizer::collected_max() const {
  const std::unique_lock<std::shared_mutex> state(mu_.state);
  return collected_max_;
}

void Quantizer::start_calibration() {
  const std::unique_lock<std::shared_mutex> state(mu_.state);
  calibrating_ = true;
  collected_max_ = 0.0f;
  seen_ = false;
  amax_before_calibration_ = calibrated_amax_;
}

void Quantizer::abort_calibration() noexcept {
  const std::unique_lock<std::shared_mutex> state(mu_.state);
  if (!calibrating_) return;
  calibrating_ = false;
  collected_max_ = 0.0f;
  seen_ = false;
  calibrated_amax_ = amax_before_calibration_;
}

template <typename T>
void Quantizer::collect_impl(const T* x, int64_t n) {
  const std::shared_lock<std::shared_mutex> state(mu_.state);
  MOEFQ_CHECK(calibrating_, name_, ": collect called outside calibration; call start_calibration() first");
  MOEFQ_ASSERT(n >= 0 && (n == 0 || x != nullptr), name_, ": collect with n = ", n);
  // The partial max outside the lock: concurrent collects only serialise their fold.
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(x[i]);
    MOEFQ_CHECK(is_finite(v), name_, ": calibration data contains NaN/inf at element ", i,
                " (value ", v, ")");
    m = max_ignore_nan(m, abs_f32(v));
  }
  if (n == 0) return;
  const std::lock_guard<std::mutex> lock(mu_.fold);
  collected_max_ = max_ignore_nan(collected_max_, m);
  seen_ = true;
}

void Quantizer::collect(const bf16* x, int64_t n) { collect_impl(x, n); }
void Quantizer::collect(const float* x, int64_t n) { collect_impl(x, n); }

void Quantizer::collect_max(float partial_max) {
  const std::shared_lock<std::shared_mutex> state(mu_.state);
  MOEFQ_CHECK(calibrating_, name_, ": collect_max called outside calibration; call start_calibration() first");
  MOEFQ_CHECK(is_finite(partial_max), name_, ": calibration data contains NaN/inf (partial max ",
              partial_max, ")");
  MOEFQ_CHECK(!(partial_max < 0.0f), name_, ": a partial max |x| cannot be negative, got ",
              partial_max);
  const std::lock_guard<std::mutex> lock(mu_.fold);
  collected_max_ = max_ignore_nan(collected_max_, abs_f32(partial_max));  // -0 counts as +0
  seen_ = true;
}

void Quantizer::finish_calibration() {
  const std::unique_lock<std::shared_mutex> state(mu_.state);
  MOEFQ_CHECK(calibrating_, name_, ": finish_calibration called outside calibration; call start_calibration() first");
  if (needs_calibration() && enabled_) {
    MOEFQ_CHECK(seen_, "no calibration data reached ", name_,
                " (on any rank); check that the calibration batches route tokens through it");
  }
  if (needs_calibration() && seen_) calibrated_amax_ = collected_max_;
  calibrating_ = false;
}

void Quantizer::reset() {
  const std::unique_lock<std::shared_mutex> state(mu_.state);
  calibrating_ = false;
  collected_max_ = 0.0f;
  seen_ = false;
  calibrated_amax_.reset();
  amax_before_calibration_.reset();
}

void reduce_calibration_max(std::span<Quantizer* const> replicas) {
  float m = 0.0f;
  bool seen = false;
  for (const Quantizer* q : replicas) {
    MOEFQ_ASSERT(q != nullptr, "reduce_calibration_max: null replica");
    MOEFQ_ASSERT(q->name_ == replicas[0]->name_, "reduce_calibration_max: replicas of ",
                 replicas[0]->name_, " include ", q->name_);
    MOEFQ_ASSERT(q->calibrating_, q->name_, ": reduce_calibration_max outside calibration");
    m = max_ignore_nan(m, q->collected_max_);
    seen = seen || q->seen_;
  }
  for (Quantizer* q : replicas) {
    q->collected_max_ = m;
    q->seen_ = seen;
  }
}

// ---------------------------------------------------------------------------------------------
// amax and QDQ

std::optional<float> Quantizer::amax() const {
  if (!format_has_global_amax(spec_.format)) return std::nullopt;
  switch (spec_.amax_source) {
    case AmaxSource::kCalibrated: return calibrated_amax_;
    case AmaxSource::kConstant: return spec_.constant_amax;
    case AmaxSource::kDynamic: return std::nullopt;
  }
  return std::nullopt;
}

void Quantizer::set_amax(float amax) {
  MOEFQ_CHECK(needs_calibration(), name_, ": set_amax applies to calibrated quantizers; this one is ",
              spec_.describe());
  MOEFQ_CHECK(is_finite(amax) && !(amax < 0.0f), name_,
              ": amax must be a finite number >= 0, got ", amax);
  const std::unique_lock<std::shared_mutex> state(mu_.state);
  calibrated_amax_ = abs_f32(amax);  // -0 is stored as +0
}

template <typename T>
float Quantizer::resolve_impl(const T* x, int64_t n) const {
  if (!format_has_global_amax(spec_.format)) return 0.0f;
  switch (spec_.amax_source) {
    case AmaxSource::kCalibrated:
      MOEFQ_CHECK(calibrated_amax_.has_value(), name_,
                  ": not calibrated; run calibration or load a calibration file");
      return *calibrated_amax_;
    case AmaxSource::kConstant: return spec_.constant_amax;
    case AmaxSource::kDynamic: return amax_ref(x, n);
  }
  MOEFQ_FAIL(ErrorKind::kInternal, name_, ": unknown amax source");
}

float Quantizer::resolve_amax(const bf16* x, int64_t n) const { return resolve_impl(x, n); }
float Quantizer::resolve_amax(const float* x, int64_t n) const { return resolve_impl(x, n); }

template <typename T>
void Quantizer::qdq_impl(const T* x, T* y, int64_t rows, int64_t cols) const {
  MOEFQ_ASSERT(rows >= 0 && cols >= 0, name_, ": qdq with shape [", rows, ", ", cols, "]");
  const int64_t n = rows * cols;
  if (!enabled_ || calibrating_) {
    if (n > 0 && x != y) std::memmove(y, x, size_t(n) * sizeof(T));
    return;
  }
  qdq_ref(spec_.format, x, y, rows, cols, resolve_impl(x, n));
}

void Quantizer::qdq(const bf16* x, bf16* y, int64_t rows, int64_t cols) const {
  qdq_impl(x, y, rows, cols);
}
void Quantizer::qdq(const float* x, float* y, int64_t rows, int64_t cols) const {
  qdq_impl(x, y, rows, cols);
}

}  // namespace moefq
