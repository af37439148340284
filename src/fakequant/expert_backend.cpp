#include "moefq/expert_backend.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <mutex>

#include "engine/expert_cpu.h"
#include "engine/parallel.h"
#include "moefq/errors.h"
#include "moefq/qdq.h"

namespace moefq {
namespace {

// mega_moe: the fused engine; the combine rows are read from its symmetric buffer at the offset
// its layout reports.
class MegaMoeBackend final : public ExpertBackend {
 public:
  MegaMoeBackend(const MoeConfig& cfg, int64_t R, int64_t T, std::vector<LayerWeights> w, EngineOptions o)
      : engine_(cfg, R, T, std::move(w), o) {}
  std::string kind() const override { return "mega_moe"; }
  const MoeConfig& config() const override { return engine_.config(); }
  int64_t num_ranks() const override { return engine_.num_ranks(); }
  int64_t max_tokens() const override { return engine_.layout().shape().max_tokens; }
  bool fused_shared() const override { return engine_.layout().shape().fused_shared_slots() > 0; }
  CombineWeighting combine_weighting() const override { return engine_.options().combine_weighting; }
  void forward(std::span<const RankBatch> b) override { engine_.forward(b); }
  std::optional<size_t> combine_offset() const override { return engine_.layout().combine_offset(); }
  std::span<const uint8_t> combine_bytes(int64_t rank) const override { return engine_.buffer(rank); }
  void shared_expert(int64_t rank, const bf16* x, int64_t n, bf16* y) const override {
    engine_.shared_expert(rank, x, n, y);
  }

 private:
  CpuEngine engine_;
};

// routed_experts: the modular layer. prepare stages each rank's tokens; dispatch groups the
// (token, slot) rows by expert; the experts run; finalize sums each token's rows. Its rows live in
// its own [K + fused][T][H] arrays (offset 0), where the finalize step reads them.
class RoutedExpertsBackend final : public ExpertBackend {
 public:
  RoutedExpertsBackend(const MoeConfig& cfg, int64_t R, int64_t T, std::vector<LayerWeights> weights, EngineOptions o)
      : cfg_(cfg),
        R_(R),
        T_(T),
        fused_(o.fuse_shared && cfg.num_shared > 0),
        threads_(resolve_threads(o.num_threads)),
        weighting_(o.combine_weighting),
        staging_(o.staging),
        weights_(std::move(weights)) {
    const std::vector<LayerWeights>& w = weights_;  // the views below point into these
    cfg.validate();
    MOEFQ_CHECK(R >= 1 && cfg.num_experts % R == 0 && int64_t(w.size()) == R, "routed_experts: ", w.size(),
                " ranks of weights for ", R, " ranks of ", cfg.num_experts, " experts");
    const int64_t el = cfg.num_experts / R;
    for (int64_t r = 0; r < R; ++r) {
      MOEFQ_CHECK(w[size_t(r)].first_expert == r * el && int64_t(w[size_t(r)].experts.size()) == el,
                  "routed_experts: rank ", r, " must hold experts [", r * el, ", ", (r + 1) * el, ")");
      for (const ExpertWeights& e : w[size_t(r)].experts) experts_.emplace_back(e, cfg.hidden, cfg.intermediate);
      if (cfg.num_shared > 0) {
        MOEFQ_CHECK(w[size_t(r)].shared.size() == 1, "routed_experts: rank ", r, " has no shared expert weights");
        shared_.emplace_back(w[size_t(r)].shared[0], cfg.hidden, cfg.intermediate * cfg.num_shared);
      }
    }
    rows_.assign(size_t(R), std::vector<uint8_t>(size_t((cfg.top_k + (fused_ ? 1 : 0)) * T * cfg.hidden * 2)));
  }
  std::string kind() const override { return "routed_experts"; }
  const MoeConfig& config() const override { return cfg_; }
  int64_t num_ranks() const override { return R_; }
  int64_t max_tokens() const override { return T_; }
  bool fused_shared() const override { return fused_; }
  CombineWeighting combine_weighting() const override { return weighting_; }
  std::optional<size_t> combine_offset() const override { return 0; }
  std::span<const uint8_t> combine_bytes(int64_t rank) const override { return rows_[size_t(rank)]; }

