#include "engine/cuda/cuda_engine.cuh"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "engine/cuda/combine_kernels.cuh"
#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "engine/cuda/grouped_gemm.cuh"
#include "cuda_base/pdl.cuh"
#include "quant/cuda/qdq_kernels.cuh"
#include "cuda_base/warp_scan.cuh"
#include "moefq/errors.h"

namespace moefq::cuda {
namespace {

// skip_combine of forward() and combine(): empty, or one flag per local rank.
void check_skip_flags(const std::vector<bool>& skip, int64_t ranks, const char* who) {
  MOEFQ_CHECK(skip.empty() || int64_t(skip.size()) == ranks, who, ": skip_combine flags for ", skip.size(), " of ",
              ranks, " ranks");
}

constexpr int64_t kB = kStageBlock;
constexpr int kMaxRanks = 64;
constexpr int kThreads = 256;

// Per-call token counts, passed by value (a graph captures them with the launch). Simulated ranks:
// the host knows every rank's. Real ranks (published): the host knows only its own rank's; every
// rank writes its count into its rank_state before the barrier that precedes the dispatch, and
// the kernels read the others' there.
struct TokenCounts {
  int32_t n[kMaxRanks];
  bool published;
};

// Where a rank's kernels find its buffer and its engine-private per-call arrays (device memory).
struct RankPtrs {
  uint8_t* buf;
  int32_t* counts;    // [E/R + 1]: rows per local expert of this call, then the shared expert's
  int32_t* offsets;   // [E/R + 1]: first pool row of each local expert, then 0
  float* row_weight;  // [pool_rows]: router weight of each pool row
  bf16** row_out;     // [pool_rows]: the combine row (in the token's rank) each pool row goes to
};

// Region offsets of the layout, for the kernels.
struct Offsets {
  size_t expert_counts, expert_lists, staged_x, staged_scales, topk_idx, topk_weights, pool_x, pool_x_scales, combine,
      rank_state;
};

__device__ int32_t tokens_of(const RankPtrs* ranks, const Offsets& off, const TokenCounts& tc, int r) {
  return tc.published ? *reinterpret_cast<const int32_t*>(ranks[r].buf + off.rank_state) : tc.n[r];
}

// Every kernel below computes for the ranks first_rank .. first_rank + n - 1 that this process
// holds (all R simulated ranks, or one real rank) and reads the others' buffers through `ranks`.

// One CTA per global expert e of those ranks: appends every (token, slot) of every rank that
// picked e to e's list in the workspace of e's rank, in (rank, token, slot) order: the list
// entries and their order are the CPU engine's. Entry = (src_rank * T + token) * K + slot.
// Each pass takes kDispatchRun consecutive entries per thread (kThreads * kDispatchRun per pass,
// the loads independent of each other), so that a pass's global-load latency and its two barriers
// are paid once per 4096 entries: the list is the block's exclusive scan of the threads' hits.
constexpr int kDispatchRun = 16;
__global__ void __launch_bounds__(kThreads) dispatch_kernel(const RankPtrs* ranks, Offsets off, TokenCounts tc,
                                                            int R, int T, int K, int el, int first_rank) {
  pdl_enter();
  const int e = first_rank * el + int(blockIdx.x), d = e / el, le = e % el;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  __shared__ int warp_hits[kThreads / 32];
  const int64_t cap = int64_t(R) * T;
  int32_t* list = reinterpret_cast<int32_t*>(ranks[d].buf + off.expert_lists) + int64_t(le) * cap;
  int base = 0;  // entries listed so far (the same in every thread)
  for (int r = 0; r < R; ++r) {
    const int n = tokens_of(ranks, off, tc, r) * K;
    const int32_t* idx = reinterpret_cast<const int32_t*>(ranks[r].buf + off.topk_idx);
    const bool vec = (reinterpret_cast<uintptr_t>(idx) & 15u) == 0;
    for (int s = 0; s < n; s += int(blockDim.x) * kDispatchRun) {
      const int i0 = s + int(threadIdx.x) * kDispatchRun;
      uint32_t hits = 0;  // bit u: entry i0 + u picked e
      if (vec && i0 + kDispatchRun <= n) {
        int4 v[kDispatchRun / 4];
#pragma unroll
        for (int u = 0; u < kDispatchRun / 4; ++u) v[u] = reinterpret_cast<const int4*>(idx + i0)[u];
#pragma unroll
        for (int u = 0; u < kDispatchRun / 4; ++u)
          hits |= uint32_t(v[u].x == e) << (4 * u) | uint32_t(v[u].y == e) << (4 * u + 1) |
                  uint32_t(v[u].z == e) << (4 * u + 2) | uint32_t(v[u].w == e) << (4 * u + 3);
      } else {
#pragma unroll
        for (int u = 0; u < kDispatchRun; ++u) hits |= uint32_t(i0 + u < n && idx[i0 + u] == e) << u;
      }
      const int mine = __popc(hits);
      const int incl = warp_inclusive_sum(mine, lane);
      if (lane == 31) warp_hits[warp] = incl;
      __syncthreads();
      int pos = base + incl - mine, pass = 0;
      for (int j = 0; j < nwarps; ++j) {
        const int w = warp_hits[j];
        pass += w;
        if (j < warp) pos += w;
      }
      for (; hits; hits &= hits - 1, ++pos)
        if (pos < cap) list[pos] = int32_t(int64_t(r) * T * K + i0 + __ffs(int(hits)) - 1);
      base += pass;
      __syncthreads();  // warp_hits is the next pass's
    }
  }
  if (threadIdx.x == 0) reinterpret_cast<int32_t*>(ranks[d].buf + off.expert_counts)[le] = int32_t(base < cap ? int64_t(base) : cap);
}

// One warp per rank: pool offsets of the local experts (a scan over 32 experts at a time, so that
// the counts' loads are not one latency each), the counts the GEMMs read, and the dispatch
// counters reset for the next call (the workspace cleans itself).
__global__ void plan_kernel(const RankPtrs* ranks, Offsets off, TokenCounts tc, int first_rank, int el) {
  pdl_enter();
  const int d = first_rank + int(blockIdx.x), lane = int(threadIdx.x);
  const RankPtrs rp = ranks[d];
  int32_t* counts = reinterpret_cast<int32_t*>(rp.buf + off.expert_counts);
  int32_t run = 0;
  for (int l0 = 0; l0 < el; l0 += 32) {
    const int le = l0 + lane;
    const int32_t n = le < el ? counts[le] : 0;
    const int32_t incl = warp_inclusive_sum(n, lane);
    if (le < el) {
      rp.counts[le] = n;
      rp.offsets[le] = run + incl - n;
      counts[le] = 0;
    }
    run += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) {
    rp.counts[el] = tc.n[d];
    rp.offsets[el] = 0;
  }
}

constexpr int kPullRun = 16;  // 16-byte chunks per lane per pass: rows up to 8192 bytes in one pass

// Pulls each listed row (e4m3 bytes and scales, or bf16 with staging none: row_bytes = 2H and no
// scales) from its token rank's staged copy into the expert rank's pool, with the row's router weight (1.0 when weight_rows is false: combine_weighting
// after, the combine weights the row instead; times 1.0 is exact) and destination combine row (in
// the token rank's buffer: for a real peer, a pointer into its memory, so the down GEMM's stores
// go over NVLink). Grid: (E/R, n, splits), one warp per row.
__global__ void __launch_bounds__(kThreads) pull_kernel(const RankPtrs* ranks, Offsets off, int R, int T, int K,
                                                        int el, int H, int row_bytes, bool scaled, int first_rank,
                                                        bool weight_rows) {
  pdl_enter();
  const int le = blockIdx.x, d = first_rank + int(blockIdx.y);
  const RankPtrs me = ranks[d];
  const int n = me.counts[le], first = me.offsets[le];
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int32_t* list = reinterpret_cast<const int32_t*>(me.buf + off.expert_lists) + int64_t(le) * R * T;
  const int hb = scaled ? H / int(kB) : 0, chunks = row_bytes / 16;
  for (int i = blockIdx.z * warps + (threadIdx.x >> 5); i < n; i += gridDim.z * warps) {
    const int32_t entry = list[i];
    const int src = entry / (T * K), t = entry / K % T, k = entry % K;
    const uint8_t* sbuf = ranks[src].buf;
    const int64_t row = int64_t(first) + i;
    const int4* sx = reinterpret_cast<const int4*>(sbuf + off.staged_x + int64_t(t) * row_bytes);
    int4* dx = reinterpret_cast<int4*>(me.buf + off.pool_x + row * row_bytes);
    const float* ss = reinterpret_cast<const float*>(sbuf + off.staged_scales) + int64_t(t) * hb;
    float* ds = reinterpret_cast<float*>(me.buf + off.pool_x_scales) + row * hb;
    // A lane issues all its loads of a pass before its stores: a load that follows a store
    // through a pointer that may alias it waits for that store's data, so a load-store loop
    // keeps one load per warp in flight and the pull runs at the loads' latency.
    for (int c0 = 0; c0 < chunks; c0 += 32 * kPullRun) {
      int4 v[kPullRun];
#pragma unroll
      for (int u = 0; u < kPullRun; ++u)
        if (c0 + 32 * u + lane < chunks) v[u] = sx[c0 + 32 * u + lane];
#pragma unroll
      for (int u = 0; u < kPullRun; ++u)
        if (c0 + 32 * u + lane < chunks) dx[c0 + 32 * u + lane] = v[u];
    }
    for (int c0 = 0; c0 < hb; c0 += 32 * 4) {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (c0 + 32 * u + lane < hb) v[u] = ss[c0 + 32 * u + lane];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (c0 + 32 * u + lane < hb) ds[c0 + 32 * u + lane] = v[u];
    }
    if (lane == 0) {
      me.row_weight[row] = weight_rows ? reinterpret_cast<const float*>(sbuf + off.topk_weights)[int64_t(t) * K + k] : 1.0f;
      me.row_out[row] = reinterpret_cast<bf16*>(const_cast<uint8_t*>(sbuf) + off.combine + (int64_t(k) * T + t) * H * 2);
    }
  }
}

__global__ void row_pointers_kernel(bf16* y, int64_t n, int64_t H, bf16** out) {
  pdl_enter();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = y + i * H;
}

__global__ void set_count_kernel(int32_t* counts, int32_t n) {
  pdl_enter();
  counts[0] = n;
  counts[1] = 0;
}

// Real ranks: this call's token count into the rank's own rank_state, for the peers' dispatch.
__global__ void publish_tokens_kernel(int32_t* rank_state, int32_t n) { rank_state[0] = n; }

bool debug_zeroing_env() {
  const char* v = std::getenv("MOEFQ_COMM_KERNEL_DEBUG");
  return v && std::strcmp(v, "1") == 0;
}

int sm_count() {
  int dev = 0, n = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFQ_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

}  // namespace

// The weights of a set of experts of one shape, contiguous on the device (expert e's matrices at
// e times their size), as the grouped GEMMs' bulk tensor loads read them.
struct ExpertSet {
  int64_t count = 0, inter = 0;
  DeviceBuffer<uint8_t> gate_up, down;
  DeviceBuffer<float> gate_up_scale, down_scale;

