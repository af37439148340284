// The two fake quantizers of one MoE layer (docs/fake_quant.md), one replica per expert-parallel rank,
// with the rules every fake-quantized layer shares whatever it runs on (CPU or GPU): their names,
// the configuration-time errors, max calibration reduced with MAX over the ranks, the calibration
// file, and the layout check's error.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "moefq/quantizer.h"
#include "moefq/recipe.h"

namespace moefq {

// Elements a quantizer saw (the sent tokens' for dispatch, the active routed rows' for combine)
// and how many lay beyond its global amax (|x| > amax: the format saturates them).
struct ClipCounts {
  uint64_t clipped = 0, total = 0;
};

class MoeQuantizers {
 public:
  MoeQuantizers(int64_t layer, int64_t num_ranks);

  static std::string dispatch_name(int64_t layer);  // "layers.{i}.mlp.experts.dispatch_quantizer"
  static std::string combine_name(int64_t layer);   // "layers.{i}.mlp.experts.combine_quantizer"
  std::vector<std::string> names() const;
  int64_t layer() const { return layer_; }

  // Sets both quantizers from resolved recipe configs (names of other layers are ignored). Raises
  // docs/fake_quant.md's configuration errors: dispatch with the shared expert fused, a dynamic global
  // amax on combine, combine on a back-end (`kind`) that cannot expose its combine rows.
  void configure(const std::map<std::string, QuantizerConfig>& configs, bool fused_shared, bool has_combine_rows,
                 const std::string& kind);

  void start_calibration();
  // MAX over the ranks (the NCCL all-reduce on real ranks), then every replica finishes.
  void finish_calibration();
  // Leaves a calibration that did not finish (an error, an interrupt): every replica is back as
  // it was at start_calibration, also when finish_calibration failed half-way. Nothing happens
  // outside a calibration.
  void abort_calibration() noexcept;

  Quantizer& dispatch(int64_t rank) { return dispatch_[size_t(rank)]; }
  Quantizer& combine(int64_t rank) { return combine_[size_t(rank)]; }
  const Quantizer& dispatch(int64_t rank) const { return dispatch_[size_t(rank)]; }
  const Quantizer& combine(int64_t rank) const { return combine_[size_t(rank)]; }
  // Rank 0's quantizers (identical on every rank after calibration), for save_calibration.
  std::vector<const Quantizer*> calibration_state() const;
  // Loads a calibration file into every rank's replicas.
  void load_calibration_file(const std::string& path);
  // Stores calibrated amax values (e.g. from a calibration shared by several recipes) in every
  // rank's replica of each quantizer that needs one; the others are left as they are.
  void set_calibrated_amax(float dispatch_amax, float combine_amax);

  // The layout check's error (kind kFailedCheck): the buffer (rank), the first mismatching token
  // and element, the engine's value and the re-sum's, and the offset the rows were read at.
  [[noreturn]] void fail_layout_check(int64_t rank, int64_t token, int64_t element, uint16_t engine_bits,
                                      uint16_t resum_bits, size_t combine_offset) const;

 private:
  int64_t layer_;
  std::vector<Quantizer> dispatch_, combine_;
  // The replicas as they were at start_calibration, until the calibration finishes or aborts.
  struct Snapshot {
    std::vector<Quantizer> dispatch, combine;
  };
  std::optional<Snapshot> before_calibration_;
};

}  // namespace moefq
