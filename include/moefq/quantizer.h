// A named fake quantizer: a QuantSpec plus its state (enabled, max calibration, the global amax),
// and the calibration file that stores calibrated amax values between runs.
// Invariants: a stored amax is finite and >= 0; no QDQ is applied while disabled or calibrating;
// a failed call (bad data, a bad file) leaves the quantizer's state as it was. collect and
// collect_max may run concurrently on one quantizer (their fold is locked); the calls that change
// the calibration state (start, finish, abort, reset, set_amax, set_enabled) wait for the collects
// in flight and hold them off while they run. Reading the state (amax(), qdq) is not locked.
#pragma once

#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <optional>
#include <span>
#include <string>

#include "moefq/numerics.h"
#include "moefq/quant_spec.h"

namespace moefq {

class Quantizer {
 public:
  // Throws moefq::Error (bad input) naming `name` when the spec is invalid.
  Quantizer(std::string name, QuantSpec spec, bool enabled = true);

  const std::string& name() const { return name_; }
  const QuantSpec& spec() const { return spec_; }
  bool enabled() const { return enabled_; }
  void set_enabled(bool enabled);

  // Whether QDQ needs a calibrated amax: a format with a global amax (fp8, nvfp4, int8) whose
  // amax source is `calibrated`. Constant, dynamic and block-local (mx) quantizers do not.
  bool needs_calibration() const;

  // ---- Max calibration: start, collect (any number of calls), [reduce across ranks], finish.
  // Clears the collected max and the seen flag; a stored amax is kept until finish replaces it.
  void start_calibration();
  // Leaves a calibration without finishing it: the quantizer is back as it was before
  // start_calibration (the amax it held then, nothing collected, not calibrating). Nothing
  // happens when it is not calibrating. For error paths: it never throws.
  void abort_calibration() noexcept;
  bool calibrating() const { return calibrating_; }
  // Folds max |x| over n elements into the collected max. NaN or +-inf is an error naming the
  // quantizer and the element index (the collected state is then unchanged). n == 0 sees nothing.
  // Outside a calibration it is an error (bad input) naming the quantizer.
  // Several threads may collect into one quantizer at once: each computes its max on its own and
  // folds it in under a lock.
  void collect(const bf16* x, int64_t n);   // x: [n] bf16
  void collect(const float* x, int64_t n);  // x: [n] fp32
  // Folds a max |x| computed elsewhere (e.g. on the GPU) over at least one element: it counts as
  // seen data. Not finite or negative is an error naming the quantizer.
  void collect_max(float partial_max);
  // Whether any element was collected since start_calibration (zeros count).
  bool seen_data() const { return seen_; }
  // The max collected so far (0 when nothing was seen); what reduce_calibration_max combines.
  float collected_max() const;
  // Ends calibration. A quantizer that needs calibration and is enabled must have seen data
  // (else an error naming it, and it stays calibrating); it stores the collected max as its amax.
  // Other quantizers just leave calibration.
  void finish_calibration();
  // Forgets the calibration state and the stored amax.
  void reset();

  // ---- The global amax.
  // The calibrated (or loaded) value for calibrated quantizers, the constant for constant ones,
  // nullopt otherwise (dynamic: per call; mx formats: no global amax).
  std::optional<float> amax() const;
  bool has_amax() const { return amax().has_value(); }
  // Stores a calibrated amax (e.g. loaded from a file). Error naming the quantizer when the value
  // is not finite or negative, or when the quantizer does not use a calibrated amax.
  void set_amax(float amax);

  // The amax a QDQ of x uses: stored (calibrated; an error naming the quantizer when missing),
  // the constant, or amax_ref(x, n) (dynamic). 0 for formats without a global amax.
  float resolve_amax(const bf16* x, int64_t n) const;   // x: [n] bf16
  float resolve_amax(const float* x, int64_t n) const;  // x: [n] fp32

  // y = QDQ(x) per the spec; a plain copy while disabled or calibrating. y may alias x.
  void qdq(const bf16* x, bf16* y, int64_t rows, int64_t cols) const;    // x, y: [rows, cols] bf16
  void qdq(const float* x, float* y, int64_t rows, int64_t cols) const;  // x, y: [rows, cols] fp32

 private:
  template <typename T>
  void collect_impl(const T* x, int64_t n);
  template <typename T>
  float resolve_impl(const T* x, int64_t n) const;
  template <typename T>
  void qdq_impl(const T* x, T* y, int64_t rows, int64_t cols) const;

  std::string name_;
  QuantSpec spec_;
  bool enabled_ = true;
  bool calibrating_ = false;
  // Per-replica calibration state: all that a cross-rank MAX all-reduce needs.
  float collected_max_ = 0.0f;
  bool seen_ = false;
  std::optional<float> calibrated_amax_;
  // The stored amax when calibration started, which abort_calibration restores.
  std::optional<float> amax_before_calibration_;
  // fold: serialises the fold of collect and collect_max. state: held shared by each collect
  // (its scan and fold) and exclusively by the calls that change the calibration state, so that a
  // finish on one thread stores a max including every collect that started before it. A copy of
  // the quantizer gets mutexes of its own.
  struct Mutexes {
    std::mutex fold;
    std::shared_mutex state;
    Mutexes() = default;
    Mutexes(const Mutexes&) {}
    Mutexes& operator=(const Mutexes&) { return *this; }
  };
  mutable Mutexes mu_;

  friend void reduce_calibration_max(std::span<Quantizer* const> replicas);
};

// The same quantizer on several simulated ranks, all calibrating, before finish_calibration:
// every replica gets the MAX of all collected maxima, and seen = any replica saw data.
// The replicas must share a name and be calibrating (else an internal error).
void reduce_calibration_max(std::span<Quantizer* const> replicas);

}  // namespace moefq
