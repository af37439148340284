// The CUDA engine with staging none (bf16 activations into the expert GEMMs) against the CPU
// engine with the same staging, as tests/cuda/test_cuda_engine.cu checks e4m3 staging: the staged
// bf16 rows, the expert lists and the pooled rows bit for bit; the layer output within the GEMMs'
// tolerance, for bf16 weights and for e4m3 weights (used dequantized); the combine bit-exact
// against a re-sum of the GPU's own rows; graph replays and chained launches bit-identical to
// eager ones; the shared expert on its own.
#include <gtest/gtest.h>

#include <cstdlib>

#include "moefq/qdq.h"
#include "cuda_moe_test_util.h"
#include "moefq/cpu_engine.h"
#include "moefq/metrics.h"

namespace moefq {
namespace {

using test::DeviceProblem, test::download_buffer, test::make_problem, test::Problem, test::small_config,
    test::weights_for;

// docs/engine_cuda.md's layer tolerance (the GEMMs' accumulation order only).
constexpr double kLayerTolerance = 1e-2;

EngineOptions none_options(bool fused, CombineWeighting w = CombineWeighting::kBefore) {
  EngineOptions o;
  o.fuse_shared = fused;
  o.num_threads = 2;
  o.combine_weighting = w;
  o.staging = Staging::kNone;
  return o;
}

TEST(CudaEngineStagingNone, StagedAndPooledRowsAreBitExactAgainstCpu) {
  SKIP_WITHOUT_GPU();
  for (const int64_t R : {1, 2, 4}) {
    const int64_t T = 40, n = 37;
    const MoeConfig c = small_config();
    const Problem p = make_problem(c, R, n, 20 + uint64_t(R), 5);
    const auto w = weights_for(c, R, WeightFormat::kBf16);
    CpuEngine cpu(c, R, T, w, none_options(true));
    cuda::CudaEngine gpu(c, R, T, w, none_options(true));
    ASSERT_EQ(gpu.layout().total_bytes(), cpu.layout().total_bytes());
    test::host_forward(cpu, p);
    DeviceProblem dp(p, T);
    gpu.forward(dp.batches(), nullptr);
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    const BufferLayout& l = gpu.layout();
    const int64_t H = c.hidden, K = c.top_k, el = c.num_experts / R;
    for (int64_t r = 0; r < R; ++r) {
      SCOPED_TRACE("R " + std::to_string(R) + " rank " + std::to_string(r));
      const std::vector<uint8_t> g = download_buffer(gpu, r);
      const auto cb = cpu.buffer(r);
      const auto same = [&](const Region& reg, size_t bytes, const char* what) {
        EXPECT_TRUE(test::bytes_equal(cb.data() + reg.offset, g.data() + reg.offset, bytes, 1)) << what;
      };
      same(l.staged_x, size_t(n * H * 2), "staged_x (bf16)");
      same(l.topk_idx, size_t(n * K * 4), "topk_idx");
      same(l.expert_counts, l.expert_counts.bytes, "expert_counts (reset for the next call)");
      int64_t total = 0;
      for (int64_t le = 0; le < el; ++le) {
        int64_t rows = 0;
        for (int64_t s = 0; s < p.R; ++s)
          for (int32_t e : p.idx[size_t(s)]) rows += e >= 0 && e == r * el + le;
        const size_t off = l.expert_lists.offset + size_t(le * R * T) * 4;
        EXPECT_TRUE(test::bytes_equal(cb.data() + off, g.data() + off, size_t(rows), 4)) << "list " << le;
        total += rows;
      }
      same(l.pool_x, size_t(total * H * 2), "pool_x (bf16)");
    }
  }
}

// Output within tolerance of the CPU engine, combine = re-sum of the GPU's rows, for both weight
// formats (e4m3: the bf16 x e4m3 kernels), fused and unfused, with a SwiGLU clamp, and with the
// router weight applied after the combine.
void expect_close_to_cpu(const MoeConfig& c, WeightFormat f, bool fused, CombineWeighting weighting) {
  const int64_t R = 2, T = 64;
  const Problem p = make_problem(c, R, 61, 77, 6);
  const auto w = weights_for(c, R, f);
  CpuEngine cpu(c, R, T, w, none_options(fused, weighting));
  cuda::CudaEngine gpu(c, R, T, w, none_options(fused, weighting));
  const auto want = test::host_forward(cpu, p);
  DeviceProblem dp(p, T);
  gpu.forward(dp.batches(), nullptr);
  const auto got = dp.outputs();
  const bool after = weighting == CombineWeighting::kAfter;
  for (int64_t r = 0; r < R; ++r) {
    const ErrorMetrics m = compute_metrics(got[size_t(r)].data(), want[size_t(r)].data(), int64_t(want[size_t(r)].size()));
    std::printf("[ measured ] staging none, %s weights, fused %d, %s, rank %ld: rel_l2 %.3g cosine %.9f\n",
                weight_format_name(f), int(fused), after ? "after" : "before", long(r), m.rel_l2, m.cosine);
    EXPECT_LT(m.rel_l2, kLayerTolerance) << "rank " << r;
    EXPECT_GT(m.cosine, 0.99999) << "rank " << r;
    const auto buf = download_buffer(gpu, r);
    const auto resum = after ? test::qdq_resum(buf.data(), gpu.layout().combine_offset(), T, fused, p, r, std::nullopt,
                                               0.0f, /*weighted=*/true)
                             : test::resum_rows(gpu.layout(), buf, p, r, fused);
    EXPECT_TRUE(test::bytes_equal(resum.data(), got[size_t(r)].data(), resum.size(), 2)) << "combine of rank " << r;
  }
}

TEST(CudaEngineStagingNone, OutputMatchesCpuWithinTolerance) {
  SKIP_WITHOUT_GPU();
  MoeConfig clamped = small_config(16, 4, 2);
  clamped.swiglu_clamp = 10.0f;
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kE4m3}) {
    expect_close_to_cpu(small_config(), f, true, CombineWeighting::kBefore);
    expect_close_to_cpu(small_config(), f, false, CombineWeighting::kBefore);
    expect_close_to_cpu(clamped, f, true, CombineWeighting::kBefore);
    expect_close_to_cpu(small_config(), f, true, CombineWeighting::kAfter);
  }
}

