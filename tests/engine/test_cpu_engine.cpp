// The CPU engine (docs/engine.md): against a naive double-precision implementation, bit-exact across
// simulated rank counts and repeated calls, the combine against a re-sum of the buffer's rows,
// padding / empty experts / edge sizes, the debug switch and the input checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include "moefq/cpu_engine.h"
#include "moefq/errors.h"
#include "moefq/metrics.h"
#include "moefq/qdq.h"
#include "moe_test_util.h"
#include "test_util.h"

namespace moefq {
namespace {

using test::random_routing;
using test::small_config;
using test::weights_for;

// Runs n tokens through an engine of R ranks (rank r gets tokens [r*n/R, (r+1)*n/R)); returns y.
std::vector<bf16> run(CpuEngine& eng, const std::vector<bf16>& x, const std::vector<int32_t>& idx,
                      const std::vector<float>& w, int64_t n) {
  const int64_t R = eng.num_ranks(), H = eng.config().hidden, K = eng.config().top_k;
  std::vector<bf16> y(size_t(n * H));
  std::vector<RankBatch> b(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t0 = n * r / R, t1 = n * (r + 1) / R;
    b[size_t(r)] = {x.data() + t0 * H, t1 - t0, idx.data() + t0 * K, w.data() + t0 * K, y.data() + t0 * H};
  }
  eng.forward(b);
  return y;
}

// The naive implementation: per (token, slot), dequantized weights, GEMMs in double, docs/engine.md's
// roundings (staging, bf16 of g/u and of the row, re-staging) and the sum in double.
std::vector<double> naive(const MoeConfig& c, const std::vector<LayerWeights>& w, const std::vector<bf16>& x,
                          const std::vector<int32_t>& idx, const std::vector<float>& wt, int64_t n, bool fused) {
  const int64_t H = c.hidden, K = c.top_k, el = c.num_experts / int64_t(w.size());
  std::vector<uint8_t> x8(size_t(n * H));
  std::vector<float> xs(size_t(n * H / 128));
  stage_e4m3_ref(x.data(), x8.data(), xs.data(), n, H);
  std::vector<double> y(size_t(n * H), 0.0);
  auto expert = [&](const ExpertWeights& e, int64_t t, double weight, std::vector<double>& out) {
    const int64_t I = e.intermediate;
    const auto gu = e.gate_up_f32(), dn = e.down_f32();
    std::vector<float> h(static_cast<size_t>(I));
    for (int64_t i = 0; i < I; ++i) {
      double g = 0, u = 0;
      for (int64_t k = 0; k < H; ++k) {
        const double a = double(e4m3_decode(x8[size_t(t * H + k)])) * xs[size_t(t * H / 128 + k / 128)];
        g += a * gu[size_t(i * H + k)];
        u += a * gu[size_t((I + i) * H + k)];
      }
      double gb = bf16_to_f32(bf16_round(float(g))), ub = bf16_to_f32(bf16_round(float(u)));
      if (c.swiglu_clamp) {
        gb = std::min(gb, double(*c.swiglu_clamp));
        ub = std::clamp(ub, -double(*c.swiglu_clamp), double(*c.swiglu_clamp));
      }
      h[size_t(i)] = float(gb / (1.0 + std::exp(-gb)) * ub * weight);
    }
    std::vector<uint8_t> h8(static_cast<size_t>(I));
    std::vector<float> hs(size_t(I / 128));
    // re-staging with the staging rule of docs/numerics.md (on fp32 values)
    for (int64_t b = 0; b < I / 128; ++b) {
      float m = 0;
      for (int64_t i = b * 128; i < (b + 1) * 128; ++i) m = std::max(m, std::fabs(h[size_t(i)]));
      const float sf = std::max(m, 1e-4f) / 448.0f;
      for (int64_t i = b * 128; i < (b + 1) * 128; ++i) h8[size_t(i)] = e4m3_encode_sat(h[size_t(i)] * (1.0f / sf));
      hs[size_t(b)] = sf;
    }
    for (int64_t o = 0; o < H; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < I; ++i) acc += double(e4m3_decode(h8[size_t(i)])) * hs[size_t(i / 128)] * dn[size_t(o * I + i)];
      out[size_t(o)] = bf16_to_f32(bf16_round(float(acc)));
    }
  };
  std::vector<double> row(static_cast<size_t>(H));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = idx[size_t(t * K + k)];
      if (e < 0) continue;
      expert(w[size_t(e / el)].experts[size_t(e % el)], t, wt[size_t(t * K + k)], row);
      for (int64_t o = 0; o < H; ++o) y[size_t(t * H + o)] += row[size_t(o)];
    }
    if (fused) {
      expert(w[0].shared[0], t, 1.0, row);
      for (int64_t o = 0; o < H; ++o) y[size_t(t * H + o)] += row[size_t(o)];
    }
  }
  return y;
}

