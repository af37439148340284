// CudaFakeQuantMoe (docs/fake_quant.md on the GPU), one test per behaviour of the
// quantizers: dispatch and combine quantization (with and without a fused shared expert) against
// independent expectations computed on the host from the GPU engine's own rows; the raise paths;
// the layout check waiting for routed rows; calibrated amax; and CUDA graph capture/replay after
// a padding-only warm-up, with the correct layout and with a corrupted one (the error surfaces at
// synchronize() and the CUDA context keeps working). The layer facade on CUDA (FakeQuantMoe::make)
// is checked bit-identical to this face, and its add_shared to the CPU's.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>

#include "fakequant/cuda/cuda_fake_quant.cuh"
#include "moefq/cuda.h"
#include "cuda_moe_test_util.h"
#include "moefq/expert_backend.h"
#include "moefq/fake_quant_moe.h"
#include "moefq/recipe.h"

namespace moefq {
namespace {

using test::DeviceProblem, test::download_buffer, test::make_problem, test::Problem, test::small_config,
    test::weights_for;

const char* const kDispatchFp8 =
    "quant_cfg:\n  - quantizer_name: '*dispatch_quantizer'\n    cfg: {num_bits: e4m3, constant_amax: 1000}\n";
const char* const kDispatchFp8Dynamic =
    "quant_cfg:\n  - quantizer_name: '*dispatch_quantizer'\n    cfg: {num_bits: e4m3, amax: dynamic}\n";
const char* const kCombineNvfp4 =
    "quant_cfg:\n  - quantizer_name: '*combine_quantizer'\n"
    "    cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}, constant_amax: 2688}\n";
const char* const kCombineMxfp4 = "$import: [moe_combine_mxfp4]\n";
const char* const kCombineFp8Dynamic =
    "quant_cfg:\n  - quantizer_name: '*combine_quantizer'\n    cfg: {num_bits: e4m3, amax: dynamic}\n";
const char* const kCalibrateBoth = "$import: [moe_dispatch_fp8, moe_combine_nvfp4]\nalgorithm: max\n";

struct Layer {
  std::unique_ptr<cuda::CudaFakeQuantMoe> fq;
  std::unique_ptr<cuda::CudaEngine> plain;  // the same engine without quantizers
};

Layer make_layer(const MoeConfig& c, int64_t R, int64_t T, bool fused, const std::string& yaml,
                 CombineWeighting w = CombineWeighting::kBefore) {
  Layer l;
  l.fq = std::make_unique<cuda::CudaFakeQuantMoe>(std::make_unique<cuda::CudaEngine>(c, R, T, weights_for(c, R),
                                                                                      EngineOptions{fused, 2, w}),
                                                  0);
  l.fq->configure(apply_recipe(parse_recipe_text(yaml, "test.yaml"), l.fq->quantizer_names()));
  l.plain = std::make_unique<cuda::CudaEngine>(c, R, T, weights_for(c, R), EngineOptions{fused, 2, w});
  return l;
}

std::vector<std::vector<bf16>> run(cuda::CudaFakeQuantMoe& fq, DeviceProblem& dp) {
  fq.forward(dp.batches(), nullptr);
  fq.synchronize(nullptr);
  return dp.outputs();
}
std::vector<std::vector<bf16>> run(cuda::CudaEngine& e, DeviceProblem& dp) {
  e.forward(dp.batches(), nullptr);
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  return dp.outputs();
}

template <typename Fn>
void expect_error(Fn&& fn, ErrorKind kind, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(int(e.kind()), int(kind)) << e.what();
    for (const auto& s : needles) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << "'" << s << "' in: " << e.what();
    return;
  }
  ADD_FAILURE() << "no moefq::Error";
}

bool any_differs(const std::vector<std::vector<bf16>>& a, const std::vector<std::vector<bf16>>& b) {
  for (size_t r = 0; r < a.size(); ++r)
    for (size_t i = 0; i < a[r].size(); ++i)
      if (a[r][i].bits != b[r][i].bits) return true;
  return false;
}

void expect_finite(const std::vector<std::vector<bf16>>& ys) {
  for (const auto& y : ys)
    for (const bf16& v : y) ASSERT_TRUE(is_finite(to_f32(v)));
}

// Dispatch: the output equals the plain engine run on qdq_ref(x) (a constant amax, and a dynamic
// one over the tokens with an active slot).
TEST(CudaFakeQuant, DispatchQuantization) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = small_config();
  const int64_t R = 2, T = 24;
  for (const char* yaml : {kDispatchFp8, kDispatchFp8Dynamic}) {
    Layer l = make_layer(c, R, T, false, yaml);
    const Problem p = make_problem(c, R, T, 40, 4);
    DeviceProblem dp(p, T);
    const auto got = run(*l.fq, dp);
    Problem q = p;
    for (int64_t r = 0; r < R; ++r) {
      float amax = 1000.0f;
      if (yaml == kDispatchFp8Dynamic) {
        amax = 0.0f;
        for (int64_t t = 0; t < T; ++t) {
          bool active = false;
          for (int64_t k = 0; k < c.top_k; ++k) active |= p.idx[size_t(r)][size_t(t * c.top_k + k)] >= 0;
          if (active) amax = max_ignore_nan(amax, amax_ref(p.x[size_t(r)].data() + t * c.hidden, c.hidden));
        }
      }
      qdq_ref(Format::kFp8, p.x[size_t(r)].data(), q.x[size_t(r)].data(), T, c.hidden, amax);
    }
    DeviceProblem dq(q, T);
    const auto want = run(*l.plain, dq);
    for (int64_t r = 0; r < R; ++r)
      EXPECT_TRUE(test::bytes_equal(want[size_t(r)].data(), got[size_t(r)].data(), got[size_t(r)].size(), 2));
    // The caller's x is unchanged (QDQ out of place).
    for (int64_t r = 0; r < R; ++r) EXPECT_TRUE(test::bytes_equal(p.x[size_t(r)].data(), dp.x[size_t(r)].download().data(), p.x[size_t(r)].size(), 2));
  }
}

