// The calibration methods of include/moefq/calibration_stats.h, from the exact bf16 histogram.
#include "moefq/calibration_stats.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "moefq/errors.h"
#include "moefq/qdq.h"

namespace moefq {
namespace {

std::string number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

}  // namespace

std::string CalibrationMethod::name() const {
  switch (kind) {
    case Kind::kMax: return "max";
    case Kind::kPercentile: return "percentile " + number(percentile);
    case Kind::kMse: {
      const CalibrationMethod d{Kind::kMse};
      if (*this == d) return "mse";
      return "mse (step_size " + number(step_size) + ", multipliers " + number(start_multiplier) + " to " +
             number(stop_multiplier) + ")";
    }
  }
  return "?";
}

std::string CalibrationMethod::short_name() const {
  switch (kind) {
    case Kind::kMax: return "max";
    case Kind::kPercentile: return "p" + number(percentile);
    case Kind::kMse: return "mse";
  }
  return "?";
}

std::vector<double> CalibrationMethod::mse_multipliers() const {
  const int64_t n = int64_t(std::ceil((stop_multiplier - start_multiplier) / step_size)) + 1;
  std::vector<double> m;
  for (int64_t i = 0; i < n; ++i)
    m.push_back(n == 1 ? start_multiplier
                       : start_multiplier + double(i) * (stop_multiplier - start_multiplier) / double(n - 1));
  return m;
}

void CalibrationMethod::validate(const std::string& where) const {
  if (kind == Kind::kPercentile)
    MOEFQ_CHECK(std::isfinite(percentile) && percentile > 0 && percentile <= 100, where, ": percentile ",
                number(percentile), " must be in (0, 100] (e.g. 99.99)");
  if (kind == Kind::kMse) {
    MOEFQ_CHECK(std::isfinite(step_size) && step_size > 0, where, ": mse step_size must be > 0, got ", number(step_size));
    MOEFQ_CHECK(std::isfinite(start_multiplier) && start_multiplier > 0, where,
                ": mse start_multiplier must be > 0, got ", number(start_multiplier));
    MOEFQ_CHECK(std::isfinite(stop_multiplier) && stop_multiplier >= start_multiplier, where,
                ": mse stop_multiplier must be >= start_multiplier, got ", number(stop_multiplier));
    MOEFQ_CHECK((stop_multiplier - start_multiplier) / step_size <= 10000, where,
                ": mse parameters give more than 10000 candidates");
  }
}

CalibrationMethod parse_calibration_method(const std::string& text, const std::string& where) {
  CalibrationMethod m;
  const std::string expected = " (expected max, percentile, percentile:P such as percentile:99.999, or mse)";
  if (text == "max") return m;
  if (text == "mse") {
    m.kind = CalibrationMethod::Kind::kMse;
    return m;
  }
  if (text.rfind("percentile", 0) == 0) {
    m.kind = CalibrationMethod::Kind::kPercentile;
    if (text.size() > 10) {
      MOEFQ_CHECK(text[10] == ':', where, ": unknown calibration method '", text, "'", expected);
      const std::string p = text.substr(11);
      size_t used = 0;
      double v = 0;
      try {
        v = std::stod(p, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      MOEFQ_CHECK(!p.empty() && used == p.size(), where, ": '", p, "' is not a percentile", expected);
      m.percentile = v;
    }
    m.validate(where);
    return m;
  }
  MOEFQ_FAIL(ErrorKind::kBadInput, where, ": unknown calibration method '", text, "'", expected);
}

std::vector<CalibrationMethod> parse_calibration_methods(const std::string& text, const std::string& where) {
  std::vector<CalibrationMethod> out;
  MOEFQ_CHECK(!text.empty() && text.back() != ',', where, ": '", text, "' is not a list of calibration methods");
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const CalibrationMethod m = parse_calibration_method(item, where);
    for (const CalibrationMethod& o : out)
      MOEFQ_CHECK(!(o == m), where, ": ", m.name(), " is listed twice");
    out.push_back(m);
  }
  return out;
}

void AbsHistogram::add(const bf16* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const int bin = bin_of(x[i].bits);
    if (bin < 0) {
      ++nonfinite_;
      continue;
    }
    ++counts_[size_t(bin)];
    ++total_;
  }
}

void AbsHistogram::add(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const int bin = bin_of(bf16_round(x[i]));  // a finite fp32 beyond the bf16 range rounds to inf
    if (!std::isfinite(x[i]) || bin < 0) {
      ++nonfinite_;
      continue;
    }
    ++counts_[size_t(bin)];
    ++total_;
  }
}

