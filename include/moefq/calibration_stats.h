// Calibration methods beyond max, and the statistics they are derived from.
//
// The data a quantizer sees during calibration is folded into an AbsHistogram: the exact count of
// every bf16 magnitude (|x| of a bf16 value is one of 0x7F80 finite magnitudes, so the histogram is
// a lossless summary of bf16 data in 255 KiB, whatever the amount of data; fp32 data is counted
// after rounding to bf16, round to nearest even). Every method's amax is then derived from it, so a
// layer is calibrated once and each method costs a pass over the histogram:
//   max            the largest magnitude (Model Optimizer's "max");
//   percentile P   the smallest magnitude v with count(|x| <= v) >= ceil(P / 100 * N), N the number
//                  of elements (nearest rank; P = 100 is the max). Model Optimizer's histogram
//                  calibrator names this method "percentile";
//   mse            Model Optimizer's MSE search ("mse", MseCalibrator): candidates
//                  amax_i = max * m_i, m_i = start + i * (stop - start) / (n - 1) for i in [0, n),
//                  n = ceil((stop - start) / step_size) + 1 (defaults 0.25, 4.0, 0.1: 39
//                  candidates); the candidate whose QDQ error sum_b count_b * (qdq(v_b) - v_b)^2
//                  over the histogram's magnitudes v_b is least wins (ties: the first). The QDQ is
//                  the format's own rule (qdq_ref), element by element, so the search is exact for
//                  the element-wise formats with a global amax (fp8, int8); nvfp4's error depends on
//                  its 16-element blocks, which the histogram does not keep, so mse refuses it.
// The derived figures come with the clipped fraction (count(|x| > amax) / N) and, for element-wise
// formats, the relative QDQ error sqrt(sum err^2 / sum v^2) on the calibration data.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moefq/numerics.h"
#include "moefq/quant_spec.h"

namespace moefq {

struct CalibrationMethod {
  enum class Kind { kMax, kPercentile, kMse };
  Kind kind = Kind::kMax;
  double percentile = 99.99;  // kPercentile: in (0, 100]
  // kMse: Model Optimizer's MseCalibrator parameters (the same names and defaults).
  double step_size = 0.1, start_multiplier = 0.25, stop_multiplier = 4.0;

  // "max", "percentile 99.99", "mse" (with its parameters when they are not the defaults).
  std::string name() const;
  // The suffix of a recipe evaluated with several methods: "max", "p99.99", "mse".
  std::string short_name() const;
  bool operator==(const CalibrationMethod& o) const {
    return kind == o.kind && percentile == o.percentile && step_size == o.step_size &&
           start_multiplier == o.start_multiplier && stop_multiplier == o.stop_multiplier;
  }
  // Bad input naming `where` for a percentile outside (0, 100] or MSE parameters that give no
  // candidate (step_size <= 0, start <= 0, stop < start, more than 10000 candidates).
  void validate(const std::string& where) const;
  // The MSE search's multipliers m_i (see above).
  std::vector<double> mse_multipliers() const;
};

// "max", "percentile" (99.99), "percentile:P", "mse"; bad input naming `where` otherwise.
CalibrationMethod parse_calibration_method(const std::string& text, const std::string& where);
// A comma-separated list of the above, without repeats; bad input naming `where`.
std::vector<CalibrationMethod> parse_calibration_methods(const std::string& text, const std::string& where);

class AbsHistogram {
 public:
  // Bins: the finite non-negative bf16 bit patterns 0x0000 .. 0x7F7F.
  static constexpr int kBins = 0x7F80;
  AbsHistogram() : counts_(size_t(kBins), 0) {}

  // Counts |x| of every element; NaN and inf are not counted (calibration refuses them elsewhere)
  // but are tallied in nonfinite().
  void add(const bf16* x, int64_t n);
  void add(const float* x, int64_t n);
  void merge(const AbsHistogram& o);

  uint64_t total() const { return total_; }
  uint64_t nonfinite() const { return nonfinite_; }
  uint64_t count(int bin) const { return counts_[size_t(bin)]; }
  static float bin_value(int bin) { return bf16_to_f32(uint16_t(bin)); }
  // The largest magnitude counted (0 when none).
  float max() const;
  // The fraction of the counted elements with |x| > amax (0 when none).
  double clipped_fraction(float amax) const;
  // sum of v^2 over the counted elements.
  double sum_squares() const;
  // sum of (qdq(v) - v)^2 over the counted elements, qdq being format f's rule with global amax.
  // Only for element-wise formats (format_block_size(f) == 0); an internal error otherwise.
  double qdq_squared_error(Format f, float amax) const;

 private:
  std::vector<uint64_t> counts_;
  uint64_t total_ = 0, nonfinite_ = 0;
};

// One method's amax for one quantizer of one format, with what it costs on the calibration data.
struct DerivedAmax {
  float amax = 0;
  double clipped_fraction = 0;     // on the calibration data
  std::optional<double> rel_error;  // relative QDQ error on the calibration data (element-wise formats)
};

// The method's amax from the histogram, for format f (one with a global amax). mse on a format that
// is not element-wise is bad input naming `where`; an empty histogram is an internal error.
DerivedAmax derive_amax(const AbsHistogram& h, const CalibrationMethod& m, Format f, const std::string& where);

}  // namespace moefq