// Combine: the output equals the re-sum of the QDQ'd rows of the GPU's buffer, with the fused
// shared slot last and unquantized; it differs from the unquantized output and is finite.
// A combine recipe, its format and the amax it runs with.
struct CombineCase {
  const char* yaml;
  Format f;
  float amax;
};

TEST(CudaFakeQuant, CombineQuantizationWithAndWithoutFusedShared) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = small_config();
  const int64_t R = 2, T = 24;
  using Case = CombineCase;
  for (const Case& cs : {Case{kCombineNvfp4, Format::kNvfp4, 2688.0f}, Case{kCombineMxfp4, Format::kMxfp4, 0.0f},
                         Case{"$import: [moe_combine_fp8_block128]\n", Format::kFp8Block128, 0.0f},
                         Case{"$import: [moe_combine_fp8_block128_ue8m0]\n", Format::kFp8Block128Ue8m0, 0.0f},
                         Case{"$import: [moe_combine_logfmt10]\n", Format::kLogfmt10, 0.0f}})
    for (bool fused : {false, true}) {
      SCOPED_TRACE(std::string(format_name(cs.f)) + (fused ? " fused" : " unfused"));
      Layer l = make_layer(c, R, T, fused, cs.yaml);
      const Problem p = make_problem(c, R, T, 50, 5);
      DeviceProblem dp(p, T);
      // Each rank's output against the re-sum of the QDQ'd rows the call left in its buffer.
      const auto expect_resum = [&](const Problem& prob, const std::vector<std::vector<bf16>>& out, const char* call) {
        for (int64_t r = 0; r < R; ++r) {
          const auto buf = download_buffer(l.fq->engine(), r);
          const auto want =
              test::qdq_resum(buf.data(), l.fq->engine().layout().combine_offset(), T, fused, prob, r, cs.f, cs.amax);
          EXPECT_TRUE(test::bytes_equal(want.data(), out[size_t(r)].data(), want.size(), 2)) << call << " call, rank " << r;
        }
      };
      const auto got = run(*l.fq, dp);
      const auto plain = run(*l.plain, dp);
      expect_resum(p, got, "first");
      EXPECT_TRUE(l.fq->layout_checked(0) && l.fq->layout_checked(1));
      EXPECT_TRUE(any_differs(got, plain));
      expect_finite(got);
      // Once the buffers are checked the engine skips its combine and the re-sum is y's only
      // writer: a call on new inputs, over outputs filled with NaN, gives the re-sum of its rows.
      const Problem p2 = make_problem(c, R, T, 51, 5);
      dp.load(p2);
      const auto got2 = run(*l.fq, dp);
      expect_resum(p2, got2, "second");
      expect_finite(got2);
    }
}

