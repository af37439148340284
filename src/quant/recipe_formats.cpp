// The table from a cfg's numerics to a moefq format (recipe_formats.h).
#include "quant/recipe_formats.h"

namespace moefq::recipe {

std::string Bits::text() const {
  std::string s;
  switch (kind) {
    case Kind::kAbsent: s = "absent"; break;
    case Kind::kInt: s = std::to_string(value); break;
    case Kind::kFloat: s.append("e").append(std::to_string(exp)).append("m").append(std::to_string(man)); break;
    case Kind::kName: s.append("'").append(name).append("'"); break;
  }
  return s;
}

bool Bits::operator==(const Bits& o) const {
  if (kind != o.kind) return false;
  switch (kind) {
    case Kind::kAbsent: return true;
    case Kind::kInt: return value == o.value;
    case Kind::kFloat: return exp == o.exp && man == o.man;
    case Kind::kName: return name == o.name;
  }
  return false;
}

namespace {

// One simulated format: per tensor (block 0) or blocks of `block` along the last dimension with
// dynamic block scales of `scale` (kAbsent: fp32 scales), always with axis null.
struct Row {
  Bits num_bits;
  int64_t block;
  Bits scale;
  Format format;
};

const Row kRows[] = {
    {Bits::fp(4, 3), 0, {}, Format::kFp8},
    {Bits::integer(8), 0, {}, Format::kInt8},
    {Bits::fp(2, 1), 16, Bits::fp(4, 3), Format::kNvfp4},
    {Bits::fp(4, 3), 32, Bits::fp(8, 0), Format::kMxfp8},
    {Bits::fp(2, 1), 32, Bits::fp(8, 0), Format::kMxfp4},
    // The wire formats of the dispatch and combine kernels: e4m3 with an fp32 scale per 128
    // channels (Model Optimizer's block quantization without scale_bits), the same with the scale
    // rounded up to a power of two, and DeepEP's 10-bit log format (a moefq extension: Model
    // Optimizer has no log format).
    {Bits::fp(4, 3), 128, {}, Format::kFp8Block128},
    {Bits::fp(4, 3), 128, Bits::fp(8, 0), Format::kFp8Block128Ue8m0},
    {Bits{Bits::Kind::kName, 0, 0, 0, "logfmt10"}, 0, {}, Format::kLogfmt10},
    // The other peers' wire formats (docs/numerics.md), by name: moefq extensions of num_bits, each
    // with the peer's own block and scale rule.
    {Bits{Bits::Kind::kName, 0, 0, 0, "fp8_cast"}, 0, {}, Format::kFp8Cast},
    {Bits{Bits::Kind::kName, 0, 0, 0, "fp8_cast_nan"}, 0, {}, Format::kFp8CastNan},
    {Bits{Bits::Kind::kName, 0, 0, 0, "fp8_block128_ue8m0_nofloor"}, 0, {}, Format::kFp8Block128Ue8m0NoFloor},
    {Bits{Bits::Kind::kName, 0, 0, 0, "fp8_block128_mori"}, 0, {}, Format::kFp8Block128Mori},
    {Bits{Bits::Kind::kName, 0, 0, 0, "fp4_block128_mori"}, 0, {}, Format::kFp4Block128Mori},
    {Bits{Bits::Kind::kName, 0, 0, 0, "fp8_block128_deepgemm"}, 0, {}, Format::kFp8Block128DeepGemm},
    {Bits{Bits::Kind::kName, 0, 0, 0, "fp8_block128_vllm"}, 0, {}, Format::kFp8Block128Vllm},
    {Bits{Bits::Kind::kName, 0, 0, 0, "fp4_block16_flashinfer"}, 0, {}, Format::kFp4Block16FlashInfer},
};

std::string describe_row(const Row& r) {
  std::string s = r.num_bits.text();
  if (r.block > 0) {
    s += " with block_sizes {-1: " + std::to_string(r.block) + ", type: dynamic";
    if (r.scale.kind != Bits::Kind::kAbsent) s += ", scale_bits: " + r.scale.text();
    s += "}";
  }
  return s + " (" + format_name(r.format) + ")";
}

std::string supported() {
  std::string s;
  for (const Row& r : kRows) s += (s.empty() ? "" : ", ") + describe_row(r);
  return s;
}

std::string describe(const CfgNumerics& c) {
  std::string s = "num_bits " + c.num_bits.text();
  if (!c.blocked) return s + " without block_sizes";
  s += " with block_sizes {-1: " + (c.block_size ? std::to_string(*c.block_size) : std::string("null"));
  s += ", type: " + (c.block_type.empty() ? std::string("static (absent)") : c.block_type);
  if (c.scale_bits.kind != Bits::Kind::kAbsent) s += ", scale_bits: " + c.scale_bits.text();
  return s + "}";
}

}  // namespace

std::optional<QuantSpec> spec_of_numerics(const CfgNumerics& c, std::string* why) {
  const auto fail = [&](const std::string& m) -> std::optional<QuantSpec> {
    if (why) *why = m;
    return std::nullopt;
  };
  if (!c.axis.empty())
    return fail("per-channel quantization (axis " + c.axis + ") is not supported; write axis: null (per tensor) "
                "or leave it out");
  if (c.blocked) {
    if (!c.other_axes.empty())
      return fail("block_sizes blocks only the last dimension here (key -1), not " + c.other_axes.front());
    if (!c.block_extras.empty())
      return fail("block_sizes." + c.block_extras.front() + " is not supported (supported: " + supported() + ")");
    if (c.block_type != "dynamic")
      return fail("block_sizes type: " + (c.block_type.empty() ? std::string("static (the default)") : c.block_type) +
                  " is not supported; block scales are computed from each block here: write type: dynamic");
  }
  for (const Row& r : kRows) {
    const bool blocks_match = c.blocked ? (c.block_size && *c.block_size == r.block && r.block > 0 &&
                                           c.scale_bits == r.scale)
                                        : r.block == 0;
    if (blocks_match && c.num_bits == r.num_bits) {
      QuantSpec s;
      s.format = r.format;
      s.block_size = static_cast<int>(r.block);
      return s;
    }
  }
  return fail("unsupported combination: " + describe(c) + " (supported: " + supported() + ")");
}

}  // namespace moefq::recipe