  void forward(std::span<const RankBatch> batches) override {
    const int64_t H = cfg_.hidden, K = cfg_.top_k, hb = H / kStageBlock, E = cfg_.num_experts;
    const int64_t Is = cfg_.intermediate * cfg_.num_shared, imax = std::max(cfg_.intermediate, Is);
    validate_batches(batches, R_, T_, E, K);
    const bool after = weighting_ == CombineWeighting::kAfter;  // then finalize weights the rows
    // prepare: stage each rank's tokens to e4m3 with 1 x 128 scales (staging none: the bf16 tokens
    // as they are)
    const bool scaled = staging_ == Staging::kE4m3;
    const int64_t eb = scaled ? 1 : 2;  // bytes of a staged element
    std::vector<std::vector<uint8_t>> x8(static_cast<size_t>(R_));
    std::vector<std::vector<float>> xs(static_cast<size_t>(R_));
    for (int64_t r = 0; r < R_ && scaled; ++r) {
      const RankBatch& b = batches[size_t(r)];
      x8[size_t(r)].resize(size_t(b.num_tokens * H));
      xs[size_t(r)].resize(size_t(b.num_tokens * hb));
      stage_e4m3_ref(b.x, x8[size_t(r)].data(), xs[size_t(r)].data(), b.num_tokens, H);
    }
    const auto x_row = [&](int64_t r, int64_t t) -> const void* {
      return scaled ? static_cast<const void*>(x8[size_t(r)].data() + t * H) : batches[size_t(r)].x + t * H;
    };
    const auto x_scale = [&](int64_t r, int64_t t) { return scaled ? xs[size_t(r)].data() + t * hb : nullptr; };
    // dispatch: the rows of each expert, in (rank, token, slot) order
    std::vector<std::vector<std::array<int64_t, 3>>> lists(static_cast<size_t>(E));
    for (int64_t r = 0; r < R_; ++r)
      for (int64_t t = 0; t < batches[size_t(r)].num_tokens; ++t)
        for (int64_t k = 0; k < K; ++k)
          if (const int32_t e = batches[size_t(r)].topk_idx[t * K + k]; e >= 0) lists[size_t(e)].push_back({r, t, k});
    // experts
    size_t total = 0;
    for (const auto& l : lists) total += l.size();
    for (int64_t r = 0; fused_ && r < R_; ++r) total += size_t(batches[size_t(r)].num_tokens);
    h8_.resize(total * size_t(imax * eb));
    hs_.resize(scaled ? total * size_t(imax / kStageBlock) : 0);
    const auto h_row = [&](size_t row) { return h8_.data() + row * size_t(imax * eb); };
    const auto h_scale = [&](size_t row) { return scaled ? hs_.data() + row * size_t(imax / kStageBlock) : nullptr; };
    std::vector<ExpertGroup> groups;
    size_t row = 0;
    auto out_row = [&](int64_t r, int64_t k, int64_t t) {
      return reinterpret_cast<bf16*>(rows_[size_t(r)].data() + size_t((k * T_ + t) * H) * 2);
    };
    for (int64_t e = 0; e < E; ++e)
      for (size_t i = 0; i < lists[size_t(e)].size(); ++i, ++row) {
        const auto [r, t, k] = lists[size_t(e)][i];
        add_expert_row(groups, &experts_[size_t(e)], staging_, i == 0, x_row(r, t), x_scale(r, t),
                       after ? 1.0f : batches[size_t(r)].topk_weights[t * K + k], h_row(row), h_scale(row),
                       out_row(r, k, t));
      }
    for (int64_t r = 0; fused_ && r < R_; ++r)
      for (int64_t t = 0; t < batches[size_t(r)].num_tokens; ++t, ++row)
        add_expert_row(groups, &shared_[size_t(r)], staging_, t == 0, x_row(r, t), x_scale(r, t), 1.0f, h_row(row),
                       h_scale(row), out_row(r, K, t));
    run_expert_groups(groups, cfg_.swiglu_clamp, threads_);
    // finalize: active slots ascending (weighted here when after), fp32 from +0, the shared slot
    // last, one bf16 rounding
    for (int64_t r = 0; r < R_; ++r) {
      const RankBatch& b = batches[size_t(r)];
      parallel_for(b.num_tokens, threads_, [&](int64_t t) {
        combine_token(b.topk_idx + t * K, after ? b.topk_weights + t * K : nullptr, K, fused_, H,
                      [&](int64_t k) { return out_row(r, k, t); }, b.y + t * H);
      });
    }
  }

  void shared_expert(int64_t rank, const bf16* x, int64_t n, bf16* y) const override {
    MOEFQ_CHECK(!shared_.empty(), "shared_expert: the config has no shared expert");
    run_expert_on_tokens(shared_[size_t(rank)], staging_, x, n, y, cfg_.swiglu_clamp, threads_);
  }

 private:
  MoeConfig cfg_;
  int64_t R_, T_;
  bool fused_;
  int threads_;
  CombineWeighting weighting_;
  Staging staging_;
  std::vector<LayerWeights> weights_;    // [R], what experts_ and shared_ read
  std::vector<PreparedExpert> experts_;  // [E], global ids
  std::vector<PreparedExpert> shared_;   // [R] or empty
  std::vector<std::vector<uint8_t>> rows_;
  std::vector<uint8_t> h8_;  // the SwiGLU outputs: e4m3 codes, or bf16 (staging none)
  std::vector<float> hs_;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, ExpertBackendFactory> kinds;
  Registry() {
    kinds["mega_moe"] = [](const MoeConfig& c, int64_t R, int64_t T, std::vector<LayerWeights> w, EngineOptions o) {
      return std::unique_ptr<ExpertBackend>(new MegaMoeBackend(c, R, T, std::move(w), o));
    };
    kinds["routed_experts"] = [](const MoeConfig& c, int64_t R, int64_t T, std::vector<LayerWeights> w,
                                 EngineOptions o) {
      return std::unique_ptr<ExpertBackend>(new RoutedExpertsBackend(c, R, T, std::move(w), o));
    };
  }
};
Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_expert_backend(const std::string& kind, ExpertBackendFactory factory) {
  std::lock_guard<std::mutex> lock(registry().mu);
  registry().kinds[kind] = std::move(factory);
}

std::vector<std::string> expert_backend_kinds() {
  std::lock_guard<std::mutex> lock(registry().mu);
  std::vector<std::string> k;
  for (const auto& [name, f] : registry().kinds) k.push_back(name);
  return k;
}

std::unique_ptr<ExpertBackend> make_expert_backend(const std::string& kind, const MoeConfig& cfg, int64_t R, int64_t T,
                                                   std::vector<LayerWeights> w, EngineOptions o) {
  ExpertBackendFactory f;
  {
    std::lock_guard<std::mutex> lock(registry().mu);
    const auto it = registry().kinds.find(kind);
    if (it != registry().kinds.end()) f = it->second;
  }
  if (!f) {
    std::string names;
    for (const auto& k : expert_backend_kinds()) names += (names.empty() ? "" : ", ") + k;
    MOEFQ_FAIL(ErrorKind::kBadInput, "unknown expert back-end '", kind, "' (registered: ", names, ")");
  }
  return f(cfg, R, T, std::move(w), o);
}

}  // namespace moefq
