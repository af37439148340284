#include "fakequant/fake_quant_driver.h"

#include "moefq/errors.h"

namespace moefq {

FakeQuantDriver::FakeQuantDriver(std::unique_ptr<FakeQuantOps> ops, int64_t layer)
    : ops_(std::move(ops)), q_(layer, ops_->num_local_ranks()), weighting_(ops_->combine_weighting()) {
  const size_t R = size_t(ops_->num_local_ranks());
  checked_.assign(R, false);
  pending_.assign(R, false);
  rank_amax_[0].assign(R, 0.0f);
  rank_amax_[1].assign(R, 0.0f);
  upload_amax();
}

void FakeQuantDriver::upload_amax() {
  const int64_t R = ops_->num_local_ranks();
  std::vector<float> v(size_t(2 * R));
  for (int64_t r = 0; r < R; ++r) {
    v[size_t(r)] = q_.dispatch(r).amax().value_or(0.0f);
    v[size_t(R + r)] = q_.combine(r).amax().value_or(0.0f);
  }
  ops_->set_amax(v);
}

void FakeQuantDriver::configure(const std::map<std::string, QuantizerConfig>& configs) {
  q_.configure(configs, ops_->fused_shared(), ops_->combine_offset().has_value(), ops_->kind());
  upload_amax();
}

void FakeQuantDriver::start_calibration() {
  q_.start_calibration();
  ops_->synchronize();
  ops_->reset_calibration();
}

void FakeQuantDriver::finish_calibration() {
  const int64_t R = ops_->num_local_ranks();
  ops_->synchronize();  // a barrier that timed out during calibration, before the reduction
  const std::vector<AmaxStats> seen = ops_->read_calibration();
  for (int64_t r = 0; r < R; ++r)
    for (int which = 0; which < 2; ++which) {
      Quantizer& q = which == 0 ? q_.dispatch(r) : q_.combine(r);
      const AmaxStats& s = seen[size_t(which * R + r)];
      rank_amax_[which][size_t(r)] = s.max;
      if (!q.enabled() || !q.calibrating()) continue;
      MOEFQ_CHECK(s.nonfinite == 0, q.name(), ": ", s.nonfinite, " NaN or inf values in the calibration data of ",
                  ops_->real_ranks() ? "one of the expert-parallel ranks" : "rank " + std::to_string(ops_->first_rank() + r),
                  " (calibration needs finite data)");
      if (s.seen) q.collect_max(s.max);
    }
  q_.finish_calibration();
  upload_amax();
}

void FakeQuantDriver::abort_calibration() {
  q_.abort_calibration();
  upload_amax();
}

void FakeQuantDriver::load_calibration_file(const std::string& path) {
  q_.load_calibration_file(path);
  upload_amax();
}

void FakeQuantDriver::set_calibrated_amax(float dispatch_amax, float combine_amax) {
  q_.set_calibrated_amax(dispatch_amax, combine_amax);
  upload_amax();
}

void FakeQuantDriver::forward(std::span<const RankBatch> batches, bool with_engine) {
  const int64_t R = ops_->num_local_ranks(), T = ops_->max_tokens(), K = ops_->config().top_k;
  const int64_t H = ops_->config().hidden;
  MOEFQ_CHECK(int64_t(batches.size()) == R, "forward: ", batches.size(), " batches for ", R, " ranks");
  // A quantizer that needs a calibrated amax and has none would QDQ with the placeholder 0 that
  // upload_amax() sends for it: refuse before any work.
  for (int64_t r = 0; r < R; ++r)
    for (const Quantizer* q : {&q_.dispatch(r), &q_.combine(r)})
      MOEFQ_CHECK(!q->enabled() || q->calibrating() || !q->needs_calibration() || q->has_amax(), q->name(),
                  ": no amax yet: calibrate it (start_calibration, forward on calibration batches, "
                  "finish_calibration), load a calibration file or set the calibrated amax");
  // The rows the combine quantizer reads must lie inside the buffer (the last one: the last slot
  // of the last token).
  const int64_t slots = K + (ops_->fused_shared() ? 1 : 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = batches[size_t(r)].num_tokens;
    if (!q_.combine(r).enabled() || n == 0) continue;
    const size_t offset = *ops_->combine_offset();
    const size_t end = offset + size_t(((slots - 1) * T + n) * H) * 2;
    if (end > ops_->buffer_bytes())
      MOEFQ_FAIL(ErrorKind::kFailedCheck, q_.combine(r).name(), ": combine rows read at offset ", offset,
                 " would run past the end of the ", ops_->buffer_bytes(), "-byte buffer of rank ",
                 ops_->first_rank() + r, "; the combine region must hold bf16 rows [K + fused shared slots][max tokens][H]");
  }

  // Dispatch: QDQ out of place; calibration and a dynamic amax see the tokens that are sent.
  std::vector<RankBatch> sent(batches.begin(), batches.end());
  for (int64_t r = 0; r < R; ++r) {
    const Quantizer& q = q_.dispatch(r);
    const RankBatch& b = batches[size_t(r)];
    if (!q.enabled() || b.num_tokens == 0) continue;
    if (q.calibrating()) {
      ops_->token_stats(r, b, TokenStats::kCalibration);
      continue;
    }
    const bool dynamic = q.spec().amax_source == AmaxSource::kDynamic && format_has_global_amax(q.spec().format);
    if (dynamic) {
      ops_->reset_dynamic(r);
      ops_->token_stats(r, b, TokenStats::kDynamic);
    }
    if (count_clipping_ && q.has_amax()) ops_->count_clipped(r, b, 0);  // a dynamic amax clips nothing
    sent[size_t(r)].x = ops_->dispatch_qdq(r, b, q.spec().format, dynamic);
  }
  // A rank whose combine quantizer has passed the layout check replaces y with its own re-sum of
  // the rows: the engine's combine would be overwritten unread, so it is skipped (the check, while
  // it is still to come, compares with the engine's y).
  std::vector<bool> replaced(size_t(R), false);
  for (int64_t r = 0; r < R; ++r) {
    const Quantizer& q = q_.combine(r);
    replaced[size_t(r)] = q.enabled() && !q.calibrating() && checked_[size_t(r)];
  }
  if (with_engine) ops_->engine_forward(sent, replaced);

  // Combine: the layout check (until the buffer passed one), calibration or QDQ + re-sum.
  for (int64_t r = 0; r < R; ++r) {
    const Quantizer& q = q_.combine(r);
    const RankBatch& b = batches[size_t(r)];
    if (!q.enabled() || b.num_tokens == 0) continue;
    bool check = false, eager = false;
    if (!checked_[size_t(r)]) {
      // The eager check waits for a call with routed rows (a synchronisation, only until the
      // buffer is checked); a graph being captured records the check instead.
      if (!ops_->capturing()) {
        if (!ops_->has_routed_rows(r, b)) continue;  // padding only: nothing to check, collect or quantize
        eager = true;
      }
      check = true;
    }
    if (q.calibrating()) {
      ops_->row_stats(r, b);
      if (check) ops_->combine(r, b, std::nullopt, weighting_, true);
    } else {
      if (count_clipping_ && q.has_amax()) ops_->count_clipped(r, b, 1);
      ops_->combine(r, b, q.spec().format, weighting_, check);
    }
    if (eager) {
      raise_recorded(r);
      checked_[size_t(r)] = true;
    } else if (check) {
      pending_[size_t(r)] = true;  // a graph carries the check; synchronize() reads its record
    }
  }
}

void FakeQuantDriver::raise_recorded(int64_t r) {
  const std::optional<LayoutMismatch> m = ops_->read_check(r);
  if (m)
    q_.fail_layout_check(ops_->first_rank() + r, m->token, m->element, m->engine_bits, m->resum_bits,
                         *ops_->combine_offset());
}

void FakeQuantDriver::synchronize() {
  ops_->synchronize();
  for (int64_t r = 0; r < ops_->num_local_ranks(); ++r)
    if (pending_[size_t(r)]) raise_recorded(r);
}

}  // namespace moefq
