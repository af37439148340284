#include "engine/cuda/combine_kernels.cuh"

#include <algorithm>
#include <type_traits>

#include "cuda_base/cuda_check.h"
#include "cuda_base/pdl.cuh"
#include "quant/cuda/qdq_rules.cuh"

namespace moefq::cuda {
namespace {

using namespace rules;

// One CTA covers kThreads 16-byte chunks (8 bf16) of a token's H; each thread sums its chunk over
// the token's active rows. A CTA loops over a few tokens (grid-stride along grid.x, see
// launch_rule), so a rule's per-CTA setup (its divisions, the nvfp4 table) is paid once for them.
// 128 threads is also what Rule<kNvfp4> needs to fill its table.
constexpr int kThreads = 128;
constexpr int kChunkElems = kCombineElems;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
static_assert(kThreads >= 128 && kThreads % 32 == 0);

// The rule of the unquantized sum (the plain combine, or quantize = false).
struct NoQdq {
  using Shared = NoShared;
  static constexpr int kBlock = 0;
  __device__ NoQdq(const float*, Shared&) {}
  template <int kLanes>
  __device__ void combine_chunk(const CombineWords& w, float (&v)[kChunkElems]) const { unpack(w, v); }
};

struct Params {
  const uint8_t* rows;      // buffer + combine_offset: [K + fused][T][H] bf16
  const uint8_t* shared;    // the shared rows [T][H] bf16 (slot K of rows, or CombineRows::shared)
  uint64_t slot_stride;     // T * H * 2: bytes from one slot's rows to the next
  int64_t hidden;           // H
  int64_t num_tokens;
  int chunks_per_row;       // H / 8
  int top_k;                // K
  bool fused;
  const int32_t* topk_idx;  // [num_tokens, K]
  const float* topk_weights;  // [num_tokens, K] fp32 (combine_weighting after) or null
  const float* amax;        // device global amax (formats that have one)
  const bf16* y_engine;     // [num_tokens, H] or null
  CheckRecord* record;
  bool trap;
  bf16* y_out;              // [num_tokens, H]
};

// The rows are read once and never written during the kernel: non-coherent path, no L1 allocation.
__device__ __forceinline__ int4 load_row_chunk(const uint8_t* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ uint16_t half_word(int4 raw, int i) {
  const uint32_t w[4] = {uint32_t(raw.x), uint32_t(raw.y), uint32_t(raw.z), uint32_t(raw.w)};
  return uint16_t(w[i / 2] >> (16 * (i % 2)));
}

// Adds one routed row's chunk to the sum: the rule's combine_chunk gives the values of the QDQ the
// CPU quantizer applies (a bf16 row), blocks spanning kLanes consecutive lanes (whole, because H
// is a multiple of the block and each warp starts on a multiple of 32 chunks of the row). With a
// check, the unquantized values go into `plain` as well. weight: the slot's router weight (read
// only when kWeighted).
template <typename R, bool kCheck, bool kWeighted>
__device__ __forceinline__ void add_routed(R& rule, int4 raw, float weight, float (&acc)[kChunkElems],
                                           float (&plain)[kChunkElems]) {
  constexpr int kLanes = R::kBlock ? R::kBlock / kChunkElems : 1;
  const CombineWords w = {uint32_t(raw.x), uint32_t(raw.y), uint32_t(raw.z), uint32_t(raw.w)};
  float v[kChunkElems];
  if constexpr (kCheck && !std::is_same_v<R, NoQdq>) {
    unpack(w, v);
#pragma unroll
    for (int i = 0; i < kChunkElems; ++i) plain[i] = accumulate<kWeighted>(plain[i], weight, v[i]);
  }
  rule.template combine_chunk<kLanes>(w, v);
#pragma unroll
  for (int i = 0; i < kChunkElems; ++i) acc[i] = accumulate<kWeighted>(acc[i], weight, v[i]);
}

// Rules that QDQ two routed rows' chunks at once (Rule<kNvfp4>::combine_chunk_pair).
template <typename R>
concept PairRule = requires(const R& r, const CombineWords& w, float (&v)[kChunkElems]) {
  r.combine_chunk_pair(w, w, v, v);
};

// add_routed for two rows a, b (consecutive active slots, a first), their QDQ done together.
template <typename R, bool kCheck, bool kWeighted>
__device__ __forceinline__ void add_routed_pair(const R& rule, int4 raw_a, int4 raw_b, float weight_a, float weight_b,
                                                float (&acc)[kChunkElems], float (&plain)[kChunkElems]) {
  const CombineWords wa = {uint32_t(raw_a.x), uint32_t(raw_a.y), uint32_t(raw_a.z), uint32_t(raw_a.w)};
  const CombineWords wb = {uint32_t(raw_b.x), uint32_t(raw_b.y), uint32_t(raw_b.z), uint32_t(raw_b.w)};
  float va[kChunkElems], vb[kChunkElems];
  if constexpr (kCheck) {
    unpack(wa, va);
    unpack(wb, vb);
#pragma unroll
    for (int i = 0; i < kChunkElems; ++i)
      plain[i] = accumulate<kWeighted>(accumulate<kWeighted>(plain[i], weight_a, va[i]), weight_b, vb[i]);
  }
  rule.combine_chunk_pair(wa, wb, va, vb);
#pragma unroll
  for (int i = 0; i < kChunkElems; ++i)
    acc[i] = accumulate<kWeighted>(accumulate<kWeighted>(acc[i], weight_a, va[i]), weight_b, vb[i]);
}

// Rules that take a whole batch of slots at once (Rule<kLogfmt10>::combine_batch).
template <typename R>
concept BatchRule = requires(R& r, const int4 (&raw)[8], float (&v)[kChunkElems]) {
  r.template combine_batch<false>(raw, 0u, v, v);
};

// Routed slots handled per batch: all loads of a batch are issued before the first is used, so the
// K = 8 routed rows of the DeepSeek presets (and the fused shared row, loaded first) are in flight
// together. nvfp4's kernel is bound by instruction issue instead: with batches of 4 it needs
// fewer registers and no spills, so more CTAs fit an SM and each scheduler has more warps to pick
// from; the other formats, bound by the loads, keep more of them in flight with batches of 8.
template <typename R>
constexpr int kSlotBatch = std::is_same_v<R, Rule<Format::kNvfp4>> ? 4 : 8;

// grid = (tokens looped over, ceil(H / 8 / kThreads)). All lanes of a warp belong to one token, so
// the active-slot mask is warp-uniform: every branch on it is taken by the whole warp. Lanes past
// the row's end read the row's first chunk instead (real data, so their blocks and the warp's
// votes stay well defined) and take part in the shuffles, but neither compare nor store.
// kWeighted (combine_weighting after): lane k also reads slot k's router weight, and each active
// slot's weight reaches the warp by a shuffle from its lane.
template <typename R, bool kCheck, bool kWeighted>
__global__ void __launch_bounds__(kThreads) combine_kernel(const Params p) {
  pdl_enter();  // the rows and the amax are the previous kernels'
  constexpr int kBatch = kSlotBatch<R>;
  static_assert(kBatch % 2 == 0, "slots are paired within a batch");
  constexpr bool kQuant = !std::is_same_v<R, NoQdq>;
  __shared__ typename R::Shared shared;
  R rule(p.amax, shared);  // not const: logfmt10's rule keeps its vote's parity
  if constexpr (!std::is_same_v<typename R::Shared, NoShared>) __syncthreads();

  const int c = int(blockIdx.y) * kThreads + int(threadIdx.x);
  const bool in_row = c < p.chunks_per_row;
  if constexpr (requires { rule.bind_row(p.chunks_per_row, in_row); }) {
    static_assert(kThreads == 32 * R::kWarps, "logfmt10's cast groups are voted within the CTA");
    rule.bind_row(p.chunks_per_row, in_row);
  }
  const int c_read = in_row ? c : 0;
  const int lane = int(threadIdx.x) & 31;
  const bool slot_lane = lane < p.top_k;  // lane k reads slot k's expert index
  const uint64_t stride = p.slot_stride;

  int64_t t = blockIdx.x;
  int32_t expert = slot_lane && t < p.num_tokens ? __ldg(p.topk_idx + t * p.top_k + lane) : -1;
  float weight = 1.0f;
  if constexpr (kWeighted) weight = slot_lane && t < p.num_tokens ? __ldg(p.topk_weights + t * p.top_k + lane) : 1.0f;
  for (; t < p.num_tokens; t += gridDim.x) {
    // Bit k: routed slot k is active. The next token's indices are read now, under this token's rows.
    const uint32_t active = __ballot_sync(kFullMask, expert >= 0);
    const float slot_weight = weight;  // lane k: this token's slot k
    const int64_t next = t + gridDim.x;
    expert = slot_lane && next < p.num_tokens ? __ldg(p.topk_idx + next * p.top_k + lane) : -1;
    if constexpr (kWeighted)
      weight = slot_lane && next < p.num_tokens ? __ldg(p.topk_weights + next * p.top_k + lane) : 1.0f;

    const int64_t chunk = t * p.chunks_per_row + c;  // this thread's chunk of y
    int4 engine = make_int4(0, 0, 0, 0);
    if constexpr (kCheck) {
      // Read before y_out is written (they may alias); plain loads, as the array may be written.
      if (in_row) engine = __ldcs(reinterpret_cast<const int4*>(p.y_engine) + chunk);
    }
    const int64_t row_offset = (t * p.chunks_per_row + c_read) * int64_t(sizeof(int4));
    const uint8_t* row = p.rows + row_offset;
    int4 shared_raw = make_int4(0, 0, 0, 0);
    if (p.fused) shared_raw = load_row_chunk(p.shared + row_offset);

    // docs/engine.md's order: fp32 from +0, active routed slots ascending, then the shared slot (weighted
    // rows as one fma each, unweighted ones as adds).
    // Slots are visited by index in batches (no compaction): a slot costs a pointer add and one
    // uniform branch, an active one its load as well.
    float acc[kChunkElems] = {}, plain[kChunkElems] = {};
    for (uint32_t pending = active, slot0 = 0; pending != 0; pending >>= kBatch, slot0 += kBatch) {
      int4 raw[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j, row += stride) {
        if (pending & (1u << j))
          raw[j] = load_row_chunk(row);
        else if constexpr (BatchRule<R>)
          raw[j] = make_int4(0, 0, 0, 0);  // the batch rule reduces every slot's chunk
      }
      // Slot slot0 + j's router weight, from its lane (uniform: called under warp-uniform branches).
      const auto slot_w = [&](int j) {
        return kWeighted ? __shfl_sync(kFullMask, slot_weight, int(slot0) + j) : 1.0f;
      };
      if constexpr (BatchRule<R>) {
        static_assert(kBatch == R::kBatch);
        rule.template combine_batch<kCheck, kWeighted>(raw, pending & ((1u << kBatch) - 1u), acc, plain, slot_w);
      } else if constexpr (PairRule<R>) {
        // Slots j and j + 1 together when both are active (the usual case), else one by one.
#pragma unroll
        for (int j = 0; j < kBatch; j += 2) {
          const bool a = pending & (1u << j), b = pending & (2u << j);
          if (a && b) {
            add_routed_pair<R, kCheck, kWeighted>(rule, raw[j], raw[j + 1], slot_w(j), slot_w(j + 1), acc, plain);
          } else {
            if (a) add_routed<R, kCheck, kWeighted>(rule, raw[j], slot_w(j), acc, plain);
            if (b) add_routed<R, kCheck, kWeighted>(rule, raw[j + 1], slot_w(j + 1), acc, plain);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBatch; ++j)
          if (pending & (1u << j)) add_routed<R, kCheck, kWeighted>(rule, raw[j], slot_w(j), acc, plain);
      }
    }
    if (p.fused) {  // the shared row is not quantized
      float v[kChunkElems];
      const CombineWords w = {uint32_t(shared_raw.x), uint32_t(shared_raw.y), uint32_t(shared_raw.z),
                              uint32_t(shared_raw.w)};
      unpack(w, v);
#pragma unroll
      for (int i = 0; i < kChunkElems; ++i) {
        acc[i] = add_rn(acc[i], v[i]);
        if constexpr (kCheck && kQuant) plain[i] = add_rn(plain[i], v[i]);
      }
    }
    const int4 out = pack(acc);

    if constexpr (kCheck) {
      const int4 resum = kQuant ? pack(plain) : out;
      unsigned long long first = ~0ull, count = 0;
      if (in_row) {
#pragma unroll
        for (int i = kChunkElems - 1; i >= 0; --i) {
          const uint16_t r = half_word(resum, i), e = half_word(engine, i);
          if (r != e) {
            ++count;
            first = (uint64_t(t * p.hidden + int64_t(c) * kChunkElems + i) << 32) | (uint64_t(e) << 16) | r;
          }
        }
      }
      // Mismatches are the rare path: one pair of atomics per warp that has any.
      if (__any_sync(kFullMask, count != 0)) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          const unsigned long long f = __shfl_xor_sync(kFullMask, first, o);
          first = f < first ? f : first;
          count += __shfl_xor_sync(kFullMask, count, o);
        }
        if (lane == 0) {
          atomicMin(&p.record->first, first);
          atomicAdd(&p.record->mismatches, count);
        }
        if (p.trap) {
          __threadfence_system();
          __trap();
        }
      }
    }
    if (in_row) __stcs(reinterpret_cast<int4*>(p.y_out) + chunk, out);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Checks the rows' description; false when there is nothing to do (no tokens).
bool validate(const CombineRows& r, const bf16* y, const char* who) {
  MOEFQ_CHECK(r.top_k >= 1 && r.top_k <= 32, who, ": top_k is ", r.top_k, "; top-k must be 1..32");
  MOEFQ_CHECK(r.hidden > 0 && r.hidden % kMxBlock == 0, who, ": hidden size ", r.hidden,
              " is not a positive multiple of 32 (the engine needs a multiple of 128)");
  MOEFQ_CHECK(r.num_tokens >= 0 && r.num_tokens <= r.max_tokens, who, ": ", r.num_tokens,
              " tokens; the buffer holds at most ", r.max_tokens);
  if (r.num_tokens == 0) return false;
  MOEFQ_CHECK(r.buffer && r.topk_idx && y, who, ": null buffer, topk_idx or output");
  MOEFQ_CHECK(aligned16(r.buffer + r.combine_offset) && aligned16(y), who,
              ": the combine rows (buffer + offset ", r.combine_offset, ") and the output must be 16-byte aligned");
  MOEFQ_CHECK(!r.shared || aligned16(r.shared), who, ": the shared rows must be 16-byte aligned");
  return true;
}

Params make_params(const CombineRows& r, bf16* y) {
  Params p{};
  p.rows = r.buffer + r.combine_offset;
  p.slot_stride = uint64_t(r.max_tokens * r.hidden) * sizeof(bf16);
  p.hidden = r.hidden;
  p.num_tokens = r.num_tokens;
  p.chunks_per_row = int(r.hidden / kChunkElems);
  p.top_k = int(r.top_k);
  p.fused = r.fused_shared;
  p.shared = r.shared ? reinterpret_cast<const uint8_t*>(r.shared) : p.rows + uint64_t(r.top_k) * p.slot_stride;
  p.topk_idx = r.topk_idx;
  p.topk_weights = r.topk_weights;
  p.y_out = y;
  return p;
}

// Tokens per CTA: up to kMaxTokensPerCta, so a rule's per-CTA setup is paid once for several
// tokens, while the grid keeps about kCtasPerSm CTAs per SM (several waves, so the last, partial
// one costs little; one token per CTA for small calls, which need every CTA they can get).
constexpr int64_t kMaxTokensPerCta = 4;
constexpr int64_t kCtasPerSm = 32;

template <typename R>
void launch_rule(const Params& p, int64_t num_tokens, bool check, cudaStream_t stream, bool pdl = false) {
  int device = 0, sms = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&device));
  MOEFQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t groups = (p.chunks_per_row + kThreads - 1) / kThreads;
  const int64_t per_cta = std::clamp<int64_t>(num_tokens * groups / (kCtasPerSm * sms), 1, kMaxTokensPerCta);
  const dim3 grid{unsigned((num_tokens + per_cta - 1) / per_cta), unsigned(groups)};
  const bool with_weights = p.topk_weights != nullptr;
  auto* kernel = check ? (with_weights ? combine_kernel<R, true, true> : combine_kernel<R, true, false>)
                       : (with_weights ? combine_kernel<R, false, true> : combine_kernel<R, false, false>);
  launch_chained(kernel, grid, dim3(kThreads), 0, stream, pdl, p);
}

}  // namespace

void launch_combine(const CombineRows& rows, bf16* y, cudaStream_t stream, bool pdl) {
  if (!validate(rows, y, "launch_combine")) return;
  launch_rule<NoQdq>(make_params(rows, y), rows.num_tokens, false, stream, pdl);
}

void launch_combine_qdq(const CombineRows& rows, bool quantize, Format f, const float* d_amax,
                        const CombineCheck& check, bf16* y_out, cudaStream_t stream) {
  constexpr const char* kWho = "launch_combine_qdq";
  if (!validate(rows, y_out, kWho)) return;
  MOEFQ_CHECK(!quantize || d_amax || !format_has_global_amax(f), kWho, ": ", format_name(f),
              " needs a device amax");
  const bool with_check = check.y_engine != nullptr;
  if (with_check) {
    MOEFQ_CHECK(check.record != nullptr, kWho, ": a check needs a device record");
    MOEFQ_CHECK(aligned16(check.y_engine), kWho, ": the engine output must be 16-byte aligned");
    MOEFQ_CHECK(uint64_t(rows.num_tokens) * uint64_t(rows.hidden) <= (1ull << 32), kWho, ": ",
                rows.num_tokens, " x ", rows.hidden, " positions do not fit the check record's 32 bits");
  }
  MOEFQ_CHECK(!quantize || format_block_size(f) <= kMxBlock || rows.hidden % format_block_size(f) == 0, kWho,
              ": ", format_name(f), " needs a hidden size that is a multiple of ", format_block_size(f), ", got ",
              rows.hidden);
  Params p = make_params(rows, y_out);
  p.amax = d_amax;
  p.y_engine = check.y_engine;
  p.record = check.record;
  p.trap = check.trap;
  const int64_t n = rows.num_tokens;
  if (!quantize) return launch_rule<NoQdq>(p, n, with_check, stream);
  switch (f) {
    case Format::kFp8: return launch_rule<Rule<Format::kFp8>>(p, n, with_check, stream);
    case Format::kNvfp4: return launch_rule<Rule<Format::kNvfp4>>(p, n, with_check, stream);
    case Format::kMxfp8: return launch_rule<Rule<Format::kMxfp8>>(p, n, with_check, stream);
    case Format::kMxfp4: return launch_rule<Rule<Format::kMxfp4>>(p, n, with_check, stream);
    case Format::kInt8: return launch_rule<Rule<Format::kInt8>>(p, n, with_check, stream);
    case Format::kFp8Block128: return launch_rule<Rule<Format::kFp8Block128>>(p, n, with_check, stream);
    case Format::kFp8Block128Ue8m0: return launch_rule<Rule<Format::kFp8Block128Ue8m0>>(p, n, with_check, stream);
    case Format::kLogfmt10: return launch_rule<Rule<Format::kLogfmt10>>(p, n, with_check, stream);
    case Format::kFp8Cast: return launch_rule<Rule<Format::kFp8Cast>>(p, n, with_check, stream);
    case Format::kFp8CastNan: return launch_rule<Rule<Format::kFp8CastNan>>(p, n, with_check, stream);
    case Format::kFp8Block128Ue8m0NoFloor: return launch_rule<Rule<Format::kFp8Block128Ue8m0NoFloor>>(p, n, with_check, stream);
    case Format::kFp8Block128Mori: return launch_rule<Rule<Format::kFp8Block128Mori>>(p, n, with_check, stream);
    case Format::kFp4Block128Mori: return launch_rule<Rule<Format::kFp4Block128Mori>>(p, n, with_check, stream);
    case Format::kFp8Block128DeepGemm: return launch_rule<Rule<Format::kFp8Block128DeepGemm>>(p, n, with_check, stream);
    case Format::kFp8Block128Vllm: return launch_rule<Rule<Format::kFp8Block128Vllm>>(p, n, with_check, stream);
    case Format::kFp4Block16FlashInfer:
      return launch_rule<Rule<Format::kFp4Block16FlashInfer>>(p, n, with_check, stream);
  }
  MOEFQ_FAIL(ErrorKind::kInternal, kWho, ": unknown format");
}

void reset_check_record(CheckRecord* record, cudaStream_t stream) {
  MOEFQ_CUDA_CHECK(cudaMemsetAsync(&record->first, 0xFF, sizeof(record->first), stream));
  MOEFQ_CUDA_CHECK(cudaMemsetAsync(&record->mismatches, 0, sizeof(record->mismatches), stream));
}

std::optional<CheckMismatch> read_check(CheckRecord* record, int64_t hidden, cudaStream_t stream) {
  MOEFQ_ASSERT(record && hidden > 0, "read_check: null record or bad hidden size");
  CheckRecord host{};
  MOEFQ_CUDA_CHECK(cudaMemcpyAsync(&host, record, sizeof host, cudaMemcpyDeviceToHost, stream));
  MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (host.mismatches == 0 && host.first == ~0ull) return std::nullopt;
  reset_check_record(record, stream);
  const uint64_t pos = host.first >> 32;
  CheckMismatch m;
  m.token = int64_t(pos / uint64_t(hidden));
  m.element = int64_t(pos % uint64_t(hidden));
  m.engine_bits = uint16_t(host.first >> 16);
  m.resum_bits = uint16_t(host.first);
  m.count = host.mismatches;
  return m;
}

}  // namespace moefq::cuda