TEST(CpuEngine, MatchesNaiveDoublePrecisionImplementation) {
  for (bool fused : {true, false}) {
    for (WeightFormat f : {WeightFormat::kE4m3, WeightFormat::kBf16}) {
      MoeConfig c = small_config();
      c.swiglu_clamp = f == WeightFormat::kBf16 ? std::optional<float>(10.0f) : std::nullopt;
      const int64_t n = 24, R = 2;
      const auto w = weights_for(c, R, f);
      CpuEngine eng(c, R, n, w, {fused, 2});
      const auto x = test::to_bf16(test::activations(n, c.hidden, 3, false));
      std::vector<int32_t> idx;
      std::vector<float> wt;
      random_routing(c, n, 5, idx, wt, 7);
      const auto y = run(eng, x, idx, wt, n);
      const auto ref = naive(c, w, x, idx, wt, n, fused);
      std::vector<float> yf(y.size()), rf(ref.size());
      for (size_t i = 0; i < ref.size(); ++i) rf[i] = bf16_to_f32(bf16_round(float(ref[i])));  // y is bf16 too
      for (size_t i = 0; i < y.size(); ++i) yf[i] = to_f32(y[i]);
      const ErrorMetrics m = compute_metrics(yf.data(), rf.data(), int64_t(yf.size()));
      // Tolerance: fp32 vs double accumulation occasionally moves a bf16 or e4m3 rounding of an
      // intermediate by one step (with e4m3 weights the block sums of e4m3 products are exact
      // here, so only the bf16 weights' sums can move one). The bounds allow a few such steps.
      EXPECT_LT(m.rel_l2, 2e-3) << "fused=" << fused << " format=" << weight_format_name(f);
      EXPECT_LT(m.calc_diff, 1e-6) << "fused=" << fused;
      EXPECT_GT(m.count, 0);
    }
  }
}

TEST(CpuEngine, BitExactAcrossRankCounts) {
  const MoeConfig c = small_config();
  const int64_t n = 64;
  const auto x = test::to_bf16(test::activations(n, c.hidden, 9, false));
  std::vector<int32_t> idx;
  std::vector<float> wt;
  random_routing(c, n, 11, idx, wt, 5);
  std::vector<bf16> first;
  for (int64_t R : {1, 2, 4, 8}) {
    CpuEngine eng(c, R, n / R, weights_for(c, R), {true, 2});
    const auto y = run(eng, x, idx, wt, n);
    if (R == 1)
      first = y;
    else
      EXPECT_TRUE(test::bytes_equal(first, y)) << "R=" << R;
  }
}

TEST(CpuEngine, RepeatedCallsAreIdenticalAndTheWorkspaceCleansItself) {
  const MoeConfig c = small_config();
  const int64_t n = 32, R = 4;
  CpuEngine eng(c, R, n / R, weights_for(c, R), {true, 2});
  const auto x = test::to_bf16(test::activations(n, c.hidden, 1, false));
  const auto x2 = test::to_bf16(test::activations(n, c.hidden, 2, false));
  std::vector<int32_t> idx, idx2;
  std::vector<float> wt, wt2;
  random_routing(c, n, 1, idx, wt);
  random_routing(c, n, 2, idx2, wt2, 3);
  const auto y1 = run(eng, x, idx, wt, n);
  run(eng, x2, idx2, wt2, n);  // a different call in between
  const auto y3 = run(eng, x, idx, wt, n);
  EXPECT_TRUE(test::bytes_equal(y1, y3));
  for (int64_t r = 0; r < R; ++r) {
    const auto buf = eng.buffer(r);
    const auto& l = eng.layout();
    for (size_t i = l.expert_counts.offset; i < l.expert_counts.offset + l.expert_counts.bytes; ++i)
      ASSERT_EQ(buf[i], 0) << "rank " << r << " counters not reset";
  }
}

