// Real ranks over NCCL (comm::NcclComm, one process per GPU) against the simulated ranks of the
// CUDA engine. Run as N ranks (`moefq launch -n N -- test_nccl_ranks`) or directly as 1 rank: each
// rank builds the simulated engine of all N ranks on its own GPU from the same seeds and checks its
// own rank bit for bit (output, dispatch lists); CUDA graph replays equal eager calls; calibrated
// amax identical on every rank and the max any rank saw; the layout check on real ranks; the MAX
// all-reduce; a barrier a peer skips fails with the timeout error naming that peer; a peer that
// never joins fails the set-up with the timeout error. Skips when this host has fewer GPUs than
// ranks.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include "comm/nccl_comm.cuh"
#include "fakequant/cuda/cuda_fake_quant.cuh"
#include "moefq/cuda_device.h"
#include "cuda/cuda_moe_test_util.h"
#include "moefq/dist_env.h"
#include "moefq/recipe.h"

namespace moefq {
namespace {

using test::DeviceProblem, test::download_buffer, test::make_problem, test::Problem, test::small_config,
    test::weights_for;

#define SKIP_WITHOUT_RANK_GPUS()                                                                           \
  SKIP_WITHOUT_GPU();                                                                                      \
  if (cuda::device_count() < rank_env().local_world_size)                                                  \
  GTEST_SKIP() << rank_env().local_world_size << " ranks on this host but " << cuda::device_count()        \
               << " GPUs are visible (one process per GPU)"

const char* const kCombineNvfp4 =
    "quant_cfg:\n  - quantizer_name: '*combine_quantizer'\n"
    "    cfg: {num_bits: e2m1, block_sizes: {-1: 16, type: dynamic, scale_bits: e4m3}, constant_amax: 2688}\n";
const char* const kDispatchFp8 =
    "quant_cfg:\n  - quantizer_name: '*dispatch_quantizer'\n    cfg: {num_bits: e4m3, constant_amax: 1000}\n";
const char* const kCalibrateBoth = "$import: [moe_dispatch_fp8, moe_combine_nvfp4]\nalgorithm: max\n";

// The communicator of the tests that leave it usable, built by the first of them and torn down
// (collectively) after the last.
std::unique_ptr<comm::NcclComm> g_comm;

comm::NcclComm& shared_comm() {
  if (!g_comm) g_comm = std::make_unique<comm::NcclComm>(rank_env());
  return *g_comm;
}

struct TearDownComm : ::testing::Environment {
  void TearDown() override { g_comm.reset(); }
};
[[maybe_unused]] const auto* const g_teardown = ::testing::AddGlobalTestEnvironment(new TearDownComm);

// Rank d's part of a call of every rank: the one-rank problem its process feeds its engine.
Problem rank_part(const Problem& p, int d) {
  Problem q;
  q.R = 1;
  q.H = p.H;
  q.K = p.K;
  q.n = {p.n[size_t(d)]};
  q.x = {p.x[size_t(d)]};
  q.idx = {p.idx[size_t(d)]};
  q.wt = {p.wt[size_t(d)]};
  return q;
}

// Entries of each local expert list of rank d (the rows its experts receive).
std::vector<int64_t> list_lengths(const Problem& p, int64_t E, int64_t d) {
  const int64_t el = E / p.R;
  std::vector<int64_t> rows(size_t(el), 0);
  for (const auto& idx : p.idx)
    for (int32_t e : idx)
      if (e >= 0 && e / el == d) ++rows[size_t(e % el)];
  return rows;
}

template <typename Fn>
std::string failure_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(int(e.kind()), int(ErrorKind::kFailedCheck)) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no moefq::Error";
  return "";
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The calls of the checks below: padding, a rank without tokens, a rank of padding only, a call of
// padding only.
std::vector<Problem> problems(const MoeConfig& c, int64_t N, int64_t T) {
  std::vector<Problem> ps;
  ps.push_back(make_problem(c, N, T, 11, 5));
  Problem sparse = make_problem(c, N, T - 3, 12, 0, N - 1);
  sparse.n[0] = 0;
  sparse.x[0].clear();
  sparse.idx[0].clear();
  sparse.wt[0].clear();
  ps.push_back(sparse);
  ps.push_back(make_problem(c, N, T, 13, 1));  // every token padding
  ps.push_back(make_problem(c, N, T, 14, 3));
  return ps;
}

TEST(NcclRanks, AllReduceMaxIsTheMaxOverEveryRank) {
  SKIP_WITHOUT_RANK_GPUS();
  comm::NcclComm& comm = shared_comm();
  const uint32_t n = uint32_t(comm.num_ranks()), d = uint32_t(comm.rank());
  cuda::DeviceBuffer<uint32_t> words(std::vector<uint32_t>{d + 1, 100 - d, 7, d == n - 1 ? 0x7f800000u : 0u});
  comm.all_reduce_max(words.get(), 4, nullptr);
  EXPECT_EQ(words.download(), (std::vector<uint32_t>{n, 100, 7, 0x7f800000u}));
}

// The same calls of every rank give each real rank the bits of its simulated twin.
TEST(NcclRanks, OutputsAreBitIdenticalToSimulatedRanks) {
  SKIP_WITHOUT_RANK_GPUS();
  comm::NcclComm& comm = shared_comm();
  const int64_t N = comm.num_ranks(), d = comm.rank(), T = 24;
  const MoeConfig c = small_config();
  for (bool fused : {true, false}) {
    SCOPED_TRACE(fused ? "fused shared expert" : "unfused shared expert");
    const auto w = weights_for(c, N);
    cuda::CudaEngine sim(c, N, T, w, {fused, 2});
    cuda::CudaEngine real(c, comm, T, w[size_t(d)], {fused, 2});
    const BufferLayout& l = real.layout();
    for (const Problem& p : problems(c, N, T)) {
      DeviceProblem all(p, T), mine(rank_part(p, int(d)), T);
      sim.forward(all.batches(), nullptr);
      real.forward(mine.batches(), nullptr);
      real.synchronize(nullptr);
      const auto want = all.outputs(), got = mine.outputs();
      EXPECT_TRUE(test::bytes_equal(want[size_t(d)], got[0])) << "output of rank " << d;
      const auto sb = download_buffer(sim, d), rb = download_buffer(real, d);
      EXPECT_TRUE(test::bytes_equal(sb.data() + l.expert_counts.offset, rb.data() + l.expert_counts.offset,
                                    l.expert_counts.bytes, 1))
          << "expert counters (reset for the next call)";
      const std::vector<int64_t> rows = list_lengths(p, c.num_experts, d);
      for (size_t le = 0; le < rows.size(); ++le) {
        const size_t off = l.expert_lists.offset + le * size_t(N * T) * 4;
        EXPECT_TRUE(test::bytes_equal(sb.data() + off, rb.data() + off, size_t(rows[le]), 4)) << "list of local expert " << le;
      }
    }
  }
}

// A captured forward (its barriers included) replayed on new inputs gives the eager results.
TEST(NcclRanks, GraphReplaysEqualEagerCalls) {
  SKIP_WITHOUT_RANK_GPUS();
  comm::NcclComm& comm = shared_comm();
  const int64_t N = comm.num_ranks(), d = comm.rank(), T = 32;
  const MoeConfig c = small_config();
  cuda::CudaEngine real(c, comm, T, weights_for(c, N)[size_t(d)], {true, 2});
  std::vector<Problem> inputs;
  for (uint64_t s = 0; s < 3; ++s) inputs.push_back(rank_part(make_problem(c, N, T, 900 + s, 4), int(d)));
  DeviceProblem dp(inputs[0], T);
  std::vector<std::vector<bf16>> eager;
  for (const Problem& p : inputs) {
    dp.load(p);
    real.forward(dp.batches(), nullptr);
    real.synchronize(nullptr);
    eager.push_back(dp.outputs()[0]);
  }
  dp.load(inputs[0]);
  const test::CapturedGraph graph([&](cudaStream_t s) { real.forward(dp.batches(), s); });
  for (int rep = 0; rep < 2; ++rep)
    for (size_t i = 0; i < inputs.size(); ++i) {
      dp.load(inputs[i]);
      graph.launch();
      real.synchronize(graph.stream());
      EXPECT_TRUE(test::bytes_equal(eager[i], dp.outputs()[0])) << "replay " << rep << " input " << i;
    }
}

// The fake-quantized layer on real ranks gives its simulated twin's bits, eagerly and in a graph.
TEST(NcclRanks, FakeQuantizedLayerMatchesSimulatedRanks) {
  SKIP_WITHOUT_RANK_GPUS();
  comm::NcclComm& comm = shared_comm();
  const int64_t N = comm.num_ranks(), d = comm.rank(), T = 24;
  const MoeConfig c = small_config();
  const auto w = weights_for(c, N);
  for (const auto& [yaml, fused] : {std::pair{kCombineNvfp4, true}, std::pair{kDispatchFp8, false}}) {
    SCOPED_TRACE(yaml);
    cuda::CudaFakeQuantMoe sim(std::make_unique<cuda::CudaEngine>(c, N, T, w, EngineOptions{fused, 2}), 0);
    cuda::CudaFakeQuantMoe real(std::make_unique<cuda::CudaEngine>(c, comm, T, w[size_t(d)], EngineOptions{fused, 2}), 0);
    for (auto* fq : {&sim, &real}) fq->configure(apply_recipe(parse_recipe_text(yaml, "test.yaml"), fq->quantizer_names()));
    const Problem p = make_problem(c, N, T, 60, 5);
    DeviceProblem all(p, T), mine(rank_part(p, int(d)), T);
    sim.forward(all.batches(), nullptr);
    sim.synchronize(nullptr);
    real.forward(mine.batches(), nullptr);  // the eager layout check of this rank's buffer
    real.synchronize(nullptr);
    const auto want = all.outputs()[size_t(d)];
    EXPECT_TRUE(test::bytes_equal(want, mine.outputs()[0])) << "eager output of rank " << d;
    const test::CapturedGraph graph([&](cudaStream_t s) { real.forward(mine.batches(), s); });
    for (int rep = 0; rep < 2; ++rep) {
      mine.load(rank_part(p, int(d)));
      graph.launch();
      real.synchronize(graph.stream());
      EXPECT_TRUE(test::bytes_equal(want, mine.outputs()[0])) << "replay " << rep;
    }
  }
}

// docs/fake_quant.md: the calibrated amax equals the largest |value| any rank saw, on every rank, also
// on a rank that saw none (rank 0 gets padding only when there are peers).
TEST(NcclRanks, CalibratedAmaxIsTheMaxOverEveryRank) {
  SKIP_WITHOUT_RANK_GPUS();
  comm::NcclComm& comm = shared_comm();
  const int64_t N = comm.num_ranks(), d = comm.rank(), T = 16, K = 4;
  const MoeConfig c = small_config(16, K, 1);
  const auto w = weights_for(c, N);
  cuda::CudaFakeQuantMoe sim(std::make_unique<cuda::CudaEngine>(c, N, T, w, EngineOptions{false, 2}), 0);
  cuda::CudaFakeQuantMoe real(std::make_unique<cuda::CudaEngine>(c, comm, T, w[size_t(d)], EngineOptions{false, 2}), 0);
  for (auto* fq : {&sim, &real}) {
    fq->configure(apply_recipe(parse_recipe_text(kCalibrateBoth, "test.yaml"), fq->quantizer_names()));
    fq->start_calibration();
  }
  float want_dispatch = 0.0f;
  for (uint64_t b = 0; b < 2; ++b) {
    Problem p = make_problem(c, N, T, 80 + b, 3, N > 1 ? 0 : -1);
    for (bf16& v : p.x[size_t(N - 1)]) v.bits = bf16_round(4.0f * to_f32(v));  // the last rank holds the max
    for (int64_t r = 0; r < N; ++r)
      for (int64_t t = 0; t < T; ++t) {
        bool active = false;
        for (int64_t k = 0; k < K; ++k) active |= p.idx[size_t(r)][size_t(t * K + k)] >= 0;
        if (active) want_dispatch = std::max(want_dispatch, amax_ref(p.x[size_t(r)].data() + t * c.hidden, c.hidden));
      }
    DeviceProblem all(p, T), mine(rank_part(p, int(d)), T);
    sim.forward(all.batches(), nullptr);
    sim.synchronize(nullptr);
    real.forward(mine.batches(), nullptr);
    real.synchronize(nullptr);
  }
  sim.finish_calibration();
  real.finish_calibration();
  const uint32_t dispatch_bits = f32_bits(*real.quantizers().dispatch(0).amax());
  const uint32_t combine_bits = f32_bits(*real.quantizers().combine(0).amax());
  EXPECT_EQ(dispatch_bits, f32_bits(want_dispatch));
  EXPECT_EQ(combine_bits, f32_bits(*sim.quantizers().combine(0).amax())) << "the simulated ranks' MAX";
  // Identical on every rank: each publishes its values and compares them with everyone's.
  const RankEnv env = rank_env();
  rendezvous_publish(env, "amax." + std::to_string(d),
                     {uint8_t(dispatch_bits), uint8_t(dispatch_bits >> 8), uint8_t(dispatch_bits >> 16),
                      uint8_t(dispatch_bits >> 24), uint8_t(combine_bits), uint8_t(combine_bits >> 8),
                      uint8_t(combine_bits >> 16), uint8_t(combine_bits >> 24)});
  for (int64_t r = 0; r < N; ++r) {
    const std::vector<uint8_t> theirs = rendezvous_fetch(env, "amax." + std::to_string(r), std::chrono::seconds(60));
    ASSERT_EQ(theirs.size(), 8u);
    uint32_t dv = 0, cv = 0;
    std::memcpy(&dv, theirs.data(), 4);
    std::memcpy(&cv, theirs.data() + 4, 4);
    EXPECT_EQ(dv, dispatch_bits) << "dispatch amax of rank " << r;
    EXPECT_EQ(cv, combine_bits) << "combine amax of rank " << r;
  }
}

// The debug switch zeroes each real rank's buffer after the call: its layout check must fail.
TEST(NcclRanks, LayoutCheckCatchesTheDebugSwitch) {
  SKIP_WITHOUT_RANK_GPUS();
  comm::NcclComm& comm = shared_comm();
  const int64_t N = comm.num_ranks(), d = comm.rank(), T = 16;
  const MoeConfig c = small_config();
  ::setenv("MOEFQ_COMM_KERNEL_DEBUG", "1", 1);
  cuda::CudaFakeQuantMoe fq(std::make_unique<cuda::CudaEngine>(c, comm, T, weights_for(c, N)[size_t(d)], EngineOptions{true, 2}), 0);
  ::unsetenv("MOEFQ_COMM_KERNEL_DEBUG");
  fq.configure(apply_recipe(parse_recipe_text(kCombineNvfp4, "test.yaml"), fq.quantizer_names()));
  DeviceProblem dp(rank_part(make_problem(c, N, T, 70), int(d)), T);
  const std::string e = failure_of([&] { fq.forward(dp.batches(), nullptr); });
  EXPECT_TRUE(contains(e, "layout check failed on the buffer of rank " + std::to_string(d))) << e;
}

// A rank that skips a barrier makes every other rank fail with the error that names it, within
// the barrier timeout; afterwards their communicator refuses work.
TEST(NcclRanks, BarrierTimeoutNamesTheRankThatSkippedIt) {
  SKIP_WITHOUT_RANK_GPUS();
  const RankEnv env = rank_env();
  if (env.world_size < 2) GTEST_SKIP() << "needs a peer: run under moefq launch -n 2 or more";
  comm::CommOptions o;
  o.timeout = std::chrono::seconds(20);
  o.barrier_timeout = std::chrono::seconds(2);
  o.id_key = "nccl_id.barrier_timeout";
  comm::NcclComm comm(env, o);
  if (env.rank == 0) {
    // Skips the barrier, then reads what the others reported.
    for (int r = 1; r < env.world_size; ++r) {
      const auto blob = rendezvous_fetch(env, "barrier_timeout." + std::to_string(r), std::chrono::seconds(60));
      const std::string e(blob.begin(), blob.end());
      EXPECT_TRUE(contains(e, "rank " + std::to_string(r) + ": device barrier 'test barrier'")) << e;
      EXPECT_TRUE(contains(e, "timed out after 2 s waiting for rank 0")) << e;
    }
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  comm.barrier("test barrier", nullptr);
  MOEFQ_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  const std::string e = failure_of([&] { comm.check(); });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(waited, 2.0);
  EXPECT_LT(waited, 15.0) << "the barrier waited far past its timeout";
  rendezvous_publish(env, "barrier_timeout." + std::to_string(env.rank), std::vector<uint8_t>(e.begin(), e.end()));
  EXPECT_TRUE(contains(failure_of([&] { comm.barrier("test barrier", nullptr); }), "unusable"));
}

// A peer that never joins: the set-up gives up after the timeout with an error, instead of hanging.
TEST(NcclRanks, SetUpTimesOutWhenAPeerNeverJoins) {
  SKIP_WITHOUT_RANK_GPUS();
  char dir[] = "/tmp/moefq_nccl_test_XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  RankEnv root, me;
  root.world_size = me.world_size = me.local_world_size = root.local_world_size = 2;
  me.rank = 1;
  me.local_rank = rank_env().local_rank;
  root.rendezvous = me.rendezvous = dir;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  rendezvous_publish(root, "nccl_id", std::vector<uint8_t>(id.internal, id.internal + sizeof id.internal));
  comm::CommOptions o;
  o.timeout = std::chrono::seconds(3);
  const auto start = std::chrono::steady_clock::now();
  const std::string e = failure_of([&] { comm::NcclComm never(me, o); });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(contains(e, "rank 1: NCCL communicator not ready after 3 s; a peer rank died or hung")) << e;
  EXPECT_LT(waited, 30.0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace moefq
