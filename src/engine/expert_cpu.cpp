#include "engine/expert_cpu.h"

#include <algorithm>
#include <thread>

#include "engine/parallel.h"
#include "moefq/errors.h"
#include "moefq/qdq.h"

namespace moefq {
namespace {

constexpr int64_t kB = kStageBlock;  // 128: activation blocks and weight blocks

void prepare_matrix(const std::vector<uint8_t>& w8, const std::vector<float>& scale, const std::vector<bf16>& wbf,
                    WeightFormat f, int64_t rows, int64_t cols, std::vector<float>& out, std::vector<float>& out_scale) {
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

// Per-thread working rows.
struct Scratch {
  std::vector<float> a, gu, h;
};

// gate/up GEMM on the staged input, bf16 rounding, clamp, h = silu(g) * u * weight, re-staging,
// down GEMM, bf16 rounding.
void run_group(const ExpertGroup& g, std::optional<float> clamp, Scratch& s) {
  const PreparedExpert& e = *g.expert;
  const int64_t H = e.hidden, I = e.inter, astride = std::max(H, I), gstride = std::max(2 * I, H);
  s.a.resize(size_t(kGemmRows * astride));
  s.gu.resize(size_t(kGemmRows * gstride));
  s.h.resize(size_t(I));
  const float* a[kGemmRows];
  float* gu[kGemmRows];
  for (int r = 0; r < g.n; ++r) {
    float* ar = s.a.data() + r * astride;
    for (int64_t i = 0; i < H; ++i) ar[i] = e4m3_decode(g.a8[r][i]);
    a[r] = ar;
    gu[r] = s.gu.data() + r * gstride;
  }
  gemm_rows(g.n, a, g.a_scale, e.gate_up.data(), e.gate_up_scale.data(), 2 * I, H, gu);
  const float* h_scale[kGemmRows];
  for (int r = 0; r < g.n; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      float gv = bf16_to_f32(bf16_round(gu[r][i]));
      float uv = bf16_to_f32(bf16_round(gu[r][I + i]));
      if (clamp) {
        gv = gv < *clamp ? gv : *clamp;
        uv = uv < -*clamp ? -*clamp : (uv > *clamp ? *clamp : uv);
      }
      s.h[size_t(i)] = mul_rn(mul_rn(silu_f32(gv), uv), g.weight[r]);
    }
    stage_e4m3_ref(s.h.data(), g.h8[r], g.h_scale[r], 1, I);
    float* ar = s.a.data() + r * astride;
    for (int64_t i = 0; i < I; ++i) ar[i] = e4m3_decode(g.h8[r][i]);
    h_scale[r] = g.h_scale[r];
  }
  gemm_rows(g.n, a, h_scale, e.down.data(), e.down_scale.data(), H, I, gu);
  for (int r = 0; r < g.n; ++r)
    for (int64_t i = 0; i < H; ++i) g.out[r][i].bits = bf16_round(gu[r][i]);
}

}  // namespace

PreparedExpert::PreparedExpert(const ExpertWeights& w, int64_t h, int64_t i) : hidden(h), inter(i) {
  MOEFQ_CHECK(w.hidden == h && w.intermediate == i, "expert weights of shape H=", w.hidden, " I=", w.intermediate,
              " do not match the config (H=", h, " I=", i, ")");
  prepare_matrix(w.gate_up_e4m3, w.gate_up_scale, w.gate_up_bf16, w.format, 2 * i, h, gate_up, gate_up_scale);
  prepare_matrix(w.down_e4m3, w.down_scale, w.down_bf16, w.format, h, i, down, down_scale);
}

void add_expert_row(std::vector<ExpertGroup>& groups, const PreparedExpert* e, bool new_group, const uint8_t* a8,
                    const float* a_scale, float weight, uint8_t* h8, float* h_scale, bf16* out) {
  if (new_group || groups.empty() || groups.back().n == kGemmRows) {
    groups.emplace_back();
    groups.back().expert = e;
  }
  ExpertGroup& g = groups.back();
  g.a8[g.n] = a8;
  g.a_scale[g.n] = a_scale;
  g.weight[g.n] = weight;
  g.h8[g.n] = h8;
  g.h_scale[g.n] = h_scale;
  g.out[g.n] = out;
  ++g.n;
}

void run_expert_groups(const std::vector<ExpertGroup>& groups, std::optional<float> clamp, int num_threads) {
  parallel_for(int64_t(groups.size()), num_threads, [&](int64_t i) {
    thread_local Scratch s;
    run_group(groups[size_t(i)], clamp, s);
  });
}

void run_expert_on_tokens(const PreparedExpert& e, const bf16* x, int64_t n, bf16* y, std::optional<float> clamp,
                          int num_threads) {
  const int64_t H = e.hidden, hb = H / kB, I = e.inter, ib = I / kB;
  std::vector<uint8_t> x8(size_t(n * H)), h8(size_t(n * I));
  std::vector<float> xs(size_t(n * hb)), hs(size_t(n * ib));
  stage_e4m3_ref(x, x8.data(), xs.data(), n, H);
  std::vector<ExpertGroup> groups;
  for (int64_t t = 0; t < n; ++t)
    add_expert_row(groups, &e, t == 0, x8.data() + t * H, xs.data() + t * hb, 1.0f, h8.data() + t * I,
                   hs.data() + t * ib, y + t * H);
  run_expert_groups(groups, clamp, num_threads);
}

void combine_rows(const bf16* const* rows, int n, int64_t H, bf16* y) {
  for (int64_t h = 0; h < H; ++h) {
    float acc = 0.0f;
    for (int i = 0; i < n; ++i) acc = add_rn(acc, to_f32(rows[i][h]));
    y[h].bits = bf16_round(acc);
  }
}

void validate_batches(std::span<const RankBatch> batches, int64_t R, int64_t T, int64_t E, int64_t K) {
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
}

int resolve_threads(int requested) {
  return requested > 0 ? requested : int(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace moefq
