// The synthetic model generated on the GPU equals the CPU generator byte for byte: expert weights
// (codes and block scales, super experts' boosted rows and columns included) written into an
// engine's weight sets, and activations (sink tokens included).
#include <gtest/gtest.h>

#include "cuda_base/cuda_check.h"
#include "engine/cuda/cuda_engine.cuh"
#include "engine/cuda/synthetic_kernels.cuh"
#include "gpu_test.h"
#include "moefq/synthetic.h"
#include "test_util.h"

namespace moefq {
namespace {

using test::bytes_equal;

MoeConfig config() {
  MoeConfig c = preset("tiny");
  c.num_experts = 8;
  c.n_group = 1;
  c.topk_group = 1;
  c.top_k = 4;
  return c;
}

template <typename T>
std::vector<T> download(const T* p, size_t n) {
  std::vector<T> h(n);
  MOEFQ_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

TEST(SyntheticCuda, ExpertWeightsEqualTheCpuGenerator) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = config();
  const int64_t H = c.hidden, I = c.intermediate;
  for (const bool early : {true, false}) {
    const SyntheticLayer L = synthetic_layer(c, 77, SyntheticKind::kModel, early);
    ASSERT_EQ(L.super_experts.empty(), !early);
    const LayerWeights cpu = synthetic_layer_weights(L, c, WeightFormat::kE4m3, 0, c.num_experts);
    const cuda::DeviceSyntheticLayer dev(L, c);
    const int64_t n = c.num_experts;
    cuda::DeviceBuffer<uint8_t> gu(size_t(n * 2 * I * H)), dn(size_t(n * H * I)), sgu(size_t(2 * I * H)), sdn(size_t(H * I));
    cuda::DeviceBuffer<float> gus(size_t(n * (2 * I / 128) * (H / 128))), dns(size_t(n * (H / 128) * (I / 128)));
    cuda::DeviceBuffer<float> sgus(size_t((2 * I / 128) * (H / 128))), sdns(size_t((H / 128) * (I / 128)));
    dev.generate_experts(0, false, {gu.get(), gus.get(), dn.get(), dns.get(), n, I}, nullptr);
    dev.generate_experts(0, true, {sgu.get(), sgus.get(), sdn.get(), sdns.get(), 1, I}, nullptr);
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    const auto gu_h = gu.download(), dn_h = dn.download();
    const auto gus_h = gus.download(), dns_h = dns.download();
    for (int64_t e = 0; e < n; ++e) {
      SCOPED_TRACE("expert " + std::to_string(e));
      const ExpertWeights& w = cpu.experts[size_t(e)];
      EXPECT_TRUE(bytes_equal(w.gate_up_e4m3.data(), gu_h.data() + e * 2 * I * H, w.gate_up_e4m3.size(), 1));
      EXPECT_TRUE(bytes_equal(w.down_e4m3.data(), dn_h.data() + e * H * I, w.down_e4m3.size(), 1));
      EXPECT_TRUE(bytes_equal(w.gate_up_scale.data(), gus_h.data() + e * w.gate_up_scale.size(), w.gate_up_scale.size(), 4));
      EXPECT_TRUE(bytes_equal(w.down_scale.data(), dns_h.data() + e * w.down_scale.size(), w.down_scale.size(), 4));
    }
    EXPECT_TRUE(bytes_equal(cpu.shared[0].gate_up_e4m3, sgu.download()));
    EXPECT_TRUE(bytes_equal(cpu.shared[0].down_e4m3, sdn.download()));
    EXPECT_TRUE(bytes_equal(cpu.shared[0].gate_up_scale, sgus.download()));
    EXPECT_TRUE(bytes_equal(cpu.shared[0].down_scale, sdns.download()));
  }
}

TEST(SyntheticCuda, ActivationsEqualTheCpuGenerator) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = config();
  for (const SyntheticKind kind : {SyntheticKind::kModel, SyntheticKind::kGaussian}) {
    const SyntheticLayer L = synthetic_layer(c, 5, kind);
    cuda::DeviceSyntheticLayer dev(L, c);
    // A range that holds two sink tokens (0 and the next), from an offset.
    const std::vector<int64_t> sinks = L.sink_tokens(5000);
    const int64_t first = 0, n = kind == SyntheticKind::kModel ? sinks.at(1) + 7 : 300;
    cuda::DeviceBuffer<bf16> x(size_t(n * c.hidden));
    dev.generate_activations(first, n, x.get(), nullptr);
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(bytes_equal(synthetic_activations(L, first, n), x.download())) << synthetic_kind_name(kind);
    // A later window alone gives the same tokens.
    cuda::DeviceBuffer<bf16> y(size_t(10 * c.hidden));
    dev.generate_activations(n - 10, 10, y.get(), nullptr);
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_TRUE(bytes_equal(synthetic_activations(L, n - 10, 10), y.download()));
  }
}

// The engine made from device-generated weights computes what the engine made from the CPU
// generator's weights computes, bit for bit.
TEST(SyntheticCuda, EngineFromGeneratedWeightsEqualsEngineFromHostWeights) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = config();
  const int64_t R = 2, T = 32, el = c.num_experts / R, H = c.hidden, K = c.top_k;
  const SyntheticLayer L = synthetic_layer(c, 9);
  const cuda::DeviceSyntheticLayer dev(L, c);
  std::vector<LayerWeights> w;
  for (int64_t r = 0; r < R; ++r) w.push_back(synthetic_layer_weights(L, c, WeightFormat::kE4m3, r * el, el));
  cuda::CudaEngine host(c, R, T, w, EngineOptions{true, 2});
  cuda::CudaEngine gen(
      c, R, T, WeightFormat::kE4m3,
      [&](int64_t rank, const cuda::DeviceExpertSet& routed, const cuda::DeviceExpertSet& shared) {
        dev.generate_experts(rank * el, false, routed, nullptr);
        dev.generate_experts(0, true, shared, nullptr);
      },
      EngineOptions{true, 2});
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<bf16> x = synthetic_activations(L, 0, R * T);
  cuda::DeviceBuffer<bf16> dx(x), y1(size_t(R * T * H)), y2(size_t(R * T * H));
  std::vector<int32_t> idx(size_t(R * T * K));
  std::vector<float> wt(idx.size());
  for (size_t t = 0; t < idx.size() / size_t(K); ++t)  // distinct experts per token
    for (int64_t k = 0; k < K; ++k) {
      idx[t * size_t(K) + size_t(k)] = int32_t((t + size_t(k) * 2) % size_t(c.num_experts));
      wt[t * size_t(K) + size_t(k)] = 0.25f;
    }
  cuda::DeviceBuffer<int32_t> didx(idx);
  cuda::DeviceBuffer<float> dwt(wt);
  for (auto* e : {&host, &gen}) {
    cuda::DeviceBuffer<bf16>& y = e == &host ? y1 : y2;
    std::vector<cuda::DeviceBatch> b;
    for (int64_t r = 0; r < R; ++r)
      b.push_back({dx.get() + r * T * H, T, didx.get() + r * T * K, dwt.get() + r * T * K, y.get() + r * T * H});
    e->forward(b, nullptr);
  }
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(bytes_equal(y1.download(), y2.download()));
}

}  // namespace
}  // namespace moefq