TEST(CpuEngine, CombineEqualsResumOfBufferRows) {
  for (bool fused : {true, false}) {
    const MoeConfig c = small_config();
    const int64_t n = 20, R = 2, K = c.top_k, H = c.hidden;
    CpuEngine eng(c, R, n / R, weights_for(c, R), {fused, 2});
    const auto x = test::to_bf16(test::activations(n, H, 4, false));
    std::vector<int32_t> idx;
    std::vector<float> wt;
    random_routing(c, n, 4, idx, wt, 6);
    const auto y = run(eng, x, idx, wt, n);
    for (int64_t r = 0; r < R; ++r) {
      const auto buf = eng.buffer(r);
      const auto& l = eng.layout();
      std::vector<bf16> resum(size_t(n / R * H));
      for (int64_t t = 0; t < n / R; ++t)
        for (int64_t h = 0; h < H; ++h) {
          float acc = 0.0f;
          for (int64_t k = 0; k < K; ++k)
            if (idx[size_t((r * n / R + t) * K + k)] >= 0)
              acc += to_f32(reinterpret_cast<const bf16*>(buf.data() + l.combine_row_offset(k, t))[h]);
          if (fused) acc += to_f32(reinterpret_cast<const bf16*>(buf.data() + l.combine_row_offset(K, t))[h]);
          resum[size_t(t * H + h)].bits = bf16_round(acc);
        }
      EXPECT_TRUE(test::bytes_equal(resum, std::vector<bf16>(y.begin() + r * n / R * H, y.begin() + (r + 1) * n / R * H)))
          << "rank " << r << " fused=" << fused;
    }
  }
}

// combine_weighting after, the slow way: rows of a `before` engine given weights 1.0 (the
// unweighted rows), each added as std::fma(x, w, acc) (one rounding, as DeepEP's low-latency
// combine accumulates), the shared row last and unweighted.
std::vector<bf16> weighted_combine_slow(const CpuEngine& unweighted, const std::vector<int32_t>& idx,
                                        const std::vector<float>& wt, int64_t n) {
  const int64_t R = unweighted.num_ranks(), K = unweighted.config().top_k, H = unweighted.config().hidden;
  const bool fused = unweighted.layout().shape().fused_shared_slots() > 0;
  const BufferLayout& l = unweighted.layout();
  std::vector<bf16> y(size_t(n * H));
  for (int64_t r = 0; r < R; ++r) {
    const auto buf = unweighted.buffer(r);
    const int64_t t0 = n * r / R, t1 = n * (r + 1) / R;
    const auto row = [&](int64_t k, int64_t t) { return reinterpret_cast<const bf16*>(buf.data() + l.combine_row_offset(k, t)); };
    for (int64_t t = 0; t < t1 - t0; ++t)
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
          if (idx[size_t((t0 + t) * K + k)] < 0) continue;
          acc = std::fma(to_f32(row(k, t)[h]), wt[size_t((t0 + t) * K + k)], acc);
        }
        if (fused) acc = float(double(acc) + double(to_f32(row(K, t)[h])));
        y[size_t((t0 + t) * H + h)].bits = bf16_round(acc);
      }
  }
  return y;
}

// One call's tokens and random routing (n tokens, every `padding_every`-th all padding).
struct Call {
  std::vector<bf16> x;
  std::vector<int32_t> idx;
  std::vector<float> wt;
};
Call random_call(const MoeConfig& c, int64_t n, uint64_t seed, int64_t padding_every) {
  Call call{test::to_bf16(test::activations(n, c.hidden, seed, false)), {}, {}};
  random_routing(c, n, seed + 1, call.idx, call.wt, padding_every);
  return call;
}

TEST(CpuEngine, CombineWeightingAfterMatchesSlowReference) {
  for (bool fused : {true, false}) {
    const MoeConfig c = small_config();
    const int64_t n = 24, R = 2;
    const auto [x, idx, wt] = random_call(c, n, 8, 5);
    EngineOptions after{fused, 2, CombineWeighting::kAfter}, before{fused, 2, CombineWeighting::kBefore};
    CpuEngine eng(c, R, n / R, weights_for(c, R), after), unweighted(c, R, n / R, weights_for(c, R), before);
    const auto y = run(eng, x, idx, wt, n);
    run(unweighted, x, idx, std::vector<float>(wt.size(), 1.0f), n);
    // The rows the after engine leaves are the unweighted ones, bit for bit.
    for (int64_t r = 0; r < R; ++r) {
      const auto a = eng.buffer(r), b = unweighted.buffer(r);
      const size_t off = eng.layout().combine.offset;
      EXPECT_TRUE(test::bytes_equal(std::vector<uint8_t>(b.begin() + off, b.end()),
                                    std::vector<uint8_t>(a.begin() + off, a.end())))
          << "rank " << r << " fused=" << fused;
    }
    EXPECT_TRUE(test::bytes_equal(weighted_combine_slow(unweighted, idx, wt, n), y)) << "fused=" << fused;
  }
}

