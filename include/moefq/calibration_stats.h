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
//                  the element-wise formats with a global amax (fp8, int8). nvfp4's error depends on
//                  its 16-element blocks, which the histogram does not keep: its error is taken over
//                  Nvfp4Blocks, the blocks of a bounded, deterministic sample of the calibration rows
//                  (every row when they fit), exactly; the candidates are the histogram's.
// The derived figures come with the clipped fraction (count(|x| > amax) / N) and the relative QDQ
// error sqrt(sum err^2 / sum v^2) on the calibration data (element-wise formats) or on the sampled
// rows (nvfp4, where they were kept).
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
  // The bin of a bf16 value's magnitude (its bit pattern without the sign), or -1 for NaN and inf:
  // the one rule of the host's add() and the GPU evaluation's histogram kernel.
  static constexpr MOEFQ_HD int bin_of(uint16_t bits) {
    const int mag = int(bits & 0x7FFFu);
    return mag < kBins ? mag : -1;
  }
  AbsHistogram() : counts_(size_t(kBins), 0) {}

  // Counts |x| of every element; NaN and inf are not counted (calibration refuses them elsewhere)
  // but are tallied in nonfinite().
  void add(const bf16* x, int64_t n);
  void add(const float* x, int64_t n);
  // Adds counts collected elsewhere (the GPU evaluation's): counts [kBins], in the bins' order.
  void add_counts(const uint64_t* counts, uint64_t nonfinite);
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

// The rows nvfp4's mse keeps of one quantizer's calibration. Its calibration rows have positions
// p in [0, N), whether the row is active or not: dispatch p = (b * R + r) * T + t (calibration batch
// b, rank r, token t of T per rank), combine p = ((b * R + r) * T + t) * K + k (routed slot k).
// Position p has slot j = p * multiplier mod N (the multiplier a prime that does not divide N, so
// p -> j is a bijection) and is kept, in slot j, when j < S = min(N, max(1, max_elements / H)): at
// most S rows (max_elements elements), spread over batches, ranks, tokens and slots, the same rows
// on every device. With N <= S every row is kept. The inactive rows among those kept hold nothing.
inline constexpr int64_t kNvfp4SampleElements = int64_t(1) << 22;  // 8 MiB of bf16 per quantizer
struct SampleRows {
  uint64_t num_positions = 0, num_slots = 0, multiplier = 1;
  // N positions of rows of `cols` elements; N < 2^32 (so p * multiplier fits 64 bits), else bad input.
  static SampleRows plan(uint64_t num_positions, int64_t cols, int64_t max_elements = kNvfp4SampleElements);
  // The slot of position p < N, or -1 when the row is not kept.
  MOEFQ_HD int64_t slot(uint64_t p) const {
    const uint64_t j = p * multiplier % num_positions;
    return j < num_slots ? int64_t(j) : -1;
  }
};

// nvfp4's QDQ error of sampled rows for any global amax, exactly: a block's e4m3 scale is a function
// of the block's max |x| and the global scale, and an element's error of its |x| and that scale, so
// the rows reduce to the count of each (block max, |x|) pair of bf16 magnitudes (blocks of 16 along a
// row, a short last one as qdq_ref forms it). The error sums over the pairs in the order of their
// bits: the same figure from the same rows, whatever the order they were collected in. NaN and inf
// elements (calibration refuses them) are left out of the pairs; the block max is qdq_ref's.
class Nvfp4Blocks {
 public:
  Nvfp4Blocks() = default;
  // rows: [num_rows, cols] bf16; valid: [num_rows], nonzero for a row that holds data (null: all).
  Nvfp4Blocks(const bf16* rows, const uint8_t* valid, int64_t num_rows, int64_t cols);

  uint64_t num_rows() const { return rows_; }
  uint64_t num_elements() const { return elements_; }
  size_t num_pairs() const { return keys_.size(); }
  // sum of v^2 over the elements.
  double sum_squares() const;
  // sum of (qdq(v) - v)^2 over the elements, qdq being nvfp4's rule (fp32, as qdq_ref on floats)
  // with this global amax.
  double qdq_squared_error(float amax) const;

 private:
  std::vector<uint32_t> keys_;    // block max bits << 16 | |x| bits, ascending
  std::vector<uint64_t> counts_;  // [keys_]
  uint64_t rows_ = 0, elements_ = 0;
};

// One method's amax for one quantizer of one format, with what it costs on the calibration data.
struct DerivedAmax {
  float amax = 0;
  double clipped_fraction = 0;     // on the calibration data
  // Relative QDQ error on the calibration data (element-wise formats) or on the sampled rows
  // (nvfp4, when given its blocks).
  std::optional<double> rel_error;
};

// The method's amax from the histogram, for format f (one with a global amax). mse on nvfp4 takes
// its error over `blocks` (which the mse of nvfp4 needs, holding data: bad input naming `where`
// otherwise; the candidates are still the histogram's max times the multipliers); mse on another
// format that is not element-wise is bad input naming `where`; an empty histogram is an internal
// error.
DerivedAmax derive_amax(const AbsHistogram& h, const CalibrationMethod& m, Format f, const std::string& where,
                        const Nvfp4Blocks* blocks = nullptr);

}  // namespace moefq
