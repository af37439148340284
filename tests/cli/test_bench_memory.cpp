// The GPU micro-benchmarks' memory plans (bench/bench_memory.h) on the CPU: the sizes and bytes of
// `bench gemm`, `qdq` and `combine` against hand-computed values, and the refusal of a plan that
// does not fit a GPU whose free memory the test fakes (set_device_memory_query), with eval's rule.
#include "bench/bench_memory.h"

#include <gtest/gtest.h>

#include <string>

#include "eval/layer_runner.h"
#include "moefq/buffer_layout.h"
#include "moefq/cpu_engine.h"
#include "moefq/errors.h"

namespace moefq::bench {
namespace {

constexpr int64_t kPage = int64_t(2) << 20;
constexpr int64_t kMiB = int64_t(1) << 20;

class BenchMemory : public ::testing::Test {
 protected:
  void TearDown() override { set_device_memory_query({}); }

  // A GPU with `free` bytes free (of 141 GB).
  static void fake_gpu(double free) {
    set_device_memory_query([free] { return std::pair<double, double>(free, 141e9); });
  }

  // The message of the bad-input error `f` throws ("" and a failure when it throws none).
  template <typename F>
  static std::string refusal(F&& f) {
    try {
      f();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kBadInput) << e.what();
      return e.what();
    }
    ADD_FAILURE() << "not refused";
    return "";
  }