TEST(CudaFakeQuant, RaisePaths) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = small_config();
  // Dispatch with a fused shared expert, dynamic combine: configuration errors.
  expect_error([&] { make_layer(c, 2, 8, true, kDispatchFp8); }, ErrorKind::kBadInput, {"dispatch_quantizer", "unfused"});
  expect_error([&] { make_layer(c, 2, 8, false, kCombineFp8Dynamic); }, ErrorKind::kBadInput,
               {"combine_quantizer", "dynamic"});
  // A changed layout: rows read one row off (the buffer holds one token more than the call, so
  // the shifted rows stay inside it), and the debug switch that zeroes the buffer.
  const Problem p = make_problem(c, 2, 8, 60, 3);
  {
    Layer l = make_layer(c, 2, 9, true, kCombineNvfp4);
    l.fq->set_combine_offset(l.fq->combine_offset() + size_t(c.hidden) * 2);
    DeviceProblem dp(p, 9);
    expect_error([&] { run(*l.fq, dp); }, ErrorKind::kFailedCheck, {"layout check failed", "rank 0", "token 0"});
    EXPECT_FALSE(l.fq->layout_checked(0));
    l.fq->set_combine_offset(l.fq->engine().layout().total_bytes());
    expect_error([&] { run(*l.fq, dp); }, ErrorKind::kFailedCheck,
                 {"past the end", "the combine region must hold bf16 rows [K + fused shared slots]"});
  }
  {
    ::setenv("MOEFQ_COMM_KERNEL_DEBUG", "1", 1);
    Layer l = make_layer(c, 2, 8, true, kCombineNvfp4);
    ::unsetenv("MOEFQ_COMM_KERNEL_DEBUG");
    DeviceProblem dp(p, 8);
    expect_error([&] { run(*l.fq, dp); }, ErrorKind::kFailedCheck, {"layout check failed", "debug mode"});
  }
}

// Padding-only calls do not count; the first call with routed rows checks each buffer.
TEST(CudaFakeQuant, LayoutCheckWaitsForRoutedRows) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = small_config();
  Layer l = make_layer(c, 2, 8, true, kCombineNvfp4);
  Problem pad = make_problem(c, 2, 8, 70, 0, 0);
  for (auto& v : pad.idx[1]) v = -1;
  DeviceProblem dp(pad, 8);
  run(*l.fq, dp);
  EXPECT_FALSE(l.fq->layout_checked(0));
  EXPECT_FALSE(l.fq->layout_checked(1));
  dp.load(make_problem(c, 2, 8, 71, 0, 1));  // rank 1 still padding only
  run(*l.fq, dp);
  EXPECT_TRUE(l.fq->layout_checked(0));
  EXPECT_FALSE(l.fq->layout_checked(1));
  dp.load(make_problem(c, 2, 8, 72));
  run(*l.fq, dp);
  EXPECT_TRUE(l.fq->layout_checked(1));
}

