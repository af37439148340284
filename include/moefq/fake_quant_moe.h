// Fake quantization of MoE dispatch and combine (docs/fake_quant.md) around an expert back-end on host
// tensors: dispatch_quantizer QDQs the experts' input tokens out of place; combine_quantizer reads
// the combine rows the back-end summed (at its own combine offset), QDQs each active routed row and
// sums again in the engine's order (shared slot last, unquantized), replacing the output. A layout
// check proves, once per buffer, that those rows are the ones the engine summed. The logic is the
// one every device shares (src/fakequant/fake_quant_driver.h); this is its host-loop form.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moefq/expert_backend.h"
#include "moefq/moe_quantizers.h"

namespace moefq {

class FakeQuantDriver;

class FakeQuantMoe {
 public:
  // layer: the model layer index, used in the quantizer names.
  FakeQuantMoe(std::unique_ptr<ExpertBackend> backend, int64_t layer);
  ~FakeQuantMoe();

  static std::string dispatch_name(int64_t layer) { return MoeQuantizers::dispatch_name(layer); }
  static std::string combine_name(int64_t layer) { return MoeQuantizers::combine_name(layer); }
  std::vector<std::string> quantizer_names() const;

  // Sets both quantizers from resolved recipe configs (apply_recipe's output; names of other
  // layers are ignored). Raises the configuration errors of docs/fake_quant.md before any forward:
  // a dispatch quantizer with the shared expert fused, a dynamic global amax on the combine
  // quantizer, a combine quantizer on a back-end that cannot expose its combine rows.
  void configure(const std::map<std::string, QuantizerConfig>& configs);

  // Max calibration over exactly what each quantizer sees; no QDQ meanwhile. finish reduces
  // each amax with MAX over the ranks (every rank then holds the same value); NaN or inf in the
  // data is an error naming the quantizer and the rank.
  void start_calibration();
  void finish_calibration();
  // Leaves a calibration that did not finish (an error, an interrupt): both quantizers as they
  // were at start_calibration. Nothing happens outside a calibration.
  void abort_calibration();
  // Each rank's own max of the last calibration, before the reduction (which 0: dispatch, 1:
  // combine).
  const std::vector<float>& rank_amax(int which) const;
  // Hears every element a quantizer folds into its calibration (which 0: dispatch, 1: combine; the
  // rank; n bf16 values), one rank after the other; empty: none. For statistics beyond the max.
  using CalibrationObserver = std::function<void(int which, int64_t rank, const bf16* x, int64_t n)>;
  void set_calibration_observer(CalibrationObserver observer);

  // One call of every rank; batches[r].y receives rank r's output. A dynamic dispatch amax is the
  // max |x| over the rank's tokens that have an active routed slot (the tokens that are sent). An
  // enabled quantizer that needs a calibrated amax and has none (and is not calibrating) is an
  // error naming it, before any work.
  void forward(std::span<const RankBatch> batches);
  // The quantizers' work in forward() alone, on the combine rows the last call left (the engine is
  // not called): a combine quantizer configured since re-sums those rows into y.
  void quantizers_only(std::span<const RankBatch> batches);

  ExpertBackend& backend() { return *backend_; }
  const MoeQuantizers& quantizers() const;
  const Quantizer& dispatch_quantizer(int64_t rank) const;
  const Quantizer& combine_quantizer(int64_t rank) const;
  // Rank 0's quantizers (identical on every rank after calibration) for save_calibration, and
  // loading into every rank.
  std::vector<const Quantizer*> calibration_state() const;
  void load_calibration_file(const std::string& path);
  void set_calibrated_amax(float dispatch_amax, float combine_amax);
  // Where the combine quantizer's re-sum applies the router weight (quant_spec.h); by default the
  // back-end's own. Set apart from the back-end's, the layout check fails on the first call.
  CombineWeighting combine_weighting() const;
  void set_combine_weighting(CombineWeighting w);
  bool layout_checked(int64_t rank) const;
  // Counting of elements beyond the global amax in the forwards that quantize ([2][R]: dispatch,
  // combine), read and reset.
  void set_count_clipping(bool on);
  std::vector<ClipCounts> read_clip_counts();

 private:
  ExpertBackend* backend_;  // owned by the driver's ops
  std::unique_ptr<FakeQuantDriver> driver_;
  std::shared_ptr<CalibrationObserver> observer_;  // shared with the ops
};

}  // namespace moefq
