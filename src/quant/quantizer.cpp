#include "moefq/quantizer.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "moefq/errors.h"
#include "moefq/fileio.h"

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

void Quantizer::start_calibration() {
  calibrating_ = true;
  collected_max_ = 0.0f;
  seen_ = false;
}

template <typename T>
void Quantizer::collect_impl(const T* x, int64_t n) {
  MOEFQ_ASSERT(calibrating_, name_, ": collect called outside calibration");
  MOEFQ_ASSERT(n >= 0 && (n == 0 || x != nullptr), name_, ": collect with n = ", n);
  float m = collected_max_;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(x[i]);
    MOEFQ_CHECK(is_finite(v), name_, ": calibration data contains NaN/inf at element ", i,
                " (value ", v, ")");
    m = max_ignore_nan(m, abs_f32(v));
  }
  collected_max_ = m;
  seen_ = seen_ || n > 0;
}

void Quantizer::collect(const bf16* x, int64_t n) { collect_impl(x, n); }
void Quantizer::collect(const float* x, int64_t n) { collect_impl(x, n); }

void Quantizer::collect_max(float partial_max) {
  MOEFQ_ASSERT(calibrating_, name_, ": collect_max called outside calibration");
  MOEFQ_CHECK(is_finite(partial_max), name_, ": calibration data contains NaN/inf (partial max ",
              partial_max, ")");
  MOEFQ_CHECK(!(partial_max < 0.0f), name_, ": a partial max |x| cannot be negative, got ",
              partial_max);
  collected_max_ = max_ignore_nan(collected_max_, abs_f32(partial_max));  // -0 counts as +0
  seen_ = true;
}

void Quantizer::finish_calibration() {
  MOEFQ_ASSERT(calibrating_, name_, ": finish_calibration called outside calibration");
  if (needs_calibration() && enabled_) {
    MOEFQ_CHECK(seen_, "no calibration data reached ", name_,
                " (on any rank); check that the calibration batches route tokens through it");
  }
  if (needs_calibration() && seen_) calibrated_amax_ = collected_max_;
  calibrating_ = false;
}

