// The logic of a fake-quantized MoE layer (docs/fake_quant.md), written once for every device: dispatch
// QDQ out of place with its amax over the tokens that are sent, max calibration reduced with MAX
// over the ranks, the layout check (eager on the first call with routed rows, or recorded in a
// captured graph and raised at the next synchronisation), combine QDQ + re-sum with the shared slot
// last and unquantized, and the counting of clipped elements. FakeQuantOps are the device-specific
// primitives beneath it: host loops for the CPU back-ends (fake_quant_moe.cpp), kernels on the GPU
// (fakequant/cuda). A local rank index r runs over the ranks the ops compute (rank
// first_rank() + r).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "moefq/cpu_engine.h"
#include "moefq/moe_quantizers.h"
#include "moefq/qdq.h"

namespace moefq {

// Statistics of one quantizer replica: the largest |x| over non-NaN elements (>= 0, so its bits
// order like its value), whether any element was seen, how many were NaN or inf. Every word is a
// non-negative number ordered like its bits: one MAX over the words reduces a set of them.
struct AmaxStats {
  float max;
  uint32_t seen, nonfinite, pad;
};
static_assert(sizeof(AmaxStats) == 16);

// Where the tokens' statistics go: the calibration of the dispatch quantizer, or the per-call
// dynamic dispatch amax.
enum class TokenStats { kCalibration, kDynamic };

// The first element at which a buffer's unquantized re-sum differed from the engine's output.
struct LayoutMismatch {
  int64_t token = 0, element = 0;
  uint16_t engine_bits = 0, resum_bits = 0;
};

class FakeQuantOps {
 public:
  virtual ~FakeQuantOps() = default;
  virtual std::string kind() const = 0;  // the back-end, for messages
  virtual const MoeConfig& config() const = 0;
  virtual int64_t first_rank() const = 0;
  virtual int64_t num_local_ranks() const = 0;
  virtual int64_t max_tokens() const = 0;
  virtual bool fused_shared() const = 0;
  // Where the engine applies the router weight (the quantizer's default, FakeQuantDriver).
  virtual CombineWeighting combine_weighting() const = 0;
  // The combine rows p[t, k] of a rank: bf16 [K + fused][T][H] from this byte offset of its
  // buffer of buffer_bytes(); nullopt when the back-end cannot expose them.
  virtual std::optional<size_t> combine_offset() const = 0;
  virtual size_t buffer_bytes() const = 0;
  // Whether the calls are being captured into a CUDA graph (no synchronisation allowed).
  virtual bool capturing() const { return false; }
  // Whether the ranks are real processes (this one computing one of them), not simulated ones.
  virtual bool real_ranks() const { return false; }

  // The global amax each QDQ reads: [2][R] (dispatch, combine; 0 where none).
  virtual void set_amax(const std::vector<float>& amax) = 0;
  // Max calibration: zero both quantizers' statistics; fold tokens (those with an active routed
  // slot) or the active routed combine rows in; read [2][R] (dispatch, combine), synchronising,
  // after a MAX over every expert-parallel rank where the ranks are real processes.
  virtual void reset_calibration() = 0;
  virtual void token_stats(int64_t r, const RankBatch& b, TokenStats where) = 0;
  virtual void row_stats(int64_t r, const RankBatch& b) = 0;
  virtual std::vector<AmaxStats> read_calibration() = 0;
  // The per-call dynamic dispatch amax of rank r starts from zero (before token_stats kDynamic).
  virtual void reset_dynamic(int64_t r) = 0;
  // Clip counters [2][R]: count b's elements beyond the amax of (which, r) (which 0: dispatch over
  // the tokens with an active routed slot, 1: combine over the active routed rows); read and zero.
  virtual void count_clipped(int64_t r, const RankBatch& b, int which) = 0;
  virtual std::vector<ClipCounts> read_clip_counts() = 0;