  // The item of `plan` whose name starts with `what`.
  static MemoryItem item(const MemoryPlan& plan, const std::string& what) {
    for (const MemoryItem& m : plan.items)
      if (m.what.rfind(what, 0) == 0) return m;
    ADD_FAILURE() << "no item " << what << "\n" << plan.describe();
    return {};
  }
};

TEST_F(BenchMemory, DeviceBuffersAreCountedInWholePages) {
  EXPECT_EQ(device_allocation_bytes(0), 0);
  EXPECT_EQ(device_allocation_bytes(1), kPage);
  EXPECT_EQ(device_allocation_bytes(kPage), kPage);
  EXPECT_EQ(device_allocation_bytes(kPage + 1), 2 * kPage);
  EXPECT_EQ(copy_ceiling_device_bytes(int64_t(1) << 30), int64_t(2) << 30);
  // cuBLASLt's constant operands only where none are given; the bf16 output; 32 MiB of workspace.
  const CublasltCeilingSizes c = cublaslt_ceiling_sizes(1024, 4096, 7168, false, true, 2);
  EXPECT_EQ(c.a_const, 2 * 1024 * 7168);
  EXPECT_EQ(c.b_const, 0);
  EXPECT_EQ(c.d, 2 * 1024 * 4096);
  EXPECT_EQ(c.device_bytes(), 14 * kMiB + 16 * kMiB + 32 * kMiB);
}

// deepseek-v3's shape (H 7168, I 2048, 32 local experts, top-8) at 4096 tokens: every big buffer a
// whole number of pages, counted by hand.
TEST_F(BenchMemory, GemmPlanByHand) {
  GemmBenchOptions o;
  o.tokens = {1, 4096, 128};
  const GemmBenchSizes s = gemm_bench_sizes(o);
  EXPECT_EQ(s.max_rows, 32768);
  EXPECT_EQ(s.op_rows, 32768);  // 32 groups of 1024 rows, no padding
  EXPECT_EQ(s.gate_up, int64_t(32) * 4096 * 7168);
  EXPECT_EQ(s.down, int64_t(32) * 7168 * 2048);
  EXPECT_EQ(s.gate_up_scales, 32 * 32 * 56);
  EXPECT_EQ(s.down_scales, 32 * 56 * 16);
  EXPECT_EQ(s.x8, int64_t(32768) * 7168);
  EXPECT_EQ(s.h8, int64_t(32768) * 2048);
  EXPECT_EQ(s.x_scales, 32768 * 56);
  EXPECT_EQ(s.h_scales, 32768 * 16);
  EXPECT_EQ(s.out, int64_t(32768) * 7168);
  EXPECT_EQ(s.row_out, 32768);
  EXPECT_EQ(s.groups, 32);
  const MemoryPlan p = plan_gemm_bench_memory(o);
  // Weights 896 + 448 MiB and a page of scales each; x8 224 MiB, h8 64, x scales 7 (4 pages), h
  // scales 2, row weights 1 page; the output 448 MiB and a page of pointers; 6 pages of pointers,
  // counts and offsets.
  EXPECT_EQ(item(p, "expert weights").device_bytes, double((896 + 448) * kMiB + 2 * kPage));
  EXPECT_EQ(item(p, "activations").device_bytes, double((224 + 64) * kMiB + 6 * kPage));
  EXPECT_EQ(item(p, "output rows").device_bytes, double(448 * kMiB + kPage));
  EXPECT_EQ(item(p, "expert pointers").device_bytes, double(6 * kPage));
  // The copy ceiling's 2 x 1 GiB is more than any cuBLASLt ceiling here (the largest: the down
  // GEMM on constant operands, 64 + 14 + 448 + 32 MiB).
  EXPECT_EQ(item(p, "ceilings").device_bytes, double(int64_t(2) << 30));
  EXPECT_EQ(p.device_bytes, double(2079 * kPage));
  // The check of a gate/up row: its expert's weights as codes and fp32 (4096 x 7168 x 5 bytes);
  // the row pointers; the pointers, counts and offsets of the routing.
  EXPECT_EQ(item(p, "reference check").host_bytes,
            double(int64_t(4096) * 7168 * 5 + 4 * 32 * 56 + 7168 * 5 + 4 * 56 + 4 * 4096 + 2 * 7168));
  EXPECT_EQ(p.host_bytes, item(p, "reference check").host_bytes + 32768 * 8 + 32 * 48);

  // 16 times the rows: cuBLASLt's down GEMM on constant operands (A 524288 x 2048, B 7168 x 2048,
  // D 524288 x 7168 bf16, workspace) is the largest ceiling.
  o.tokens = {65536};
  EXPECT_EQ(item(plan_gemm_bench_memory(o), "ceilings").device_bytes,
            double((1024 + 14 + 7168 + 32) * kMiB));
  // Padded rows: 100 rows are 112 for one expert's weights, and 3 x 48 (34 each, padded to 16)
  // for the grouped ceiling over 3 experts; the activations hold the more.
  o.tokens = {50};
  o.top_k = 2;
  o.experts = 3;
  EXPECT_EQ(cublaslt_rows(100), 112);
  EXPECT_EQ(cublaslt_group_rows(100, 3), 48);
  EXPECT_EQ(gemm_bench_sizes(o).op_rows, 144);
  EXPECT_EQ(gemm_bench_sizes(o).max_rows, 100);
}

// --weights bf16, the same shape: bf16 weights and activations (2 bytes each, no scales), and the
// cuBLASLt bf16 grouped ceiling on those operands (the down GEMM's output, 32 x 1024 x 7168 bf16,
// and the workspace) as the largest ceiling.
TEST_F(BenchMemory, GemmPlanBf16ByHand) {
  GemmBenchOptions o;
  o.tokens = {1, 4096, 128};
  o.weights = "bf16";
  const MemoryPlan p = plan_gemm_bench_memory(o);
  EXPECT_NE(item(p, "expert weights").what.find("bf16"), std::string::npos) << item(p, "expert weights").what;
  EXPECT_EQ(item(p, "expert weights").device_bytes, double(2 * (896 + 448) * kMiB));
  EXPECT_EQ(item(p, "activations").device_bytes, double((448 + 128) * kMiB + kPage));
  EXPECT_EQ(item(p, "output rows").device_bytes, double(448 * kMiB + kPage));
  EXPECT_EQ(item(p, "counts").device_bytes, double(2 * kPage));
  EXPECT_EQ(item(p, "ceiling").device_bytes, double((448 + 32) * kMiB));
  EXPECT_EQ(item(p, "reference check").host_bytes, double(2 * int64_t(4096) * 7168 + 16 * (4096 + 7168)));
}

// qdq: the row count whose buffers are largest is planned; the sets rotate over 3 x L2.
TEST_F(BenchMemory, QdqPlanByHand) {
  QdqBenchOptions o;
  o.rows = {32768, 128};
  const int64_t l2 = 50 * kMiB;
  const QdqBenchSizes big = qdq_bench_sizes(o, 32768, l2);
  EXPECT_EQ(big.elems, int64_t(32768) * 7168);
  EXPECT_EQ(big.sets, 1);  // 448 MiB is more than 3 x 50 MiB
  EXPECT_EQ(big.sample_rows, 256);
  EXPECT_TRUE(big.stage);
  EXPECT_EQ(qdq_bench_sizes(o, 1024, l2).sets, 11);  // ceil(150 / 14)
  EXPECT_EQ(qdq_bench_sizes(o, 128, l2).sets, 64);   // ceil(150 / 1.75) = 86, at most 64
  EXPECT_EQ(qdq_bench_sizes(o, 128, l2).sample_rows, 128);
  const MemoryPlan p = plan_qdq_bench_memory(o, l2);
  // 32768 rows: input and output 448 MiB each; e4m3 224 MiB and 7 MiB of scales (4 pages); amax.
  // (128 rows: 64 sets of 4 one-page buffers, 512 MiB, less.)
  EXPECT_EQ(item(p, "inputs, outputs").device_bytes, double(896 * kMiB));
  EXPECT_EQ(item(p, "stage_e4m3").device_bytes, double(224 * kMiB + 4 * kPage));
  EXPECT_EQ(p.device_bytes, double(896 * kMiB + 224 * kMiB + 5 * kPage));
  EXPECT_EQ(p.host_bytes, double(256 * 7168 * 10));
  // Without stage_e4m3 its buffers are not planned.
  o.formats = {"fp8", "nvfp4"};
  EXPECT_FALSE(qdq_bench_sizes(o, 32768, l2).stage);
  EXPECT_EQ(plan_qdq_bench_memory(o, l2).device_bytes, double(896 * kMiB + kPage));
  o.formats = {"fp8", "stage_e4m3"};
  EXPECT_TRUE(qdq_bench_sizes(o, 32768, l2).stage);
  // Small row counts only: 64 sets of one-page buffers are the largest.
  o.formats = {};
  o.rows = {128, 1};
  EXPECT_EQ(plan_qdq_bench_memory(o, l2).device_bytes, double(64 * 4 * kPage + kPage));
}

TEST_F(BenchMemory, CombinePlanByHand) {
  CombineBenchOptions o;  // T 4096, K 8, H 7168
  const CombineBenchSizes s = combine_bench_sizes(o);
  EXPECT_EQ(s.sample, 64);
  EXPECT_EQ(s.rows, int64_t(9) * 4096 * 7168);
  EXPECT_EQ(s.routing, 4096 * 8);
  EXPECT_EQ(s.y, 4096 * 7168);
  EXPECT_EQ(s.copy_ceiling, int64_t(9) * 4096 * 7168);
  const MemoryPlan p = plan_combine_bench_memory(o);
  // Rows 504 MiB; three [T, K] 4-byte arrays of 128 KiB; two outputs of 56 MiB; amax and record;
  // the copy ceiling's two buffers of 252 MiB.
  EXPECT_EQ(item(p, "rows").device_bytes, double(504 * kMiB));
  EXPECT_EQ(item(p, "copy ceiling").device_bytes, double(504 * kMiB));
  EXPECT_EQ(p.device_bytes, double(504 * kMiB + 3 * kPage + 112 * kMiB + 2 * kPage + 504 * kMiB));
  // The routing's vectors; the sample of 9 slots (bf16) with its fp32 source, reference, result
  // (64 tokens), and the reference's 8 QDQ rows.
  EXPECT_EQ(p.host_bytes, double(32768 * 12 + 64 * 7168 * (18 + 4 + 2 + 2) + 8 * 7168 * 2));
  o.tokens = 10;
  EXPECT_EQ(combine_bench_sizes(o).sample, 10);
}

// deepseek-v3 as one rank of EP8 (H 7168, I 2048, 32 local experts, top-8, one shared expert of
// 2048) at 4096 tokens: the engine's, the fake quantizer's and the benchmark's buffers by hand.
TEST_F(BenchMemory, MoePlanByHand) {
  MoeBenchOptions o;
  o.tokens = {128, 4096};
  const MoeConfig c = moe_rank_config("deepseek-v3", 8);
  EXPECT_EQ(c.num_experts, 32);
  const MemoryPlan p = plan_moe_bench_memory(o, "deepseek-v3");
  // Routed gate/up 896 MiB and down 448, the shared expert's 28 and 14, each set's two scale
  // arrays a page; on the host 34 routed experts (E, the source of the copies, the generated one)
  // and the shared one, codes and scales.
  const double expert_host = double(3 * 7168 * 2048 + 3 * 56 * 16 * 4);
  EXPECT_EQ(item(p, "engine expert weights").device_bytes, double((896 + 448 + 28 + 14) * kMiB + 4 * kPage));
  EXPECT_EQ(item(p, "host weights").host_bytes, 35 * expert_host);
  // The symmetric buffer (the shared expert unfused): staged x 28 MiB, 32768 pool rows of x (224
  // MiB), h of those and the shared expert's rows (72 MiB), 8 combine slots (448 MiB), and scales.
  const int64_t buffer =
      BufferLayout(BufferShape{.num_experts = 32, .max_tokens = 4096, .top_k = 8, .hidden = 7168, .intermediate = 2048})
          .total_bytes();
  EXPECT_NEAR(double(buffer), double((28 + 224 + 72 + 448) * kMiB), double(12 * kMiB));
  EXPECT_EQ(item(p, "engine buffer").device_bytes, double(device_allocation_bytes(buffer)));
  // Counts, offsets, the pool rows' weights and pointers, the shared expert's weights and
  // pointers, the rank pointers: a page each.
  EXPECT_EQ(item(p, "engine routing arrays").device_bytes, double(7 * kPage));
  // The shared expert on its own: x 28 MiB, h 8 MiB, their scales, pointers and counts.
  EXPECT_EQ(item(p, "engine shared expert's staged rows").device_bytes, double(36 * kMiB + 4 * kPage));
  EXPECT_EQ(item(p, "fake quantizer").device_bytes, double(56 * kMiB + 5 * kPage));
  // x, y and the shared expert's y, 56 MiB each; the routing's indices and weights; the saved amax
  // of the 9 configurations. On the host: the fp32 and bf16 activations and the routing.
  EXPECT_EQ(item(p, "inputs, outputs, routing").device_bytes, double(168 * kMiB + 11 * kPage));
  EXPECT_EQ(item(p, "inputs, outputs, routing").host_bytes, double(4096 * 7168 * 6 + 32768 * 8));
  // The layer's buffers exceed the copy ceiling's 2 GiB and cuBLASLt's (540 MiB) here.
  EXPECT_EQ(item(p, "ceilings").device_bytes, 0.0);
  EXPECT_GT(p.device_bytes, double(int64_t(2) << 30));
  EXPECT_EQ(p.host_bytes, 35 * expert_host + double(4096 * 7168 * 6 + 32768 * 8));

  // Fewer configurations: one saved amax each, "none" always among them.
  o.configs = {"both-fp8", "none"};
  EXPECT_EQ(item(plan_moe_bench_memory(o, "deepseek-v3"), "inputs, outputs, routing").device_bytes,
            double(168 * kMiB + 4 * kPage));
  // 8 tokens: the copy ceiling's 2 GiB is the peak; the plan counts what it needs beyond the layer.
  o.tokens = {8};
  const MemoryPlan small = plan_moe_bench_memory(o, "deepseek-v3");
  EXPECT_GT(item(small, "ceilings").device_bytes, 0.0);
  EXPECT_EQ(small.device_bytes, double(int64_t(2) << 30));
  // A preset without a shared expert has neither its weights nor its rows.
  const MemoryPlan qwen = plan_moe_bench_memory(o, "qwen3-30b-a3b");
  for (const MemoryItem& m : qwen.items) EXPECT_EQ(m.what.find("shared"), std::string::npos) << m.what;
}

// One of 8 real ranks of deepseek-v3 at 4096 tokens: its buffer is a window of the communicator
// (8 ranks' tokens can reach it: 262144 pool rows), the lone engine's its own; both hold the 32
// local experts and the shared one, fused. The all-to-all ceiling's window stays registered.
TEST_F(BenchMemory, MoeRealRanksPlanByHand) {
  MoeBenchOptions o;
  o.tokens = {4096};
  const MemoryPlan p = plan_moe_ranks_bench_memory(o, 8, 0);
  EXPECT_EQ(item(p, "communicator windows").device_bytes, double(256 * kMiB));
  // The buffer of `ranks` ranks over `experts` experts, the shared expert fused.
  const auto buffer = [](int64_t ranks, int64_t experts) {
    return double(device_allocation_bytes(
        BufferLayout(BufferShape{.num_ranks = ranks, .num_experts = experts, .max_tokens = 4096, .top_k = 8,
                                 .hidden = 7168, .intermediate = 2048, .shared_intermediate = 2048})
            .total_bytes()));
  };
  EXPECT_EQ(item(p, "this rank's window").device_bytes, buffer(8, 256));
  EXPECT_EQ(item(p, "lone GPU's buffer").device_bytes, buffer(1, 32));
  for (const char* who : {"real rank's expert weights", "lone GPU's expert weights"})
    EXPECT_EQ(item(p, who).device_bytes, double((896 + 448 + 28 + 14) * kMiB + 4 * kPage)) << who;
  // 262144 pool rows: their weights (1 MiB) and pointers (2 MiB) a page each, as the rest.
  EXPECT_EQ(item(p, "real rank's routing arrays (262144 pool rows)").device_bytes, double(7 * kPage));
  EXPECT_EQ(item(p, "lone GPU's routing arrays (32768 pool rows)").device_bytes, double(7 * kPage));
  for (const MemoryItem& m : p.items) EXPECT_EQ(m.what.find("staged rows"), std::string::npos) << m.what;
  EXPECT_EQ(item(p, "inputs, outputs, routing").device_bytes, double(168 * kMiB + 5 * kPage));
  // A later preset also counts the windows of the earlier ones; one rank has no all-to-all window.
  o.presets = {"deepseek-v3", "deepseek-v4-flash"};
  const MemoryPlan later = plan_moe_ranks_bench_memory(o, 8, 1);
  EXPECT_EQ(item(later, "communicator windows").device_bytes, double(256 * kMiB) + buffer(8, 256));
  for (const MemoryItem& m : plan_moe_ranks_bench_memory(o, 1, 0).items)
    EXPECT_EQ(m.what.find("communicator windows"), std::string::npos) << m.what;
  // A preset given twice registers its window twice.
  o.presets = {"deepseek-v3", "deepseek-v3"};
  EXPECT_EQ(item(plan_moe_ranks_bench_memory(o, 8, 1), "communicator windows").device_bytes,
            double(256 * kMiB) + buffer(8, 256));
  // Refused as the simulated benchmark is, naming the real ranks.
  fake_gpu(p.device_bytes / kUsableFraction - 1e6);
  o.presets = {"deepseek-v3"};
  const std::string m = refusal([&] { check_moe_bench_memory(o, 8); });
  EXPECT_EQ(m.rfind("moefq bench moe --real-ranks: --preset deepseek-v3 --ep 8 --tokens 4096 needs ", 0), 0u) << m;
  EXPECT_NE(m.find("use fewer --tokens, more ranks or a smaller preset"), std::string::npos) << m;
}

TEST_F(BenchMemory, MoeRefusedWhereTheGpuIsTooSmall) {
  MoeBenchOptions o;  // deepseek-v3, EP8, up to 8192 tokens
  const double need = plan_moe_bench_memory(o, "deepseek-v3").device_bytes;
  fake_gpu(need / kUsableFraction);
  check_moe_bench_memory(o);
  fake_gpu(need / kUsableFraction - 1e6);
  const std::string m = refusal([&] { check_moe_bench_memory(o); });
  EXPECT_EQ(m.rfind("moefq bench moe: --preset deepseek-v3 --ep 8 --tokens 8192 (the largest of the sweep) needs ", 0), 0u)
      << m;
  for (const char* s : {" of GPU memory, ", " available: use fewer --tokens, a larger --ep or a smaller preset\n",
                        "memory plan (GiB)", "engine buffer"})
    EXPECT_NE(m.find(s), std::string::npos) << s << "\n" << m;
  // Every preset is checked: the second one here is the larger.
  o.presets = {"deepseek-v3", "deepseek-v4-pro"};
  o.tokens = {128};
  fake_gpu(plan_moe_bench_memory(o, "deepseek-v3").device_bytes / kUsableFraction);
  EXPECT_GT(plan_moe_bench_memory(o, "deepseek-v4-pro").device_bytes, plan_moe_bench_memory(o, "deepseek-v3").device_bytes);
  EXPECT_NE(refusal([&] { check_moe_bench_memory(o); }).find("--preset deepseek-v4-pro --ep 8 --tokens 128 needs "),
            std::string::npos);
  // A preset that does not split into --ep ranks is bad input naming both.
  o.ep = 3;
  EXPECT_NE(refusal([&] { check_moe_bench_memory(o); }).find("--ep 3: deepseek-v3's 256 experts do not split"),
            std::string::npos);
}

// Refused with eval's rule: the plan may take 90% of the free memory; the message names the
// benchmark, its sizes, the bytes needed and available, the options to shrink and the plan.
TEST_F(BenchMemory, GemmRefusedWhereTheGpuIsTooSmall) {
  GemmBenchOptions o;
  const double need = plan_gemm_bench_memory(o).device_bytes;
  fake_gpu(need / kUsableFraction);  // exactly fits
  check_gemm_bench_memory(o);
  fake_gpu(need / kUsableFraction - 1e6);
  const std::string m = refusal([&] { check_gemm_bench_memory(o); });
  for (const char* s : {"moefq bench gemm: --tokens 4096 (the largest of the sweep) with --experts 32 --hidden 7168 "
                        "--inter 2048 --top-k 8 needs 4.1 GiB of GPU memory, 4.5 GiB available: use fewer --tokens or "
                        "--experts, or a smaller --hidden, --inter or --top-k",
                        "memory plan (GiB)", "ceilings"})
    EXPECT_NE(m.find(s), std::string::npos) << s << "\n" << m;
  fake_gpu(0);  // no figure: not checked, as eval
  check_gemm_bench_memory(o);
}

TEST_F(BenchMemory, QdqAndCombineRefusedWhereTheGpuIsTooSmall) {
  fake_gpu(1e9);
  QdqBenchOptions q;
  q.rows = {128, 32768};
  std::string m = refusal([&] { check_qdq_bench_memory(q, 50 * kMiB); });
  EXPECT_NE(m.find("moefq bench qdq: --rows 32768 (the largest of the sweep) --cols 7168 needs 1.1 GiB of GPU memory, "
                   "0.9 GiB available: use fewer --rows or --cols"),
            std::string::npos)
      << m;
  q.rows = {128};
  check_qdq_bench_memory(q, 50 * kMiB);
  CombineBenchOptions c;
  m = refusal([&] { check_combine_bench_memory(c); });
  EXPECT_NE(m.find("moefq bench combine: --tokens 4096 --top-k 8 --hidden 7168 needs 1.1 GiB of GPU memory, 0.9 GiB "
                   "available: use fewer --tokens, or a smaller --top-k or --hidden"),
            std::string::npos)
      << m;
  c.tokens = 1024;
  check_combine_bench_memory(c);
}

// The host's side with the same rule (a plan made by hand: the host's figure cannot be faked).
TEST_F(BenchMemory, HostRefusedWithTheSameRule) {
  MemoryPlan p;
  p.items.push_back({"x", 9e9, 1e9});
  p.host_bytes = 9e9;
  p.device_bytes = 1e9;
  p.host_available = 10e9;
  p.device_available = 10e9;
  require_memory_fits(p, "moefq bench x:", "use less");
  p.host_available = 9.9e9;
  const std::string m = refusal([&] { require_memory_fits(p, "moefq bench x:", "use less"); });
  EXPECT_NE(m.find("moefq bench x: needs 8.4 GiB of host memory, 9.2 GiB available: use less\nmemory plan"),
            std::string::npos)
      << m;
  p.host_available = 0;  // unknown
  require_memory_fits(p, "moefq bench x:", "use less");
}

}  // namespace
}  // namespace moefq::bench