void AbsHistogram::add_counts(const uint64_t* counts, uint64_t nonfinite) {
  for (size_t i = 0; i < counts_.size(); ++i) {
    counts_[i] += counts[i];
    total_ += counts[i];
  }
  nonfinite_ += nonfinite;
}

void AbsHistogram::merge(const AbsHistogram& o) {
  for (size_t i = 0; i < counts_.size(); ++i) counts_[i] += o.counts_[i];
  total_ += o.total_;
  nonfinite_ += o.nonfinite_;
}

float AbsHistogram::max() const {
  for (int b = kBins - 1; b >= 0; --b)
    if (counts_[size_t(b)]) return bin_value(b);
  return 0.0f;
}

double AbsHistogram::clipped_fraction(float amax) const {
  if (total_ == 0) return 0.0;
  uint64_t above = 0;
  for (int b = kBins - 1; b >= 0 && bin_value(b) > amax; --b) above += counts_[size_t(b)];
  return double(above) / double(total_);
}

double AbsHistogram::sum_squares() const {
  double s = 0;
  for (int b = 0; b < kBins; ++b)
    if (counts_[size_t(b)]) s += double(counts_[size_t(b)]) * double(bin_value(b)) * double(bin_value(b));
  return s;
}

double AbsHistogram::qdq_squared_error(Format f, float amax) const {
  MOEFQ_ASSERT(format_block_size(f) == 0, "qdq_squared_error: ", format_name(f), " is not element-wise");
  double s = 0;
  for (int b = 0; b < kBins; ++b) {
    if (!counts_[size_t(b)]) continue;
    const float v = bin_value(b);
    float q = 0;
    qdq_ref(f, &v, &q, 1, 1, amax);
    const double d = double(q) - double(v);
    s += double(counts_[size_t(b)]) * d * d;
  }
  return s;
}

SampleRows SampleRows::plan(uint64_t num_positions, int64_t cols, int64_t max_elements) {
  MOEFQ_ASSERT(cols > 0 && max_elements > 0, "SampleRows::plan: cols and max_elements must be > 0");
  MOEFQ_CHECK(num_positions < (uint64_t(1) << 32), "nvfp4 mse calibration: ", num_positions,
              " calibration rows per quantizer are more than the row sample can index (2^32); use fewer "
              "--calib-batches, --ranks or --tokens");
  SampleRows s;
  s.num_positions = std::max<uint64_t>(num_positions, 1);
  s.num_slots = std::min<uint64_t>(s.num_positions, uint64_t(std::max<int64_t>(1, max_elements / cols)));
  // Primes below 2^32; N < 2^32 is a multiple of at most one of them.
  for (uint64_t prime : {2654435761ull, 2246822519ull}) {
    s.multiplier = prime;
    if (s.num_positions % prime != 0) break;
  }
  return s;
}

Nvfp4Blocks::Nvfp4Blocks(const bf16* rows, const uint8_t* valid, int64_t num_rows, int64_t cols) {
  std::vector<uint32_t> keys;
  for (int64_t r = 0; r < num_rows; ++r) {
    if (valid && !valid[r]) continue;
    ++rows_;
    const bf16* x = rows + r * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += kNvfp4Block) {
      const int64_t c1 = std::min(cols, c0 + kNvfp4Block);
      float bmax = 0.0f;  // qdq_ref's block_amax: over the non-NaN elements, +inf counts
      for (int64_t c = c0; c < c1; ++c) bmax = max_ignore_nan(bmax, abs_f32(to_f32(x[c])));
      const uint32_t bkey = uint32_t(bf16_round(bmax)) << 16;  // bmax is a bf16 magnitude: exact
      for (int64_t c = c0; c < c1; ++c) {
        const uint32_t mag = x[c].bits & 0x7FFFu;
        if (mag >= uint32_t(AbsHistogram::kBins)) continue;  // NaN or inf
        keys.push_back(bkey | mag);
      }
    }
  }
  elements_ = keys.size();
  std::sort(keys.begin(), keys.end());
  for (size_t i = 0; i < keys.size();) {
    size_t j = i;
    while (j < keys.size() && keys[j] == keys[i]) ++j;
    keys_.push_back(keys[i]);
    counts_.push_back(uint64_t(j - i));
    i = j;
  }
}