  // QDQ of b.x out of place (the caller's tokens are not modified); returns the quantized tokens
  // ([n, H] in the ops' memory, valid until the next call). dynamic: the amax is rank r's dynamic
  // statistic, else the dispatch amax of set_amax.
  virtual const bf16* dispatch_qdq(int64_t r, const RankBatch& b, Format f, bool dynamic) = 0;
  // The engine call of every local rank; skip_combine: ranks whose y the caller replaces (the
  // engine may leave it unwritten).
  virtual void engine_forward(std::span<const RankBatch> batches, const std::vector<bool>& skip_combine) = 0;
  // Whether b has an active routed slot (may synchronise).
  virtual bool has_routed_rows(int64_t r, const RankBatch& b) = 0;
  // b.y = the re-sum of rank r's rows in the engine's order: each active routed row QDQ'd in
  // `format` with the combine amax (plain when nullopt) and, when weighting is after, multiplied
  // by its router weight b.topk_weights[t, k], the fused shared slot last and unquantized. check:
  // first compares the unquantized re-sum (weighted the same way) with b.y (the engine's output)
  // and records the first mismatch.
  virtual void combine(int64_t r, const RankBatch& b, std::optional<Format> format, CombineWeighting weighting,
                       bool check) = 0;
  // The mismatch recorded for rank r since the last read, if any (synchronises; real ranks raise
  // a barrier timeout first, before rows a peer never wrote read as a mismatch).
  virtual std::optional<LayoutMismatch> read_check(int64_t r) = 0;
  // Synchronises; real ranks raise a barrier timeout.
  virtual void synchronize() = 0;

  // Beside the driver, for the layer facade (moefq/fake_quant_moe.h): the stream the calls that
  // follow enqueue on (a cudaStream_t; host loops ignore it), the model's shared expert on local
  // rank r's tokens, and the model's output out = bf16(routed + shared) (one rounding; shared null:
  // a copy of routed).
  virtual void set_stream(void* /*stream*/) {}
  virtual void shared_expert(int64_t r, const bf16* x, int64_t n, bf16* y) = 0;
  virtual void add_shared(const bf16* routed, const bf16* shared, bf16* out, int64_t n) = 0;
};

class FakeQuantDriver {
 public:
  FakeQuantDriver(std::unique_ptr<FakeQuantOps> ops, int64_t layer);

  FakeQuantOps& ops() { return *ops_; }
  const FakeQuantOps& ops() const { return *ops_; }
  MoeQuantizers& quantizers() { return q_; }
  const MoeQuantizers& quantizers() const { return q_; }

  // Both quantizers from resolved recipe configs, with docs/fake_quant.md's configuration errors
  // before any forward.
  void configure(const std::map<std::string, QuantizerConfig>& configs);
  // Max calibration (no QDQ meanwhile): start, forwards, finish (MAX over the ranks; errors name
  // the quantizer when no rank saw data or the data held NaN or inf). Both synchronise.
  void start_calibration();
  void finish_calibration();
  // Leaves a calibration that did not finish: both quantizers as they were at start (their amax
  // back on the device too). Nothing happens outside a calibration.
  void abort_calibration();
  // Each local rank's own max of the last calibration, before the reduction ([R]).
  const std::vector<float>& rank_amax(int which) const { return rank_amax_[size_t(which)]; }
  void load_calibration_file(const std::string& path);
  void set_calibrated_amax(float dispatch_amax, float combine_amax);
  // Where the combine quantizer's re-sum applies the router weight; by default where the engine
  // does. Set apart from the engine, a mismatch is what the layout check reports.
  CombineWeighting combine_weighting() const { return weighting_; }
  void set_combine_weighting(CombineWeighting w) { weighting_ = w; }

  // One call of every local rank; batches[r].y receives rank r's output. No synchronisation
  // except the eager layout check (once per buffer, on its first call with routed rows). Once a
  // rank's buffer passed it, the combine quantizer's re-sum is y's only writer and the engine's
  // combine is skipped. with_engine = false: the quantizers' work alone, on the rows the last call
  // left (what the benchmarks time). A quantizer that QDQs with a calibrated amax it does not
  // have yet (configured, never calibrated, loaded or set) is an error naming it, before any work.
  void forward(std::span<const RankBatch> batches, bool with_engine = true);
  // Synchronises; raises a barrier timeout, then the first mismatch a check recorded in a graph.
  void synchronize();

  bool layout_checked(int64_t r) const { return checked_[size_t(r)]; }
  // Counting of clipped elements in the forwards that quantize (off by default).
  void set_count_clipping(bool on) { count_clipping_ = on; }
  std::vector<ClipCounts> read_clip_counts() { return ops_->read_clip_counts(); }

 private:
  void upload_amax();
  void raise_recorded(int64_t r);

  std::unique_ptr<FakeQuantOps> ops_;
  MoeQuantizers q_;
  std::vector<bool> checked_, pending_;
  std::vector<float> rank_amax_[2];
  CombineWeighting weighting_;
  bool count_clipping_ = false;
};

}  // namespace moefq