// Calibrated amax = the max |value| any rank saw over exactly the quantizer's data, on every rank.
TEST(CudaFakeQuant, CalibratedAmaxIsTheMaxSeenOnEveryRank) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = small_config();
  const int64_t R = 2, T = 16, K = c.top_k, H = c.hidden;
  Layer l = make_layer(c, R, T, false, kCalibrateBoth);
  l.fq->start_calibration();
  float want_d = 0.0f, want_c = 0.0f;
  for (uint64_t b = 0; b < 2; ++b) {
    const Problem p = make_problem(c, R, T, 80 + b, 3, int64_t(b));  // one rank padding only per batch
    DeviceProblem dp(p, T);
    run(*l.fq, dp);
    for (int64_t r = 0; r < R; ++r) {
      const auto buf = download_buffer(l.fq->engine(), r);
      for (int64_t t = 0; t < T; ++t) {
        bool active = false;
        for (int64_t k = 0; k < K; ++k) {
          if (p.idx[size_t(r)][size_t(t * K + k)] < 0) continue;
          active = true;
          const auto* row = reinterpret_cast<const bf16*>(buf.data() + l.fq->engine().layout().combine_row_offset(k, t));
          want_c = std::max(want_c, amax_ref(row, H));
        }
        if (active) want_d = std::max(want_d, amax_ref(p.x[size_t(r)].data() + t * H, H));
      }
    }
  }
  l.fq->finish_calibration();
  for (int64_t r = 0; r < R; ++r) {
    EXPECT_EQ(f32_bits(*l.fq->quantizers().dispatch(r).amax()), f32_bits(want_d)) << "rank " << r;
    EXPECT_EQ(f32_bits(*l.fq->quantizers().combine(r).amax()), f32_bits(want_c)) << "rank " << r;
  }
}

// Graph mode: a padding-only warm-up with constant scales (so no buffer was checked), then a
// capture that carries the device-side check. Correct layout: replays on new inputs equal the
// eager results bit for bit. Corrupted layout: the error surfaces at synchronize() and the
// process and its CUDA context keep working.
TEST(CudaFakeQuant, GraphCaptureAfterPaddingOnlyWarmup) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = small_config();
  const int64_t R = 2, T = 16;
  const std::string yaml = std::string(kCombineNvfp4) + "  - quantizer_name: '*dispatch_quantizer'\n"
                                                        "    cfg: {num_bits: e4m3, constant_amax: 1000}\n";
  for (bool corrupt : {false, true}) {
    SCOPED_TRACE(corrupt ? "corrupted layout" : "correct layout");
    Layer l = make_layer(c, R, T + 1, false, yaml);  // one spare token: a shifted layout stays inside
    Layer ref = make_layer(c, R, T, false, yaml);      // eager reference
    if (corrupt) l.fq->set_combine_offset(l.fq->combine_offset() + size_t(c.hidden) * 2);
    Problem warm = make_problem(c, R, T, 90);
    for (auto& idx : warm.idx) std::fill(idx.begin(), idx.end(), -1);
    DeviceProblem dp(warm, T + 1);
    run(*l.fq, dp);
    ASSERT_FALSE(l.fq->layout_checked(0));
    const test::CapturedGraph graph([&](cudaStream_t s) { l.fq->forward(dp.batches(), s); });
    const cudaStream_t s = graph.stream();
    for (uint64_t i = 0; i < 3; ++i) {
      const Problem p = make_problem(c, R, T, 91 + i, 4);
      dp.load(p);
      graph.launch();
      if (corrupt) {
        expect_error([&] { l.fq->synchronize(s); }, ErrorKind::kFailedCheck, {"layout check failed", "rank 0"});
        // The context survives: an eager call of the reference layer still works.
        DeviceProblem dq(p, T);
        EXPECT_NO_THROW(run(*ref.fq, dq));
        break;
      }
      l.fq->synchronize(s);
      const auto got = dp.outputs();
      DeviceProblem dq(p, T);
      const auto want = run(*ref.fq, dq);
      for (int64_t r = 0; r < R; ++r)
        EXPECT_TRUE(test::bytes_equal(want[size_t(r)].data(), got[size_t(r)].data(), got[size_t(r)].size(), 2))
            << "replay " << i << " rank " << r;
    }
  }
}

