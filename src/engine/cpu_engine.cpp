#include "moefq/cpu_engine.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "engine/expert_cpu.h"
#include "engine/parallel.h"
#include "moefq/errors.h"
#include "moefq/qdq.h"

namespace moefq {

namespace {

constexpr int64_t kB = kStageBlock;

bool debug_zeroing() {
  const char* v = std::getenv("MOEFQ_COMM_KERNEL_DEBUG");
  return v && std::strcmp(v, "1") == 0;
}

template <typename T>
T* at(std::vector<uint8_t>& buf, const Region& r) {
  return reinterpret_cast<T*>(buf.data() + r.offset);
}
template <typename T>
const T* at(const std::vector<uint8_t>& buf, const Region& r) {
  return reinterpret_cast<const T*>(buf.data() + r.offset);
}

}  // namespace

BufferShape engine_buffer_shape(const MoeConfig& cfg, int64_t num_ranks, int64_t max_tokens,
                                std::span<const LayerWeights> w, const EngineOptions& opt) {
  cfg.validate();
  BufferShape s;
  s.num_ranks = num_ranks;
  s.num_experts = cfg.num_experts;
  s.max_tokens = max_tokens;
  s.top_k = cfg.top_k;
  s.hidden = cfg.hidden;
  s.intermediate = cfg.intermediate;
  s.shared_intermediate = opt.fuse_shared ? cfg.intermediate * cfg.num_shared : 0;
  s.weight_format = w.empty() || w[0].experts.empty() ? WeightFormat::kE4m3 : w[0].experts[0].format;
  s.staging = opt.staging;
  return s;
}

CpuEngine::CpuEngine(const MoeConfig& cfg, int64_t num_ranks, int64_t max_tokens,
                     std::vector<LayerWeights> rank_weights, EngineOptions options)
    : cfg_(cfg),
      opt_(options),
      layout_(engine_buffer_shape(cfg, num_ranks, max_tokens, rank_weights, options)),
      weights_(std::move(rank_weights)) {
  const int64_t el = layout_.shape().local_experts();
  MOEFQ_CHECK(int64_t(weights_.size()) == num_ranks, "engine: ", weights_.size(),
              " ranks of weights given for ", num_ranks, " ranks");
  num_threads_ = resolve_threads(options.num_threads);
  experts_.resize(size_t(num_ranks));
  for (int64_t r = 0; r < num_ranks; ++r) {
    const LayerWeights& w = weights_[size_t(r)];
    MOEFQ_CHECK(w.first_expert == r * el && int64_t(w.experts.size()) == el, "engine: rank ", r,
                " must hold experts [", r * el, ", ", (r + 1) * el, "), got ", w.experts.size(),
                " from ", w.first_expert);
    for (const ExpertWeights& e : w.experts) experts_[size_t(r)].emplace_back(e, cfg.hidden, cfg.intermediate);
    if (cfg.num_shared > 0) {
      MOEFQ_CHECK(w.shared.size() == 1, "engine: rank ", r, " has no shared expert weights");
      shared_.emplace_back(w.shared[0], cfg.hidden, cfg.intermediate * cfg.num_shared);
    }
  }
  buffers_.assign(size_t(num_ranks), std::vector<uint8_t>(layout_.total_bytes(), 0));
}

CpuEngine::~CpuEngine() = default;

std::span<const uint8_t> CpuEngine::buffer(int64_t rank) const {
  MOEFQ_ASSERT(rank >= 0 && rank < num_ranks(), "buffer: rank out of range");
  return buffers_[size_t(rank)];
}

void CpuEngine::forward(std::span<const RankBatch> batches) {
  const BufferShape& sh = layout_.shape();
  const int64_t R = sh.num_ranks, T = sh.max_tokens, K = sh.top_k, H = sh.hidden, E = sh.num_experts;
  const int64_t el = sh.local_experts(), hb = H / kB;
  const bool fused = sh.fused_shared_slots() > 0;
  const bool after = opt_.combine_weighting == CombineWeighting::kAfter;
  const Staging st = sh.staging;
  const bool scaled = st == Staging::kE4m3;
  const int64_t xb = H * sh.staged_elem_bytes();  // bytes of a staged x row
  validate_batches(batches, R, T, E, K);

  // Token side: stage x (e4m3 with scales, or a bf16 copy), publish topk_idx / topk_weights in the
  // rank's own buffer.
  for (int64_t r = 0; r < R; ++r) {
    const RankBatch& b = batches[size_t(r)];
    auto& buf = buffers_[size_t(r)];
    if (scaled)
      stage_e4m3_ref(b.x, at<uint8_t>(buf, layout_.staged_x), at<float>(buf, layout_.staged_scales), b.num_tokens, H);
    else if (b.num_tokens > 0)
      std::memcpy(at<uint8_t>(buf, layout_.staged_x), b.x, size_t(b.num_tokens * xb));
    if (b.num_tokens == 0) continue;
    std::memcpy(at<int32_t>(buf, layout_.topk_idx), b.topk_idx, size_t(b.num_tokens * K) * 4);
    std::memcpy(at<float>(buf, layout_.topk_weights), b.topk_weights, size_t(b.num_tokens * K) * 4);
  }

  // Dispatch: every (token, slot) is appended to its expert's list in the expert rank's workspace.
  for (int64_t r = 0; r < R; ++r) {
    const RankBatch& b = batches[size_t(r)];
    const int32_t* idx = at<int32_t>(buffers_[size_t(r)], layout_.topk_idx);
    for (int64_t t = 0; t < b.num_tokens; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = idx[t * K + k];
        if (e < 0) continue;
        auto& dst = buffers_[size_t(e / el)];
        int32_t& count = at<int32_t>(dst, layout_.expert_counts)[e % el];
        MOEFQ_ASSERT(count >= 0 && count < R * T, "dispatch: expert ", e, " list overflow (workspace not clean)");
        at<int32_t>(dst, layout_.expert_lists)[(e % el) * R * T + count++] = int32_t((r * T + t) * K + k);
      }
  }

  // Expert side: pull each listed row (e4m3 bytes and scales, or bf16) from its token rank into the pool,
  // then run the expert on it; the output row goes into the token rank's combine region. Rows of
  // one expert are computed in groups; each writes only its own pool and combine rows.
  const int64_t imax = std::max(sh.intermediate, sh.shared_intermediate), ib = imax / kB;
  const int64_t hrow = imax * sh.staged_elem_bytes();  // bytes of a pool_h row
  // A row's scales, where the staging has them (none: null, never read).
  const auto scales = [scaled](std::vector<uint8_t>& b, const Region& reg, int64_t row, int64_t per_row) {
    return scaled ? at<float>(b, reg) + row * per_row : nullptr;
  };
  std::vector<ExpertGroup> groups;
  for (int64_t d = 0; d < R; ++d) {
    auto& buf = buffers_[size_t(d)];
    int64_t row = 0;
    for (int64_t le = 0; le < el; ++le) {
      const int32_t n = at<int32_t>(buf, layout_.expert_counts)[le];
      for (int32_t i = 0; i < n; ++i, ++row) {
        const int32_t entry = at<int32_t>(buf, layout_.expert_lists)[le * R * T + i];
        const int64_t src = entry / K / T, t = entry / K % T, k = entry % K;
        auto& sbuf = buffers_[size_t(src)];
        uint8_t* x8 = at<uint8_t>(buf, layout_.pool_x) + row * xb;
        float* xs = scales(buf, layout_.pool_x_scales, row, hb);
        std::memcpy(x8, at<uint8_t>(sbuf, layout_.staged_x) + t * xb, size_t(xb));
        if (scaled) std::memcpy(xs, at<float>(sbuf, layout_.staged_scales) + t * hb, size_t(hb) * 4);
        // combine_weighting after: the row stays unweighted (weight 1.0 is exact), the combine weights it.
        const float w = after ? 1.0f : at<float>(sbuf, layout_.topk_weights)[t * K + k];
        add_expert_row(groups, &experts_[size_t(d)][size_t(le)], st, i == 0, x8, xs, w,
                at<uint8_t>(buf, layout_.pool_h) + row * hrow, scales(buf, layout_.pool_h_scales, row, ib),
                reinterpret_cast<bf16*>(sbuf.data() + layout_.combine_row_offset(k, t)));
      }
    }
  }
  // The fused shared expert: weight 1, slot K of the token's own rank, intermediates after the pool.
  const int64_t P = sh.pool_rows();
  for (int64_t r = 0; fused && r < R; ++r) {
    auto& buf = buffers_[size_t(r)];
    for (int64_t t = 0; t < batches[size_t(r)].num_tokens; ++t)
      add_expert_row(groups, &shared_[size_t(r)], st, t == 0, at<uint8_t>(buf, layout_.staged_x) + t * xb,
              scales(buf, layout_.staged_scales, t, hb), 1.0f, at<uint8_t>(buf, layout_.pool_h) + (P + t) * hrow,
              scales(buf, layout_.pool_h_scales, P + t, ib),
              reinterpret_cast<bf16*>(buf.data() + layout_.combine_row_offset(K, t)));
  }
  run_expert_groups(groups, cfg_.swiglu_clamp, num_threads_);

  // Combine on each token rank: active slots ascending, fp32 from +0 (each routed row times its
  // router weight first when combine_weighting is after), the shared slot last, one bf16 rounding.
  for (int64_t r = 0; r < R; ++r) {
    const RankBatch& b = batches[size_t(r)];
    const auto& buf = buffers_[size_t(r)];
    const int32_t* idx = at<int32_t>(buf, layout_.topk_idx);
    const float* wts = at<float>(buf, layout_.topk_weights);
    parallel_for(b.num_tokens, num_threads_, [&](int64_t t) {
      const auto row = [&](int64_t k) { return reinterpret_cast<const bf16*>(buf.data() + layout_.combine_row_offset(k, t)); };
      combine_token(idx + t * K, after ? wts + t * K : nullptr, K, fused, H, row, b.y + t * H);
    });
  }

  // The workspace cleans itself: counters back to zero for the next call.
  for (auto& buf : buffers_) std::memset(buf.data() + layout_.expert_counts.offset, 0, layout_.expert_counts.bytes);
  if (debug_zeroing())
    for (auto& buf : buffers_) std::fill(buf.begin(), buf.end(), uint8_t(0));
}

void CpuEngine::shared_expert(int64_t rank, const bf16* x, int64_t num_tokens, bf16* y) const {
  MOEFQ_CHECK(!shared_.empty(), "shared_expert: the config has no shared expert");
  MOEFQ_ASSERT(rank >= 0 && rank < num_ranks(), "shared_expert: rank out of range");
  run_expert_on_tokens(shared_[size_t(rank)], opt_.staging, x, num_tokens, y, cfg_.swiglu_clamp, num_threads_);
}

}  // namespace moefq