double Nvfp4Blocks::sum_squares() const {
  double s = 0;
  for (size_t i = 0; i < keys_.size(); ++i) {
    const double v = bf16_to_f32(uint16_t(keys_[i] & 0xFFFFu));
    s += double(counts_[i]) * v * v;
  }
  return s;
}

double Nvfp4Blocks::qdq_squared_error(float amax) const {
  const float gs = nvfp4_global_scale(amax);
  double s = 0;
  uint32_t block = ~0u;
  float scale = 0;
  for (size_t i = 0; i < keys_.size(); ++i) {
    if (keys_[i] >> 16 != block) {
      block = keys_[i] >> 16;
      scale = nvfp4_block_scale(bf16_to_f32(uint16_t(block)), gs);
    }
    const float v = bf16_to_f32(uint16_t(keys_[i] & 0xFFFFu));
    const double d = double(nvfp4_qdq(v, scale)) - double(v);
    s += double(counts_[i]) * d * d;
  }
  return s;
}

DerivedAmax derive_amax(const AbsHistogram& h, const CalibrationMethod& m, Format f, const std::string& where,
                        const Nvfp4Blocks* blocks) {
  MOEFQ_ASSERT(h.total() > 0, where, ": no calibration data in the histogram");
  const bool elementwise = format_block_size(f) == 0;
  const bool sampled = f == Format::kNvfp4 && blocks && blocks->num_elements() > 0;
  // The QDQ error of a global amax: over the histogram, or over nvfp4's sampled blocks.
  const auto error = [&](float a) { return elementwise ? h.qdq_squared_error(f, a) : blocks->qdq_squared_error(a); };
  DerivedAmax d;
  switch (m.kind) {
    case CalibrationMethod::Kind::kMax: d.amax = h.max(); break;
    case CalibrationMethod::Kind::kPercentile: {
      // Nearest rank: at least ceil(P/100 * N) elements at or below the amax (at least one).
      const double want = std::ceil(m.percentile / 100.0 * double(h.total()));
      const uint64_t rank = std::max<uint64_t>(1, uint64_t(std::min(want, double(h.total()))));
      uint64_t seen = 0;
      for (int b = 0; b < AbsHistogram::kBins; ++b) {
        seen += h.count(b);
        if (seen >= rank) {
          d.amax = AbsHistogram::bin_value(b);
          break;
        }
      }
      break;
    }
    case CalibrationMethod::Kind::kMse: {
      MOEFQ_CHECK(elementwise || f == Format::kNvfp4, where, ": mse calibration needs fp8, int8 or nvfp4, not ",
                  format_name(f));
      MOEFQ_CHECK(elementwise || sampled, where, ": mse calibration of nvfp4 needs the blocks of sampled "
                  "calibration rows", blocks ? ", but none of the sampled rows held data" : "",
                  " (use max or percentile)");
      const float max = h.max();
      double best = 0;
      bool first = true;
      for (double mult : m.mse_multipliers()) {
        const float a = float(double(max) * mult);
        if (!(a > 0)) continue;
        const double e = error(a);
        if (first || e < best) {
          best = e;
          d.amax = a;
          first = false;
        }
      }
      break;
    }
  }
  d.clipped_fraction = h.clipped_fraction(d.amax);
  if ((elementwise || sampled) && d.amax > 0) {
    const double ref = elementwise ? h.sum_squares() : blocks->sum_squares();
    d.rel_error = ref > 0 ? std::sqrt(error(d.amax) / ref) : 0.0;
  }
  return d;
}

}  // namespace moefq
