// Which moefq format a recipe cfg describes: the numerics keys of Model Optimizer's quantizer
// attributes (num_bits, block_sizes with type and scale_bits, axis) against one table of the
// combinations moefq simulates. New formats are new rows of that table (recipe_formats.cpp).
// Internal to src/quant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moefq/quant_spec.h"

namespace moefq::recipe {

// num_bits or scale_bits as written: an integer (8), a float format (e4m3, E4M3, [4, 3]) or
// another name (a custom back-end's format).
struct Bits {
  enum class Kind { kAbsent, kInt, kFloat, kName };
  Kind kind = Kind::kAbsent;
  int value = 0;         // kInt
  int exp = 0, man = 0;  // kFloat
  std::string name;      // kName

  static Bits integer(int v) { return {Kind::kInt, v, 0, 0, {}}; }
  static Bits fp(int e, int m) { return {Kind::kFloat, 0, e, m, {}}; }
  std::string text() const;  // "8", "e4m3", "'name'", "absent"
  bool operator==(const Bits& o) const;
};

// The numerics of one cfg. An absent num_bits is Model Optimizer's default, 8 (int8).
struct CfgNumerics {
  Bits num_bits = Bits::integer(8);
  std::string axis;                    // "" per tensor (null or absent), else as written ("0")
  bool blocked = false;                // block_sizes given and not null
  std::optional<int64_t> block_size;   // the -1 entry; nullopt when absent or null (whole row)
  std::vector<std::string> other_axes;  // other axis entries ("-2: 16"): only the last dimension is blocked here
  std::string block_type;              // "dynamic", "static", or "" when absent (static in Model Optimizer)
  Bits scale_bits;                     // absent: fp32 block scales
  std::vector<std::string> block_extras;  // other block_sizes keys set (scale_block_sizes, four_over_six)
};

// The QuantSpec (format and block size; the amax source stays calibrated) of the numerics, or
// nullopt with `why` saying what is unsupported and listing what is.
std::optional<QuantSpec> spec_of_numerics(const CfgNumerics& c, std::string* why);

}  // namespace moefq::recipe
