// The CUDA router against the CPU router (route(), the oracle), byte for byte: expert ids and
// weight bits, for every preset's routing rule and every scoring function, with padding, exact
// ties (duplicate gate rows), NaN and inf in x, num_tokens = 0, 1, 7, 300 and 4096, and inside a
// CUDA graph replayed with new inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "moefq/qdq.h"
#include "gpu_test.h"
#include "engine/cuda/router_kernels.cuh"
#include "moefq/errors.h"
#include "moefq/moe_config.h"
#include "moefq/router.h"
#include "router_test_util.h"
#include "test_util.h"

namespace moefq {
namespace {

using cuda::DeviceBuffer;
using test::router_config;

// Router inputs of one call. pad: [T] 0/1.
struct Inputs {
  std::vector<bf16> x;      // [T, H]
  std::vector<float> gate;  // [E, H]
  std::vector<float> bias;  // [E]
  std::vector<uint8_t> pad;
};

// x ~ N(0, 1) in bf16, gate ~ N(0, 1/H) so logits are ~N(0, 1) (no score saturates); bias on the
// scale of the scores' spread (softmax scores are ~1/E); every 5th token padding.
Inputs random_inputs(const MoeConfig& c, int64_t T, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const float gscale = 1.0f / std::sqrt(float(c.hidden));
  const float brange = c.scoring == ScoringFunc::kSoftmax ? 0.5f / float(c.num_experts) : 0.1f;
  std::uniform_real_distribution<float> bu(-brange, brange);
  Inputs in;
  in.x.resize(size_t(T * c.hidden));
  for (bf16& v : in.x) v.bits = bf16_round(n(rng));
  in.gate.resize(size_t(c.num_experts * c.hidden));
  for (float& v : in.gate) v = n(rng) * gscale;
  in.bias.resize(size_t(c.num_experts));
  for (float& v : in.bias) v = bu(rng);
  in.pad.resize(size_t(T));
  for (int64_t t = 0; t < T; ++t) in.pad[size_t(t)] = t % 5 == 3 ? 1 : 0;
  return in;
}

Routing cpu_route(const MoeConfig& c, const Inputs& in, int64_t T, bool use_pad) {
  std::vector<bool> pad;
  if (use_pad) pad.assign(in.pad.begin(), in.pad.end());
  return route(c, in.x.data(), T, in.gate, in.bias, pad);
}

struct GpuRouting {
  std::vector<int32_t> idx;
  std::vector<float> w;
};

// Uploads, routes on the GPU (workspace and outputs poisoned first: nothing may depend on their
// old contents and every slot must be written), downloads.
GpuRouting gpu_route(const MoeConfig& c, const Inputs& in, int64_t T, bool use_pad) {
  const DeviceBuffer<bf16> x(in.x);
  const DeviceBuffer<float> gate(in.gate), bias(in.bias);
  const DeviceBuffer<uint8_t> pad(in.pad);
  DeviceBuffer<uint8_t> ws(cuda::route_workspace_bytes(c, T));
  DeviceBuffer<int32_t> idx(size_t(T * c.top_k));
  DeviceBuffer<float> w(size_t(T * c.top_k));
  if (ws.bytes()) MOEFQ_CUDA_CHECK(cudaMemset(ws.get(), 0xFF, ws.bytes()));  // NaN everywhere
  if (idx.bytes()) MOEFQ_CUDA_CHECK(cudaMemset(idx.get(), 0x5A, idx.bytes()));
  if (w.bytes()) MOEFQ_CUDA_CHECK(cudaMemset(w.get(), 0x5A, w.bytes()));
  cuda::launch_route(c, x.get(), T, gate.get(), bias.get(), use_pad ? pad.get() : nullptr, ws.get(), idx.get(),
                     w.get(), nullptr);
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  return {idx.download(), w.download()};
}

// Ids and weight bits equal; reports the first differing slot.
void expect_same(const Routing& cpu, const GpuRouting& gpu, const std::string& what) {
  EXPECT_TRUE(test::bytes_equal(cpu.topk_idx, gpu.idx)) << what << ": topk_idx";
  EXPECT_TRUE(test::bytes_equal(cpu.topk_weights, gpu.w)) << what << ": topk_weights";
}

void check_case(const MoeConfig& c, const Inputs& in, int64_t T, bool use_pad, const std::string& what) {
  SCOPED_TRACE(what);
  expect_same(cpu_route(c, in, T, use_pad), gpu_route(c, in, T, use_pad), what);
}

TEST(CudaRouter, EveryPresetMatchesTheCpuRouter) {
  SKIP_WITHOUT_GPU();
  // deepseek-v3 (sigmoid, noaux_tc, 8 groups / top-4), deepseek-v4-flash and -pro (sqrtsoftplus),
  // kimi-k2 (384 experts, one group), kimi-k3 (896 experts, K = 16), glm-4.5 and -air, the softmax
  // architectures (qwen3 top-8 renormalised, mixtral top-2 of 8, olmoe not renormalised), tiny; at
  // full H.
  for (const std::string& name : preset_names()) {
    const MoeConfig c = preset(name);
    for (int64_t T : {1, 7, 300}) {
      const Inputs in = random_inputs(c, T, 1000 + uint64_t(T));
      check_case(c, in, T, /*use_pad=*/T > 1, name + " T=" + std::to_string(T));
    }
  }
  // The same shapes with softmax scoring (and the DeepSeek-V2 group rule: the group's max).
  for (const char* name : {"deepseek-v3", "tiny"}) {
    MoeConfig c = preset(name);
    c.scoring = ScoringFunc::kSoftmax;
    c.noaux_tc = false;
    const Inputs in = random_inputs(c, 300, 7);
    check_case(c, in, 300, true, std::string(name) + " softmax");
  }
}

TEST(CudaRouter, EveryRuleCombinationMatchesTheCpuRouter) {
  SKIP_WITHOUT_GPU();
  // E = 64 (whole expert tiles) and E = 40 (a partial tile), every scoring function, with and
  // without groups, noaux_tc and normalisation.
  for (int64_t E : {64, 40})
    for (ScoringFunc s : {ScoringFunc::kSigmoid, ScoringFunc::kSoftmax, ScoringFunc::kSqrtSoftplus})
      for (auto [g, tg] : {std::pair<int64_t, int64_t>{1, 1}, {8, 3}, {4, 1}})
        for (bool noaux : {false, true})
          for (bool norm : {false, true}) {
            const MoeConfig c = router_config(E, 256, 6, s, g, tg, noaux, norm, 2.5f);
            const Inputs in = random_inputs(c, 7, 55);
            check_case(c, in, 7, true,
                       std::string(scoring_name(s)) + " E=" + std::to_string(E) + " g=" + std::to_string(g) +
                           " tg=" + std::to_string(tg) + (noaux ? " noaux" : "") + (norm ? " norm" : ""));
          }
}

TEST(CudaRouter, ExactTiesGoToTheLowerIdOnBothSides) {
  SKIP_WITHOUT_GPU();
  // Duplicate gate rows give bit-equal logits: experts 8..15 copy 0..7 (group 1 = group 0, so the
  // group scores tie too), and within group 2 every expert copies expert 16.
  for (ScoringFunc s : {ScoringFunc::kSigmoid, ScoringFunc::kSoftmax, ScoringFunc::kSqrtSoftplus}) {
    const MoeConfig c = router_config(32, 512, 8, s, 4, 2, true, true, 2.5f);
    Inputs in = random_inputs(c, 300, 99);
    const int64_t H = c.hidden;
    for (int64_t e = 8; e < 16; ++e)
      std::copy_n(in.gate.begin() + (e - 8) * H, H, in.gate.begin() + e * H);
    for (int64_t e = 17; e < 24; ++e) std::copy_n(in.gate.begin() + 16 * H, H, in.gate.begin() + e * H);
    std::fill(in.bias.begin(), in.bias.end(), 0.0f);
    const Routing cpu = cpu_route(c, in, 300, true);
    // The test bites: some tokens hold tied weights in adjacent slots.
    int64_t tied = 0;
    for (size_t i = 0; i + 1 < cpu.topk_weights.size(); ++i)
      tied += (i + 1) % size_t(c.top_k) != 0 && cpu.topk_idx[i] >= 0 && cpu.topk_weights[i] == cpu.topk_weights[i + 1];
    EXPECT_GT(tied, 100) << scoring_name(s);
    expect_same(cpu, gpu_route(c, in, 300, true), scoring_name(s));
  }
  // A zero gate: every logit is +0, every score ties; ids 0..K-1 of the lowest groups.
  const MoeConfig c = preset("tiny");
  Inputs in = random_inputs(c, 7, 3);
  std::fill(in.gate.begin(), in.gate.end(), 0.0f);
  std::fill(in.bias.begin(), in.bias.end(), 0.0f);
  const GpuRouting gpu = gpu_route(c, in, 7, false);
  for (int64_t k = 0; k < c.top_k; ++k) EXPECT_EQ(gpu.idx[size_t(k)], int32_t(k));
  expect_same(cpu_route(c, in, 7, false), gpu, "zero gate");
}

TEST(CudaRouter, NanAndInfInXMatchTheCpuRouter) {
  SKIP_WITHOUT_GPU();
  for (ScoringFunc s : {ScoringFunc::kSigmoid, ScoringFunc::kSoftmax, ScoringFunc::kSqrtSoftplus}) {
    for (int64_t groups : {1, 4}) {
      const MoeConfig c = router_config(64, 384, 8, s, groups, groups > 1 ? 2 : 1, true, true, 1.5f);
      const int64_t T = 300, H = c.hidden;
      Inputs in = random_inputs(c, T, 17);
      const uint16_t kNan = kCanonicalNanBf16, kInf = 0x7F80, kNegInf = 0xFF80, kNegNan = 0xFFC1;
      for (int64_t t = 0; t < T; ++t) {
        bf16* row = in.x.data() + t * H;
        switch (t % 8) {
          case 0: row[t % H].bits = kNan; break;                              // one NaN: every logit NaN
          case 1: row[(t * 7) % H].bits = kInf; break;                        // +-inf logits, NaN where g = 0
          case 2: row[(t * 5) % H].bits = kNegInf; break;
          case 3: row[1].bits = kInf; row[2].bits = kNegInf; break;           // inf - inf in a lane sum
          case 4: for (int64_t h = 0; h < H; ++h) row[h].bits = bf16_round(to_f32(row[h]) * 1e30f); break;  // saturated scores
          case 5: for (int64_t h = 0; h < H; ++h) row[h].bits = bf16_round(to_f32(row[h]) * 1e-38f); break;  // subnormal products
          case 6: row[3].bits = kNegNan; break;
          default: break;
        }
      }
      check_case(c, in, T, false, std::string(scoring_name(s)) + " groups " + std::to_string(groups));
    }
  }
  // A NaN in the gate and in the bias.
  const MoeConfig c = preset("tiny");
  Inputs in = random_inputs(c, 7, 4);
  in.gate[5 * size_t(c.hidden) + 9] = NAN;
  in.bias[11] = NAN;
  check_case(c, in, 7, true, "NaN gate and bias");
}

TEST(CudaRouter, ZeroTokensLaunchNothing) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = preset("tiny");
  EXPECT_EQ(cuda::route_workspace_bytes(c, 0), 0u);
  EXPECT_NO_THROW(cuda::launch_route(c, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr));
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST(CudaRouter, BadPointersAreRejected) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = preset("tiny");
  const Inputs in = random_inputs(c, 7, 5);
  DeviceBuffer<bf16> x(in.x);
  DeviceBuffer<float> gate(in.gate);
  DeviceBuffer<uint8_t> ws(cuda::route_workspace_bytes(c, 7));
  DeviceBuffer<int32_t> idx(size_t(7 * c.top_k));
  DeviceBuffer<float> w(size_t(7 * c.top_k));
  // x one element off 16-byte alignment (6 tokens from the second element).
  EXPECT_THROW(cuda::launch_route(c, x.get() + 1, 6, gate.get(), nullptr, nullptr, ws.get(), idx.get(), w.get(), nullptr),
               Error);
  EXPECT_THROW(cuda::launch_route(c, x.get(), 7, nullptr, nullptr, nullptr, ws.get(), idx.get(), w.get(), nullptr),
               Error);
  MoeConfig bad = c;
  bad.top_k = 0;
  EXPECT_THROW(cuda::launch_route(bad, x.get(), 7, gate.get(), nullptr, nullptr, ws.get(), idx.get(), w.get(), nullptr),
               Error);
}

TEST(CudaRouter, GraphCaptureReplaysWithNewInputs) {
  SKIP_WITHOUT_GPU();
  const MoeConfig c = preset("deepseek-v3");
  const int64_t T = 300, K = c.top_k;
  const Inputs a = random_inputs(c, T, 21);
  Inputs b = random_inputs(c, T, 22);
  b.gate = a.gate;  // the graph's weights stay; x and padding change
  b.bias = a.bias;
  for (int64_t t = 0; t < T; ++t) b.pad[size_t(t)] = t % 7 == 0;
  DeviceBuffer<bf16> x(a.x);
  DeviceBuffer<float> gate(a.gate), bias(a.bias);
  DeviceBuffer<uint8_t> pad(a.pad);
  DeviceBuffer<uint8_t> ws(cuda::route_workspace_bytes(c, T));
  DeviceBuffer<int32_t> idx(size_t(T * K));
  DeviceBuffer<float> w(size_t(T * K));
  cudaStream_t stream;
  MOEFQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOEFQ_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  cuda::launch_route(c, x.get(), T, gate.get(), bias.get(), pad.get(), ws.get(), idx.get(), w.get(), stream);
  MOEFQ_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOEFQ_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  size_t num_nodes = 0;
  MOEFQ_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &num_nodes));
  EXPECT_EQ(num_nodes, 2u);  // the two kernels, nothing else

  MOEFQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  expect_same(cpu_route(c, a, T, true), {idx.download(), w.download()}, "first replay");

  x.upload(b.x);
  pad.upload(b.pad);
  MOEFQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MOEFQ_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // twice: the workspace needs no reset
  MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  const Routing want_b = cpu_route(c, b, T, true);
  expect_same(want_b, {idx.download(), w.download()}, "replay with new x and padding");
  EXPECT_FALSE(test::bytes_equal(cpu_route(c, a, T, true).topk_idx, want_b.topk_idx));  // the inputs did change

  MOEFQ_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOEFQ_CUDA_CHECK(cudaGraphDestroy(graph));
  MOEFQ_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(CudaRouter, DeepSeekV3At4096Tokens) {
  SKIP_WITHOUT_GPU();
  // The full-size call, its first and last 128 tokens checked against the CPU router (a token's
  // result does not depend on the others). Timing belongs to the benchmarks, not to this test.
  const MoeConfig c = preset("deepseek-v3");
  const int64_t T = 4096, H = c.hidden, K = c.top_k;
  const Inputs in = random_inputs(c, T, 4096);
  const DeviceBuffer<bf16> x(in.x);
  const DeviceBuffer<float> gate(in.gate), bias(in.bias);
  DeviceBuffer<uint8_t> ws(cuda::route_workspace_bytes(c, T));
  DeviceBuffer<int32_t> idx(size_t(T * K));
  DeviceBuffer<float> w(size_t(T * K));
  cuda::launch_route(c, x.get(), T, gate.get(), bias.get(), nullptr, ws.get(), idx.get(), w.get(), nullptr);
  const std::vector<int32_t> gi = idx.download();
  const std::vector<float> gw = w.download();
  for (int64_t t0 : {int64_t(0), T - 128}) {
    const Routing cpu = route(c, in.x.data() + t0 * H, 128, in.gate, in.bias);
    const GpuRouting part{{gi.begin() + t0 * K, gi.begin() + (t0 + 128) * K},
                          {gw.begin() + t0 * K, gw.begin() + (t0 + 128) * K}};
    expect_same(cpu, part, "tokens from " + std::to_string(t0));
  }
}

}  // namespace
}  // namespace moefq