// Enough rows for the automatic choice of 128-row GEMM tiles (two consumer warpgroups): some
// 32768 routed rows over 8 experts, more 128-row tiles than an H100 or H200 has SMs.
TEST(CudaEngineStagingNone, LargeBatchMatchesCpuWithinTolerance) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = small_config(8, 4, 1);
  const int64_t R = 1, T = 8192;
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kE4m3}) {
    const Problem p = make_problem(c, R, T, 55, 0);
    const auto w = weights_for(c, R, f);
    CpuEngine cpu(c, R, T, w, none_options(true));
    cuda::CudaEngine gpu(c, R, T, w, none_options(true));
    const auto want = test::host_forward(cpu, p);
    DeviceProblem dp(p, T);
    gpu.forward(dp.batches(), nullptr);
    const auto got = dp.outputs();
    const ErrorMetrics m = compute_metrics(got[0].data(), want[0].data(), int64_t(want[0].size()));
    std::printf("[ measured ] staging none, %s weights, %ld tokens: rel_l2 %.3g\n", weight_format_name(f), long(T),
                m.rel_l2);
    EXPECT_LT(m.rel_l2, kLayerTolerance) << weight_format_name(f);
  }
}

// The shared expert run on its own (bf16 x read in place) against the CPU's, and the fused slot.
TEST(CudaEngineStagingNone, UnfusedSharedExpertMatchesCpu) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = small_config();
  const int64_t T = 50;
  const Problem p = make_problem(c, 1, T, 91, 0);
  for (WeightFormat f : {WeightFormat::kBf16, WeightFormat::kE4m3}) {
    const auto w = weights_for(c, 1, f);
    CpuEngine cpu(c, 1, T, w, none_options(false));
    cuda::CudaEngine gpu(c, 1, T, w, none_options(false));
    std::vector<bf16> want(size_t(T * c.hidden));
    cpu.shared_expert(0, p.x[0].data(), T, want.data());
    DeviceProblem dp(p, T);
    cuda::DeviceBuffer<bf16> ys(size_t(T * c.hidden));
    gpu.shared_expert(0, dp.x[0].get(), T, ys.get(), nullptr);
    const auto got = ys.download();
    const ErrorMetrics m = compute_metrics(got.data(), want.data(), int64_t(want.size()));
    EXPECT_LT(m.rel_l2, kLayerTolerance) << weight_format_name(f);
  }
}

// Eager calls repeat bit for bit; a captured graph (no host synchronisation inside a forward)
// replays them on new inputs; chained launches (PDL) give the serialised bits, shared expert on
// its own included.
TEST(CudaEngineStagingNone, GraphReplaysAndChainedLaunchesAreBitIdentical) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = small_config();
  const int64_t R = 2, T = 48;
  cuda::CudaEngine gpu(c, R, T, weights_for(c, R, WeightFormat::kBf16), none_options(false));
  std::vector<Problem> inputs;
  for (uint64_t s = 0; s < 3; ++s) inputs.push_back(make_problem(c, R, T, 700 + s, 4));
  DeviceProblem dp(inputs[0], T);
  cuda::DeviceBuffer<bf16> ys(size_t(T * c.hidden));
  const auto run = [&](cudaStream_t s) {
    gpu.forward(dp.batches(), s);
    gpu.shared_expert(1, dp.x[1].get(), T, ys.get(), s);
  };
  std::vector<std::vector<std::vector<bf16>>> eager;
  std::vector<std::vector<bf16>> eager_shared;
  ::setenv("MOEFQ_PDL", "0", 1);
  for (const Problem& p : inputs) {
    dp.load(p);
    run(nullptr);
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    eager.push_back(dp.outputs());
    eager_shared.push_back(ys.download());
  }
  ::unsetenv("MOEFQ_PDL");
  dp.load(inputs[0]);
  const test::CapturedGraph graph(run);
  for (int rep = 0; rep < 2; ++rep)
    for (size_t i = 0; i < inputs.size(); ++i) {
      dp.load(inputs[i]);
      graph.launch();
      MOEFQ_CUDA_CHECK(cudaStreamSynchronize(graph.stream()));
      const auto got = dp.outputs();
      for (int64_t r = 0; r < R; ++r)
        EXPECT_TRUE(test::bytes_equal(eager[i][size_t(r)].data(), got[size_t(r)].data(), got[size_t(r)].size(), 2))
            << "replay " << rep << " input " << i << " rank " << r;
      const auto s = ys.download();
      EXPECT_TRUE(test::bytes_equal(eager_shared[i].data(), s.data(), s.size(), 2)) << "shared expert, input " << i;
    }
}

}  // namespace
}  // namespace moefq