TEST(CpuEngine, CombineWeightingAfterDiffersFromBeforeAndEqualsItWithUnitWeights) {
  const MoeConfig c = small_config();
  const int64_t n = 32, R = 4;
  const auto [x, idx, wt] = random_call(c, n, 2, 7);
  CpuEngine before(c, R, n / R, weights_for(c, R), {true, 2, CombineWeighting::kBefore});
  CpuEngine after(c, R, n / R, weights_for(c, R), {true, 2, CombineWeighting::kAfter});
  EXPECT_FALSE(test::bytes_equal(run(before, x, idx, wt, n), run(after, x, idx, wt, n)));
  const std::vector<float> ones(wt.size(), 1.0f);
  EXPECT_TRUE(test::bytes_equal(run(before, x, idx, ones, n), run(after, x, idx, ones, n)));
}

TEST(CpuEngine, PaddingEmptyExpertsAndEdgeSizes) {
  const MoeConfig c = small_config();
  const int64_t T = 16, R = 2, H = c.hidden, K = c.top_k;
  for (bool fused : {true, false}) {
    CpuEngine eng(c, R, T, weights_for(c, R), {fused, 2});
    const auto x = test::to_bf16(test::activations(2 * T, H, 6, false));
    // All padding: outputs are zero, or exactly the shared expert's row when fused.
    std::vector<int32_t> idx(size_t(2 * T * K), -1);
    std::vector<float> wt(size_t(2 * T * K), 0.0f);
    auto y = run(eng, x, idx, wt, 2 * T);
    std::vector<bf16> shared(size_t(T * H));
    eng.shared_expert(0, x.data(), T, shared.data());
    for (int64_t i = 0; i < T * H; ++i) {
      const uint16_t want = fused ? bf16_round(0.0f + to_f32(shared[size_t(i)])) : 0;
      ASSERT_EQ(y[size_t(i)].bits, want) << "element " << i << " fused=" << fused;
    }
    // num_tokens = 0 on one rank, T on the other; experts only on rank 1 (rank 0's are empty).
    std::vector<int32_t> idx2;
    std::vector<float> wt2;
    random_routing(c, T, 8, idx2, wt2, 4);
    for (auto& e : idx2)
      if (e >= 0) e = int32_t(c.num_experts / 2 + e % (c.num_experts / 2));
    for (int64_t t = 0; t < T; ++t)  // keep the slots distinct after folding
      for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < k; ++j)
          if (idx2[size_t(t * K + k)] >= 0 && idx2[size_t(t * K + k)] == idx2[size_t(t * K + j)]) idx2[size_t(t * K + k)] = -1;
    std::vector<bf16> y2(size_t(T * H));
    std::vector<RankBatch> b = {{x.data(), 0, idx2.data(), wt2.data(), nullptr},
                                {x.data(), T, idx2.data(), wt2.data(), y2.data()}};
    eng.forward(b);
    // The same tokens on one rank of a 1-rank engine give the same rows.
    CpuEngine one(c, 1, T, weights_for(c, 1), {fused, 2});
    std::vector<bf16> y1(size_t(T * H));
    std::vector<RankBatch> b1 = {{x.data(), T, idx2.data(), wt2.data(), y1.data()}};
    one.forward(b1);
    EXPECT_TRUE(test::bytes_equal(y1, y2)) << "fused=" << fused;
  }
}

TEST(CpuEngine, KimiShapeK16With896Experts) {
  MoeConfig c = small_config(896, 16, 2);
  const int64_t n = 32;
  const auto x = test::to_bf16(test::activations(n, c.hidden, 12, false));
  std::vector<int32_t> idx;
  std::vector<float> wt;
  random_routing(c, n, 13, idx, wt, 9);
  std::vector<bf16> first[2];
  for (int64_t R : {1, 8}) {
    const auto w = weights_for(c, R);
    for (bool fused : {true, false}) {
      CpuEngine eng(c, R, n / R, w, {fused, 2});
      const auto y = run(eng, x, idx, wt, n);
      if (first[fused].empty()) first[fused] = y;
      else EXPECT_TRUE(test::bytes_equal(first[fused], y)) << "R=" << R << " fused=" << fused;
    }
  }
  EXPECT_FALSE(test::bytes_equal(first[0], first[1]));  // the shared slot is there when fused
  for (const bf16& v : first[1]) ASSERT_TRUE(is_finite(to_f32(v)));
}

