// The dequantized views of expert weights (weights.h).
#include "moefq/weights.h"

#include <algorithm>
#include <array>

#include "moefq/errors.h"

namespace moefq {

namespace {

constexpr int64_t kBlock = 128;  // weight scales cover 128 x 128 blocks

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------------------
// Dequantization

// [rows, cols] e4m3 codes with [ceil(rows/128), ceil(cols/128)] fp32 block scales -> fp32.
std::vector<float> dequant_e4m3(const std::vector<uint8_t>& codes, const std::vector<float>& scales,
                                int64_t rows, int64_t cols, const char* what) {
  const int64_t scale_cols = ceil_div(cols, kBlock);
  MOEFQ_ASSERT(rows >= 0 && cols >= 0 && codes.size() == size_t(rows * cols), what, ": ",
               codes.size(), " e4m3 codes for a [", rows, ", ", cols, "] matrix");
  MOEFQ_ASSERT(scales.size() == size_t(ceil_div(rows, kBlock) * scale_cols), what, ": ",
               scales.size(), " block scales for a [", rows, ", ", cols, "] matrix (expected [",
               ceil_div(rows, kBlock), ", ", scale_cols, "])");
  // e4m3_decode of every code, looked up: the values are the same, the decode per element is not.
  static const auto decoded = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[size_t(c)] = e4m3_decode(uint8_t(c));
    return t;
  }();
  std::vector<float> out(codes.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* srow = scales.data() + (r / kBlock) * scale_cols;
    const uint8_t* crow = codes.data() + r * cols;
    float* orow = out.data() + r * cols;
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const float s = srow[c0 / kBlock];
      const int64_t c1 = std::min(cols, c0 + kBlock);
      for (int64_t c = c0; c < c1; ++c) orow[c] = mul_rn(decoded[crow[c]], s);
    }
  }
  return out;
}

std::vector<float> dequant_bf16(const std::vector<bf16>& w, int64_t rows, int64_t cols,
                                const char* what) {
  MOEFQ_ASSERT(rows >= 0 && cols >= 0 && w.size() == size_t(rows * cols), what, ": ", w.size(),
               " bf16 values for a [", rows, ", ", cols, "] matrix");
  std::vector<float> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = to_f32(w[i]);
  return out;
}

}  // namespace

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kE4m3:
      return "e4m3";
    case WeightFormat::kBf16:
      return "bf16";
  }
  return "unknown";
}

const char* stored_weight_format_name(StoredWeightFormat f) {
  switch (f) {
    case StoredWeightFormat::kE4m3:
      return "e4m3";
    case StoredWeightFormat::kBf16:
      return "bf16";
    case StoredWeightFormat::kMxfp4:
      return "mxfp4";
  }
  return "unknown";
}

WeightFormat loaded_weight_format(StoredWeightFormat f) {
  return f == StoredWeightFormat::kE4m3 ? WeightFormat::kE4m3 : WeightFormat::kBf16;
}

double stored_weight_bytes(StoredWeightFormat f, double n) {
  switch (f) {
    case StoredWeightFormat::kE4m3:
      return n + n / (128.0 * 128.0) * 4.0;  // codes and fp32 128 x 128 block scales
    case StoredWeightFormat::kBf16:
      return 2.0 * n;
    case StoredWeightFormat::kMxfp4:
      return n / 2.0 + n / 32.0;  // two values a byte, one ue8m0 scale per 32
  }
  return 0.0;
}

std::vector<bf16> decode_mxfp4(const uint8_t* packed, const uint8_t* scales, int64_t rows, int64_t cols) {
  MOEFQ_ASSERT(rows >= 0 && cols >= 0 && cols % 32 == 0, "decode_mxfp4: [", rows, ", ", cols,
               "] is not a matrix of whole 32-element blocks");
  // e2m1_decode(c) * 2^(s - 127) rounded to bf16: an e2m1 value has at most 2 significant bits, so
  // the product is exact in fp32 (a subnormal down to 2^-128) and in bf16 (which has the same
  // exponent range) unless it overflows, which gives inf. A NaN scale gives NaN.
  std::vector<bf16> out(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* prow = packed + r * (cols / 2);
    const uint8_t* srow = scales + r * (cols / 32);
    bf16* orow = out.data() + r * cols;
    for (int64_t c = 0; c < cols; c += 2) {
      const float s = ue8m0_decode(srow[c / 32]);
      const uint8_t byte = prow[c / 2];
      orow[c].bits = bf16_round(mul_rn(e2m1_decode(uint8_t(byte & 0x0F)), s));
      orow[c + 1].bits = bf16_round(mul_rn(e2m1_decode(uint8_t(byte >> 4)), s));
    }
  }
  return out;
}

const char* staging_name(Staging s) { return s == Staging::kNone ? "none" : "e4m3"; }

std::optional<Staging> parse_staging(std::string_view name) {
  if (name == "e4m3") return Staging::kE4m3;
  if (name == "none") return Staging::kNone;
  return std::nullopt;
}

Staging staging_from_name(std::string_view name, std::string_view what) {
  const std::optional<Staging> s = parse_staging(name);
  MOEFQ_CHECK(s.has_value(), what, ": unknown staging '", name, "' (expected e4m3 or none)");
  return *s;
}

const char* staging_baseline(Staging s) {
  return s == Staging::kNone ? "bf16 activations into the expert GEMMs (a bf16 grouped-GEMM layer)"
                             : "e4m3 activations with 1x128 scales into the expert GEMMs (FP8 Mega-MoE)";
}

Staging default_staging(const MoeConfig& cfg, std::optional<WeightFormat> checkpoint_format) {
  if (checkpoint_format) return *checkpoint_format == WeightFormat::kBf16 ? Staging::kNone : Staging::kE4m3;
  constexpr std::string_view kBf16Served[] = {"deepseek_v2", "glm4_moe", "qwen3_moe", "mixtral", "olmoe"};
  for (std::string_view t : kBf16Served)
    if (cfg.model_type == t) return Staging::kNone;
  return Staging::kE4m3;
}

std::vector<float> ExpertWeights::gate_up_f32() const {
  if (format == WeightFormat::kE4m3)
    return dequant_e4m3(gate_up_e4m3, gate_up_scale, 2 * intermediate, hidden, "gate_up");
  return dequant_bf16(gate_up_bf16, 2 * intermediate, hidden, "gate_up");
}

std::vector<float> ExpertWeights::down_f32() const {
  if (format == WeightFormat::kE4m3)
    return dequant_e4m3(down_e4m3, down_scale, hidden, intermediate, "down");
  return dequant_bf16(down_bf16, hidden, intermediate, "down");
}

}  // namespace moefq