  ExpertSet() = default;
  // Allocated, not filled.
  ExpertSet(int64_t n, WeightFormat f, int64_t H, int64_t I) : count(n), inter(I) {
    const bool e4m3 = f == WeightFormat::kE4m3;
    const size_t elem = e4m3 ? 1 : 2;
    gate_up = DeviceBuffer<uint8_t>(size_t(n * 2 * I * H) * elem);
    down = DeviceBuffer<uint8_t>(size_t(n * H * I) * elem);
    gate_up_scale = DeviceBuffer<float>(e4m3 ? size_t(n * (2 * I / kB) * (H / kB)) : 0);
    down_scale = DeviceBuffer<float>(e4m3 ? size_t(n * (H / kB) * (I / kB)) : 0);
  }
  // Allocated and filled from host weights.
  ExpertSet(const std::vector<ExpertWeights>& experts, WeightFormat f, int64_t H, int64_t I)
      : ExpertSet(int64_t(experts.size()), f, H, I) {
    const bool e4m3 = f == WeightFormat::kE4m3;
    const size_t elem = e4m3 ? 1 : 2, gu_bytes = size_t(2 * I * H) * elem, dn_bytes = size_t(H * I) * elem;
    const size_t gu_scales = size_t((2 * I / kB) * (H / kB)), dn_scales = size_t((H / kB) * (I / kB));
    for (size_t e = 0; e < experts.size(); ++e) {
      const ExpertWeights& w = experts[e];
      MOEFQ_CHECK(w.format == f && w.hidden == H && w.intermediate == I, "cuda engine: expert weights of format ",
                  weight_format_name(w.format), " H=", w.hidden, " I=", w.intermediate, " where ", weight_format_name(f),
                  " H=", H, " I=", I, " is expected");
      const void* gu = e4m3 ? static_cast<const void*>(w.gate_up_e4m3.data()) : w.gate_up_bf16.data();
      const void* dn = e4m3 ? static_cast<const void*>(w.down_e4m3.data()) : w.down_bf16.data();
      MOEFQ_CUDA_CHECK(cudaMemcpy(gate_up.get() + e * gu_bytes, gu, gu_bytes, cudaMemcpyHostToDevice));
      MOEFQ_CUDA_CHECK(cudaMemcpy(down.get() + e * dn_bytes, dn, dn_bytes, cudaMemcpyHostToDevice));
      if (e4m3) {
        MOEFQ_CUDA_CHECK(cudaMemcpy(gate_up_scale.get() + e * gu_scales, w.gate_up_scale.data(), gu_scales * 4,
                                    cudaMemcpyHostToDevice));
        MOEFQ_CUDA_CHECK(cudaMemcpy(down_scale.get() + e * dn_scales, w.down_scale.data(), dn_scales * 4,
                                    cudaMemcpyHostToDevice));
      }
    }
  }
  DeviceExpertSet view() const {
    return {gate_up.get(), gate_up_scale.get(), down.get(), down_scale.get(), count, inter};
  }
};

struct CudaEngine::RankState {
  uint8_t* buf = nullptr;        // the rank's symmetric buffer
  DeviceBuffer<uint8_t> buffer;  // its memory, when simulated (a real rank's belongs to the link)
  ExpertSet routed, shared;
  DeviceBuffer<int32_t> counts, offsets;  // [el + 1]
  DeviceBuffer<float> row_weight;         // [pool_rows]
  DeviceBuffer<bf16*> row_out;            // [pool_rows]
  DeviceBuffer<float> ones;               // [T]: the shared expert's weight
  DeviceBuffer<bf16*> shared_out;         // [T]: slot K's combine rows
  // shared_expert() on its own: staged x, its h (e4m3 with scales, or bf16 and no scales with
  // staging none), its output rows and counts.
  DeviceBuffer<uint8_t> solo_x8, solo_h8;
  DeviceBuffer<float> solo_xs, solo_hs;
  DeviceBuffer<bf16*> solo_out;
  DeviceBuffer<int32_t> solo_count;  // {n, 0}
};

namespace {

// One grouped pass of experts over pooled rows: gate/up GEMM + SwiGLU, then down GEMM.
struct ExpertPass {
  const ExpertSet* set;
  const int32_t* counts;
  const int32_t* offsets;
  int num_groups;
  const uint8_t* a;  // staged input rows, stride H elements (e4m3, or bf16 with staging none)
  const float* a_scale;  // null with staging none
  const float* row_weight;
  uint8_t* h8;  // h (re-staged e4m3, or bf16), stride ldh elements
  float* h_scale;  // null with staging none
  int64_t ldh;
  bf16* const* row_out;
  int64_t rows_bound;
  int64_t a_rows;  // rows allocated at a
};

// The shape and operands of one grouped GEMM of the pass: rows of `a` (stride lda bytes, 1x128
// scales) times every group's weights, stored contiguously (group g at g * n * k elements).
GroupedGemmArgs gemm_args(const ExpertPass& p, Staging st, WeightFormat f, int64_t n, int64_t k, const uint8_t* a,
                          int64_t lda, const float* a_scale, const void* weights, const float* scales) {
  GroupedGemmArgs g;
  g.a_format = st == Staging::kNone ? WeightFormat::kBf16 : WeightFormat::kE4m3;
  g.num_groups = p.num_groups;
  g.max_total_rows = p.rows_bound;
  g.n = n;
  g.k = k;
  g.counts = p.counts;
  g.row_offset = p.offsets;
  g.a = a;
  g.lda = lda;
  g.a_scale = a_scale;
  g.lda_scale = lda / kB;
  g.a_rows = p.a_rows;
  g.b_format = f;
  g.b_all = weights;
  g.b_scale_all = f == WeightFormat::kE4m3 ? scales : nullptr;
  return g;
}

// pdl: the stream's previous operation is a kernel (cuda_base/pdl.cuh); so is each GEMM for the next.
void run_pass(const ExpertPass& p, int64_t H, std::optional<float> clamp, WeightFormat f, Staging st,
              cudaStream_t stream, bool pdl) {
  const int64_t I = p.set->inter;
  SwigluEpilogue e1;
  e1.row_weight = p.row_weight;
  e1.has_clamp = clamp.has_value();
  e1.clamp = clamp.value_or(0.0f);
  if (st == Staging::kNone)
    e1.h16 = reinterpret_cast<bf16*>(p.h8);
  else
    e1.h8 = p.h8;
  e1.ldh = p.ldh;
  e1.h_scale = p.h_scale;
  e1.ldh_scale = p.ldh / kB;
  GroupedGemmArgs g1 =
      gemm_args(p, st, f, 2 * I, H, p.a, H, p.a_scale, p.set->gate_up.get(), p.set->gate_up_scale.get());
  g1.pdl = pdl;
  launch_gemm_swiglu(g1, e1, stream);
  StoreEpilogue e2;
  e2.row_out = p.row_out;
  GroupedGemmArgs g2 = gemm_args(p, st, f, H, I, p.h8, p.ldh, p.h_scale, p.set->down.get(), p.set->down_scale.get());
  g2.pdl = pdl;
  launch_gemm_store(g2, e2, stream);
}

}  // namespace

CudaEngine::CudaEngine(const MoeConfig& cfg, int64_t R, int64_t T, const std::vector<LayerWeights>& w,
                       EngineOptions options)
    : cfg_(cfg),
      layout_(engine_buffer_shape(cfg, R, T, w, options)),
      debug_zeroing_(debug_zeroing_env()),
      weighting_(options.combine_weighting) {
  MOEFQ_CHECK(int64_t(w.size()) == R, "cuda engine: ", w.size(), " ranks of weights given for ", R, " ranks");
  init(w, nullptr);
}

namespace {
BufferShape shape_with_format(const MoeConfig& cfg, int64_t R, int64_t T, WeightFormat f, const EngineOptions& o) {
  BufferShape sh = engine_buffer_shape(cfg, R, T, {}, o);
  sh.weight_format = f;
  return sh;
}
}  // namespace

CudaEngine::CudaEngine(const MoeConfig& cfg, int64_t R, int64_t T, WeightFormat format, const WeightFill& fill,
                       EngineOptions options)
    : cfg_(cfg),
      layout_(shape_with_format(cfg, R, T, format, options)),
      debug_zeroing_(debug_zeroing_env()),
      weighting_(options.combine_weighting) {
  init({}, &fill);
}

CudaEngine::CudaEngine(const MoeConfig& cfg, RankLink& link, int64_t T, const LayerWeights& w, EngineOptions options)
    : cfg_(cfg),
      layout_(engine_buffer_shape(cfg, link.num_ranks(), T, {&w, 1}, options)),
      debug_zeroing_(debug_zeroing_env()),
      weighting_(options.combine_weighting),
      link_(&link),
      first_rank_(link.rank()) {
  init({&w, 1}, nullptr);
}

void CudaEngine::init(std::span<const LayerWeights> w, const WeightFill* fill) {
  const BufferShape& sh = layout_.shape();
  const int64_t R = sh.num_ranks, T = sh.max_tokens, el = sh.local_experts(), P = sh.pool_rows(), H = sh.hidden;
  MOEFQ_CHECK(R <= kMaxRanks, "cuda engine: at most ", kMaxRanks, " ranks, got ", R);
  prepare_grouped_gemm();  // kernel attributes now, never during a graph capture
  const int64_t Is = cfg_.intermediate * cfg_.num_shared;
  const size_t local = fill ? size_t(R) : w.size();
  for (size_t i = 0; i < w.size(); ++i) {
    const int64_t r = first_rank_ + int64_t(i);
    MOEFQ_CHECK(w[i].first_expert == r * el && int64_t(w[i].experts.size()) == el, "cuda engine: rank ", r,
                " must hold experts [", r * el, ", ", (r + 1) * el, "), got ", w[i].experts.size(), " from ",
                w[i].first_expert);
    MOEFQ_CHECK(cfg_.num_shared == 0 || w[i].shared.size() == 1, "cuda engine: rank ", r, " has no shared expert weights");
  }
  // Every rank's buffer as this process addresses it; the simulated ones are allocated below.
  std::vector<uint8_t*> bufs = link_ ? link_->symmetric_buffers(layout_.total_bytes()) : std::vector<uint8_t*>(size_t(R));
  MOEFQ_ASSERT(int64_t(bufs.size()) == R, "cuda engine: the link gave ", bufs.size(), " buffers for ", R, " ranks");
  for (size_t i = 0; i < local; ++i) {
    auto rs = std::make_unique<RankState>();
    if (!link_) {
      rs->buffer = DeviceBuffer<uint8_t>(layout_.total_bytes());
      MOEFQ_CUDA_CHECK(cudaMemset(rs->buffer.get(), 0, layout_.total_bytes()));
      bufs[size_t(first_rank_) + i] = rs->buffer.get();
    }
    rs->buf = bufs[size_t(first_rank_) + i];
    if (fill) {
      rs->routed = ExpertSet(el, sh.weight_format, H, cfg_.intermediate);
      if (cfg_.num_shared > 0) rs->shared = ExpertSet(1, sh.weight_format, H, Is);
      (*fill)(first_rank_ + int64_t(i), rs->routed.view(), rs->shared.view());
    } else {
      rs->routed = ExpertSet(w[i].experts, sh.weight_format, H, cfg_.intermediate);
      if (cfg_.num_shared > 0) rs->shared = ExpertSet(w[i].shared, sh.weight_format, H, Is);
    }
    rs->counts = DeviceBuffer<int32_t>(std::vector<int32_t>(size_t(el + 1), 0));
    rs->offsets = DeviceBuffer<int32_t>(std::vector<int32_t>(size_t(el + 1), 0));
    rs->row_weight = DeviceBuffer<float>(size_t(P));
    rs->row_out = DeviceBuffer<bf16*>(size_t(P));
    rs->ones = DeviceBuffer<float>(std::vector<float>(size_t(T), 1.0f));
    std::vector<bf16*> out(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t)
      out[size_t(t)] = sh.fused_shared_slots() ? reinterpret_cast<bf16*>(rs->buf + layout_.combine_row_offset(cfg_.top_k, t)) : nullptr;
    rs->shared_out = DeviceBuffer<bf16*>(out);
    if (cfg_.num_shared > 0 && !sh.fused_shared_slots()) {
      const bool scaled = sh.staging == Staging::kE4m3;
      rs->solo_x8 = DeviceBuffer<uint8_t>(size_t(T * H * sh.staged_elem_bytes()));
      rs->solo_xs = DeviceBuffer<float>(scaled ? size_t(T * (H / kB)) : 0);
      rs->solo_h8 = DeviceBuffer<uint8_t>(size_t(T * Is * sh.staged_elem_bytes()));
      rs->solo_hs = DeviceBuffer<float>(scaled ? size_t(T * (Is / kB)) : 0);
      rs->solo_out = DeviceBuffer<bf16*>(size_t(T));
      rs->solo_count = DeviceBuffer<int32_t>(std::vector<int32_t>{0, 0});
    }
    ranks_.push_back(std::move(rs));
  }
  // A rank this process does not compute is reached only through its buffer.
  std::vector<RankPtrs> ptrs(size_t(R), RankPtrs{});
  for (int64_t r = 0; r < R; ++r) ptrs[size_t(r)].buf = bufs[size_t(r)];
  for (size_t i = 0; i < ranks_.size(); ++i) {
    RankState& rs = *ranks_[i];
    ptrs[size_t(first_rank_) + i] = {rs.buf, rs.counts.get(), rs.offsets.get(), rs.row_weight.get(), rs.row_out.get()};
  }
  rank_ptrs_ = DeviceBuffer<uint8_t>(ptrs.size() * sizeof(RankPtrs));
  MOEFQ_CUDA_CHECK(cudaMemcpy(rank_ptrs_.get(), ptrs.data(), rank_ptrs_.bytes(), cudaMemcpyHostToDevice));
  land_host_copies();  // the buffers' zeroing, the weights and these pointers, before any stream's work
}

CudaEngine::~CudaEngine() = default;

const uint8_t* CudaEngine::buffer(int64_t rank) const {
  MOEFQ_ASSERT(rank >= first_rank_ && rank < first_rank_ + num_local_ranks(), "buffer: rank ", rank,
               " is not computed by this process");
  return ranks_[size_t(rank - first_rank_)]->buf;
}

void CudaEngine::synchronize(cudaStream_t stream) {
  MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (link_) link_->check();
}

void CudaEngine::forward(std::span<const DeviceBatch> batches, cudaStream_t stream, const std::vector<bool>& skip_combine) {
  const BufferShape& sh = layout_.shape();
  const int64_t R = sh.num_ranks, T = sh.max_tokens, K = sh.top_k, H = sh.hidden, el = sh.local_experts();
  const int64_t P = sh.pool_rows(), imax = std::max(sh.intermediate, sh.shared_intermediate);
  const int64_t nl = num_local_ranks(), r0 = first_rank_;
  const Staging st = sh.staging;
  const bool scaled = st == Staging::kE4m3;
  MOEFQ_CHECK(int64_t(batches.size()) == nl, "forward: ", batches.size(), " batches for ", nl, " ranks");
  check_skip_flags(skip_combine, nl, "forward");  // before any work is enqueued (combine() checks again)
  TokenCounts tc{};
  tc.published = link_ != nullptr;
  int64_t sent = 0;
  for (int64_t i = 0; i < nl; ++i) {
    const DeviceBatch& b = batches[size_t(i)];
    const int64_t r = r0 + i;
    MOEFQ_CHECK(b.num_tokens >= 0 && b.num_tokens <= T, "forward: rank ", r, " has ", b.num_tokens,
                " tokens; the buffer holds at most ", T);
    MOEFQ_CHECK(b.num_tokens == 0 || (b.x && b.topk_idx && b.topk_weights && b.y), "forward: rank ", r, ": null tensor");
    tc.n[r] = int32_t(b.num_tokens);
    sent += b.num_tokens * std::min(K, el);
  }
  // The routed GEMMs' row bound sets only their launch shape, never their results. Real ranks:
  // the peers' token counts are device data, so the pool's size bounds the rows.
  const int64_t routed_rows = link_ ? P : std::min(P, sent);
  const Offsets off{layout_.expert_counts.offset, layout_.expert_lists.offset, layout_.staged_x.offset,
                    layout_.staged_scales.offset,  layout_.topk_idx.offset,     layout_.topk_weights.offset,
                    layout_.pool_x.offset,         layout_.pool_x_scales.offset, layout_.combine.offset,
                    layout_.rank_state.offset};
  const auto* rp = reinterpret_cast<const RankPtrs*>(rank_ptrs_.get());

  // Token side: stage x (staging none: a copy of the bf16 rows), publish topk (and, real ranks, the
  // token count) in the rank's own buffer.
  for (int64_t i = 0; i < nl; ++i) {
    const DeviceBatch& b = batches[size_t(i)];
    uint8_t* buf = ranks_[size_t(i)]->buf;
    if (link_) {
      publish_tokens_kernel<<<1, 1, 0, stream>>>(reinterpret_cast<int32_t*>(buf + off.rank_state), int32_t(b.num_tokens));
      MOEFQ_CUDA_CHECK_LAUNCH();
    }
    if (b.num_tokens == 0) continue;
    if (scaled)
      launch_stage_e4m3(b.x, buf + off.staged_x, reinterpret_cast<float*>(buf + off.staged_scales), b.num_tokens, H, stream);
    else
      MOEFQ_CUDA_CHECK(cudaMemcpyAsync(buf + off.staged_x, b.x, size_t(b.num_tokens * H) * 2, cudaMemcpyDeviceToDevice,
                                       stream));
    MOEFQ_CUDA_CHECK(cudaMemcpyAsync(buf + off.topk_idx, b.topk_idx, size_t(b.num_tokens * K) * 4, cudaMemcpyDeviceToDevice, stream));
    MOEFQ_CUDA_CHECK(cudaMemcpyAsync(buf + off.topk_weights, b.topk_weights, size_t(b.num_tokens * K) * 4,
                                     cudaMemcpyDeviceToDevice, stream));
  }
  // Every rank's tokens, topk and count are in place before any rank's dispatch reads them.
  if (link_) link_->barrier("engine: tokens staged, before the dispatch", stream);
  // Dispatch, plan, pull.
  dispatch_kernel<<<unsigned(nl * el), kThreads, 0, stream>>>(rp, off, tc, int(R), int(T), int(K), int(el), int(r0));
  MOEFQ_CUDA_CHECK_LAUNCH();
  // From here on every operation is a kernel that follows a kernel (real ranks: up to the
  // barrier before the combine, and their path keeps full serialisation).
  const bool pdl = !link_ && pdl_enabled();
  launch_chained(plan_kernel, dim3(unsigned(nl)), dim3(32), 0, stream, pdl, rp, off, tc, int(r0), int(el));
  static const int sms = sm_count();
  const unsigned splits = unsigned(std::clamp<int64_t>((2 * sms + nl * el - 1) / (nl * el), 1, 64));
  launch_chained(pull_kernel, dim3(unsigned(el), unsigned(nl), splits), dim3(kThreads), 0, stream, pdl, rp, off, int(R),
                 int(T), int(K), int(el), int(H), int(H * sh.staged_elem_bytes()), scaled, int(r0),
                 weighting_ == CombineWeighting::kBefore);

  // Expert side of each rank: the routed experts over its pool, the fused shared expert over its
  // own staged tokens (intermediates after the pool, rows into slot K).
  for (int64_t i = 0; i < nl; ++i) {
    RankState& rs = *ranks_[size_t(i)];
    const int64_t n = batches[size_t(i)].num_tokens;
    uint8_t* buf = rs.buf;
    auto* h8 = buf + layout_.pool_h.offset;
    const int64_t hrow = imax * sh.staged_elem_bytes();  // bytes of a pool_h row
    // Scales where the staging has them (none: null, the GEMMs read none).
    auto* hs = scaled ? reinterpret_cast<float*>(buf + layout_.pool_h_scales.offset) : nullptr;
    const auto* xs = scaled ? reinterpret_cast<const float*>(buf + off.pool_x_scales) : nullptr;
    const auto* ss = scaled ? reinterpret_cast<const float*>(buf + off.staged_scales) : nullptr;
    run_pass({&rs.routed, rs.counts.get(), rs.offsets.get(), int(el), buf + off.pool_x, xs, rs.row_weight.get(), h8, hs,
              imax, rs.row_out.get(), routed_rows, P},
             H, cfg_.swiglu_clamp, sh.weight_format, st, stream, pdl);
    if (fused_shared() && n > 0)
      run_pass({&rs.shared, rs.counts.get() + el, rs.offsets.get() + el, 1, buf + off.staged_x, ss, rs.ones.get(),
                h8 + P * hrow, scaled ? hs + P * (imax / kB) : nullptr, imax, rs.shared_out.get(), n, T},
               H, cfg_.swiglu_clamp, sh.weight_format, st, stream, pdl);
  }
  // Every expert rank's rows are in this rank's combine region before the combine reads them, and
  // no peer still pulls from the staged tokens that the next call overwrites.
  if (link_) link_->barrier("engine: combine rows written, before the combine", stream);

  combine_ranks(batches, stream, skip_combine, pdl);
  if (debug_zeroing_)
    for (auto& rs : ranks_) MOEFQ_CUDA_CHECK(cudaMemsetAsync(rs->buf, 0, layout_.total_bytes(), stream));
}

void CudaEngine::combine(std::span<const DeviceBatch> batches, cudaStream_t stream, const std::vector<bool>& skip) {
  combine_ranks(batches, stream, skip, false);  // after whatever the caller enqueued
}

void CudaEngine::combine_ranks(std::span<const DeviceBatch> batches, cudaStream_t stream, const std::vector<bool>& skip,
                               bool pdl) {
  MOEFQ_CHECK(int64_t(batches.size()) == num_local_ranks(), "combine: ", batches.size(), " batches for ",
              num_local_ranks(), " ranks");
  check_skip_flags(skip, num_local_ranks(), "combine");
  // On each token rank.
  for (size_t i = 0; i < batches.size(); ++i) {
    const DeviceBatch& b = batches[i];
    if (b.num_tokens == 0 || (!skip.empty() && skip[i])) continue;
    CombineRows rows;
    rows.buffer = ranks_[i]->buf;
    rows.combine_offset = layout_.combine.offset;
    rows.max_tokens = max_tokens();
    rows.top_k = cfg_.top_k;
    rows.hidden = cfg_.hidden;
    rows.fused_shared = fused_shared();
    rows.topk_idx = reinterpret_cast<const int32_t*>(rows.buffer + layout_.topk_idx.offset);
    if (weighting_ == CombineWeighting::kAfter)
      rows.topk_weights = reinterpret_cast<const float*>(rows.buffer + layout_.topk_weights.offset);
    rows.num_tokens = b.num_tokens;
    launch_combine(rows, b.y, stream, pdl);
    pdl = pdl_enabled();  // the next rank's combine follows this one
  }
}

void CudaEngine::shared_expert(int64_t rank, const bf16* x, int64_t n, bf16* y, cudaStream_t stream) {
  MOEFQ_CHECK(cfg_.num_shared > 0, "shared_expert: the config has no shared expert");
  MOEFQ_CHECK(!fused_shared(), "shared_expert: the shared expert is fused into the engine (slot K)");
  MOEFQ_ASSERT(rank >= first_rank_ && rank < first_rank_ + num_local_ranks(), "shared_expert: rank ", rank,
               " is not computed by this process");
  MOEFQ_CHECK(n >= 0 && n <= max_tokens(), "shared_expert: ", n, " tokens; at most ", max_tokens());
  if (n == 0) return;
  RankState& rs = *ranks_[size_t(rank - first_rank_)];
  const int64_t H = cfg_.hidden, Is = rs.shared.inter;
  const Staging st = layout_.shape().staging;
  const bool scaled = st == Staging::kE4m3;
  // Staging none: a copy of the bf16 x (the GEMM's 16-byte loads need an aligned base, which a
  // caller's view need not have).
  if (scaled)
    launch_stage_e4m3(x, rs.solo_x8.get(), rs.solo_xs.get(), n, H, stream);
  else
    MOEFQ_CUDA_CHECK(cudaMemcpyAsync(rs.solo_x8.get(), x, size_t(n * H) * 2, cudaMemcpyDeviceToDevice, stream));
  const uint8_t* a = rs.solo_x8.get();
  const bool pdl = pdl_enabled();  // each of the kernels below follows a kernel (the first: the staging's)
  launch_chained(row_pointers_kernel, dim3(unsigned((n + 255) / 256)), dim3(256), 0, stream, pdl && scaled, y, n, H,
                 rs.solo_out.get());
  launch_chained(set_count_kernel, dim3(1), dim3(1), 0, stream, pdl, rs.solo_count.get(), int32_t(n));
  run_pass({&rs.shared, rs.solo_count.get(), rs.solo_count.get() + 1, 1, a, scaled ? rs.solo_xs.get() : nullptr,
            rs.ones.get(), rs.solo_h8.get(), scaled ? rs.solo_hs.get() : nullptr, Is, rs.solo_out.get(), n,
            max_tokens()},
           H, cfg_.swiglu_clamp, layout_.shape().weight_format, st, stream, pdl);
}

}  // namespace moefq::cuda