// The one layer facade on CUDA (FakeQuantMoe::make from host weights) gives the CUDA face's bits,
// and forward_with_shared adds the shared expert as add_shared's rule says: bf16(routed + shared),
// one rounding, checked on the host against the routed output and the shared expert's.
TEST(CudaFakeQuant, LayerFacadeOnCudaMatchesTheCudaFace) {
  SKIP_WITHOUT_GPU();
  cuda::register_cuda_backends();
  const MoeConfig c = small_config();
  ASSERT_GT(c.num_shared, 0);
  const int64_t R = 2, T = 16, H = c.hidden;
  const std::string yaml = std::string(kCombineNvfp4) + "  - quantizer_name: '*dispatch_quantizer'\n"
                                                        "    cfg: {num_bits: e4m3, constant_amax: 1000}\n";
  Layer l = make_layer(c, R, T, false, yaml);
  const std::unique_ptr<FakeQuantMoe> fq =
      FakeQuantMoe::make(LayerDevice::kCuda, c, R, T, weights_for(c, R), EngineOptions{false, 2}, 0);
  EXPECT_EQ(fq->device(), LayerDevice::kCuda);
  fq->configure(apply_recipe(parse_recipe_text(yaml, "test.yaml"), fq->quantizer_names()));
  const Problem p = make_problem(c, R, T, 95, 3);
  DeviceProblem dp(p, T), dq(p, T), ds(p, T);
  const auto want = run(*l.fq, dp);
  fq->forward(dq.batches(), nullptr);
  fq->synchronize(nullptr);
  const auto routed = dq.outputs();
  for (int64_t r = 0; r < R; ++r)
    EXPECT_TRUE(test::bytes_equal(want[size_t(r)].data(), routed[size_t(r)].data(), routed[size_t(r)].size(), 2))
        << "rank " << r;
  EXPECT_TRUE(fq->layout_checked(0) && fq->layout_checked(1));

  std::vector<cuda::DeviceBuffer<bf16>> shared;
  std::vector<bf16*> shared_ptrs;
  for (int64_t r = 0; r < R; ++r) shared_ptrs.push_back(shared.emplace_back(size_t(T * H)).get());
  fq->forward_with_shared(ds.batches(), shared_ptrs, nullptr);
  fq->synchronize(nullptr);
  const auto whole = ds.outputs();
  for (int64_t r = 0; r < R; ++r) {
    const std::vector<bf16> sh = shared[size_t(r)].download();
    const std::vector<bf16>& y = routed[size_t(r)];
    std::vector<bf16> expect(y.size());
    for (size_t i = 0; i < y.size(); ++i) expect[i].bits = bf16_round(add_rn(to_f32(y[i]), to_f32(sh[i])));
    EXPECT_TRUE(test::bytes_equal(expect.data(), whole[size_t(r)].data(), expect.size(), 2)) << "rank " << r;
  }
  EXPECT_TRUE(any_differs(whole, routed));  // the shared expert contributes
}

// add_shared on the GPU and on the CPU: the same bits for the same routed and shared rows,
// including the values at the edges of bf16 (inf, NaN, +-0, subnormals, overflow to inf), and a
// copy of routed without a shared output.
TEST(CudaFakeQuant, AddSharedIsTheSameRuleOnBothDevices) {
  SKIP_WITHOUT_GPU();
  cuda::register_cuda_backends();
  const MoeConfig c = small_config();
  const int64_t R = 1, T = 8, H = c.hidden, n = T;
  auto gpu = FakeQuantMoe::make(LayerDevice::kCuda, c, R, T, weights_for(c, R), EngineOptions{false, 2}, 0);
  auto cpu = FakeQuantMoe::make(LayerDevice::kCpu, c, R, T, weights_for(c, R), EngineOptions{false, 2}, 0);
  std::vector<bf16> a(size_t(n * H)), b(size_t(n * H));
  const uint16_t edges[] = {0x7F80, 0xFF80, 0x7FC0, 0x0000, 0x8000, 0x0001, 0x8001, 0x7F7F, 0xFF7F, 0x3F80};
  uint32_t z = 12345;
  for (size_t i = 0; i < a.size(); ++i) {
    z = z * 1664525u + 1013904223u;
    a[i].bits = i < 10 ? edges[i] : uint16_t(z >> 16);
    b[i].bits = i < 10 ? edges[9 - i] : uint16_t(z & 0xFFFF);
  }
  std::vector<bf16> want(a.size()), copy(a.size());
  cpu->add_shared(a.data(), b.data(), want.data(), n);
  cpu->add_shared(a.data(), nullptr, copy.data(), n);
  EXPECT_TRUE(test::bytes_equal(a.data(), copy.data(), a.size(), 2));
  cuda::DeviceBuffer<bf16> da(a), db(b), dout(a.size());
  gpu->add_shared(da.get(), db.get(), dout.get(), n, nullptr);
  EXPECT_TRUE(test::bytes_equal(want.data(), dout.download().data(), want.size(), 2));
  gpu->add_shared(da.get(), nullptr, dout.get(), n, nullptr);
  EXPECT_TRUE(test::bytes_equal(a.data(), dout.download().data(), a.size(), 2));
  gpu->add_shared(da.get(), db.get(), da.get(), n, nullptr);  // in place
  EXPECT_TRUE(test::bytes_equal(want.data(), da.download().data(), want.size(), 2));
}

