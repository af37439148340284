#include "moefq/cpu_engine.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "engine/gemm_cpu.h"
#include "engine/parallel.h"
#include "moefq/errors.h"
#include "moefq/qdq.h"

namespace moefq {

// An expert's weights as the GEMM reads them: the element values as fp32 (e4m3 codes decoded,
// unscaled, or bf16 values) and one fp32 scale per 128 x 128 block (all 1 for bf16 weights).
struct CpuEngine::PreparedExpert {
  int64_t hidden = 0, inter = 0;
  std::vector<float> gate_up, gate_up_scale;  // [2I, H], [2I/128, H/128]
  std::vector<float> down, down_scale;        // [H, I], [H/128, I/128]
};

// Per-thread working rows.
struct CpuEngine::Scratch {
  std::vector<float> a, gu, h;
};

namespace {

constexpr int64_t kB = kStageBlock;  // 128: activation blocks and weight blocks

void prepare_matrix(const std::vector<uint8_t>& w8, const std::vector<float>& scale,
                    const std::vector<bf16>& wbf, WeightFormat f, int64_t rows, int64_t cols,
                    std::vector<float>& out, std::vector<float>& out_scale) {
  out.resize(size_t(rows * cols));
  const int64_t sb = (rows / kB) * (cols / kB);
  if (f == WeightFormat::kE4m3) {
    MOEFQ_ASSERT(int64_t(w8.size()) == rows * cols && int64_t(scale.size()) == sb, "expert weights: bad e4m3 shape");
    for (size_t i = 0; i < out.size(); ++i) out[i] = e4m3_decode(w8[i]);
    out_scale = scale;
  } else {
    MOEFQ_ASSERT(int64_t(wbf.size()) == rows * cols, "expert weights: bad bf16 shape");
    for (size_t i = 0; i < out.size(); ++i) out[i] = to_f32(wbf[i]);
    out_scale.assign(size_t(sb), 1.0f);
  }
}

// Stages one row [n] fp32 to e4m3 with 1 x 128 scales (numerics.md), as stage_e4m3_ref does for bf16.
void stage_row(const float* h, int64_t n, uint8_t* h8, float* scale) {
  for (int64_t b = 0; b < n / kB; ++b) {
    float m = 0.0f;
    for (int64_t i = b * kB; i < (b + 1) * kB; ++i) m = max_ignore_nan(m, abs_f32(h[i]));
    const float sf = stage_scale(m), inv = div_rn(1.0f, sf);
    for (int64_t i = b * kB; i < (b + 1) * kB; ++i) h8[i] = stage_encode(h[i], inv);
    scale[b] = sf;
  }
}

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

BufferShape shape_for(const MoeConfig& cfg, int64_t num_ranks, int64_t max_tokens,
                      const std::vector<LayerWeights>& w, const EngineOptions& opt) {
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
  return s;
}

}  // namespace

CpuEngine::CpuEngine(const MoeConfig& cfg, int64_t num_ranks, int64_t max_tokens,
                     const std::vector<LayerWeights>& rank_weights, EngineOptions options)
    : cfg_(cfg), opt_(options), layout_(shape_for(cfg, num_ranks, max_tokens, rank_weights, options)) {
  const int64_t el = layout_.shape().local_experts();
  MOEFQ_CHECK(int64_t(rank_weights.size()) == num_ranks, "engine: ", rank_weights.size(),
              " ranks of weights given for ", num_ranks, " ranks");
  num_threads_ = options.num_threads > 0 ? options.num_threads : int(std::max(1u, std::thread::hardware_concurrency()));
  auto prepare = [](const ExpertWeights& w, int64_t h, int64_t inter) {
    MOEFQ_CHECK(w.hidden == h && w.intermediate == inter, "engine: expert weights of shape H=", w.hidden,
                " I=", w.intermediate, " do not match the config (H=", h, " I=", inter, ")");
    auto p = std::make_unique<PreparedExpert>();
    p->hidden = h;
    p->inter = inter;
    prepare_matrix(w.gate_up_e4m3, w.gate_up_scale, w.gate_up_bf16, w.format, 2 * inter, h, p->gate_up, p->gate_up_scale);
    prepare_matrix(w.down_e4m3, w.down_scale, w.down_bf16, w.format, h, inter, p->down, p->down_scale);
    return p;
  };
  experts_.resize(size_t(num_ranks));
  for (int64_t r = 0; r < num_ranks; ++r) {
    const LayerWeights& w = rank_weights[size_t(r)];
    MOEFQ_CHECK(w.first_expert == r * el && int64_t(w.experts.size()) == el, "engine: rank ", r,
                " must hold experts [", r * el, ", ", (r + 1) * el, "), got ", w.experts.size(),
                " from ", w.first_expert);
    for (const ExpertWeights& e : w.experts) experts_[size_t(r)].push_back(std::move(*prepare(e, cfg.hidden, cfg.intermediate)));
    if (cfg.num_shared > 0) {
      MOEFQ_CHECK(w.shared.size() == 1, "engine: rank ", r, " has no shared expert weights");
      shared_.push_back(prepare(w.shared[0], cfg.hidden, cfg.intermediate * cfg.num_shared));
    }
  }
  buffers_.assign(size_t(num_ranks), std::vector<uint8_t>(layout_.total_bytes(), 0));
}

CpuEngine::~CpuEngine() = default;

std::span<const uint8_t> CpuEngine::buffer(int64_t rank) const {
  MOEFQ_ASSERT(rank >= 0 && rank < num_ranks(), "buffer: rank out of range");
  return buffers_[size_t(rank)];
}

// Up to kGemmRows rows through one expert: gate/up GEMM on the staged input, bf16 rounding,
// clamp, h = silu(g) * u * weight, re-staging, down GEMM, bf16 rounding (engine.md, steps 1-5).
// Row r reads a8[r] / a_scale[r], writes h8[r] / h_scale[r] and out[r].
void CpuEngine::expert_rows(const PreparedExpert& e, int n, const RowRefs& rows, Scratch& s) const {
  const int64_t H = e.hidden, I = e.inter;
  s.a.resize(size_t(kGemmRows * std::max(H, I)));
  s.gu.resize(size_t(kGemmRows * std::max(2 * I, H)));
  s.h.resize(size_t(I));
  const float* a[kGemmRows];
  float* gu[kGemmRows];
  for (int r = 0; r < n; ++r) {
    float* ar = s.a.data() + r * std::max(H, I);
    for (int64_t i = 0; i < H; ++i) ar[i] = e4m3_decode(rows.a8[r][i]);
    a[r] = ar;
    gu[r] = s.gu.data() + r * std::max(2 * I, H);
  }
  gemm_rows(n, a, rows.a_scale, e.gate_up.data(), e.gate_up_scale.data(), 2 * I, H, gu);
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      float g = bf16_to_f32(bf16_round(gu[r][i]));
      float u = bf16_to_f32(bf16_round(gu[r][I + i]));
      if (cfg_.swiglu_clamp) {
        const float c = *cfg_.swiglu_clamp;
        g = g < c ? g : c;
        u = u < -c ? -c : (u > c ? c : u);
      }
      s.h[size_t(i)] = mul_rn(mul_rn(silu_f32(g), u), rows.weight[r]);
    }
    stage_row(s.h.data(), I, rows.h8[r], rows.h_scale[r]);
    float* ar = s.a.data() + r * std::max(H, I);
    for (int64_t i = 0; i < I; ++i) ar[i] = e4m3_decode(rows.h8[r][i]);
  }
  const float* h_scale[kGemmRows];
  for (int r = 0; r < n; ++r) h_scale[r] = rows.h_scale[r];
  gemm_rows(n, a, h_scale, e.down.data(), e.down_scale.data(), H, I, gu);
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < H; ++i) rows.out[r][i].bits = bf16_round(gu[r][i]);
}

