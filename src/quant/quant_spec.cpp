#include "moefq/quant_spec.h"

#include "moefq/errors.h"

namespace moefq {

const char* amax_source_name(AmaxSource s) {
  switch (s) {
    case AmaxSource::kCalibrated: return "calibrated";
    case AmaxSource::kConstant: return "constant";
    case AmaxSource::kDynamic: return "dynamic";
  }
  return "?";
}

const char* combine_weighting_name(CombineWeighting w) { return w == CombineWeighting::kAfter ? "after" : "before"; }

std::optional<CombineWeighting> parse_combine_weighting(std::string_view text) {
  if (text == "before") return CombineWeighting::kBefore;
  if (text == "after") return CombineWeighting::kAfter;
  return std::nullopt;
}

CombineWeighting combine_weighting_option(std::string_view text, std::string_view what) {
  const std::optional<CombineWeighting> w = parse_combine_weighting(text);
  MOEFQ_CHECK(w.has_value(), what, ": unknown mode '", text, "' (expected before or after)");
  return *w;
}

void QuantSpec::validate(std::string_view quantizer) const {
  const int own = format_block_size(format);
  MOEFQ_CHECK(block_size == 0 || block_size == own, quantizer, ": format ", format_name(format),
              own ? " uses blocks of " + std::to_string(own) : std::string(" is per-tensor"),
              ", not blocks of ", block_size);
  if (amax_source == AmaxSource::kConstant)
    MOEFQ_CHECK(is_finite(constant_amax) && constant_amax > 0.0f, quantizer,
                ": constant_amax must be a finite number > 0, got ", constant_amax);
}

std::string QuantSpec::describe() const {
  // Built without iostreams, like the error messages (errors.h says why): Python's repr calls it.
  std::string s = format_name(format);
  switch (format) {
    case Format::kNvfp4: s += " (e2m1, block 16, e4m3 scales)"; break;
    case Format::kMxfp8: s += " (e4m3, block 32, ue8m0 scales)"; break;
    case Format::kMxfp4: s += " (e2m1, block 32, ue8m0 scales)"; break;
    case Format::kFp8: s += " (e4m3, per tensor)"; break;
    case Format::kInt8: s += " (int8, per tensor)"; break;
    case Format::kFp8Block128: s += " (e4m3, block 128, fp32 scales)"; break;
    case Format::kFp8Block128Ue8m0: s += " (e4m3, block 128, ue8m0 scales)"; break;
    case Format::kLogfmt10: s += " (10-bit log, block 128, bf16 fallback)"; break;
    case Format::kFp8Cast: s += " (e4m3, no scale, saturating)"; break;
    case Format::kFp8CastNan: s += " (e4m3, no scale, NaN beyond 448)"; break;
    case Format::kFp8Block128Ue8m0NoFloor: s += " (e4m3, block 128, ue8m0 scales, no amax floor)"; break;
    case Format::kFp8Block128Mori: s += " (e4m3, block 128, fp32 scales only above 448)"; break;
    case Format::kFp4Block128Mori: s += " (e2m1, block 128, fp32 scales)"; break;
    case Format::kFp8Block128DeepGemm: s += " (e4m3, block 128, fp32 scales, x * (1 / sf))"; break;
    case Format::kFp8Block128Vllm: s += " (e4m3, block 128, fp32 scales, x / sf)"; break;
    case Format::kFp4Block16FlashInfer: s += " (e2m1, block 16, bf16 block maxima)"; break;
  }
  if (format_has_global_amax(format)) {
    s += detail::concat(", amax ", amax_source_name(amax_source));
    if (amax_source == AmaxSource::kConstant) s += detail::concat(" ", constant_amax);
  }
  return s;
}

bool operator==(const QuantSpec& a, const QuantSpec& b) {
  return a.format == b.format && (a.block_size ? a.block_size : format_block_size(a.format)) ==
                                     (b.block_size ? b.block_size : format_block_size(b.format)) &&
         a.amax_source == b.amax_source &&
         (a.amax_source != AmaxSource::kConstant || a.constant_amax == b.constant_amax);
}

}  // namespace moefq
