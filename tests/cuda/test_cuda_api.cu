// The public CUDA face (moefq/cuda.h, moefq/cuda_device.h) against the CPU references, byte for
// byte: qdq_device (static and dynamic amax) against qdq_ref, combine_qdq_resum against
// combine_qdq_ref (inactive slots, a shared row, router weights, every format), DeviceRouter
// against route(); and the stream and device queries: capture status, a mark another stream waits
// for, a copy to host, the device guard.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "gpu_test.h"
#include "moefq/combine_qdq.h"
#include "moefq/cuda.h"
#include "moefq/qdq.h"
#include "moefq/router.h"
#include "router_test_util.h"
#include "test_util.h"

namespace moefq {
namespace {

using cuda::DeviceBuffer;

cuda::Stream as_public(cudaStream_t s) { return static_cast<cuda::Stream>(s); }

// Keeps its stream busy for about `cycles` SM clocks: what follows it there starts late.
__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// [rows, cols] bf16 activations with outlier channels, finite (the special values' rules have
// their own suites: test_qdq_cuda, test_combine_cuda; these check what the face passes on).
std::vector<bf16> bf16_activations(int64_t rows, int64_t cols, uint64_t seed) {
  return test::to_bf16(test::activations(rows, cols, seed, false));
}

TEST(CudaApi, QdqDeviceEqualsQdqRefForEveryFormatWithStaticAndDynamicAmax) {
  SKIP_WITHOUT_GPU();
  const int64_t rows = 9, cols = 256;
  const std::vector<bf16> x = bf16_activations(rows, cols, 11);
  const float amax = amax_ref(x.data(), rows * cols);
  const DeviceBuffer<bf16> dx(x);
  for (const Format f : kAllFormats) {
    for (const bool dynamic : {false, true}) {
      SCOPED_TRACE(::testing::Message() << format_name(f) << (dynamic ? " dynamic" : " static"));
      // A dynamic call overwrites whatever amax the buffer held.
      DeviceBuffer<float> damax(std::vector<float>{dynamic ? 12345.0f : amax});
      DeviceBuffer<bf16> dy(x.size());
      cuda::qdq_device(f, DType::kBF16, dx.get(), dy.get(), rows, cols, damax.get(), dynamic, nullptr);
      MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<bf16> want(x.size());
      qdq_ref(f, x.data(), want.data(), rows, cols, amax);
      EXPECT_TRUE(test::bytes_equal(want, dy.download()));
      const float got_amax = damax.download()[0];
      EXPECT_EQ(std::memcmp(&got_amax, &amax, 4), 0) << got_amax << " vs " << amax;
    }
  }
}

TEST(CudaApi, QdqDeviceInPlaceOnFp32) {
  SKIP_WITHOUT_GPU();
  const int64_t rows = 4, cols = 256;
  const std::vector<float> x = test::activations(rows, cols, 5, false);
  const float amax = amax_ref(x.data(), rows * cols);
  for (const Format f : kAllFormats) {
    SCOPED_TRACE(format_name(f));
    DeviceBuffer<float> dx(x), damax(std::vector<float>{amax});
    cuda::qdq_device(f, DType::kF32, dx.get(), dx.get(), rows, cols, damax.get(), false, nullptr);
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> want(x.size());
    qdq_ref(f, x.data(), want.data(), rows, cols, amax);
    EXPECT_TRUE(test::bytes_equal(want, dx.download()));
  }
}

TEST(CudaApi, CombineQdqResumEqualsCombineQdqRef) {
  SKIP_WITHOUT_GPU();
  const int64_t K = 3, T = 7, H = 256;
  const std::vector<bf16> rows = bf16_activations(K * T, H, 21);
  const std::vector<bf16> shared = bf16_activations(T, H, 22);
  std::vector<int32_t> idx(size_t(T * K));
  std::vector<float> weights(size_t(T * K));
  std::mt19937 rng(3);
  for (size_t i = 0; i < idx.size(); ++i) {
    idx[i] = i % 4 == 1 ? -1 : int32_t(rng() % 64);  // every 4th slot inactive
    weights[i] = float(rng() % 1024 + 1) / 1024.0f;
  }
  float amax = 0.0f;
  for (const bf16& v : rows) amax = std::max(amax, std::fabs(to_f32(v)));
  const DeviceBuffer<bf16> drows(rows), dshared(shared);
  const DeviceBuffer<int32_t> didx(idx);
  const DeviceBuffer<float> dweights(weights), damax(std::vector<float>{amax});
  std::vector<std::optional<Format>> formats = {std::nullopt};
  for (const Format f : kAllFormats) formats.push_back(f);
  for (const std::optional<Format>& f : formats) {
    for (const bool with_shared : {false, true}) {
      for (const bool weighted : {false, true}) {
        SCOPED_TRACE(::testing::Message() << (f ? format_name(*f) : "none") << (with_shared ? " shared" : "")
                                          << (weighted ? " weighted" : ""));
        HostCombineRows h;
        h.rows = rows.data();
        h.slot_stride = T * H;
        h.top_k = K;
        h.num_tokens = T;
        h.hidden = H;
        h.topk_idx = idx.data();
        h.shared = with_shared ? shared.data() : nullptr;
        h.topk_weights = weighted ? weights.data() : nullptr;
        std::vector<bf16> want(size_t(T * H));
        combine_qdq_ref(h, f, amax, want.data());

        cuda::DeviceCombineRows d;
        d.rows = drows.get();
        d.top_k = K;
        d.num_tokens = T;
        d.hidden = H;
        d.topk_idx = didx.get();
        d.shared = with_shared ? dshared.get() : nullptr;
        d.topk_weights = weighted ? dweights.get() : nullptr;
        DeviceBuffer<bf16> dy(size_t(T * H));
        cuda::combine_qdq_resum(d, f, damax.get(), dy.get(), nullptr);
        MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
        EXPECT_TRUE(test::bytes_equal(want, dy.download()));
      }
    }
  }
}

TEST(CudaApi, DeviceRouterEqualsRoute) {
  SKIP_WITHOUT_GPU();
  // deepseek-v3's rule (sigmoid, groups, noaux_tc bias, normalised and scaled) and a softmax one.
  const MoeConfig configs[] = {test::router_config(64, 256, 8, ScoringFunc::kSigmoid, 8, 4, true, true, 2.5f),
                               test::router_config(32, 128, 4, ScoringFunc::kSoftmax, 1, 1, false, false, 1.0f)};
  for (const MoeConfig& c : configs) {
    for (const int64_t T : {int64_t(0), int64_t(1), int64_t(37)}) {
      SCOPED_TRACE(::testing::Message() << "E=" << c.num_experts << " T=" << T);
      std::mt19937_64 rng(uint64_t(T) + 7);
      std::normal_distribution<float> n(0.0f, 1.0f);
      std::vector<bf16> x(size_t(T * c.hidden));
      for (bf16& v : x) v.bits = bf16_round(n(rng));
      std::vector<float> gate(size_t(c.num_experts * c.hidden)), bias;
      for (float& v : gate) v = n(rng) / std::sqrt(float(c.hidden));
      if (c.noaux_tc) {
        bias.resize(size_t(c.num_experts));
        for (float& v : bias) v = n(rng) * 0.05f;
      }
      const Routing want = route(c, x.data(), T, gate, bias);

      const cuda::DeviceRouter router(c, gate, bias);
      DeviceBuffer<uint8_t> ws(router.workspace_bytes(T));
      const DeviceBuffer<bf16> dx(x);
      DeviceBuffer<int32_t> didx(size_t(T * c.top_k));
      DeviceBuffer<float> dw(size_t(T * c.top_k));
      router.route(dx.get(), T, ws.get(), didx.get(), dw.get(), nullptr);
      MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(test::bytes_equal(want.topk_idx, didx.download()));
      EXPECT_TRUE(test::bytes_equal(want.topk_weights, dw.download()));
    }
  }
}

TEST(CudaApi, StreamQueriesMarksAndCopies) {
  SKIP_WITHOUT_GPU();
  cudaStream_t a = nullptr, b = nullptr;
  MOEFQ_CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  MOEFQ_CUDA_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  EXPECT_FALSE(cuda::stream_capturing(as_public(a)));
  MOEFQ_CUDA_CHECK(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal));
  EXPECT_TRUE(cuda::stream_capturing(as_public(a)));
  cudaGraph_t graph = nullptr;
  MOEFQ_CUDA_CHECK(cudaStreamEndCapture(a, &graph));
  MOEFQ_CUDA_CHECK(cudaGraphDestroy(graph));
  EXPECT_FALSE(cuda::stream_capturing(as_public(a)));