void Quantizer::reset() {
  calibrating_ = false;
  collected_max_ = 0.0f;
  seen_ = false;
  calibrated_amax_.reset();
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

// ---------------------------------------------------------------------------------------------
// Calibration file

namespace {

using nlohmann::json;

constexpr int kCalibrationVersion = 1;
constexpr const char* kNoAmaxSource = "none";

std::string amax_bits_string(float v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08X", unsigned(f32_bits(v)));
  return buf;
}

// "0x" followed by exactly 8 hex digits.
std::optional<float> parse_amax_bits(const std::string& s) {
  if (s.size() != 10 || s[0] != '0' || (s[1] != 'x' && s[1] != 'X')) return std::nullopt;
  uint32_t u = 0;
  for (size_t i = 2; i < s.size(); ++i) {
    const char c = s[i];
    uint32_t d;
    if (c >= '0' && c <= '9') d = uint32_t(c - '0');
    else if (c >= 'a' && c <= 'f') d = uint32_t(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') d = uint32_t(c - 'A' + 10);
    else return std::nullopt;
    u = (u << 4) | d;
  }
  return f32_from_bits(u);
}

std::string amax_source_field(const QuantSpec& spec) {
  return format_has_global_amax(spec.format) ? amax_source_name(spec.amax_source) : kNoAmaxSource;
}

// One parsed, validated entry of a calibration file.
struct Entry {
  Format format;
  std::string amax_source;
  std::optional<float> amax;
};

Entry parse_entry(const std::string& path, const std::string& name, const json& e) {
  const std::string where = path + ": quantizer " + name;
  MOEFQ_CHECK(e.is_object(), where, ": the entry must be an object");
  for (const auto& [key, value] : e.items()) {
    (void)value;
    MOEFQ_CHECK(key == "format" || key == "amax_source" || key == "amax" || key == "amax_bits",
                where, ": unknown key '", key, "' (expected format, amax_source, amax, amax_bits)");
  }
  MOEFQ_CHECK(e.contains("format") && e["format"].is_string(), where,
              ": 'format' must be a string (", format_choices(), ")");
  const std::string fmt = e["format"].get<std::string>();
  const std::optional<Format> format = parse_format(fmt);
  MOEFQ_CHECK(format.has_value(), where, ": unknown format '", fmt, "' (", format_choices(), ")");

  MOEFQ_CHECK(e.contains("amax_source") && e["amax_source"].is_string(), where,
              ": 'amax_source' must be a string (calibrated|constant|dynamic|none)");
  const std::string source = e["amax_source"].get<std::string>();
  const bool global = format_has_global_amax(*format);
  if (global) {
    MOEFQ_CHECK(source == "calibrated" || source == "constant" || source == "dynamic", where,
                ": amax_source must be calibrated|constant|dynamic for ", fmt, ", got '", source,
                "'");
  } else {
    MOEFQ_CHECK(source == kNoAmaxSource, where, ": format ", fmt,
                " has no global amax; amax_source must be 'none', got '", source, "'");
  }

  std::optional<float> from_number, from_bits;
  if (e.contains("amax")) {
    MOEFQ_CHECK(e["amax"].is_number(), where, ": 'amax' must be a number");
    const double d = e["amax"].get<double>();
    // Range-check before narrowing: a double beyond the float range has no float value.
    MOEFQ_CHECK(d >= 0.0 && d <= double(kFltMax), where,
                ": amax must be a finite number >= 0 in the fp32 range, got ", d);
    from_number = float(d);
  }
  if (e.contains("amax_bits")) {
    MOEFQ_CHECK(e["amax_bits"].is_string(), where,
                ": 'amax_bits' must be a string like \"0x41480000\"");
    from_bits = parse_amax_bits(e["amax_bits"].get<std::string>());
    MOEFQ_CHECK(from_bits.has_value(), where, ": 'amax_bits' must be \"0x\" and 8 hex digits, got '",
                e["amax_bits"].get<std::string>(), "'");
  }
  // The bits are exact; the number is for people. If someone edited one but not the other, say so
  // rather than silently picking one.
  if (from_number && from_bits) {
    MOEFQ_CHECK(f32_bits(*from_number) == f32_bits(*from_bits), where, ": 'amax' ", *from_number,
                " and 'amax_bits' ", e["amax_bits"].get<std::string>(), " (", *from_bits,
                ") disagree; fix or remove one of them");
  }
  Entry entry{*format, source, from_bits ? from_bits : from_number};
  if (entry.amax) {
    MOEFQ_CHECK(global, where, ": format ", fmt, " has no global amax, but the entry holds one");
    MOEFQ_CHECK(is_finite(*entry.amax) && !(*entry.amax < 0.0f), where,
                ": amax must be a finite number >= 0, got ", *entry.amax);
  }
  return entry;
}

}  // namespace

void save_calibration(const std::string& path, std::span<const Quantizer* const> quantizers) {
  json root = json::object();
  root["version"] = kCalibrationVersion;
  json entries = json::object();
  for (const Quantizer* q : quantizers) {
    MOEFQ_ASSERT(q != nullptr, "save_calibration: null quantizer");
    MOEFQ_CHECK(!entries.contains(q->name()), "save_calibration: quantizer ", q->name(),
                " appears twice");
    const std::optional<float> amax = q->amax();
    MOEFQ_CHECK(amax.has_value() || !q->needs_calibration() || !q->enabled(), "save_calibration: ",
                q->name(), " is not calibrated; run calibration before saving ", path);
    json e = json::object();
    e["format"] = format_name(q->spec().format);
    e["amax_source"] = amax_source_field(q->spec());
    if (amax) {
      e["amax"] = double(*amax);  // exact as a double; printed with round-trip precision
      e["amax_bits"] = amax_bits_string(*amax);
    }
    entries[q->name()] = std::move(e);
  }
  root["quantizers"] = std::move(entries);
  const std::string text = root.dump(2) + "\n";

  write_file_atomic(path, text);
}

void load_calibration(const std::string& path, std::span<Quantizer* const> quantizers) {
  std::ifstream in(path, std::ios::binary);
  MOEFQ_CHECK(in.is_open(), "cannot open calibration file ", path, ": ", std::strerror(errno));
  std::stringstream buf;
  buf << in.rdbuf();
  MOEFQ_CHECK(!in.bad(), "cannot read calibration file ", path);
  json root;
  try {
    root = json::parse(buf.str());
  } catch (const json::exception& e) {
    MOEFQ_FAIL(ErrorKind::kBadInput, path, ": not a valid calibration file (malformed JSON: ",
               e.what(), ")");
  }

  MOEFQ_CHECK(root.is_object(), path, ": a calibration file is a JSON object with 'version' and "
              "'quantizers'");
  for (const auto& [key, value] : root.items()) {
    (void)value;
    MOEFQ_CHECK(key == "version" || key == "quantizers", path, ": unknown key '", key,
                "' (expected version, quantizers)");
  }
  MOEFQ_CHECK(root.contains("version") && root["version"].is_number_integer(), path,
              ": 'version' must be an integer");
  MOEFQ_CHECK(root["version"].get<int64_t>() == kCalibrationVersion, path, ": version ",
              root["version"].get<int64_t>(), " is not supported (expected ", kCalibrationVersion,
              ")");
  MOEFQ_CHECK(root.contains("quantizers") && root["quantizers"].is_object(), path,
              ": 'quantizers' must be an object mapping quantizer names to entries");

  std::map<std::string, Quantizer*> by_name;
  for (Quantizer* q : quantizers) {
    MOEFQ_ASSERT(q != nullptr, "load_calibration: null quantizer");
    MOEFQ_CHECK(by_name.emplace(q->name(), q).second, "load_calibration: quantizer ", q->name(),
                " appears twice");
  }

  // Validate everything first, then apply: a bad file changes no quantizer.
  std::map<std::string, Entry> entries;
  for (const auto& [name, e] : root["quantizers"].items()) {
    Entry entry = parse_entry(path, name, e);
    const auto it = by_name.find(name);
    MOEFQ_CHECK(it != by_name.end(), path, ": quantizer ", name,
                " is not in this model/recipe; the file was made for a different configuration");
    const Quantizer& q = *it->second;
    MOEFQ_CHECK(entry.format == q.spec().format, path, ": quantizer ", name, " was calibrated as ",
                format_name(entry.format), ", but the recipe makes it ",
                format_name(q.spec().format));
    entries.emplace(name, std::move(entry));
  }
  for (const Quantizer* q : quantizers) {
    if (!q->needs_calibration() || !q->enabled()) continue;
    const auto it = entries.find(q->name());
    MOEFQ_CHECK(it != entries.end(), path, ": no calibrated amax for quantizer ", q->name(),
                "; calibrate with this recipe and save again");
    MOEFQ_CHECK(it->second.amax_source == "calibrated" && it->second.amax.has_value(), path,
                ": quantizer ", q->name(), " needs a calibrated amax, but the file's entry is ",
                it->second.amax_source, it->second.amax ? "" : " without an amax");
  }
  for (Quantizer* q : quantizers) {
    const auto it = entries.find(q->name());
    if (it == entries.end() || !q->needs_calibration()) continue;
    if (it->second.amax_source == "calibrated" && it->second.amax) q->set_amax(*it->second.amax);
  }
}

}  // namespace moefq