// combine_weighting after: the GPU quantizer's output is the CPU rule's weighted re-sum of the
// QDQ'd rows the GPU engine left (bit for bit), the layout check passes, the layer facade made
// from host weights gives the same bits, and the output differs from the before mode's.
TEST(CudaFakeQuant, CombineWeightingAfterEqualsCpuRule) {
  SKIP_WITHOUT_GPU();
  cuda::register_cuda_backends();
  const MoeConfig c = small_config();
  const int64_t R = 2, T = 24;
  using Case = CombineCase;
  for (const Case& cs : {Case{kCombineNvfp4, Format::kNvfp4, 2688.0f}, Case{kCombineMxfp4, Format::kMxfp4, 0.0f},
                         Case{"$import: [moe_combine_logfmt10]\n", Format::kLogfmt10, 0.0f}})
    for (bool fused : {false, true}) {
      SCOPED_TRACE(std::string(format_name(cs.f)) + (fused ? " fused" : " unfused"));
      Layer l = make_layer(c, R, T, fused, cs.yaml, CombineWeighting::kAfter);
      EXPECT_EQ(l.fq->combine_weighting(), CombineWeighting::kAfter);
      const Problem p = make_problem(c, R, T, 60, 5);
      DeviceProblem dp(p, T);
      const auto got = run(*l.fq, dp);
      EXPECT_TRUE(l.fq->layout_checked(0) && l.fq->layout_checked(1));
      for (int64_t r = 0; r < R; ++r) {
        const auto buf = download_buffer(l.fq->engine(), r);
        const auto want = test::qdq_resum(buf.data(), l.fq->engine().layout().combine_offset(), T, fused, p, r, cs.f,
                                          cs.amax, /*weighted=*/true);
        EXPECT_TRUE(test::bytes_equal(want.data(), got[size_t(r)].data(), want.size(), 2)) << "rank " << r;
      }
      Layer before = make_layer(c, R, T, fused, cs.yaml);
      EXPECT_TRUE(any_differs(got, run(*before.fq, dp)));
      expect_finite(got);
      const std::unique_ptr<FakeQuantMoe> facade = FakeQuantMoe::make(
          LayerDevice::kCuda, c, R, T, weights_for(c, R), EngineOptions{fused, 2, CombineWeighting::kAfter}, 0);
      facade->configure(apply_recipe(parse_recipe_text(cs.yaml, "test.yaml"), facade->quantizer_names()));
      DeviceProblem df(p, T);
      facade->forward(df.batches(), nullptr);
      facade->synchronize(nullptr);
      const auto facade_y = df.outputs();
      for (int64_t r = 0; r < R; ++r)
        EXPECT_TRUE(test::bytes_equal(got[size_t(r)].data(), facade_y[size_t(r)].data(), facade_y[size_t(r)].size(), 2))
            << "layer facade, rank " << r;
    }
}

TEST(CudaFakeQuant, MixedCombineWeightingFailsTheLayoutCheck) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = small_config();
  const int64_t R = 2, T = 16;
  for (const auto& [engine, quantizer] : {std::pair{CombineWeighting::kBefore, CombineWeighting::kAfter},
                                         std::pair{CombineWeighting::kAfter, CombineWeighting::kBefore}}) {
    SCOPED_TRACE(std::string("engine ") + combine_weighting_name(engine));
    Layer l = make_layer(c, R, T, true, kCombineNvfp4, engine);
    l.fq->set_combine_weighting(quantizer);
    const Problem p = make_problem(c, R, T, 65, 4);
    DeviceProblem dp(p, T);
    expect_error([&] { run(*l.fq, dp); }, ErrorKind::kFailedCheck, {"rank 0"});
    EXPECT_FALSE(l.fq->layout_checked(0));
  }
}

}  // namespace
}  // namespace moefq