void CpuEngine::forward(std::span<const RankBatch> batches) {
  const BufferShape& sh = layout_.shape();
  const int64_t R = sh.num_ranks, T = sh.max_tokens, K = sh.top_k, H = sh.hidden, E = sh.num_experts;
  const int64_t el = sh.local_experts(), hb = H / kB;
  const bool fused = sh.fused_shared_slots() > 0;
  MOEFQ_CHECK(int64_t(batches.size()) == R, "forward: ", batches.size(), " batches for ", R, " ranks");
  for (int64_t r = 0; r < R; ++r) {
    const RankBatch& b = batches[size_t(r)];
    MOEFQ_CHECK(b.num_tokens >= 0 && b.num_tokens <= T, "forward: rank ", r, " has ", b.num_tokens,
                " tokens; the buffer holds at most ", T);
    if (b.num_tokens == 0) continue;
    MOEFQ_CHECK(b.x && b.topk_idx && b.topk_weights && b.y, "forward: rank ", r, ": null tensor");
    for (int64_t t = 0; t < b.num_tokens; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t e = b.topk_idx[t * K + k];
        MOEFQ_CHECK(e >= -1 && e < E, "forward: rank ", r, " token ", t, " slot ", k, ": expert id ", e,
                    " outside [-1, ", E, ")");
        for (int64_t j = 0; j < k && e >= 0; ++j)
          MOEFQ_CHECK(b.topk_idx[t * K + j] != e, "forward: rank ", r, " token ", t, " picks expert ", e, " twice");
      }
  }

  // Token side: stage x, publish topk_idx / topk_weights in the rank's own buffer.
  for (int64_t r = 0; r < R; ++r) {
    const RankBatch& b = batches[size_t(r)];
    auto& buf = buffers_[size_t(r)];
    stage_e4m3_ref(b.x, at<uint8_t>(buf, layout_.staged_x), at<float>(buf, layout_.staged_scales), b.num_tokens, H);
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

  // Expert side: pull each listed row (e4m3 bytes and scales) from its token rank into the pool,
  // then run the expert on it; the output row goes into the token rank's combine region. Rows of
  // one expert are computed in groups; each writes only its own pool and combine rows.
  const int64_t imax = std::max(sh.intermediate, sh.shared_intermediate), ib = imax / kB;
  std::vector<Group> groups;
  auto add_row = [&](const PreparedExpert* e, bool new_group, const uint8_t* a8, const float* as, float w,
                     uint8_t* h8, float* hs, bf16* out) {
    if (new_group || groups.empty() || groups.back().n == kRowsPerGroup) groups.push_back({e, 0, {}});
    Group& g = groups.back();
    g.rows.a8[g.n] = a8;
    g.rows.a_scale[g.n] = as;
    g.rows.weight[g.n] = w;
    g.rows.h8[g.n] = h8;
    g.rows.h_scale[g.n] = hs;
    g.rows.out[g.n] = out;
    ++g.n;
  };
  for (int64_t d = 0; d < R; ++d) {
    auto& buf = buffers_[size_t(d)];
    int64_t row = 0;
    for (int64_t le = 0; le < el; ++le) {
      const int32_t n = at<int32_t>(buf, layout_.expert_counts)[le];
      for (int32_t i = 0; i < n; ++i, ++row) {
        const int32_t entry = at<int32_t>(buf, layout_.expert_lists)[le * R * T + i];
        const int64_t src = entry / K / T, t = entry / K % T, k = entry % K;
        auto& sbuf = buffers_[size_t(src)];
        uint8_t* x8 = at<uint8_t>(buf, layout_.pool_x) + row * H;
        float* xs = at<float>(buf, layout_.pool_x_scales) + row * hb;
        std::memcpy(x8, at<uint8_t>(sbuf, layout_.staged_x) + t * H, size_t(H));
        std::memcpy(xs, at<float>(sbuf, layout_.staged_scales) + t * hb, size_t(hb) * 4);
        add_row(&experts_[size_t(d)][size_t(le)], i == 0, x8, xs, at<float>(sbuf, layout_.topk_weights)[t * K + k],
                at<uint8_t>(buf, layout_.pool_h) + row * imax, at<float>(buf, layout_.pool_h_scales) + row * ib,
                reinterpret_cast<bf16*>(sbuf.data() + layout_.combine_row_offset(k, t)));
      }
    }
  }
  // The fused shared expert: weight 1, slot K of the token's own rank, intermediates after the pool.
  const int64_t P = sh.pool_rows();
  for (int64_t r = 0; fused && r < R; ++r) {
    auto& buf = buffers_[size_t(r)];
    for (int64_t t = 0; t < batches[size_t(r)].num_tokens; ++t)
      add_row(shared_[size_t(r)].get(), t == 0, at<uint8_t>(buf, layout_.staged_x) + t * H,
              at<float>(buf, layout_.staged_scales) + t * hb, 1.0f, at<uint8_t>(buf, layout_.pool_h) + (P + t) * imax,
              at<float>(buf, layout_.pool_h_scales) + (P + t) * ib,
              reinterpret_cast<bf16*>(buf.data() + layout_.combine_row_offset(K, t)));
  }
  run_groups(groups);

  // Combine on each token rank: active slots ascending, fp32 from +0, the shared slot last, one
  // bf16 rounding.
  for (int64_t r = 0; r < R; ++r) {
    const RankBatch& b = batches[size_t(r)];
    const auto& buf = buffers_[size_t(r)];
    const int32_t* idx = at<int32_t>(buf, layout_.topk_idx);
    parallel_for(b.num_tokens, num_threads_, [&](int64_t t) {
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k)
          if (idx[t * K + k] >= 0)
            acc = add_rn(acc, to_f32(reinterpret_cast<const bf16*>(buf.data() + layout_.combine_row_offset(k, t))[h]));
        if (fused) acc = add_rn(acc, to_f32(reinterpret_cast<const bf16*>(buf.data() + layout_.combine_row_offset(K, t))[h]));
        b.y[t * H + h].bits = bf16_round(acc);
      }
    });
  }

  // The workspace cleans itself: counters back to zero for the next call.
  for (auto& buf : buffers_) std::memset(buf.data() + layout_.expert_counts.offset, 0, layout_.expert_counts.bytes);
  if (debug_zeroing())
    for (auto& buf : buffers_) std::fill(buf.begin(), buf.end(), uint8_t(0));
}

