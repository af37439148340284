// What a fake quantizer does: its format, block size and where its global amax comes from.
// Shared by recipes (which produce specs) and quantizers (which apply them).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "moefq/qdq.h"

namespace moefq {

enum class AmaxSource {
  kCalibrated,  // max calibration over the data the quantizer is shown
  kConstant,    // a fixed value (e.g. 2688 makes the nvfp4 global scale 1)
  kDynamic,     // per call, max |x| over the whole tensor
};
const char* amax_source_name(AmaxSource s);

// Where a layer applies the router weight w[t, k] (docs/engine.md, docs/fake_quant.md). kBefore: in the
// SwiGLU step, so the combine rows are weighted and the combine sums them as they are. kAfter: the
// rows are left unweighted and the combine (and the combine quantizer's re-sum, after its QDQ)
// multiplies each routed row by w[t, k] in fp32 before adding it. A layer property: the engine
// and the quantizer wrapping it must agree (the layout check catches them when they do not).
enum class CombineWeighting { kBefore, kAfter };
const char* combine_weighting_name(CombineWeighting w);  // "before", "after"
// "before" or "after"; nullopt for anything else.
std::optional<CombineWeighting> parse_combine_weighting(std::string_view text);
// The same for a user's option: anything else is an error (bad input) naming the option `what`.
CombineWeighting combine_weighting_option(std::string_view text, std::string_view what);

struct QuantSpec {
  Format format = Format::kFp8;
  int block_size = 0;  // 0: the format's own (16 nvfp4, 32 mx, none for fp8/int8)
  AmaxSource amax_source = AmaxSource::kCalibrated;
  float constant_amax = 0.0f;  // used when amax_source == kConstant

  // Throws moefq::Error (bad input) naming `quantizer` when the spec is invalid: a block size the
  // format does not have, a constant amax that is not finite and > 0.
  void validate(std::string_view quantizer) const;
  // e.g. "nvfp4 (block 16, e4m3 scales), amax constant 2688"
  std::string describe() const;
};

bool operator==(const QuantSpec& a, const QuantSpec& b);

}  // namespace moefq
