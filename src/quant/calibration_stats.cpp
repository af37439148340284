// The calibration methods of include/moefq/calibration_stats.h, from the exact bf16 histogram.
#include "moefq/calibration_stats.h"

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
    const uint32_t mag = x[i].bits & 0x7FFFu;
    if (mag >= uint32_t(kBins)) {
      ++nonfinite_;
      continue;
    }
    ++counts_[mag];
    ++total_;
  }
}

void AbsHistogram::add(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t mag = bf16_round(x[i]) & 0x7FFFu;  // a finite fp32 beyond the bf16 range rounds to inf
    if (!std::isfinite(x[i]) || mag >= uint32_t(kBins)) {
      ++nonfinite_;
      continue;
    }
    ++counts_[mag];
    ++total_;
  }
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

DerivedAmax derive_amax(const AbsHistogram& h, const CalibrationMethod& m, Format f, const std::string& where) {
  MOEFQ_ASSERT(h.total() > 0, where, ": no calibration data in the histogram");
  const bool elementwise = format_block_size(f) == 0;
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
      MOEFQ_CHECK(elementwise, where, ": mse calibration needs an element-wise format (fp8, int8); ", format_name(f),
                  "'s error depends on its ", format_block_size(f),
                  "-element blocks, which the calibration statistics do not keep (use max or percentile)");
      const float max = h.max();
      double best = 0;
      bool first = true;
      for (double mult : m.mse_multipliers()) {
        const float a = float(double(max) * mult);
        if (!(a > 0)) continue;
        const double e = h.qdq_squared_error(f, a);
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
  if (elementwise && d.amax > 0) {
    const double ref = h.sum_squares();
    d.rel_error = ref > 0 ? std::sqrt(h.qdq_squared_error(f, d.amax) / ref) : 0.0;
  }
  return d;
}

}  // namespace moefq