void CpuEngine::run_groups(const std::vector<Group>& groups) const {
  static_assert(kRowsPerGroup == kGemmRows);
  parallel_for(int64_t(groups.size()), num_threads_, [&](int64_t i) {
    thread_local Scratch s;
    expert_rows(*groups[size_t(i)].expert, groups[size_t(i)].n, groups[size_t(i)].rows, s);
  });
}

void CpuEngine::shared_expert(int64_t rank, const bf16* x, int64_t num_tokens, bf16* y) const {
  MOEFQ_CHECK(!shared_.empty(), "shared_expert: the config has no shared expert");
  MOEFQ_ASSERT(rank >= 0 && rank < num_ranks(), "shared_expert: rank out of range");
  const int64_t H = cfg_.hidden, hb = H / kB, I = cfg_.intermediate * cfg_.num_shared;
  std::vector<uint8_t> x8(size_t(num_tokens * H)), h8(size_t(num_tokens * I));
  std::vector<float> xs(size_t(num_tokens * hb)), hs(size_t(num_tokens * (I / kB)));
  stage_e4m3_ref(x, x8.data(), xs.data(), num_tokens, H);
  std::vector<Group> groups;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (t % kRowsPerGroup == 0) groups.push_back({shared_[size_t(rank)].get(), 0, {}});
    Group& g = groups.back();
    g.rows.a8[g.n] = x8.data() + t * H;
    g.rows.a_scale[g.n] = xs.data() + t * hb;
    g.rows.weight[g.n] = 1.0f;
    g.rows.h8[g.n] = h8.data() + t * I;
    g.rows.h_scale[g.n] = hs.data() + t * (I / kB);
    g.rows.out[g.n] = y + t * H;
    ++g.n;
  }
  run_groups(groups);
}

}  // namespace moefq
