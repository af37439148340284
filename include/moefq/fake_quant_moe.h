// Fake quantization of MoE dispatch and combine (fake_quant.md) around an expert back-end:
// dispatch_quantizer QDQs the experts' input tokens out of place; combine_quantizer reads the
// combine rows the back-end summed (at its own combine offset), QDQs each active routed row and
// sums again in the engine's order (shared slot last, unquantized), replacing the output. A layout
// check proves, once per buffer, that those rows are the ones the engine summed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "moefq/expert_backend.h"
#include "moefq/moe_quantizers.h"

namespace moefq {

class FakeQuantMoe {
 public:
  // layer: the model layer index, used in the quantizer names.
  FakeQuantMoe(std::unique_ptr<ExpertBackend> backend, int64_t layer);

  static std::string dispatch_name(int64_t layer) { return MoeQuantizers::dispatch_name(layer); }
  static std::string combine_name(int64_t layer) { return MoeQuantizers::combine_name(layer); }
  std::vector<std::string> quantizer_names() const { return q_.names(); }

  // Sets both quantizers from resolved recipe configs (apply_recipe's output; names of other
  // layers are ignored). Raises the configuration errors of fake_quant.md before any forward:
  // a dispatch quantizer with the shared expert fused, a dynamic global amax on the combine
  // quantizer, a combine quantizer on a back-end that cannot expose its combine rows.
  void configure(const std::map<std::string, QuantizerConfig>& configs);

  // Max calibration over exactly what each quantizer sees; no QDQ meanwhile. finish reduces
  // each amax with MAX over the ranks (every rank then holds the same value).
  void start_calibration() { q_.start_calibration(); }
  void finish_calibration() { q_.finish_calibration(); }

  // One call of every rank; batches[r].y receives rank r's output. A dynamic dispatch amax is the
  // max |x| over the rank's tokens that have an active routed slot (the tokens that are sent).
  void forward(std::span<const RankBatch> batches);

  ExpertBackend& backend() { return *backend_; }
  const Quantizer& dispatch_quantizer(int64_t rank) const { return q_.dispatch(rank); }
  const Quantizer& combine_quantizer(int64_t rank) const { return q_.combine(rank); }
  // Rank 0's quantizers (identical on every rank after calibration) for save_calibration, and
  // loading into every rank.
  std::vector<const Quantizer*> calibration_state() const { return q_.calibration_state(); }
  void load_calibration_file(const std::string& path) { q_.load_calibration_file(path); }
  void set_calibrated_amax(float dispatch_amax, float combine_amax) { q_.set_calibrated_amax(dispatch_amax, combine_amax); }
  bool layout_checked(int64_t rank) const { return checked_[size_t(rank)]; }

 private:
  const bf16* combine_row(int64_t rank, int64_t slot, int64_t token) const;
  void check_layout(int64_t rank, const RankBatch& b) const;

  std::unique_ptr<ExpertBackend> backend_;
  MoeQuantizers q_;
  std::vector<bool> checked_;                  // per buffer: layout check done
};

}  // namespace moefq