TEST(CpuEngine, DebugSwitchZeroesTheBuffer) {
  const MoeConfig c = small_config();
  const int64_t n = 8, R = 2;
  CpuEngine eng(c, R, n / R, weights_for(c, R), {true, 2});
  const auto x = test::to_bf16(test::activations(n, c.hidden, 14, false));
  std::vector<int32_t> idx;
  std::vector<float> wt;
  random_routing(c, n, 14, idx, wt);
  run(eng, x, idx, wt, n);
  bool nonzero = false;
  for (uint8_t v : eng.buffer(0)) nonzero |= v != 0;
  EXPECT_TRUE(nonzero);
  setenv("MOEFQ_COMM_KERNEL_DEBUG", "1", 1);
  const auto y = run(eng, x, idx, wt, n);
  unsetenv("MOEFQ_COMM_KERNEL_DEBUG");
  for (int64_t r = 0; r < R; ++r)
    for (uint8_t v : eng.buffer(r)) ASSERT_EQ(v, 0) << "rank " << r;
  // The call itself is unaffected.
  EXPECT_TRUE(test::bytes_equal(y, run(eng, x, idx, wt, n)));
}

TEST(CpuEngine, SharedExpertUnfusedEqualsTheFusedSlot) {
  const MoeConfig c = small_config();
  const int64_t n = 8, K = c.top_k, H = c.hidden;
  CpuEngine eng(c, 1, n, weights_for(c, 1), {true, 2});
  const auto x = test::to_bf16(test::activations(n, H, 15, false));
  std::vector<int32_t> idx;
  std::vector<float> wt;
  random_routing(c, n, 15, idx, wt);
  run(eng, x, idx, wt, n);
  std::vector<bf16> shared(size_t(n * H));
  eng.shared_expert(0, x.data(), n, shared.data());
  const auto buf = eng.buffer(0);
  for (int64_t t = 0; t < n; ++t)
    EXPECT_TRUE(test::bytes_equal(shared.data() + t * H, buf.data() + eng.layout().combine_row_offset(K, t), size_t(H), 2));
}

TEST(CpuEngine, BadInputsAreErrorsNamingRankTokenAndSlot) {
  const MoeConfig c = small_config();
  CpuEngine eng(c, 2, 4, weights_for(c, 2), {true, 1});
  const auto x = test::to_bf16(test::activations(4, c.hidden, 16, false));
  std::vector<int32_t> idx(16, -1);
  std::vector<float> wt(16, 0.5f);
  std::vector<bf16> y(size_t(4 * c.hidden));
  auto expect_error = [&](const std::vector<RankBatch>& b, const std::string& what) {
    try {
      eng.forward(b);
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  idx[1] = 99;
  expect_error({{x.data(), 4, idx.data(), wt.data(), y.data()}, {x.data(), 0, idx.data(), wt.data(), y.data()}},
               "rank 0 token 0 slot 1");
  idx[1] = 3;
  idx[2] = 3;
  expect_error({{x.data(), 4, idx.data(), wt.data(), y.data()}, {x.data(), 0, idx.data(), wt.data(), y.data()}}, "twice");
  idx[2] = -1;
  expect_error({{x.data(), 5, idx.data(), wt.data(), y.data()}, {x.data(), 0, idx.data(), wt.data(), y.data()}},
               "at most 4");
  expect_error({{x.data(), 4, idx.data(), wt.data(), y.data()}}, "1 batches for 2 ranks");
}

TEST(BufferLayout, CombineRegionIsLastWithTheSpecifiedRowLayout) {
  BufferShape s;
  s.num_ranks = 4;
  s.num_experts = 32;
  s.max_tokens = 100;
  s.top_k = 8;
  s.hidden = 512;
  s.intermediate = 256;
  s.shared_intermediate = 256;
  const BufferLayout l(s);
  EXPECT_EQ(l.combine.offset + l.combine.bytes, l.total_bytes());
  EXPECT_EQ(l.combine.bytes, size_t(9 * 100 * 512 * 2));
  EXPECT_EQ(l.combine_row_offset(3, 7), l.combine_offset() + size_t((3 * 100 + 7) * 512 * 2));
  const Region regions[] = {l.workspace, l.staged_x, l.staged_scales, l.topk_idx, l.topk_weights,
                            l.pool_x, l.pool_x_scales, l.pool_h, l.pool_h_scales, l.combine};
  for (size_t i = 1; i < std::size(regions); ++i) {
    EXPECT_GE(regions[i].offset, regions[i - 1].offset + regions[i - 1].bytes);
    EXPECT_EQ(regions[i].offset % 256, 0u);
  }
  EXPECT_EQ(s.pool_rows(), 4 * 100 * 8);
  s.shared_intermediate = 0;
  EXPECT_EQ(BufferLayout(s).combine.bytes, size_t(8 * 100 * 512 * 2));
  s.num_experts = 30;
  EXPECT_THROW(BufferLayout{s}, Error);
}

}  // namespace
}  // namespace moefq
