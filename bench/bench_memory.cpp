// The GPU micro-benchmarks' memory plans (bench_memory.h).
#include "bench/bench_memory.h"

#include <algorithm>
#include <cstdio>

#include "eval/layer_runner.h"
#include "moefq/buffer_layout.h"
#include "moefq/cpu_engine.h"
#include "moefq/errors.h"
#include "moefq/numerics.h"

namespace moefq::bench {
namespace {

// A plan under construction: items added with their host and device bytes, then the totals and
// the figures available.
class PlanBuilder {
 public:
  void add(const std::string& what, double host_bytes, double device_bytes) {
    plan_.items.push_back({what, host_bytes, device_bytes});
  }
  const std::vector<MemoryItem>& items() const { return plan_.items; }
  MemoryPlan finish() {
    total_memory_plan(plan_, true);
    return plan_;
  }

 private:
  MemoryPlan plan_;
};

// Device bytes of `count` elements of `size` bytes each, as cudaMalloc takes them.
double dev(int64_t count, int64_t size) { return double(device_allocation_bytes(count * size)); }

// "what (n units)" ("unit" for one).
std::string with_count(const std::string& what, int64_t n, const std::string& unit) {
  return what + " (" + std::to_string(n) + " " + unit + (n == 1 ? "" : "s") + ")";
}

// Device bytes of one qdq row count's buffers: the bf16 inputs and outputs, and stage_e4m3's
// e4m3 outputs and fp32 scales (where it runs).
double qdq_io_bytes(const QdqBenchSizes& s) { return 2 * s.sets * dev(s.elems, 2); }
double qdq_stage_bytes(const QdqBenchSizes& s) {
  return s.stage ? s.sets * (dev(s.elems, 1) + dev(s.elems / kStageBlock, 4)) : 0;
}
double qdq_device_bytes(const QdqBenchSizes& s) { return qdq_io_bytes(s) + qdq_stage_bytes(s); }

// The row counts run one after another, each freeing its buffers: the plan is the largest one's.
int64_t qdq_plan_rows(const QdqBenchOptions& o, int64_t l2) {
  int64_t rows = o.rows.front();
  for (int64_t r : o.rows)
    if (qdq_device_bytes(qdq_bench_sizes(o, r, l2)) > qdq_device_bytes(qdq_bench_sizes(o, rows, l2))) rows = r;
  return rows;
}

// Device bytes of n experts' weights of hidden H and intermediate I: e4m3 with their 128 x 128
// block scales, four allocations (the CUDA engine's expert set), or bf16, two.
double expert_set_device_bytes(int64_t n, int64_t H, int64_t I, WeightFormat f) {
  if (f == WeightFormat::kBf16) return dev(n * 2 * I * H, 2) + dev(n * H * I, 2);
  return dev(n * 2 * I * H, 1) + dev(n * H * I, 1) + dev(n * (2 * I / 128) * (H / 128), 4) +
         dev(n * (H / 128) * (I / 128), 4);
}
// Host bytes of one expert's e4m3 weights and scales, or bf16 weights.
double expert_host_bytes(int64_t H, int64_t I, WeightFormat f) {
  if (f == WeightFormat::kBf16) return double(3 * H * I) * 2;
  return double(3 * H * I) + double(3 * (H / 128) * (I / 128)) * 4;
}

int64_t largest(const std::vector<int64_t>& v) { return *std::max_element(v.begin(), v.end()); }

// The CUDA engine's device allocations (cuda_engine.cu) for one rank it computes, of a layer of
// `config` over `ranks` ranks: the rank's expert sets, its symmetric buffer (where it owns one: a
// real rank's is a window of the communicator), the routing arrays and, with the shared expert
// unfused, that expert's own staged rows. Item names start with `who`.
void add_engine_memory(PlanBuilder& b, const std::string& who, const MoeConfig& c, int64_t ranks, int64_t T,
                       bool fuse_shared, bool own_buffer, Staging st) {
  const int64_t H = c.hidden, I = c.intermediate, el = c.num_experts / ranks, Is = I * c.num_shared, hb = H / 128;
  const BufferLayout layout(engine_buffer_shape(c, ranks, T, {}, moe_bench_engine_options(st, fuse_shared)));
  const int64_t P = layout.shape().pool_rows();
  const WeightFormat wf = moe_bench_weight_format(st);
  b.add(with_count(who + "expert weights, " + weight_format_name(wf), el, "expert") + (Is > 0 ? " and shared" : ""), 0,
        expert_set_device_bytes(el, H, I, wf) + (Is > 0 ? expert_set_device_bytes(1, H, Is, wf) : 0.0));
  if (own_buffer) b.add(who + "buffer: staged x, pools, combine rows", 0, dev(layout.total_bytes(), 1));
  // Counts and offsets, the pool rows' weights and output pointers, the shared expert's weights
  // and output pointers, every rank's pointers (five each).
  b.add(with_count(who + "routing arrays", P, "pool row"), 0,
        2 * dev(el + 1, 4) + dev(P, 4) + dev(P, 8) + dev(T, 4) + dev(T, 8) + dev(ranks, 40));
  // The shared expert run on its own: staged x and its scales, h and its scales (staging none: bf16
  // x and h, no scales), output pointers, counts.
  const bool scaled = st == Staging::kE4m3;
  if (Is > 0 && !fuse_shared)
    b.add(who + "shared expert's staged rows", 0,
          (scaled ? dev(T * H, 1) + dev(T * hb, 4) + dev(T * Is, 1) + dev(T * (Is / 128), 4)
                  : dev(T * H, 2) + dev(T * Is, 2)) +
              dev(T, 8) + dev(2, 4));
}

// Host bytes of the repeated weights (bench/moe_inputs.h) while they are uploaded: `el` copies of
// expert 0, the one they are copied from, the generated one, and the shared expert.
double repeated_weights_host_bytes(const MoeConfig& c, int64_t el, WeightFormat f) {
  return double(el + 2) * expert_host_bytes(c.hidden, c.intermediate, f) +
         (c.num_shared > 0 ? expert_host_bytes(c.hidden, c.intermediate * c.num_shared, f) : 0.0);
}

}  // namespace

Staging moe_bench_staging(const MoeBenchOptions& o, const MoeConfig& c) { return o.staging.value_or(default_staging(c)); }

WeightFormat moe_bench_weight_format(Staging st) {
  return st == Staging::kNone ? WeightFormat::kBf16 : WeightFormat::kE4m3;
}

EngineOptions moe_bench_engine_options(Staging st, bool fuse_shared) {
  EngineOptions eo;
  eo.fuse_shared = fuse_shared;
  eo.staging = st;
  return eo;
}

int64_t device_allocation_bytes(int64_t bytes) {
  return bytes <= 0 ? 0 : (bytes + kDevicePageBytes - 1) / kDevicePageBytes * kDevicePageBytes;
}

int64_t copy_ceiling_device_bytes(int64_t bytes) { return 2 * device_allocation_bytes(bytes); }

int64_t CublasltCeilingSizes::device_bytes() const {
  return device_allocation_bytes(a_const) + device_allocation_bytes(b_const) + device_allocation_bytes(2 * d) +
         device_allocation_bytes(workspace);
}

CublasltCeilingSizes cublaslt_ceiling_sizes(int64_t m, int64_t n, int64_t k, bool a_given, bool b_given, int batch,
                                            int elem_bytes) {
  CublasltCeilingSizes s;
  s.a_const = a_given ? 0 : int64_t(batch) * m * k * elem_bytes;
  s.b_const = b_given ? 0 : int64_t(batch) * n * k * elem_bytes;
  s.d = int64_t(batch) * m * n;
  return s;
}

int64_t cublaslt_rows(int64_t rows) { return std::max<int64_t>(16, (rows + 15) / 16 * 16); }
int64_t cublaslt_group_rows(int64_t rows, int64_t groups) { return cublaslt_rows((rows + groups - 1) / groups); }

GemmBenchSizes gemm_bench_sizes(const GemmBenchOptions& o) {
  const int64_t H = o.hidden, I = o.inter, G = o.experts, hb = H / 128, ib = I / 128;
  GemmBenchSizes s;
  for (int64_t t : o.tokens) s.max_rows = std::max(s.max_rows, t * o.top_k);
  s.op_rows = std::max(cublaslt_rows(s.max_rows), G * cublaslt_group_rows(s.max_rows, G));
  s.gate_up = G * 2 * I * H;
  s.down = G * H * I;
  s.gate_up_scales = G * 2 * ib * hb;
  s.down_scales = G * hb * ib;
  s.x8 = s.op_rows * H;
  s.h8 = s.op_rows * I;
  s.x_scales = s.max_rows * hb;
  s.h_scales = s.max_rows * ib;
  s.row_weights = s.max_rows;
  s.out = s.max_rows * H;
  s.row_out = s.max_rows;
  s.groups = G;
  return s;
}

int64_t gemm_check_host_bytes(int64_t n, int64_t k, const GemmBenchOptions& o) {
  const int64_t kb = k / 128, I = o.inter, ib = I / 128;
  const int64_t weights = n * k + 4 * (n / 128) * kb + 4 * n * k;  // codes, scales, decoded
  const int64_t row = k + 4 * kb + 4 * k + 4 * n;                  // codes, scales, decoded, reference
  const int64_t got = std::max(I + 4 * ib, 2 * o.hidden);          // h8 and its scales, or the bf16 row
  return weights + row + got;
}

QdqBenchSizes qdq_bench_sizes(const QdqBenchOptions& o, int64_t rows, int64_t l2) {
  QdqBenchSizes s;
  s.elems = rows * o.cols;
  const int64_t bytes = s.elems * 2;
  s.sets = int(std::clamp<int64_t>((3 * l2 + bytes - 1) / bytes, 1, 64));
  s.sample_rows = std::min<int64_t>(rows, 256);
  s.stage = o.formats.empty() || std::find(o.formats.begin(), o.formats.end(), "stage_e4m3") != o.formats.end();
  return s;
}

CombineBenchSizes combine_bench_sizes(const CombineBenchOptions& o) {
  const int64_t T = o.tokens, K = o.top_k, H = o.hidden;
  CombineBenchSizes s;
  s.sample = std::min<int64_t>(T, 64);
  s.rows = (K + 1) * T * H;
  s.routing = T * K;
  s.y = T * H;
  s.copy_ceiling = (K + 1) * T * H;  // bytes: half the all-active case's (K T H rows read, T H written; bf16)
  return s;
}

MemoryPlan plan_gemm_bench_memory(const GemmBenchOptions& o) {
  const GemmBenchSizes s = gemm_bench_sizes(o);
  const int64_t H = o.hidden, I = o.inter, G = o.experts;
  PlanBuilder b;
  if (o.weights == "bf16") {  // run_bench_gemm_bf16: bf16 weights and activations, no scales
    b.add(with_count("expert weights, bf16", G, "expert"), 0, dev(s.gate_up, 2) + dev(s.down, 2));
    b.add(with_count("activations, h, bf16", s.op_rows, "row"), 0, dev(s.x8, 2) + dev(s.h8, 2) + dev(s.row_weights, 4));
    b.add("output rows, bf16, and pointers", double(s.row_out) * 8, dev(s.out, 2) + dev(s.row_out, 8));
    b.add("counts, offsets", double(s.groups) * 8, 2 * dev(s.groups, 4));
    int64_t ceiling = 0;
    for (int64_t t : o.tokens)
      for (const auto& [n, k] : {std::pair<int64_t, int64_t>{2 * I, H}, {H, I}})
        ceiling = std::max(ceiling, cublaslt_ceiling_sizes(cublaslt_group_rows(t * o.top_k, G), n, k, true, true,
                                                           int(G)).device_bytes());
    b.add("ceiling: cuBLASLt bf16, largest", 0, double(ceiling));
    b.add("reference check: one expert's weights", double(2 * std::max(2 * I * H, H * I) + 16 * (2 * I + H)), 0);
    return b.finish();
  }
  b.add(with_count("expert weights, e4m3", G, "expert"), 0,
        dev(s.gate_up, 1) + dev(s.down, 1) + dev(s.gate_up_scales, 4) + dev(s.down_scales, 4));
  b.add(with_count("activations, h, scales", s.op_rows, "row"), 0,
        dev(s.x8, 1) + dev(s.h8, 1) + dev(s.x_scales, 4) + dev(s.h_scales, 4) + dev(s.row_weights, 4));
  b.add("output rows, bf16, and pointers", double(s.row_out) * 8, dev(s.out, 2) + dev(s.row_out, 8));
  // Four pointer arrays, counts and offsets; on the host the routing's counts, weights and offsets too.
  b.add("expert pointers, counts, offsets", double(s.groups) * (4 * 8 + 4 + 8 + 4),
        4 * dev(s.groups, 8) + 2 * dev(s.groups, 4));
  // The ceilings run one at a time beside the buffers above: the copy, then per token count and
  // GEMM cuBLASLt grouped, on one expert's weights and on constant operands.
  int64_t ceiling = copy_ceiling_device_bytes(s.copy_ceiling);
  for (int64_t t : o.tokens) {
    const int64_t rows = t * o.top_k, m_grp = cublaslt_group_rows(rows, G), m_cub = cublaslt_rows(rows);
    for (const auto& [n, k] : {std::pair<int64_t, int64_t>{2 * I, H}, {H, I}}) {
      ceiling = std::max({ceiling, cublaslt_ceiling_sizes(m_grp, n, k, true, true, int(G)).device_bytes(),
                          cublaslt_ceiling_sizes(m_cub, n, k, true, true, 1).device_bytes(),
                          cublaslt_ceiling_sizes(m_cub, n, k, false, false, 1).device_bytes()});
    }
  }
  b.add("ceilings: copy or cuBLASLt, largest", 0, double(ceiling));
  b.add("reference check: one expert's weights",
        double(std::max(gemm_check_host_bytes(2 * I, H, o), gemm_check_host_bytes(H, I, o))), 0);
  return b.finish();
}

MemoryPlan plan_qdq_bench_memory(const QdqBenchOptions& o, int64_t l2) {
  const QdqBenchSizes s = qdq_bench_sizes(o, qdq_plan_rows(o, l2), l2);
  const int64_t sample_rows = std::min<int64_t>(*std::max_element(o.rows.begin(), o.rows.end()), 256);
  PlanBuilder b;
  b.add(with_count("inputs, outputs, bf16", s.sets, "set"), 0, qdq_io_bytes(s));
  if (s.stage) b.add(with_count("stage_e4m3 outputs, scales", s.sets, "set"), 0, qdq_stage_bytes(s));
  b.add("amax", 0, dev(1, 4));
  // The sample (bf16, and the fp32 activations it is rounded from) and the check's expected and
  // returned rows (bf16; the stage_e4m3 case's codes and scales are smaller).
  b.add(with_count("reference sample", sample_rows, "row"), double(sample_rows * o.cols) * (2 + 4 + 2 + 2), 0);
  return b.finish();
}

MemoryPlan plan_combine_bench_memory(const CombineBenchOptions& o) {
  const CombineBenchSizes s = combine_bench_sizes(o);
  const int64_t K = o.top_k, H = o.hidden;
  PlanBuilder b;
  b.add(with_count("rows, bf16", K + 1, "slot"), 0, dev(s.rows, 2));
  b.add("routing, router weights", double(s.routing) * 12, 3 * dev(s.routing, 4));
  b.add("outputs: engine's, benchmarked", 0, 2 * dev(s.y, 2));
  b.add("amax, check record", 0, dev(1, 4) + dev(1, 16));
  b.add("copy ceiling", 0, double(copy_ceiling_device_bytes(s.copy_ceiling)));
  // The sample of every slot (bf16, and the fp32 activations it is rounded from), the reference's
  // QDQ rows, the expected and the returned outputs.
  b.add(with_count("reference sample", s.sample, "token"),
        double(s.sample * H) * (2 * double(K + 1) + 4 + 2 + 2) + double(K * H) * 2, 0);
  return b.finish();
}

MoeConfig moe_rank_config(const std::string& name, int64_t ep) {
  MoeConfig c = preset(name);
  MOEFQ_CHECK(ep >= 1 && c.num_experts % ep == 0 && c.num_experts / ep >= c.top_k, "--ep ", ep, ": ", name, "'s ",
              c.num_experts, " experts do not split into ", ep, " ranks of at least K = ", c.top_k);
  c.num_experts /= ep;
  c.n_group = c.topk_group = 1;
  return c;
}

void check_moe_bench_options(const MoeBenchOptions& o) {
  const std::vector<std::string> known = moe_bench_configs();
  for (const auto& c : o.configs)
    MOEFQ_CHECK(std::find(known.begin(), known.end(), c) != known.end(), "--configs: unknown configuration '", c, "'");
  MOEFQ_CHECK(!o.tokens.empty(), "--tokens: no token counts");
  for (int64_t t : o.tokens) MOEFQ_CHECK(t >= 1, "--tokens: ", t, " is not a positive token count");
  for (const auto& p : o.presets) moe_rank_config(p, o.ep);
}

MemoryPlan plan_moe_bench_memory(const MoeBenchOptions& o, const std::string& name) {
  const MoeConfig c = moe_rank_config(name, o.ep);
  const int64_t T = largest(o.tokens), H = c.hidden, I = c.intermediate, K = c.top_k;
  const int64_t configs = o.configs.empty() ? int64_t(moe_bench_configs().size())
                                            : 1 + std::count_if(o.configs.begin(), o.configs.end(),
                                                                [](const std::string& c) { return c != "none"; });
  PlanBuilder b;
  const Staging st = moe_bench_staging(o, c);
  add_engine_memory(b, "engine ", c, 1, T, false, true, st);
  b.add("host weights while uploaded", repeated_weights_host_bytes(c, c.num_experts, moe_bench_weight_format(st)), 0);
  // The dispatch-quantized tokens; the calibration, dynamic and global amax, check records, clip counts.
  b.add("fake quantizer: dispatch QDQ rows, amax", 0, dev(T * H, 2) + 5 * dev(1, 64));
  // x, the layer's output and the shared expert's (bf16), the routing; each configuration's saved
  // amax. On the host: the fp32 activations x is rounded from, x, the routing.
  b.add(with_count("inputs, outputs, routing", T, "token"), double(T * H) * 6 + double(T * K) * 8,
        3 * dev(T * H, 2) + 2 * dev(T * K, 4) + double(configs) * dev(2, 4));
  double layer = 0;
  for (const MemoryItem& m : b.items()) layer += m.device_bytes;
  const double ceiling = double(std::max(copy_ceiling_device_bytes(int64_t(1) << 30),
                                         cublaslt_ceiling_sizes(T * K, 2 * I, H, false, false, 1,
                                                                st == Staging::kNone ? 2 : 1).device_bytes()));
  b.add("ceilings (run first) beyond the layer", 0, std::max(0.0, ceiling - layer));
  return b.finish();
}

MemoryPlan plan_moe_ranks_bench_memory(const MoeBenchOptions& o, int64_t ranks, size_t preset_index) {
  MOEFQ_ASSERT(preset_index < o.presets.size(), "moe plan: preset ", preset_index, " of ", o.presets.size());
  const std::string& name = o.presets[preset_index];
  const MoeConfig c = preset(name), lone = moe_rank_config(name, ranks);
  const int64_t T = largest(o.tokens), H = c.hidden, K = c.top_k, el = lone.num_experts;
  const Staging st = moe_bench_staging(o, c);
  PlanBuilder b;
  // The communicator keeps every window it registered: the all-to-all ceiling's (32 MiB per rank,
  // with more than one rank), and each earlier preset's buffer.
  double windows = ranks > 1 ? double(device_allocation_bytes(ranks * (int64_t(32) << 20))) : 0.0;
  for (size_t i = 0; i < preset_index; ++i)
    windows += dev(
        BufferLayout(engine_buffer_shape(preset(o.presets[i]), ranks, T, {},
                                         moe_bench_engine_options(moe_bench_staging(o, preset(o.presets[i])), true)))
            .total_bytes(),
        1);
  if (windows > 0) b.add("communicator windows of earlier steps", 0, windows);
  b.add("this rank's window: staged x, pools, combine rows", 0,
        dev(BufferLayout(engine_buffer_shape(c, ranks, T, {}, moe_bench_engine_options(st, true))).total_bytes(), 1));
  add_engine_memory(b, "real rank's ", c, ranks, T, true, false, st);
  add_engine_memory(b, "lone GPU's ", lone, 1, T, true, true, st);
  b.add("host weights while uploaded", repeated_weights_host_bytes(c, el, moe_bench_weight_format(st)), 0);
  // x, the layer's output and the lone engine's (bf16); this rank's, the folded and the lone
  // routing's indices, two sets of weights. On the host: the fp32 activations, x, every rank's
  // routing, the lone and folded ones.
  b.add(with_count("inputs, outputs, routing", T, "token"),
        double(T * H) * 6 + double((ranks + 1) * T * K) * 8 + double(T * K) * 4,
        3 * dev(T * H, 2) + 5 * dev(T * K, 4));
  return b.finish();
}

void check_gemm_bench_memory(const GemmBenchOptions& o) {
  const int64_t tokens = *std::max_element(o.tokens.begin(), o.tokens.end());
  require_memory_fits(plan_gemm_bench_memory(o),
                     "moefq bench gemm: --tokens " + std::to_string(tokens) + (o.tokens.size() > 1 ? " (the largest of the sweep)" : "") +
                         " with --experts " + std::to_string(o.experts) + " --hidden " + std::to_string(o.hidden) +
                         " --inter " + std::to_string(o.inter) + " --top-k " + std::to_string(o.top_k),
                     "use fewer --tokens or --experts, or a smaller --hidden, --inter or --top-k");
}

void check_qdq_bench_memory(const QdqBenchOptions& o, int64_t l2) {
  require_memory_fits(plan_qdq_bench_memory(o, l2),
                     "moefq bench qdq: --rows " + std::to_string(qdq_plan_rows(o, l2)) +
                         (o.rows.size() > 1 ? " (the largest of the sweep)" : "") + " --cols " + std::to_string(o.cols),
                     "use fewer --rows or --cols");
}

void check_combine_bench_memory(const CombineBenchOptions& o) {
  require_memory_fits(plan_combine_bench_memory(o),
                     "moefq bench combine: --tokens " + std::to_string(o.tokens) + " --top-k " + std::to_string(o.top_k) +
                         " --hidden " + std::to_string(o.hidden),
                     "use fewer --tokens, or a smaller --top-k or --hidden");
}

void check_moe_bench_memory(const MoeBenchOptions& o, int64_t real_ranks) {
  const int64_t tokens = largest(o.tokens);
  for (size_t i = 0; i < o.presets.size(); ++i)
    require_memory_fits(real_ranks > 0 ? plan_moe_ranks_bench_memory(o, real_ranks, i) : plan_moe_bench_memory(o, o.presets[i]),
                       "moefq bench moe" + std::string(real_ranks > 0 ? " --real-ranks" : "") + ": --preset " + o.presets[i] +
                           " --ep " + std::to_string(o.ep) + " --tokens " + std::to_string(tokens) +
                           (o.tokens.size() > 1 ? " (the largest of the sweep)" : ""),
                       real_ranks > 0 ? "use fewer --tokens, more ranks or a smaller preset"
                                      : "use fewer --tokens, a larger --ep or a smaller preset");
}

}  // namespace moefq::bench
