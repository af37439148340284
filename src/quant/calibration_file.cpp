#include "moefq/calibration_file.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <nlohmann/json.hpp>

#include "moefq/errors.h"
#include "moefq/fileio.h"
#include "moefq/host_memory.h"

namespace moefq {
namespace {

using nlohmann::json;

constexpr int kVersion = 2;
constexpr const char* kKind = "moefq calibration";
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

bool is_integer_text(const std::string& s) {
  if (s.empty() || s.size() > 18) return false;
  for (size_t i = 0; i < s.size(); ++i)
    if (!(s[i] >= '0' && s[i] <= '9') && !(i == 0 && s[i] == '-' && s.size() > 1)) return false;
  return true;
}

// A finite, non-negative binary32 from a JSON number (range-checked before narrowing).
float amax_number(const json& v, const std::string& where) {
  MOEFQ_CHECK(v.is_number(), where, " must be a number");
  const double d = v.get<double>();
  MOEFQ_CHECK(d >= 0.0 && d <= double(kFltMax), where, " must be a finite number >= 0 in the fp32 range, got ", d);
  return float(d);
}

CalibrationEntry parse_entry(const std::string& path, const std::string& name, const json& e, int version) {
  const std::string where = path + ": quantizer " + name;
  MOEFQ_CHECK(e.is_object(), where, ": the entry must be an object");
  for (const auto& [key, value] : e.items()) {
    (void)value;
    MOEFQ_CHECK(key == "format" || key == "amax_source" || key == "amax" || key == "amax_bits" ||
                    (version >= 2 && key == "rank_amax"),
                where, ": unknown key '", key, "' (expected format, amax_source, amax, amax_bits, rank_amax)");
  }
  CalibrationEntry entry;
  if (e.contains("format") || version < 2) {
    MOEFQ_CHECK(e.contains("format") && e["format"].is_string(), where, ": 'format' must be a string (",
                format_choices(), ")");
    const std::string fmt = e["format"].get<std::string>();
    entry.format = parse_format(fmt);
    MOEFQ_CHECK(entry.format.has_value(), where, ": unknown format '", fmt, "' (", format_choices(), ")");
  }
  if (e.contains("amax_source") || version < 2) {
    MOEFQ_CHECK(e.contains("amax_source") && e["amax_source"].is_string(), where,
                ": 'amax_source' must be a string (calibrated|constant|dynamic|none)");
    entry.amax_source = e["amax_source"].get<std::string>();
  }
  const std::string& source = entry.amax_source;
  const bool global = !entry.format || format_has_global_amax(*entry.format);
  if (global) {
    MOEFQ_CHECK(source == "calibrated" || source == "constant" || source == "dynamic", where,
                ": amax_source must be calibrated|constant|dynamic", entry.format ? std::string(" for ") + format_name(*entry.format) : "",
                ", got '", source, "'");
  } else {
    MOEFQ_CHECK(source == kNoAmaxSource, where, ": format ", format_name(*entry.format),
                " has no global amax; amax_source must be 'none', got '", source, "'");
  }
  std::optional<float> from_number, from_bits;
  if (e.contains("amax")) from_number = amax_number(e["amax"], where + ": 'amax'");
  if (e.contains("amax_bits")) {
    MOEFQ_CHECK(e["amax_bits"].is_string(), where, ": 'amax_bits' must be a string like \"0x41480000\"");
    from_bits = parse_amax_bits(e["amax_bits"].get<std::string>());
    MOEFQ_CHECK(from_bits.has_value(), where, ": 'amax_bits' must be \"0x\" and 8 hex digits, got '",
                e["amax_bits"].get<std::string>(), "'");
  }
  // The bits are exact; the number is for people. If someone edited one but not the other, say so
  // rather than silently picking one.
  if (from_number && from_bits)
    MOEFQ_CHECK(f32_bits(*from_number) == f32_bits(*from_bits), where, ": 'amax' ", *from_number, " and 'amax_bits' ",
                e["amax_bits"].get<std::string>(), " (", *from_bits, ") disagree; fix or remove one of them");
  entry.amax = from_bits ? from_bits : from_number;
  if (entry.amax) {
    MOEFQ_CHECK(global, where, ": format ", format_name(*entry.format), " has no global amax, but the entry holds one");
    MOEFQ_CHECK(is_finite(*entry.amax) && !(*entry.amax < 0.0f), where, ": amax must be a finite number >= 0, got ",
                *entry.amax);
  }
  if (e.contains("rank_amax")) {
    MOEFQ_CHECK(e["rank_amax"].is_array(), where, ": 'rank_amax' must be an array of numbers");
    for (const json& v : e["rank_amax"]) entry.rank_amax.push_back(amax_number(v, where + ": 'rank_amax' entries"));
  }
  // The amax is the MAX reduction of the ranks' own maxima: a file where they disagree was edited.
  if (!entry.rank_amax.empty()) {
    MOEFQ_CHECK(entry.amax.has_value(), where, ": 'rank_amax' without an amax");
    const float most = *std::max_element(entry.rank_amax.begin(), entry.rank_amax.end());
    MOEFQ_CHECK(f32_bits(most) == f32_bits(*entry.amax), where, ": amax ", *entry.amax,
                " is not the largest of its rank_amax (", most,
                "); the amax is the maximum over the ranks: fix the file or calibrate again");
  }
  return entry;
}

}  // namespace

const std::string* CalibrationFile::setup_value(const std::string& key) const {
  for (const auto& [k, v] : setup)
    if (k == key) return &v;
  return nullptr;
}

bool CalibrationFile::setup_is_integer(const std::string& key) const {
  return std::find(setup_integers.begin(), setup_integers.end(), key) != setup_integers.end();
}

void write_calibration_file(const std::string& path, const CalibrationFile& file) {
  using ojson = nlohmann::ordered_json;  // the keys in the order written: version first
  ojson root = ojson::object();
  root["version"] = kVersion;
  root["kind"] = kKind;
  root["moefq_version"] = MOEFQ_VERSION;
  root["algorithm"] = file.algorithm;
  if (!file.source.empty()) root["source"] = file.source;
  ojson setup = ojson::object();
  for (const auto& [k, v] : file.setup) setup[k] = is_integer_text(v) ? ojson(std::stoll(v)) : ojson(v);
  root["setup"] = setup;
  ojson entries = ojson::object();
  for (const auto& [name, e] : file.quantizers) {
    ojson j = ojson::object();
    if (e.format) j["format"] = format_name(*e.format);
    j["amax_source"] = e.amax_source;
    if (e.amax) {
      j["amax"] = double(*e.amax);  // exact as a double; printed with round-trip precision
      j["amax_bits"] = amax_bits_string(*e.amax);
    }
    if (!e.rank_amax.empty()) {
      j["rank_amax"] = ojson::array();
      for (float v : e.rank_amax) j["rank_amax"].push_back(double(v));
    }
    entries[name] = std::move(j);
  }
  root["quantizers"] = std::move(entries);
  write_file_atomic(path, root.dump(2) + "\n");
}

CalibrationFile read_calibration_file(const std::string& path_arg, const std::string& where_arg) {
  const std::string& path = where_arg.empty() ? path_arg : where_arg;
  const std::string text = read_regular_file(path_arg, kMaxCalibrationFileBytes, path);
  // A calibration file nests 4 deep (root, quantizers, an entry, rank_amax).
  check_json_text(text, path, 16);
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    MOEFQ_FAIL(ErrorKind::kBadInput, path, ": not a valid calibration file (malformed JSON: ", e.what(), ")");
  } catch (const std::bad_alloc&) {
    MOEFQ_FAIL(ErrorKind::kBadInput, path, ": ran out of memory while reading this ", format_bytes(text.size()),
               " calibration file");
  }
  MOEFQ_CHECK(root.is_object(), path, ": a calibration file is a JSON object with 'version' and 'quantizers'");
  MOEFQ_CHECK(root.contains("version") && root["version"].is_number_integer(), path, ": 'version' must be an integer");
  const int64_t version = root["version"].get<int64_t>();
  // The message shows dump(): an unsigned 2^64 - 1 reads as -1 through int64_t.
  MOEFQ_CHECK(version == 1 || version == kVersion, path, ": version ", root["version"].dump(),
              " is not supported (expected 1 or ", kVersion, ")");
  MOEFQ_CHECK(version >= 2 || root.value("kind", json()) != "moefq eval calibration", path,
              ": a calibration file of an older moefq (its eval format 1); calibrate again with this version");
  for (const auto& [key, value] : root.items()) {
    (void)value;
    const bool v2_key = key == "kind" || key == "moefq_version" || key == "algorithm" || key == "source" || key == "setup";
    MOEFQ_CHECK(key == "version" || key == "quantizers" || (version >= 2 && v2_key), path, ": unknown key '", key,
                "' (expected version, kind, moefq_version, algorithm, source, setup, quantizers)");
  }
  CalibrationFile f;
  if (version >= 2) {
    MOEFQ_CHECK(root.value("kind", json()) == kKind, path, ": 'kind' must be \"", kKind, "\"");
    const json algorithm = root.value("algorithm", json("max"));
    MOEFQ_CHECK(algorithm.is_string() && (algorithm == "max" || algorithm.get<std::string>().rfind("percentile ", 0) == 0),
                path, ": 'algorithm' must be \"max\" or \"percentile P\"");
    f.algorithm = algorithm.get<std::string>();
    if (root.contains("source")) {
      MOEFQ_CHECK(root["source"].is_string(), path, ": 'source' must be a string");
      f.source = root["source"].get<std::string>();
    }
    if (root.contains("setup")) {
      MOEFQ_CHECK(root["setup"].is_object(), path, ": 'setup' must be an object");
      for (const auto& [k, v] : root["setup"].items()) {
        MOEFQ_CHECK(v.is_string() || v.is_number_integer(), path, ": setup.", k, " must be a string or an integer");
        f.setup.emplace_back(k, v.is_string() ? v.get<std::string>() : v.dump());  // an integer as written (2^64 - 1 too)
        if (v.is_number_integer()) f.setup_integers.push_back(k);
      }
    }
  }
  MOEFQ_CHECK(root.contains("quantizers") && root["quantizers"].is_object(), path,
              ": 'quantizers' must be an object mapping quantizer names to entries");
  for (const auto& [name, e] : root["quantizers"].items())
    f.quantizers.emplace(name, parse_entry(path, name, e, int(version)));
  return f;
}

