#include "moefq/fake_quant_moe.h"

#include <cstring>

#include "engine/expert_cpu.h"
#include "moefq/errors.h"

namespace moefq {
namespace {

bool has_active_slot(const RankBatch& b, int64_t t, int64_t K) {
  for (int64_t k = 0; k < K; ++k)
    if (b.topk_idx[t * K + k] >= 0) return true;
  return false;
}

}  // namespace

FakeQuantMoe::FakeQuantMoe(std::unique_ptr<ExpertBackend> backend, int64_t layer)
    : backend_(std::move(backend)), q_(layer, backend_->num_ranks()) {
  checked_.assign(size_t(backend_->num_ranks()), false);
}

void FakeQuantMoe::configure(const std::map<std::string, QuantizerConfig>& configs) {
  q_.configure(configs, backend_->fused_shared(), backend_->combine_offset().has_value(), backend_->kind());
}

const bf16* FakeQuantMoe::combine_row(int64_t rank, int64_t slot, int64_t token) const {
  const int64_t T = backend_->max_tokens(), H = backend_->config().hidden;
  const size_t offset = *backend_->combine_offset() + size_t((slot * T + token) * H) * 2;
  const auto bytes = backend_->combine_bytes(rank);
  if (offset + size_t(H) * 2 > bytes.size())
    MOEFQ_FAIL(ErrorKind::kFailedCheck, q_.combine(0).name(), ": combine row (slot ", slot, ", token ", token,
               ") at byte ", offset, " lies outside the ", bytes.size(), "-byte buffer of rank ", rank,
               "; the back-end's layout does not match engine.md's [K + shared][T][H]");
  return reinterpret_cast<const bf16*>(bytes.data() + offset);
}

// The unquantized re-sum of the rows must reproduce the engine's output bit for bit.
void FakeQuantMoe::check_layout(int64_t rank, const RankBatch& b) const {
  const int64_t K = backend_->config().top_k, H = backend_->config().hidden;
  const bool fused = backend_->fused_shared();
  std::vector<bf16> resum(static_cast<size_t>(H));
  for (int64_t t = 0; t < b.num_tokens; ++t) {
    const bf16* rows[kMaxCombineRows];
    int n = 0;
    for (int64_t k = 0; k < K + (fused ? 1 : 0); ++k)
      if (k == K || b.topk_idx[t * K + k] >= 0) rows[n++] = combine_row(rank, k, t);
    combine_rows(rows, n, H, resum.data());
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t mine = resum[size_t(h)].bits, engine = b.y[t * H + h].bits;
      if (mine != engine) q_.fail_layout_check(rank, t, h, engine, mine, *backend_->combine_offset());
    }
  }
}

void FakeQuantMoe::forward(std::span<const RankBatch> batches) {
  const int64_t R = backend_->num_ranks(), K = backend_->config().top_k, H = backend_->config().hidden;
  MOEFQ_CHECK(int64_t(batches.size()) == R, "forward: ", batches.size(), " batches for ", R, " ranks");
  // Dispatch: QDQ of the tokens out of place (the caller's x is not modified); calibration sees
  // only tokens with at least one active routed slot.
  std::vector<std::vector<bf16>> xq(static_cast<size_t>(R));
  std::vector<RankBatch> run(batches.begin(), batches.end());
  for (int64_t r = 0; r < R; ++r) {
    Quantizer& q = q_.dispatch(r);
    const RankBatch& b = batches[size_t(r)];
    if (!q.enabled() || b.num_tokens == 0) continue;
    if (q.calibrating()) {
      for (int64_t t = 0; t < b.num_tokens; ++t)
        if (has_active_slot(b, t, K)) q.collect(b.x + t * H, H);
      continue;
    }
    xq[size_t(r)].resize(size_t(b.num_tokens * H));
    if (q.spec().amax_source == AmaxSource::kDynamic && format_has_global_amax(q.spec().format)) {
      // A dynamic amax is over the tokens that are sent: those with an active routed slot.
      float amax = 0.0f;
      for (int64_t t = 0; t < b.num_tokens; ++t)
        if (has_active_slot(b, t, K)) amax = max_ignore_nan(amax, amax_ref(b.x + t * H, H));
      qdq_ref(q.spec().format, b.x, xq[size_t(r)].data(), b.num_tokens, H, amax);
    } else {
      q.qdq(b.x, xq[size_t(r)].data(), b.num_tokens, H);
    }
    run[size_t(r)].x = xq[size_t(r)].data();
  }
  backend_->forward(run);

  // Combine: layout check (once per buffer, first call with routed rows), then calibration or
  // QDQ of the active routed rows and the re-sum in the engine's order.
  const bool fused = backend_->fused_shared();
  std::vector<bf16> qrows(static_cast<size_t>(K * H));
  for (int64_t r = 0; r < R; ++r) {
    Quantizer& q = q_.combine(r);
    const RankBatch& b = batches[size_t(r)];
    if (!q.enabled() || b.num_tokens == 0) continue;
    bool any = false;
    for (int64_t t = 0; t < b.num_tokens && !any; ++t) any = has_active_slot(b, t, K);
    if (!any) continue;  // padding only: nothing to check or quantize
    if (!checked_[size_t(r)]) {
      check_layout(r, b);
      checked_[size_t(r)] = true;
    }
    for (int64_t t = 0; t < b.num_tokens; ++t) {
      if (q.calibrating()) {
        for (int64_t k = 0; k < K; ++k)
          if (b.topk_idx[t * K + k] >= 0) q.collect(combine_row(r, k, t), H);
        continue;
      }
      // QDQ each active routed row (read in place, into scratch rows), then the engine's re-sum
      // with the shared slot last and unquantized.
      const bf16* rows[kMaxCombineRows];
      int n = 0;
      for (int64_t k = 0; k < K; ++k) {
        if (b.topk_idx[t * K + k] < 0) continue;
        bf16* q_row = qrows.data() + n * H;
        q.qdq(combine_row(r, k, t), q_row, 1, H);
        rows[n++] = q_row;
      }
      if (fused) rows[n++] = combine_row(r, K, t);
      combine_rows(rows, n, H, b.y + t * H);
    }
  }
}

}  // namespace moefq