  // Stream a fills a buffer after a wait of some 100 ms; b, ordered after a's mark, copies it back
  // (without the wait on the mark, b would read the zeros).
  const size_t n = size_t(1) << 20;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = float(i) * 0.5f;
  DeviceBuffer<float> src(host), dst(std::vector<float>(n, 0.0f));
  cuda::StreamMark mark;
  spin_kernel<<<1, 1, 0, a>>>(200'000'000LL);
  MOEFQ_CUDA_CHECK_LAUNCH();
  MOEFQ_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), n * 4, cudaMemcpyDeviceToDevice, a));
  mark.record(as_public(a));
  mark.wait(as_public(b));
  std::vector<float> got(n, -1.0f);
  cuda::copy_to_host(got.data(), dst.get(), n * 4, as_public(b));
  EXPECT_TRUE(test::bytes_equal(host, got));
  cuda::copy_to_host(nullptr, nullptr, 0, as_public(b));  // nothing to copy: no call
  MOEFQ_CUDA_CHECK(cudaStreamDestroy(a));
  MOEFQ_CUDA_CHECK(cudaStreamDestroy(b));
}

TEST(CudaApi, DeviceGuardRestoresTheCurrentDevice) {
  SKIP_WITHOUT_GPU();
  const int before = cuda::current_device();
  const int other = cuda::device_count() - 1;  // the last device (the same one on a 1-GPU machine)
  {
    cuda::DeviceGuard guard(other);
    EXPECT_EQ(cuda::current_device(), other);
  }
  EXPECT_EQ(cuda::current_device(), before);
  EXPECT_FALSE(cuda::device_description().empty());
}

}  // namespace
}  // namespace moefq
