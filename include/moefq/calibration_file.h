// The calibration file: calibrated amax values saved by one run and loaded by later ones (JSON,
// version 2; version 1 files, written before the per-rank maxima and the setup were added, still
// load). One format for every writer (a quantizer set, `moefq calibrate`) and one reader:
//   {"version": 2, "kind": "moefq calibration", "moefq_version": "0.1.0", "algorithm": "max",
//    "source": "max calibration on 2 batches x 4 ranks x 256 tokens",
//    "setup": {"model": "preset tiny", "ranks": 4, ...},
//    "quantizers": {"<name>": {"format": "nvfp4", "amax_source": "calibrated", "amax": 12.5,
//                              "amax_bits": "0x41480000", "rank_amax": [12.5, 3.0]}}}
// "amax" and "amax_bits" (the exact binary32 bits, read preferentially; an "amax" that disagrees
// with them is an error) are present when the quantizer has an amax; "format" is absent where the
// amax is format-independent (max calibration measures max |x| whatever the format: the eval's
// calibration serves every recipe); "amax_source" is "none" for mx formats; "rank_amax" holds each
// expert-parallel rank's own max before the MAX reduction; "setup" says what the amax was
// measured on (free-form keys, numbers or strings). Unknown keys are errors.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "moefq/quantizer.h"

namespace moefq {

struct CalibrationEntry {
  std::optional<Format> format;  // nullopt: applies to any format
  std::string amax_source = "calibrated";  // calibrated | constant | dynamic | none
  std::optional<float> amax;
  std::vector<float> rank_amax;
};

struct CalibrationFile {
  // "max", or "percentile P" (calibration_stats.h; the amax is then not the max of rank_amax, which
  // such a file leaves out).
  std::string algorithm = "max";
  std::string source;                                       // how the amax was measured
  std::vector<std::pair<std::string, std::string>> setup;  // in order; integers are written as numbers
  std::map<std::string, CalibrationEntry> quantizers;
  const std::string* setup_value(const std::string& key) const;
  // Whether setup[key] was a JSON integer in the file read (a string such as "4" is not).
  bool setup_is_integer(const std::string& key) const;
  std::vector<std::string> setup_integers;  // the keys read as JSON integers
};

// Writes through a temporary name and a rename: `path` is either untouched or complete.
void write_calibration_file(const std::string& path, const CalibrationFile& file);
// The largest calibration file read: a file of thousands of layers and ranks stays far below it;
// a hostile one (or /dev/zero) is refused before it fills memory.
inline constexpr size_t kMaxCalibrationFileBytes = size_t(64) << 20;

// Reads and validates the whole file (errors name the file and the entry): not a regular file
// (refused without opening it for a blocking read), over kMaxCalibrationFileBytes, malformed JSON, wrong
// types, unknown keys, an unknown format, an amax that is negative or not finite, amax and
// amax_bits that disagree, an amax on a format without a global amax, a rank_amax list whose
// largest entry is not the amax (the amax is the MAX reduction of the ranks' maxima).
// `where` starts every message (default: the path), e.g. "--load-calibration calib.json".
CalibrationFile read_calibration_file(const std::string& path, const std::string& where = "");

// The quantizers' view. save: one entry per quantizer (format, source, amax); an error when names
// repeat or an enabled quantizer that needs calibration has no amax.
void save_calibration(const std::string& path, std::span<const Quantizer* const> quantizers);
// Sets the amax of every quantizer that needs calibration; all or nothing. Errors (naming the
// file): an entry for a quantizer not in `quantizers`, a format that differs from the
// quantizer's, an enabled quantizer that needs calibration but has no entry, or whose entry holds
// no calibrated amax. Entries of quantizers that do not need calibration are checked but their
// amax is not applied.
void load_calibration(const std::string& path, std::span<Quantizer* const> quantizers);

}  // namespace moefq
