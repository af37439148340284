#include "cuda/combine_kernels.cuh"

#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/qdq_rules.cuh"

namespace moefq::cuda {
namespace {

using namespace rules;

// One CTA covers kThreads 16-byte chunks (8 bf16) of one token's H; each thread sums its chunk
// over the token's active rows. 128 is also what Rule<kNvfp4> needs to fill its table.
constexpr int kThreads = 128;
// Routed row chunks a thread loads before it uses the first: the K = 8 routed rows of the DeepSeek
// presets in one batch (with the fused shared row, loaded first), so every load of a token is in
// flight together.
constexpr int kSlotBatch = 8;
constexpr int kChunkElems = 8;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
static_assert(kThreads >= 128 && kThreads % 32 == 0);

// The rule of the unquantized sum (the plain combine, or quantize = false).
struct NoQdq {
  using Shared = NoShared;
  __device__ NoQdq(const float*, Shared&) {}
};

struct Params {
  const uint8_t* rows;      // buffer + combine_offset: [K + fused][T][H] bf16
  uint64_t slot_stride;     // T * H * 2: bytes from one slot's rows to the next
  int64_t hidden;           // H
  int chunks_per_row;       // H / 8
  int top_k;                // K
  bool fused;
  const int32_t* topk_idx;  // [num_tokens, K]
  const float* amax;        // device global amax (formats that have one)
  const bf16* y_engine;     // [num_tokens, H] or null
  CheckRecord* record;
  bool trap;
  bf16* y_out;              // [num_tokens, H]
};

// The rows are read once and never written during the kernel: non-coherent path, no L1 allocation.
__device__ __forceinline__ int4 load_row_chunk(const int4* p) {
  int4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ void unpack(int4 raw, float (&v)[kChunkElems]) {
  const uint32_t w[4] = {uint32_t(raw.x), uint32_t(raw.y), uint32_t(raw.z), uint32_t(raw.w)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = f32_from_bits(w[i] << 16);
    v[2 * i + 1] = f32_from_bits(w[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ uint16_t half_word(int4 raw, int i) {
  const uint32_t w[4] = {uint32_t(raw.x), uint32_t(raw.y), uint32_t(raw.z), uint32_t(raw.w)};
  return uint16_t(w[i / 2] >> (16 * (i % 2)));
}

// QDQ of one 16-byte chunk of a bf16 row, with the block handling of qdq_vec_kernel: a block of
// the format spans kLanes consecutive lanes, which exchange their partial maxima. Blocks are whole
// because H is a multiple of the block and each warp starts on a multiple of 32 chunks of the row.
// The elements use the rule's sum-exact functions (qdq_rules.cuh): equal, as far as the fp32 sum
// can tell, to the QDQ of the CPU quantizer, which writes a bf16 row; so each result is rounded
// to bf16 unless the rule says it already is a bf16 value.
template <typename R>
__device__ __forceinline__ void qdq_chunk(const R& rule, float (&v)[kChunkElems]) {
  constexpr int kLanes = R::kBlock ? R::kBlock / kChunkElems : 1;
  static_assert(kLanes >= 1 && kLanes <= 32 && (32 % kLanes) == 0);
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunkElems; ++i) m = rule.reduce(m, v[i]);
#pragma unroll
  for (int o = 1; o < kLanes; o <<= 1) m = max_ignore_nan(m, __shfl_xor_sync(kFullMask, m, o));
  const auto param = rule.sum_block_param(m);
  if constexpr (requires { rule.apply_chunk_sum(v, param); }) {
    rule.apply_chunk_sum(v, param);
  } else {
#pragma unroll
    for (int i = 0; i < kChunkElems; ++i) v[i] = rule.apply_sum(v[i], param);
  }
  if (rule.sum_needs_bf16_round(param)) unpack(pack(v), v);
}

// grid = (num_tokens, ceil(H / 8 / kThreads)). All lanes of a warp belong to one token, so the
// active-slot mask is warp-uniform: every branch on it is taken by the whole warp, and lanes past
// the row's end still take part in the shuffles (on zeros) but neither compare nor store.
template <typename R, bool kCheck>
__global__ void __launch_bounds__(kThreads) combine_kernel(const Params p) {
  constexpr bool kQuant = !std::is_same_v<R, NoQdq>;
  __shared__ typename R::Shared shared;
  const R rule(p.amax, shared);
  if constexpr (!std::is_same_v<typename R::Shared, NoShared>) __syncthreads();

  const int64_t t = blockIdx.x;
  const int c = int(blockIdx.y) * kThreads + int(threadIdx.x);
  const bool in_row = c < p.chunks_per_row;
  const int lane = int(threadIdx.x) & 31;
  const int64_t chunk = t * p.chunks_per_row + c;  // this thread's chunk of y (and of a slot's rows)

  // Bit k: routed slot k is active (one lane per slot). The fused shared slot K is read last.
  const int32_t expert = lane < p.top_k ? __ldg(p.topk_idx + t * p.top_k + lane) : -1;
  uint32_t pending = __ballot_sync(kFullMask, expert >= 0);

  int4 engine = make_int4(0, 0, 0, 0);
  if constexpr (kCheck) {
    // Read before y_out is written (they may alias); plain loads, as the array may be written.
    if (in_row) engine = __ldcs(reinterpret_cast<const int4*>(p.y_engine) + chunk);
  }

  const uint8_t* row0 = p.rows + chunk * int64_t(sizeof(int4));
  const int4 zero = make_int4(0, 0, 0, 0);
  const int4 shared_raw = p.fused && in_row ? load_row_chunk(reinterpret_cast<const int4*>(row0 + uint32_t(p.top_k) * p.slot_stride)) : zero;
  // engine.md's order: fp32 from +0, active routed slots ascending, then the shared slot; no fma.
  float acc[kChunkElems] = {}, plain[kChunkElems] = {};
  while (pending != 0) {
    int4 raw[kSlotBatch];
    int num = 0;  // slots of this batch (warp-uniform)
#pragma unroll
    for (int j = 0; j < kSlotBatch; ++j) {
      const uint32_t slot = uint32_t(__ffs(int(pending))) - 1u;  // ~0u when none is left
      num += pending != 0 ? 1 : 0;
      raw[j] = pending != 0 && in_row ? load_row_chunk(reinterpret_cast<const int4*>(row0 + slot * p.slot_stride)) : zero;
      pending &= pending - 1u;
    }
#pragma unroll
    for (int j = 0; j < kSlotBatch; ++j) {
      if (j >= num) break;
      float v[kChunkElems];
      unpack(raw[j], v);
      if constexpr (kQuant) {
        if constexpr (kCheck) {
#pragma unroll
          for (int i = 0; i < kChunkElems; ++i) plain[i] = add_rn(plain[i], v[i]);
        }
        qdq_chunk(rule, v);
      }
#pragma unroll
      for (int i = 0; i < kChunkElems; ++i) acc[i] = add_rn(acc[i], v[i]);
    }
  }
  if (p.fused) {  // the shared row is not quantized
    float v[kChunkElems];
    unpack(shared_raw, v);
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

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Checks the rows' description; false when there is nothing to do (no tokens).
bool validate(const CombineRows& r, const bf16* y, const char* who) {
  MOEFQ_CHECK(r.top_k >= 1 && r.top_k <= 32, who, ": top_k is ", r.top_k, "; engine.md allows 1..32");
  MOEFQ_CHECK(r.hidden > 0 && r.hidden % kMxBlock == 0, who, ": hidden size ", r.hidden,
              " is not a positive multiple of 32 (engine.md: a multiple of 128)");
  MOEFQ_CHECK(r.num_tokens >= 0 && r.num_tokens <= r.max_tokens, who, ": ", r.num_tokens,
              " tokens; the buffer holds at most ", r.max_tokens);
  if (r.num_tokens == 0) return false;
  MOEFQ_CHECK(r.buffer && r.topk_idx && y, who, ": null buffer, topk_idx or output");
  MOEFQ_CHECK(aligned16(r.buffer + r.combine_offset) && aligned16(y), who,
              ": the combine rows (buffer + offset ", r.combine_offset, ") and the output must be 16-byte aligned");
  return true;
}

Params make_params(const CombineRows& r, bf16* y) {
  Params p{};
  p.rows = r.buffer + r.combine_offset;
  p.slot_stride = uint64_t(r.max_tokens * r.hidden) * sizeof(bf16);
  p.hidden = r.hidden;
  p.chunks_per_row = int(r.hidden / kChunkElems);
  p.top_k = int(r.top_k);
  p.fused = r.fused_shared;
  p.topk_idx = r.topk_idx;
  p.y_out = y;
  return p;
}

template <typename R>
void launch_rule(const Params& p, int64_t num_tokens, bool check, cudaStream_t stream) {
  const dim3 grid(unsigned(num_tokens), unsigned((p.chunks_per_row + kThreads - 1) / kThreads));
  if (check)
    combine_kernel<R, true><<<grid, kThreads, 0, stream>>>(p);
  else
    combine_kernel<R, false><<<grid, kThreads, 0, stream>>>(p);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_combine(const CombineRows& rows, bf16* y, cudaStream_t stream) {
  if (!validate(rows, y, "launch_combine")) return;
  launch_rule<NoQdq>(make_params(rows, y), rows.num_tokens, false, stream);
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
