#include "engine/expert_cpu.h"

#include <algorithm>
#include <thread>

#include "engine/parallel.h"
#include "moefq/errors.h"
#include "moefq/qdq.h"

namespace moefq {
namespace {

constexpr int64_t kB = kStageBlock;  // 128: activation blocks and weight blocks

GemmWeights view_matrix(const ExpertWeights& w, const std::vector<uint8_t>& w8, const std::vector<float>& scale,
                        const std::vector<bf16>& wbf, int64_t rows, int64_t cols) {
  GemmWeights g;
  if (w.format == WeightFormat::kE4m3) {
    MOEFQ_CHECK(int64_t(w8.size()) == rows * cols && int64_t(scale.size()) == (rows / kB) * (cols / kB),
                "expert weights: ", w8.size(), " e4m3 codes and ", scale.size(), " block scales for a [", rows, ", ",
                cols, "] matrix");
    g.e4m3 = w8.data();
    g.scale = scale.data();
  } else {
    MOEFQ_CHECK(int64_t(wbf.size()) == rows * cols, "expert weights: ", wbf.size(), " bf16 values for a [", rows,
                ", ", cols, "] matrix");
    g.b16 = wbf.data();
  }
  return g;
}

// Per-thread working memory of a run: the rows' decoded inputs, their accumulators, one h row and
// one chunk of decoded weights.
struct Scratch {
  std::vector<float> a, acc, h, w;
};

// Groups per run: a run decodes each weight chunk once for all its rows (the decode costs as much
// as one row's multiply-adds), and runs are what the threads share out.
constexpr size_t kRunGroups = 16;

// out[r][n] for n < n_out of every group of the run, through chunks of 128 weight rows decoded
// to fp32 once (the per-output accumulation order is gemm_rows', so the chunking changes no bit).
void run_gemm(const ExpertGroup* groups, size_t count, const float* const* a, const float* const* a_scale,
              const GemmWeights& w, int64_t n_out, int64_t k_dim, float* const* out, Scratch& s) {
  s.w.resize(size_t(kB * k_dim));
  for (int64_t n0 = 0; n0 < n_out; n0 += kB) {
    const GemmWeights chunk = decode_weight_rows(w, n0, kB, k_dim, s.w.data());
    for (size_t g = 0; g < count; ++g) {
      float* o[kGemmRows];
      for (int r = 0; r < groups[g].n; ++r) o[r] = out[g * kGemmRows + size_t(r)] + n0;
      gemm_rows(groups[g].n, a + g * kGemmRows, a_scale + g * kGemmRows, chunk.f32, chunk.scale, kB, k_dim, o);
    }
  }
}

// Block scales of 1 for the rows of staging none (the weights' own scales still apply), enough
// for any k of a matrix (H, I <= 131072).
const float* unit_scales() {
  static const std::vector<float> ones(131072 / kB, 1.0f);
  return ones.data();
}

// Row i's [n] input as fp32 element values, and its block scales: e4m3 codes decoded (scaled by
// a_scale at the promotion), or bf16 values with scales 1.
const float* decode_row(Staging staging, const void* a, const float* a_scale, int64_t n, float* out) {
  if (staging == Staging::kNone) {
    const bf16* x = static_cast<const bf16*>(a);
    for (int64_t k = 0; k < n; ++k) out[k] = to_f32(x[k]);
    return unit_scales();
  }
  const uint8_t* x8 = static_cast<const uint8_t*>(a);
  for (int64_t k = 0; k < n; ++k) out[k] = e4m3_decode(x8[k]);
  return a_scale;
}

// A run of groups of one expert: gate/up GEMM on the staged inputs, bf16 rounding, clamp,
// h = silu(g) * u * weight, re-staging (or bf16 rounding with staging none), down GEMM, bf16
// rounding.
void run_groups(const ExpertGroup* groups, size_t count, std::optional<float> clamp, Scratch& s) {
  const PreparedExpert& e = *groups[0].expert;
  const int64_t H = e.hidden, I = e.inter, astride = std::max(H, I), gstride = std::max(2 * I, H);
  const size_t slots = count * kGemmRows;
  s.a.resize(slots * size_t(astride));
  s.acc.resize(slots * size_t(gstride));
  s.h.resize(size_t(I));
  std::vector<const float*> a(slots), a_scale(slots), h_scale(slots);
  std::vector<float*> acc(slots);
  for (size_t g = 0; g < count; ++g)
    for (int r = 0; r < groups[g].n; ++r) {
      const size_t i = g * kGemmRows + size_t(r);
      float* ar = s.a.data() + i * size_t(astride);
      a_scale[i] = decode_row(groups[g].staging, groups[g].a[r], groups[g].a_scale[r], H, ar);
      a[i] = ar;
      acc[i] = s.acc.data() + i * size_t(gstride);
    }
  run_gemm(groups, count, a.data(), a_scale.data(), e.gate_up, 2 * I, H, acc.data(), s);
  for (size_t g = 0; g < count; ++g)
    for (int r = 0; r < groups[g].n; ++r) {
      const size_t i = g * kGemmRows + size_t(r);
      const float* gu = acc[i];
      for (int64_t k = 0; k < I; ++k) {
        float gv = bf16_to_f32(bf16_round(gu[k]));
        float uv = bf16_to_f32(bf16_round(gu[I + k]));
        if (clamp) {
          gv = gv < *clamp ? gv : *clamp;
          uv = uv < -*clamp ? -*clamp : (uv > *clamp ? *clamp : uv);
        }
        s.h[size_t(k)] = mul_rn(mul_rn(silu_f32(gv), uv), groups[g].weight[r]);
      }
      if (groups[g].staging == Staging::kNone) {
        bf16* h16 = static_cast<bf16*>(groups[g].h[r]);
        for (int64_t k = 0; k < I; ++k) h16[k].bits = bf16_round(s.h[size_t(k)]);
      } else {
        stage_e4m3_ref(s.h.data(), static_cast<uint8_t*>(groups[g].h[r]), groups[g].h_scale[r], 1, I);
      }
      h_scale[i] = decode_row(groups[g].staging, groups[g].h[r], groups[g].h_scale[r], I,
                              s.a.data() + i * size_t(astride));
    }
  run_gemm(groups, count, a.data(), h_scale.data(), e.down, H, I, acc.data(), s);
  for (size_t g = 0; g < count; ++g)
    for (int r = 0; r < groups[g].n; ++r) {
      const float* o = acc[g * kGemmRows + size_t(r)];
      for (int64_t k = 0; k < H; ++k) groups[g].out[r][k].bits = bf16_round(o[k]);
    }
}

}  // namespace

PreparedExpert::PreparedExpert(const ExpertWeights& w, int64_t h, int64_t i) : hidden(h), inter(i) {
  MOEFQ_CHECK(w.hidden == h && w.intermediate == i, "expert weights of shape H=", w.hidden, " I=", w.intermediate,
              " do not match the config (H=", h, " I=", i, ")");
  gate_up = view_matrix(w, w.gate_up_e4m3, w.gate_up_scale, w.gate_up_bf16, 2 * i, h);
  down = view_matrix(w, w.down_e4m3, w.down_scale, w.down_bf16, h, i);
}

void add_expert_row(std::vector<ExpertGroup>& groups, const PreparedExpert* e, Staging staging, bool new_group,
                    const void* a, const float* a_scale, float weight, void* h, float* h_scale, bf16* out) {
  if (new_group || groups.empty() || groups.back().n == kGemmRows) {
    groups.emplace_back();
    groups.back().expert = e;
    groups.back().staging = staging;
  }
  ExpertGroup& g = groups.back();
  MOEFQ_ASSERT(g.staging == staging, "add_expert_row: one group mixes stagings");
  g.a[g.n] = a;
  g.a_scale[g.n] = a_scale;
  g.weight[g.n] = weight;
  g.h[g.n] = h;
  g.h_scale[g.n] = h_scale;
  g.out[g.n] = out;
  ++g.n;
}

void run_expert_groups(const std::vector<ExpertGroup>& groups, std::optional<float> clamp, int num_threads) {
  // Runs: consecutive groups of one expert, at most kRunGroups each.
  std::vector<std::pair<size_t, size_t>> runs;
  for (size_t g = 0; g < groups.size(); ++g) {
    if (runs.empty() || groups[g].expert != groups[runs.back().first].expert || runs.back().second == kRunGroups)
      runs.push_back({g, 0});
    ++runs.back().second;
  }
  parallel_for(int64_t(runs.size()), num_threads, [&](int64_t i) {
    thread_local Scratch s;
    run_groups(groups.data() + runs[size_t(i)].first, runs[size_t(i)].second, clamp, s);
  });
}

void run_expert_on_tokens(const PreparedExpert& e, Staging staging, const bf16* x, int64_t n, bf16* y,
                          std::optional<float> clamp, int num_threads) {
  const int64_t H = e.hidden, hb = H / kB, I = e.inter, ib = I / kB;
  std::vector<ExpertGroup> groups;
  if (staging == Staging::kNone) {
    std::vector<bf16> h16(size_t(n * I));
    for (int64_t t = 0; t < n; ++t)
      add_expert_row(groups, &e, staging, t == 0, x + t * H, nullptr, 1.0f, h16.data() + t * I, nullptr, y + t * H);
    run_expert_groups(groups, clamp, num_threads);
    return;
  }
  std::vector<uint8_t> x8(size_t(n * H)), h8(size_t(n * I));
  std::vector<float> xs(size_t(n * hb)), hs(size_t(n * ib));
  stage_e4m3_ref(x, x8.data(), xs.data(), n, H);
  for (int64_t t = 0; t < n; ++t)
    add_expert_row(groups, &e, staging, t == 0, x8.data() + t * H, xs.data() + t * hb, 1.0f, h8.data() + t * I,
                   hs.data() + t * ib, y + t * H);
  run_expert_groups(groups, clamp, num_threads);
}

void combine_rows(const bf16* const* rows, int n, int64_t H, bf16* y, const float* weights, int num_weighted) {
  const int nw = weights ? num_weighted : 0;
  for (int64_t h = 0; h < H; ++h) {
    float acc = 0.0f;
    for (int i = 0; i < nw; ++i) acc = weighted_add(acc, to_f32(rows[i][h]), weights[i]);
    for (int i = nw; i < n; ++i) acc = add_rn(acc, to_f32(rows[i][h]));
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