void save_calibration(const std::string& path, std::span<const Quantizer* const> quantizers) {
  CalibrationFile f;
  for (const Quantizer* q : quantizers) {
    MOEFQ_ASSERT(q != nullptr, "save_calibration: null quantizer");
    MOEFQ_CHECK(!f.quantizers.count(q->name()), "save_calibration: quantizer ", q->name(), " appears twice");
    const std::optional<float> amax = q->amax();
    MOEFQ_CHECK(amax.has_value() || !q->needs_calibration() || !q->enabled(), "save_calibration: ", q->name(),
                " is not calibrated; run calibration before saving ", path);
    CalibrationEntry e;
    e.format = q->spec().format;
    e.amax_source = format_has_global_amax(q->spec().format) ? amax_source_name(q->spec().amax_source) : kNoAmaxSource;
    e.amax = amax;
    f.quantizers.emplace(q->name(), std::move(e));
  }
  write_calibration_file(path, f);
}

void load_calibration(const std::string& path, std::span<Quantizer* const> quantizers) {
  const CalibrationFile f = read_calibration_file(path);
  std::map<std::string, Quantizer*> by_name;
  for (Quantizer* q : quantizers) {
    MOEFQ_ASSERT(q != nullptr, "load_calibration: null quantizer");
    MOEFQ_CHECK(by_name.emplace(q->name(), q).second, "load_calibration: quantizer ", q->name(), " appears twice");
  }
  // Validate everything first, then apply: a bad file changes no quantizer.
  for (const auto& [name, entry] : f.quantizers) {
    const auto it = by_name.find(name);
    MOEFQ_CHECK(it != by_name.end(), path, ": quantizer ", name,
                " is not in this model/recipe; the file was made for a different configuration");
    const Quantizer& q = *it->second;
    MOEFQ_CHECK(!entry.format || *entry.format == q.spec().format, path, ": quantizer ", name, " was calibrated as ",
                entry.format ? format_name(*entry.format) : "", ", but the recipe makes it ", format_name(q.spec().format));
  }
  for (const Quantizer* q : quantizers) {
    if (!q->needs_calibration() || !q->enabled()) continue;
    const auto it = f.quantizers.find(q->name());
    MOEFQ_CHECK(it != f.quantizers.end(), path, ": no calibrated amax for quantizer ", q->name(),
                "; calibrate with this recipe and save again");
    MOEFQ_CHECK(it->second.amax_source == "calibrated" && it->second.amax.has_value(), path, ": quantizer ", q->name(),
                " needs a calibrated amax, but the file's entry is ", it->second.amax_source,
                it->second.amax ? "" : " without an amax");
  }
  for (Quantizer* q : quantizers) {
    const auto it = f.quantizers.find(q->name());
    if (it == f.quantizers.end() || !q->needs_calibration()) continue;
    if (it->second.amax_source == "calibrated" && it->second.amax) q->set_amax(*it->second.amax);
  }
}

}  // namespace moefq
