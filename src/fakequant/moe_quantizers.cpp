#include "moefq/moe_quantizers.h"

#include <cstdio>

#include "moefq/calibration_file.h"
#include "moefq/errors.h"

namespace moefq {
namespace {

std::string hex16(uint16_t v) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "0x%04x", v);
  return buf;
}

}  // namespace

std::string MoeQuantizers::dispatch_name(int64_t layer) {
  return "layers." + std::to_string(layer) + ".mlp.experts.dispatch_quantizer";
}
std::string MoeQuantizers::combine_name(int64_t layer) {
  return "layers." + std::to_string(layer) + ".mlp.experts.combine_quantizer";
}

MoeQuantizers::MoeQuantizers(int64_t layer, int64_t num_ranks) : layer_(layer) {
  dispatch_.assign(size_t(num_ranks), Quantizer(dispatch_name(layer), QuantSpec{}, false));
  combine_.assign(size_t(num_ranks), Quantizer(combine_name(layer), QuantSpec{}, false));
}

std::vector<std::string> MoeQuantizers::names() const { return {dispatch_name(layer_), combine_name(layer_)}; }

void MoeQuantizers::configure(const std::map<std::string, QuantizerConfig>& configs, bool fused_shared,
                              bool has_combine_rows, const std::string& kind) {
  const auto find = [&](const std::string& name) {
    const auto it = configs.find(name);
    return it == configs.end() ? QuantizerConfig{} : it->second;
  };
  const QuantizerConfig d = find(dispatch_name(layer_)), c = find(combine_name(layer_));
  if (d.enable) {
    d.spec.validate(dispatch_name(layer_));
    MOEFQ_CHECK(!fused_shared, dispatch_name(layer_),
                ": the shared expert is fused into the MoE kernel and reads the same staged tokens, so "
                "dispatch quantization would also quantize the shared expert's input; run the shared expert "
                "unfused (EngineOptions::fuse_shared = false) or disable the dispatch quantizer");
  }
  if (c.enable) {
    c.spec.validate(combine_name(layer_));
    MOEFQ_CHECK(!(format_has_global_amax(c.spec.format) && c.spec.amax_source == AmaxSource::kDynamic),
                combine_name(layer_), ": a dynamic amax cannot be used for combine (each rank re-quantizes rows "
                "that came from every expert rank, so a per-call scale computed at the destination simulates no "
                "real sender); set constant_amax or calibrate (algorithm: max), or use mxfp8/mxfp4");
    MOEFQ_CHECK(has_combine_rows, combine_name(layer_), ": the '", kind,
                "' back-end cannot expose its combine rows, so no combine quantizer can be enabled on it");
  }
  for (size_t r = 0; r < dispatch_.size(); ++r) {
    dispatch_[r] = Quantizer(dispatch_name(layer_), d.spec, d.enable);
    combine_[r] = Quantizer(combine_name(layer_), c.spec, c.enable);
  }
  before_calibration_.reset();  // a calibration under the old configuration has nothing to go back to
}

void MoeQuantizers::start_calibration() {
  // A calibration started again before it finished keeps the state of its first start.
  if (!before_calibration_) before_calibration_ = Snapshot{dispatch_, combine_};
  for (auto* qs : {&dispatch_, &combine_})
    for (Quantizer& q : *qs)
      if (q.enabled()) q.start_calibration();
}

void MoeQuantizers::finish_calibration() {
  for (auto* qs : {&dispatch_, &combine_}) {
    if (!(*qs)[0].enabled() || !(*qs)[0].calibrating()) continue;
    std::vector<Quantizer*> replicas;
    for (Quantizer& q : *qs) replicas.push_back(&q);
    reduce_calibration_max(replicas);
    for (Quantizer& q : *qs) q.finish_calibration();
  }
  before_calibration_.reset();
}

void MoeQuantizers::abort_calibration() noexcept {
  if (!before_calibration_) return;
  dispatch_.swap(before_calibration_->dispatch);
  combine_.swap(before_calibration_->combine);
  before_calibration_.reset();
}

std::vector<const Quantizer*> MoeQuantizers::calibration_state() const { return {&dispatch_[0], &combine_[0]}; }

void MoeQuantizers::load_calibration_file(const std::string& path) {
  for (size_t r = 0; r < dispatch_.size(); ++r) {
    std::vector<Quantizer*> qs = {&dispatch_[r], &combine_[r]};
    load_calibration(path, qs);
  }
}

void MoeQuantizers::set_calibrated_amax(float dispatch_amax, float combine_amax) {
  for (size_t r = 0; r < dispatch_.size(); ++r) {
    if (dispatch_[r].enabled() && dispatch_[r].needs_calibration()) dispatch_[r].set_amax(dispatch_amax);
    if (combine_[r].enabled() && combine_[r].needs_calibration()) combine_[r].set_amax(combine_amax);
  }
}

void MoeQuantizers::fail_layout_check(int64_t rank, int64_t token, int64_t element, uint16_t engine, uint16_t resum,
                                      size_t offset) const {
  MOEFQ_FAIL(ErrorKind::kFailedCheck, combine_name(layer_), ": layout check failed on the buffer of rank ", rank,
             ": token ", token, ", element ", element, ": the engine's output is ", hex16(engine), " (",
             bf16_to_f32(engine), ") but the re-sum of the combine rows read at offset ", offset, " is ",
             hex16(resum), " (", bf16_to_f32(resum),
             "); the combine rows are not where the engine's layout says (changed layout, or a debug mode that "
             "clears the buffer)");
}

}  // namespace moefq
