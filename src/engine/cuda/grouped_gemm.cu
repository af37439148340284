// The grouped expert GEMMs on Hopper: one persistent, warp-specialised wgmma kernel per
// (tile rows, weight format, epilogue). See grouped_gemm.cuh for the contract.
//
// Design (after DeepGEMM's Hopper FP8 grouped GEMM, "masked" layout: per-group counts on the
// device):
// - CTA = 1 producer warpgroup + kMathWG (1 or 2) consumer warpgroups; tile = BM = 64 * kMathWG
//   rows x two 128-column blocks, k walked in 128-blocks (one activation scale and one weight
//   scale per block). SwiGLU tiles pair gate columns [n0, n0+128) with up columns [I+n0, I+n0+128),
//   so a row's 128 h values (one staging block) are in one tile row; 128-row store tiles pair
//   two adjacent blocks (the second is absent in the last tile when n / 128 is odd). A stage
//   holds the A block once for both column blocks: 48 KB per 8.4 MFLOP with 128-row tiles instead
//   of 32 KB per 4.2 MFLOP. Each column block's wgmmas are waited for before their promotion and
//   the next block's issue, so the tensor cores idle while a block is promoted and the k loop
//   overlaps its loads, wgmmas and promotion only partly; keeping a wgmma group in flight across
//   the promotion needs a second accumulator, which does not fit in the registers beside the two
//   sums of a 128 x 256 tile. (128 x 128 tiles have the registers for it, but read each A block
//   twice as often and hold half the work per stage: slower for the store GEMM.) 64-row store
//   tiles (decode) keep one block: more tiles for the SMs, more stages in flight.
// - Launch (args.pdl): as a programmatic dependent of the stream's previous kernel, so that a CTA
//   can take an SM as soon as the previous kernel's CTA there exits and initialise its barriers;
//   pdl_enter() then waits for the previous kernel before any global memory is read.
// - Tile list: every CTA builds the prefix of ceil(count_g / BM) * n_tiles over the groups in
//   shared memory and walks tiles blockIdx.x, +gridDim.x, ... (n fastest inside an m-tile).
// - Producer, bulk tensor path (args.b_all and args.a_rows given): one thread issues TMA loads
//   (cp.async.bulk.tensor.2d, 128-byte swizzle, K-major) of the A tile ([BM rows][128 k] of the
//   [a_rows, k] activations; rows past a_rows are zero-filled, rows past the group's count are
//   loaded but never stored) and of the B tiles ([128 rows][128 k] of the [G * n, k] weights of
//   all groups), completing on the stage's `full` mbarrier (expect_tx); the 4-byte scales go
//   through cp.async with mbarrier arrival on the same barrier. Only the producer's first warp
//   works. bf16 weights: B by TMA, A converted e4m3 -> bf16 (exact) by the whole producer
//   warpgroup on the way to shared memory, and the bf16 wgmma is used.
// - bf16 A (staging none): the bf16 wgmma; the producer warpgroup copies A's bf16 rows into the
//   stage as it converts e4m3 A (no A scales: 1). With bf16 B, B comes by TMA or cp.async as
//   above; with e4m3 B (no bulk tensor path) the producer converts B e4m3 -> bf16 (exact) the
//   same way and its 128 x 128 block scales are applied at the promotion as for e4m3 x e4m3. The
//   SwiGLU epilogue then writes h rounded to bf16 instead of re-staging it.
// - Producer, fallback path (no b_all): cp.async (16-byte, zero fill for rows past the group's
//   count, so those rows are never read) into the same stages; weight pointers from args.b.
// - Consumers: per 128-block and column block, 4 wgmma m64n128k32 (8 x k16 for bf16) into a
//   fresh accumulator (TMA e4m3 path: A from registers, loaded once per block with ldmatrix, so
//   that the tensor cores read only B from shared memory), wait, then promote: sum =
//   fma(partial, a_scale * b_scale, sum), blocks ascending, as the CPU reference
//   (engine/gemm_cpu.h) promotes. One FMA instead of a multiply and an add halves the
//   promotion's instructions, which sit between a column block's wgmmas and the next while the
//   tensor cores wait. Only the order inside a block differs from the CPU; the
//   epilogues are bit-exact given the same sums. On the TMA e4m3 path the two consumer warpgroups
//   issue their wgmma groups in turn, so that one's promotion overlaps the other's group.
// - Epilogue through a shared-memory hand-off: the consumers write the tile's sums as bf16 pairs
//   (SwiGLU: (gate, up) of a column; store: two output columns), the epilogue reads them back a
//   row per warp (32 lanes x 16 bytes: SwiGLU's row amax is a warp reduction, the stores are
//   512-byte rows). On the TMA e4m3 path the producer warpgroup's idle warps 1-3 run it from a
//   whole-tile buffer (64 KB with 128-row tiles: three stages instead of four), so that it overlaps
//   the next tile's k loop instead of holding the consumers at the end of every tile (the store
//   GEMM with the consumers' per-warp epilogue and four stages ran about 1.25x slower). Elsewhere
//   (bf16 weights, cp.async) each consumer warp runs it on 8 of its rows at a time through its
//   own 4 KB.
// - SwiGLU epilogue: silu of the bf16-rounded gate is a load from a table of silu_f32 over all
//   65536 bf16 patterns (g_silu_of_bf16), filled once per device from the host's silu_f32 (the
//   same portable binary32 operations, so the same bits as calling it here). Computing it (an exp
//   and an IEEE division whose slow-path branch per value keeps the compiler from interleaving a
//   thread's values) would be most of the epilogue's cost.
#include "engine/cuda/grouped_gemm.cuh"

#include <cuda.h>  // CUtensorMap and its encoder's types only: the encoder comes from the runtime

#include <algorithm>
#include <mutex>
#include <vector>

#include "cuda_base/cuda_check.h"
#include "engine/cuda/gemm_sm90.cuh"
#include "cuda_base/pdl.cuh"
#include "cuda_base/warp_scan.cuh"
#include "moefq/errors.h"

namespace moefq::cuda {
namespace {

using namespace sm90;

constexpr int kBN = 128;  // columns of one column block (one 128 x 128 weight-scale block)
constexpr int kMaxStagesCpAsync = 8;  // cp.async path: deeper pipelines gave no gain on sm_90
constexpr int kMaxStagesTma = 12;
constexpr int kSmemLimit = 227 * 1024;  // sm_90 dynamic shared memory per block

enum class Epi { kSwiglu, kStore };
// The operand types: e4m3 x e4m3 (the fp8 wgmma), e4m3 x bf16, bf16 x bf16 and bf16 x e4m3 (A x B;
// the bf16 wgmma, e4m3 operands converted exactly on the way to shared memory).
enum class Ops { kFp8, kA8W16, kBf16, kA16W8 };
constexpr bool bf16_mma(Ops o) { return o != Ops::kFp8; }
constexpr bool a_bf16(Ops o) { return o == Ops::kBf16 || o == Ops::kA16W8; }
constexpr bool b_bf16(Ops o) { return o == Ops::kA8W16 || o == Ops::kBf16; }
constexpr int kHandoffWords = 128;  // 32-bit words per tile row in the hand-off buffer
constexpr int kEpilogueWarps = 3;   // the producer warpgroup's warps 1-3, where they run it (Layout)

struct KernelParams {
  CUtensorMap tmap_a;  // TMA path, e4m3 A: [a_rows, k] e4m3, box [BM rows][128]
  CUtensorMap tmap_b;  // TMA path: B of all groups, [G * n, k] e4m3 (box [128][128]) or bf16 (box [128][64])
  int num_groups = 0;
  int n_tiles = 0;  // tiles (column pairs) per m-tile
  int num_kb = 0;   // k / 128
  int stages = 0;
  int64_t k = 0;
  int64_t n = 0;           // rows of one group's B
  int64_t tile_step = 0;   // columns from one tile's first block to the next tile's (SwiGLU 128, store 256)
  int64_t pair_step = 0;   // columns from a tile's first block to its second (SwiGLU I, store 128)
  const int32_t* counts = nullptr;
  const int32_t* row_offset = nullptr;
  const uint8_t* a = nullptr;
  int64_t lda = 0;
  const float* a_scale = nullptr;
  int64_t lda_scale = 0;
  const void* const* b = nullptr;
  const float* const* b_scale = nullptr;
  const uint8_t* b_all = nullptr;      // without b: group g's B at + g * n * k elements
  const float* b_scale_all = nullptr;  // without b_scale, e4m3: group g's scales at + g * (n / 128) * num_kb
  SwigluEpilogue swiglu;
  float silu_clamp = 0.0f;  // silu_f32(swiglu.clamp), when has_clamp
  StoreEpilogue store;
};

// silu_f32 of every bf16 value, indexed by its bits (see the design notes above).
__device__ float g_silu_of_bf16[1 << 16];

template <int kMathWG, bool kBf16, Epi kEpi, bool kTma>
struct Layout {
  // Column blocks per tile: two, except for 64-row store tiles (decode: more tiles, more stages).
  static constexpr int kBlocks = kEpi == Epi::kStore && kMathWG == 1 ? 1 : 2;
  // Who runs the epilogue: the producer warpgroup's idle warps 1-3 where one warp loads (TMA,
  // e4m3 weights), overlapping the next tile's k loop, with the whole tile in the hand-off
  // buffer; else each consumer warp after its k loop, 8 of its rows at a time (16 KB or 32 KB,
  // so that the 96 KB bf16 stages keep two in flight).
  static constexpr bool kProducerEpilogue = kTma && !kBf16;
  static constexpr int kBM = 64 * kMathWG;
  static constexpr int kThreads = 128 * (kMathWG + 1);
  static constexpr int kRowBytes = kBf16 ? 256 : 128;  // one row's 128-k block in shared memory
  static constexpr int kABytes = kBM * kRowBytes;      // [k half][kBM rows][128 B] (bf16: 2 halves)
  static constexpr int kBBytes = kBN * kRowBytes;      // one column block
  static constexpr int kStageBytes = kABytes + kBlocks * kBBytes;
  static constexpr int kScaleFloats = kBM + 4;  // the rows' a scales, then the column blocks' b scales
  static constexpr int kHandoffRows = kProducerEpilogue ? kBM : kBM / 2;  // consumer warps: 16 rows each, 8 at a time
  static constexpr int kHandoffBytes = kHandoffRows * kHandoffWords * 4;
  static constexpr size_t kPerStageBytes = kStageBytes + kScaleFloats * 4 + 16;  // + full, empty
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "swizzle atoms need 1024-byte bases");

  // [stages][hand-off buffer][scales][full, empty per stage][hand-off full, empty][tile prefix]
  static size_t fixed_bytes(int num_groups) { return 1024 + kHandoffBytes + 16 + 4 * size_t(num_groups + 1); }
  static size_t smem_bytes(int stages, int num_groups) {
    return fixed_bytes(num_groups) + size_t(stages) * kPerStageBytes;
  }
  static int stages_for(int num_groups, int max_stages) {
    const size_t fixed = fixed_bytes(num_groups);
    const int s = fixed >= size_t(kSmemLimit) ? 0 : int((size_t(kSmemLimit) - fixed) / kPerStageBytes);
    return s < max_stages ? s : max_stages;
  }
};

// A CTA's tile: group, its rows (at most BM; fewer or none in a group's last m-tile) starting at
// global row row0, the two column blocks' first columns (inside the group's n), whether the
// second block exists.
struct Tile {
  int g, rows;
  int64_t row0, n0, n1;
  bool has1;
};

// Tile t of the list. The group is the largest g with prefix[g] <= t (empty groups have
// prefix[g] == prefix[g+1]).
__device__ __forceinline__ Tile decode_tile(const KernelParams& p, int t, const int* prefix, int bm) {
  int lo = 0, hi = p.num_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (prefix[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int local = t - prefix[lo];
  const int m0 = (local / p.n_tiles) * bm;
  const int64_t n0 = int64_t(local % p.n_tiles) * p.tile_step;
  return {lo, min(bm, p.counts[lo] - m0), int64_t(p.row_offset[lo]) + m0, n0, n0 + p.pair_step, n0 + p.pair_step < p.n};
}

// The stage ring every role walks: the next of `stages` stages, flipping the phase parity on wrap.
__device__ __forceinline__ void next_stage(int& s, uint32_t& phase, int stages) {
  if (++s == stages) {
    s = 0;
    phase ^= 1;
  }
}

// The hand-off of a tile's results from the consumers to the epilogue (see Layout for who runs
// it): per tile row, kHandoffWords bf16 pairs in shared memory. SwiGLU: word c
// = (bf16 gate, bf16 up) of column pair c (gate in the low half); store: word c = output columns
// 2c, 2c + 1 of the tile's 256 (the first column block, then the second). 16-byte chunks are
// XOR-swizzled by row % 8, so that the consumers' writes (8 rows per warp instruction) and the
// epilogue's row reads (lane l: chunk l) spread over the banks. The SwiGLU kernel's 8-byte writes
// are not fully conflict-free (more than the ideal 2 wavefronts per request), a small part of the
// kernel's shared-memory traffic.
__device__ __forceinline__ int handoff_index(int row, int word) {
  return row * kHandoffWords + ((((word >> 2) ^ (row & 7))) << 2) + (word & 3);
}

// The epilogue of the hand-off rows 0 .. rows - 1 in `handoff`, tile rows row0 + 0 .. rows - 1:
// warp `warp` of `num_warps` takes rows warp, warp + num_warps, ...; lane l owns the row's words
// 4l .. 4l + 3. The per-row operand (SwiGLU: router weight; store: output row pointer) of 32 rows
// is loaded at once, one row per lane, and passed by shuffles.
template <Epi kEpi, bool kH16>
__device__ __forceinline__ void run_epilogue(const KernelParams& p, const Tile& tl, const uint32_t* handoff, int row0,
                                             int rows, int warp, int num_warps, int lane) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  const int mine = rows > warp ? (rows - warp + num_warps - 1) / num_warps : 0;  // this warp's rows
  for (int base = 0; base < mine; base += 32) {
    const int n = min(32, mine - base);
    const int my_row = row0 + warp + (base + min(lane, n - 1)) * num_warps;  // tile row of this lane's operand
    if constexpr (kEpi == Epi::kStore) {
      bf16* const out_lane = p.store.row_out[tl.row0 + my_row];
      const int words = tl.has1 ? kBN : kBN / 2;
#pragma unroll 4
      for (int i = 0; i < n; ++i) {
        const int r = warp + (base + i) * num_warps;  // hand-off row
        bf16* const out = reinterpret_cast<bf16*>(__shfl_sync(kAll, reinterpret_cast<uintptr_t>(out_lane), i));
        const uint4 v = *reinterpret_cast<const uint4*>(handoff + handoff_index(r, 4 * lane));
        // Streaming stores (evict first): the rows are read only by the combine, after the GEMM,
        // and should not push the weight blocks other CTAs still read out of L2.
        if (4 * lane < words) __stcs(reinterpret_cast<uint4*>(out + tl.n0 + 8 * lane), v);  // n1 = n0 + 128
      }
    } else {
      // h = silu(g) * u * weight per column pair, the row's amax over its 128 values, e4m3 with
      // the row's new scale (numerics.h, stage_scale / stage_encode): 4 bytes per lane; with bf16
      // A (kH16) h rounded to bf16 instead: 8 bytes per lane, no scale.
      const SwigluEpilogue& e = p.swiglu;
      const float w_lane = e.row_weight[tl.row0 + my_row];
      for (int i = 0; i < n; i += 2) {
        const int ia[2] = {i, min(i + 1, n - 1)};  // a second row, or the first again (not stored)
        float h[2][4], amax[2] = {0.0f, 0.0f};
#pragma unroll
        for (int a = 0; a < 2; ++a) {
          const int r = warp + (base + ia[a]) * num_warps;  // hand-off row
          const float w = __shfl_sync(kAll, w_lane, ia[a]);
          const uint4 v = *reinterpret_cast<const uint4*>(handoff + handoff_index(r, 4 * lane));
          const uint32_t gu4[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const uint32_t gu = gu4[c];
            float silu = __ldg(&g_silu_of_bf16[gu & 0xFFFFu]);
            float uv = f32_from_bits(gu & 0xFFFF0000u);
            if (e.has_clamp) {
              // g = min(g, c) (a NaN g becomes c), then silu(g): silu(c) is precomputed.
              silu = bf16_to_f32(uint16_t(gu)) < e.clamp ? silu : p.silu_clamp;
              uv = uv < -e.clamp ? -e.clamp : (uv > e.clamp ? e.clamp : uv);
            }
            h[a][c] = mul_rn(mul_rn(silu, uv), w);
            amax[a] = max_ignore_nan(amax[a], abs_f32(h[a][c]));
          }
        }
        if constexpr (kH16) {
#pragma unroll
          for (int a = 0; a < 2; ++a) {
            if (a == 1 && i + 1 >= n) break;
            const int64_t row = tl.row0 + row0 + warp + (base + ia[a]) * num_warps;
            *reinterpret_cast<uint2*>(e.h16 + row * e.ldh + tl.n0 + 4 * lane) =
                make_uint2(bf16x2_round(h[a][0], h[a][1]), bf16x2_round(h[a][2], h[a][3]));
          }
        } else {
#pragma unroll
          for (int a = 0; a < 2; ++a) {
            // fmaxf is exact and order-free: the row's maximum whatever the lanes' order.
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) amax[a] = fmaxf(amax[a], __shfl_xor_sync(kAll, amax[a], o));
            if (a == 1 && i + 1 >= n) break;
            const float sf = stage_scale(amax[a]);
            const float inv = div_rn(1.0f, sf);
            const int64_t row = tl.row0 + row0 + warp + (base + ia[a]) * num_warps;
            uint32_t q = 0;
#pragma unroll
            for (int c = 0; c < 4; ++c) q |= uint32_t(stage_encode(h[a][c], inv)) << (8 * c);
            *reinterpret_cast<uint32_t*>(e.h8 + row * e.ldh + tl.n0 + 4 * lane) = q;
            if (lane == 0) e.h_scale[row * e.ldh_scale + tl.n0 / 128] = sf;
          }
        }
      }
    }
  }
}

// The TMA producer for e4m3 weights, run by the producer warpgroup's first warp: lane 0 loads
// the A and B tiles, lanes 0 and 1 the column blocks' weight scales, every lane the a scales of
// BM / 32 rows (zero for rows past the group's count); each lane's cp.async arrival plus lane 0's
// expect_tx complete the stage's phase with the bytes. No L2 prefetch of later blocks: the ring
// already keeps every stage's loads in flight, and bulk tensor prefetches further ahead only add
// L2 traffic that competes with them (measured slower for both GEMMs, also with one prefetching
// CTA per shared weight tile).
template <int kBM, int kStageBytes>
__device__ __forceinline__ void tma_producer_e4m3(const KernelParams& p, uint8_t* smem, float* scales, uint64_t* full,
                                                  uint64_t* empty, const int* tile_prefix, int num_tiles) {
  constexpr int kABytes = kBM * 128, kBBytes = kBN * 128, kScaleFloats = kBM + 4;
  const int lane = threadIdx.x;
  if (lane == 0) {
    prefetch_tensormap(&p.tmap_a);
    prefetch_tensormap(&p.tmap_b);
  }
  int s = 0;
  uint32_t phase = 0;
  for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const Tile tl = decode_tile(p, tile, tile_prefix, kBM);
    const float* bs = p.b_scale_all ? p.b_scale_all + int64_t(tl.g) * (p.n / 128) * p.num_kb : p.b_scale[tl.g];
    const int32_t brow0 = int32_t(int64_t(tl.g) * p.n + tl.n0), brow1 = int32_t(int64_t(tl.g) * p.n + tl.n1);
    const float* bsrow = bs + (lane == 0 ? tl.n0 : tl.n1) / 128 * p.num_kb;  // lanes 0 and 1
    for (int kb = 0; kb < p.num_kb; ++kb) {
      mbar_wait(smem_addr(&empty[s]), phase ^ 1);
      const uint32_t sa = smem_addr(smem + size_t(s) * kStageBytes);
      const uint32_t sc = smem_addr(scales + s * kScaleFloats);
      const uint32_t fb = smem_addr(&full[s]);
      if (lane == 0) {
        mbar_arrive_expect_tx(fb, kABytes + (tl.has1 ? 2 : 1) * kBBytes);
        tma_load_2d(sa, &p.tmap_a, kb * 128, int32_t(tl.row0), fb);
        tma_load_2d(sa + kABytes, &p.tmap_b, kb * 128, brow0, fb);
        if (tl.has1) tma_load_2d(sa + kABytes + kBBytes, &p.tmap_b, kb * 128, brow1, fb);
      }
      if (lane < (tl.has1 ? 2 : 1)) cp_async_4(sc + (kBM + lane) * 4, bsrow + kb, 4);
#pragma unroll
      for (int r = lane; r < kBM; r += 32) {
        const bool v = r < tl.rows;
        cp_async_4(sc + r * 4, v ? p.a_scale + (tl.row0 + r) * p.lda_scale + kb : p.a_scale, v ? 4 : 0);
      }
      cp_async_arrive_noinc(fb);
      next_stage(s, phase, p.stages);
    }
  }
  cp_async_wait_all();
}

template <int kMathWG, Ops kOps, Epi kEpi, bool kTma>
__global__ void __launch_bounds__(Layout<kMathWG, bf16_mma(kOps), kEpi, kTma>::kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ KernelParams p) {
  constexpr bool kBf16 = bf16_mma(kOps), kA16 = a_bf16(kOps), kB16 = b_bf16(kOps);
  static_assert(!(kOps == Ops::kA16W8 && kTma), "bf16 x e4m3 has no bulk tensor path");
  using L = Layout<kMathWG, kBf16, kEpi, kTma>;
  constexpr int kBM = L::kBM;

  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (((smem_addr(smem_raw) + 1023u) & ~1023u) - smem_addr(smem_raw));
  const int num_stages = p.stages;
  uint32_t* handoff = reinterpret_cast<uint32_t*>(smem + size_t(num_stages) * L::kStageBytes);
  float* scales = reinterpret_cast<float*>(smem + size_t(num_stages) * L::kStageBytes + L::kHandoffBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(scales + num_stages * L::kScaleFloats);
  uint64_t* empty = full + num_stages;
  uint64_t* epi_full = empty + num_stages;  // the hand-off buffer holds a tile's results
  uint64_t* epi_empty = epi_full + 1;       // the epilogue has read them
  int* tile_prefix = reinterpret_cast<int*>(epi_empty + 1);

  if (threadIdx.x == 0) {
    for (int s = 0; s < num_stages; ++s) {
      // Arrivals per phase: TMA path: the expect_tx, then one cp.async arrival per scale-loading
      // thread (32, or 128 for bf16), plus 128 store arrivals for bf16; cp.async path: 128
      // cp.async arrivals, plus 128 store arrivals for bf16.
      mbar_init(smem_addr(&full[s]), kTma ? (kBf16 ? 257 : 33) : (kBf16 ? 256 : 128));
      mbar_init(smem_addr(&empty[s]), 4 * kMathWG);        // one arrival per consumer warp
    }
    mbar_init(smem_addr(epi_full), 128 * kMathWG);  // every consumer thread (used with kProducerEpilogue)
    mbar_init(smem_addr(epi_empty), 32 * kEpilogueWarps);  // every epilogue thread
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  pdl_enter();  // from here on global memory: the counts, A and the outputs belong to earlier kernels
  if (threadIdx.x < 32) {
    // The tile prefix, 32 groups at a time (a warp scan), so that the counts' loads are not one
    // latency each before the first load can be issued.
    const int lane = threadIdx.x;
    int total = 0;
    if (lane == 0) tile_prefix[0] = 0;
    for (int g0 = 0; g0 < p.num_groups; g0 += 32) {
      const int g = g0 + lane, c = g < p.num_groups ? p.counts[g] : 0;
      const int incl = warp_inclusive_sum((c > 0 ? (c + kBM - 1) / kBM : 0) * p.n_tiles, lane);
      if (g < p.num_groups) tile_prefix[g + 1] = total + incl;
      total += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  __syncthreads();
  const int num_tiles = tile_prefix[p.num_groups];
  const int wg = threadIdx.x / 128;

  // Two consumer warpgroups: 384 threads enter with 168 registers each; the producer gives its
  // share to the consumers, which hold one accumulator set and two sums (192 registers). 56 is
  // the least the producers (and the TMA path's epilogue warps) need without spilling (ptxas -v,
  // CUDA 13.0: no spills in the TMA and bf16 kernels; the e4m3 cp.async fallback spills 4 bytes).
  constexpr int kProducerRegs = 56, kConsumerRegs = 224;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs == 384 * 168, "the CTA's registers, redistributed");

  if (wg == 0) {
    // ------------------------------------------------------------------ producer warpgroup
    if constexpr (kMathWG == 2) setmaxnreg_dec<kProducerRegs>();
    if constexpr (L::kProducerEpilogue) {
      if (threadIdx.x < 32) {
        tma_producer_e4m3<kBM, L::kStageBytes>(p, smem, scales, full, empty, tile_prefix, num_tiles);
      } else {
        uint32_t ephase = 0;
        for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x, ephase ^= 1) {
          const Tile tl = decode_tile(p, tile, tile_prefix, kBM);
          mbar_wait(smem_addr(epi_full), ephase);
          run_epilogue<kEpi, kA16>(p, tl, handoff, 0, tl.rows, threadIdx.x / 32 - 1, kEpilogueWarps, threadIdx.x & 31);
          mbar_arrive(smem_addr(epi_empty));
        }
      }
    } else {
      const int t = threadIdx.x;
      if (kTma && t == 0) prefetch_tensormap(&p.tmap_b);
      int s = 0;
      uint32_t phase = 0;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const Tile tl = decode_tile(p, tile, tile_prefix, kBM);
        const uint8_t* bw = kTma ? nullptr
                            : p.b ? static_cast<const uint8_t*>(p.b[tl.g])
                                  : p.b_all + int64_t(tl.g) * p.n * p.k * (kB16 ? 2 : 1);
        const float* bs = kB16 ? nullptr
                          : p.b_scale ? p.b_scale[tl.g]
                                      : p.b_scale_all + int64_t(tl.g) * (p.n / 128) * p.num_kb;
        const int nblk = tl.has1 ? 2 : 1;
        for (int kb = 0; kb < p.num_kb; ++kb) {
          mbar_wait(smem_addr(&empty[s]), phase ^ 1);
          const uint32_t sa = smem_addr(smem + size_t(s) * L::kStageBytes);
          const uint32_t sc = smem_addr(scales + s * L::kScaleFloats);
          const int64_t kbyte = int64_t(kb) * 128;  // e4m3 bytes of A (and of e4m3 B) before the block
          for (int c = 0; c < nblk; ++c) {
            const int64_t n0 = c ? tl.n1 : tl.n0;
            const uint32_t sb = sa + L::kABytes + c * L::kBBytes;
            if constexpr (!kBf16) {
              const int ch = t & 7;
#pragma unroll 4
              for (int r = t >> 3; r < kBN; r += 16)
                cp_async_16(sb + r * 128 + ((ch ^ (r & 7)) << 4), bw + (n0 + r) * p.k + kbyte + ch * 16, 16);
              if (t == c) cp_async_4(sc + (kBM + c) * 4, bs + (n0 / 128) * p.num_kb + kb, 4);
            } else if constexpr (kOps == Ops::kA16W8) {
              // e4m3 B is converted with A below; here only its block scale.
              if (t == c) cp_async_4(sc + (kBM + c) * 4, bs + (n0 / 128) * p.num_kb + kb, 4);
            } else if constexpr (kTma) {
              // B: two boxes of [128 rows][64 bf16], one per swizzle atom along k ([half][row][128 B]).
              if (t == 0) {
                const uint32_t fb = smem_addr(&full[s]);
                const int32_t brow = int32_t(int64_t(tl.g) * p.n + n0);
                if (c == 0) mbar_arrive_expect_tx(fb, nblk * L::kBBytes);  // one arrival for both blocks
                tma_load_2d(sb, &p.tmap_b, int32_t(kb * 128), brow, fb);
                tma_load_2d(sb + kBN * 128, &p.tmap_b, int32_t(kb * 128 + 64), brow, fb);
              }
            } else {
              // B: bf16 rows of 256 bytes = two swizzle atoms along k ([half][row][128 B]).
              const int ch = t & 15;
#pragma unroll 4
              for (int r = t >> 4; r < kBN; r += 8)
                cp_async_16(sb + (ch >> 3) * (kBN * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4),
                            bw + ((n0 + r) * p.k + kbyte) * 2 + ch * 16, 16);
            }
          }
          if constexpr (!kBf16) {
            const int ch = t & 7;
#pragma unroll 4
            for (int r = t >> 3; r < kBM; r += 16) {
              const bool v = r < tl.rows;
              cp_async_16(sa + r * 128 + ((ch ^ (r & 7)) << 4), v ? p.a + (tl.row0 + r) * p.lda + kbyte + ch * 16 : p.a,
                          v ? 16 : 0);
            }
          }
          if (!kA16 && t < kBM) {
            const bool v = t < tl.rows;
            cp_async_4(sc + t * 4, v ? p.a_scale + (tl.row0 + t) * p.lda_scale + kb : p.a_scale, v ? 4 : 0);
          }
          cp_async_arrive_noinc(smem_addr(&full[s]));
          if constexpr (kBf16) {
            // 16 k of a row (e4m3: 16 bytes converted; bf16 A: 32 bytes copied) -> 32 bytes of
            // bf16 in the stage, two 16-byte chunks of the same k half ([half][rows][128 B]).
            const int ch = t & 7;
            const auto put = [&](uint32_t tile, int rows_in_tile, int r, const uint4& o0, const uint4& o1) {
              const uint32_t row = tile + (ch >> 2) * (rows_in_tile * 128) + r * 128;
              const int a0 = (2 * ch) & 7;
              asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row + ((a0 ^ (r & 7)) << 4)), "r"(o0.x),
                           "r"(o0.y), "r"(o0.z), "r"(o0.w)
                           : "memory");
              asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(row + (((a0 + 1) ^ (r & 7)) << 4)),
                           "r"(o1.x), "r"(o1.y), "r"(o1.z), "r"(o1.w)
                           : "memory");
            };
            const auto put_e4m3 = [&](uint32_t tile, int rows_in_tile, int r, const uint4& v) {
              put(tile, rows_in_tile, r,
                  make_uint4(e4m3x2_to_bf16x2(v.x), e4m3x2_to_bf16x2(v.x >> 16), e4m3x2_to_bf16x2(v.y),
                             e4m3x2_to_bf16x2(v.y >> 16)),
                  make_uint4(e4m3x2_to_bf16x2(v.z), e4m3x2_to_bf16x2(v.z >> 16), e4m3x2_to_bf16x2(v.w),
                             e4m3x2_to_bf16x2(v.w >> 16)));
            };
            for (int r = t >> 3; r < kBM; r += 16) {
              if constexpr (kA16) {
                uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0;
                if (r < tl.rows) {
                  const uint4* src = reinterpret_cast<const uint4*>(p.a + ((tl.row0 + r) * p.lda + kbyte + ch * 16) * 2);
                  v0 = __ldg(src);
                  v1 = __ldg(src + 1);
                }
                put(sa, kBM, r, v0, v1);
              } else {
                uint4 v = make_uint4(0, 0, 0, 0);
                if (r < tl.rows) v = __ldg(reinterpret_cast<const uint4*>(p.a + (tl.row0 + r) * p.lda + kbyte + ch * 16));
                put_e4m3(sa, kBM, r, v);
              }
            }
            if constexpr (kOps == Ops::kA16W8) {
              for (int c = 0; c < nblk; ++c) {
                const int64_t n0 = c ? tl.n1 : tl.n0;
                for (int r = t >> 3; r < kBN; r += 16)
                  put_e4m3(sa + L::kABytes + c * L::kBBytes, kBN, r,
                           __ldg(reinterpret_cast<const uint4*>(bw + (n0 + r) * p.k + kbyte + ch * 16)));
              }
            }
            fence_proxy_async();
            mbar_arrive(smem_addr(&full[s]));
          }
          next_stage(s, phase, num_stages);
        }
      }
      cp_async_wait_all();
    }
  } else {
    // ------------------------------------------------------------------ consumer warpgroups
    if constexpr (kMathWG == 2) setmaxnreg_inc<kConsumerRegs>();
    const int wgc = wg - 1;
    const int lane = threadIdx.x & 31, q = lane & 3;
    const int r0 = wgc * 64 + ((threadIdx.x / 32) & 3) * 16 + lane / 4;  // tile row of i = 0 (i = 1: +8)
    float acc[64], sum0[64], sum1[64];
    // TMA e4m3 kernels: the stage's A block of this thread, one fragment per k step of 32 (the
    // cp.async fallback reads A from shared memory: the fragments would make it spill).
    constexpr bool kRegA = !kBf16 && kTma;
    uint32_t a_frag[4][4];
    int s = 0;
    uint32_t phase = 0, ephase = 0;
    // The block's wgmmas on column block c of stage s into a fresh `acc`, waited for.
    // Two consumer warpgroups issue their wgmma groups in turn (named barriers 1 and 2): warpgroup
    // 0's group of a block is queued before warpgroup 1's, so it completes first and is promoted
    // while the tensor cores run warpgroup 1's, and the other way round for the next block.
    // Issued together, the two groups would finish together and both promotions leave the tensor
    // cores idle. (The TMA e4m3 kernel only: elsewhere the barriers cost registers the consumers
    // do not have.)
    constexpr bool kTurns = kMathWG == 2 && L::kProducerEpilogue;
    const auto turn_wait = [&] {
      if constexpr (kTurns) asm volatile("bar.sync %0, 256;" ::"r"(1 + wgc));
    };
    const auto turn_pass = [&] {
      if constexpr (kTurns) asm volatile("bar.arrive %0, 256;" ::"r"(1 + (wgc ^ 1)));
    };
    if (wgc == 1) turn_pass();  // warpgroup 0 goes first (kTurns)
    auto mma = [&](uint32_t sa, uint32_t sb) {
#pragma unroll
      for (int i = 0; i < 64; ++i) fence_operand(acc[i]);
      turn_wait();
      wgmma_fence();
      if constexpr (kRegA) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n128k32_e4m3_rs(acc, a_frag[kk], sw128_desc(sb + kk * 32), kk > 0 ? 1u : 0u);
      } else if constexpr (!kBf16) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n128k32_e4m3(acc, sw128_desc(sa + kk * 32), sw128_desc(sb + kk * 32), kk > 0 ? 1u : 0u);
      } else {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
          wgmma_m64n128k16_bf16(acc, sw128_desc(sa + (kk >> 2) * (kBM * 128) + (kk & 3) * 32),
                                sw128_desc(sb + (kk >> 2) * (kBN * 128) + (kk & 3) * 32), kk > 0 ? 1u : 0u);
      }
      wgmma_commit();
      turn_pass();
      wgmma_wait_all();
#pragma unroll
      for (int i = 0; i < 64; ++i) fence_operand(acc[i]);
    };
    // sum += acc * f, one rounding (rows i = 0 and 1 of the thread: f0, f1).
    auto promote = [&](float(&sum)[64], float f0, float f1) {
#pragma unroll
      for (int i = 0; i < 64; ++i) sum[i] = fma_rn(acc[i], (i & 2) ? f1 : f0, sum[i]);
    };
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const Tile tl = decode_tile(p, tile, tile_prefix, kBM);
#pragma unroll
      for (int i = 0; i < 64; ++i) sum0[i] = sum1[i] = 0.0f;
      for (int kb = 0; kb < p.num_kb; ++kb) {
        mbar_wait(smem_addr(&full[s]), phase);
        if constexpr (!kTma) fence_proxy_async();  // cp.async data (generic proxy) -> wgmma
        const uint32_t sa = smem_addr(smem + size_t(s) * L::kStageBytes) + wgc * 64 * 128;
        const uint32_t sb = smem_addr(smem + size_t(s) * L::kStageBytes + L::kABytes);
        const float* sc = scales + s * L::kScaleFloats;
        const float a0 = kA16 ? 1.0f : sc[r0], a1 = kA16 ? 1.0f : sc[r0 + 8];
        const float b0 = kB16 ? 1.0f : sc[kBM], b1 = kB16 ? 1.0f : sc[kBM + 1];
        const float f00 = __fmul_rn(a0, b0), f01 = __fmul_rn(a1, b0);
        const float f10 = __fmul_rn(a0, b1), f11 = __fmul_rn(a1, b1);
        if constexpr (kRegA) {
          // A from registers for both column blocks: read from shared memory once instead of once
          // per block. Lane l loads row l % 8 (+8 for l / 8 odd) of the warp's 16, 16-byte chunk
          // l / 16 of the k step (128-byte swizzle: chunk ^ row % 8).
          const int row = 16 * ((threadIdx.x / 32) & 3) + (lane & 7) + (lane & 8);
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            ldmatrix_x4(a_frag[kk], sa + row * 128 + (((2 * kk + (lane >> 4)) ^ (row & 7)) << 4));
        }
        // The stage is free once its wgmmas are done and its scales read.
        const auto release = [&, empty_bar = smem_addr(&empty[s])] {
          __syncwarp();
          if (lane == 0) mbar_arrive(empty_bar);
        };
        mma(sa, sb);
        if (!tl.has1) release();
        promote(sum0, f00, f01);
        if (tl.has1) {
          mma(sa, sb + L::kBBytes);
          release();
          promote(sum1, f10, f11);
        }
        next_stage(s, phase, num_stages);
      }

      // The thread's row i (tile row r0 + 8 i; columns 8 j + 2 q + c of each block) into hand-off row r.
      const auto hand_off = [&](uint32_t* buf, int r, int i) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int x = 4 * j + 2 * i;
          if constexpr (kEpi == Epi::kSwiglu) {
            // (gate, up) of column pairs 8 j + 2 q and + 1: words 8 j + 2 q, + 1 (one 8-byte store).
            *reinterpret_cast<uint2*>(buf + handoff_index(r, 8 * j + 2 * q)) =
                make_uint2(bf16x2_round(sum0[x], sum1[x]), bf16x2_round(sum0[x + 1], sum1[x + 1]));
          } else {
            buf[handoff_index(r, 4 * j + q)] = bf16x2_round(sum0[x], sum0[x + 1]);
            if (tl.has1) buf[handoff_index(r, 64 + 4 * j + q)] = bf16x2_round(sum1[x], sum1[x + 1]);
          }
        }
      };
      if constexpr (L::kProducerEpilogue) {
        // The whole tile, once the epilogue warps have read the previous one.
        mbar_wait(smem_addr(epi_empty), ephase ^ 1);
        hand_off(handoff, r0, 0);
        hand_off(handoff, r0 + 8, 1);
        mbar_arrive(smem_addr(epi_full));
        ephase ^= 1;
      } else {
        // Each warp its 16 rows, 8 at a time, through its own 8 hand-off rows.
        const int w = threadIdx.x / 32 - 4;
        uint32_t* buf = handoff + w * 8 * kHandoffWords;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          hand_off(buf, lane / 4, i);
          __syncwarp();
          run_epilogue<kEpi, kA16>(p, tl, buf, 16 * w + 8 * i, min(8, tl.rows - (16 * w + 8 * i)), 0, 1, lane);
          __syncwarp();
        }
      }
    }
    if (wgc == 0) turn_wait();  // warpgroup 1's last pass: no arrival is left pending at exit
  }
}

// ---------------------------------------------------------------------------------------------
// Host side

template <int kMathWG, Ops kOps, Epi kEpi, bool kTma>
void set_attributes() {
  MOEFQ_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<kMathWG, kOps, kEpi, kTma>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemLimit));
}
// Bulk tensor loads exist for every operand pair but bf16 x e4m3.
template <Ops kOps>
constexpr bool kHasTma = kOps != Ops::kA16W8;
template <int kMathWG, Ops kOps>
void set_attributes_all() {
  set_attributes<kMathWG, kOps, Epi::kSwiglu, false>();
  set_attributes<kMathWG, kOps, Epi::kStore, false>();
  if constexpr (kHasTma<kOps>) {
    set_attributes<kMathWG, kOps, Epi::kSwiglu, true>();
    set_attributes<kMathWG, kOps, Epi::kStore, true>();
  }
}

template <int kMathWG>
void set_attributes_every_ops() {
  set_attributes_all<kMathWG, Ops::kFp8>();
  set_attributes_all<kMathWG, Ops::kA8W16>();
  set_attributes_all<kMathWG, Ops::kBf16>();
  set_attributes_all<kMathWG, Ops::kA16W8>();
}

constexpr int kMaxDevices = 64;
std::once_flag g_prepared[kMaxDevices];
int g_num_sms[kMaxDevices];

int current_device() {
  int dev = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFQ_CHECK(dev >= 0 && dev < kMaxDevices, "grouped GEMM: device ", dev, " out of range");
  return dev;
}

// cuTensorMapEncodeTiled from the driver through the runtime, so that no -lcuda is needed.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
std::once_flag g_encode_once;
EncodeTiledFn g_encode = nullptr;

EncodeTiledFn encode_tiled() {
  std::call_once(g_encode_once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    MOEFQ_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    MOEFQ_CHECK(q == cudaDriverEntryPointSuccess && fn, "grouped GEMM: the driver offers no cuTensorMapEncodeTiled");
    g_encode = reinterpret_cast<EncodeTiledFn>(fn);
  });
  return g_encode;
}

// A 2-D row-major tensor [rows, inner] (row stride row_bytes) read in boxes of [box_rows][box_inner]
// with the 128-byte swizzle (box_inner elements must span 128 bytes); out-of-bounds reads give zeros.
CUtensorMap make_tensor_map(const void* base, CUtensorMapDataType type, uint64_t inner, uint64_t rows, uint64_t row_bytes,
                            uint32_t box_inner, uint32_t box_rows) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {inner, rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_inner, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&m, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                                    CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MOEFQ_CHECK(r == CUDA_SUCCESS, "grouped GEMM: cuTensorMapEncodeTiled failed with CUresult ", int(r), " (rows ", rows,
              ", inner ", inner, ", row bytes ", row_bytes, ")");
  return m;
}

void prepare_device(int dev) {
  std::call_once(g_prepared[dev], [dev] {
    set_attributes_every_ops<1>();
    set_attributes_every_ops<2>();
    MOEFQ_CUDA_CHECK(cudaDeviceGetAttribute(&g_num_sms[dev], cudaDevAttrMultiProcessorCount, dev));
    std::vector<float> silu(size_t(1) << 16);
    for (uint32_t b = 0; b < silu.size(); ++b) silu[b] = silu_f32(bf16_to_f32(uint16_t(b)));
    MOEFQ_CUDA_CHECK(cudaMemcpyToSymbol(g_silu_of_bf16, silu.data(), silu.size() * sizeof(float)));
    encode_tiled();
  });
}

Ops ops_of(const GroupedGemmArgs& a) {
  const bool a16 = a.a_format == WeightFormat::kBf16, b16 = a.b_format == WeightFormat::kBf16;
  return a16 ? (b16 ? Ops::kBf16 : Ops::kA16W8) : (b16 ? Ops::kA8W16 : Ops::kFp8);
}

// Whether the bulk tensor path applies: all groups' B in one allocation and, for e4m3 x e4m3
// (A by TMA too), the rows allocated at A; addresses 16-byte aligned as TMA requires. Never for
// bf16 A with e4m3 B (B is converted by the producer).
bool use_tma(const GroupedGemmArgs& a) {
  const Ops ops = ops_of(a);
  auto aligned = [](const void* q) { return (reinterpret_cast<uintptr_t>(q) & 15u) == 0; };
  return ops != Ops::kA16W8 && a.b_all && aligned(a.b_all) &&
         (ops != Ops::kFp8 || (a.a_rows > 0 && aligned(a.a)));
}

template <int kMathWG, Ops kOps, Epi kEpi, bool kTma>
void launch_kernel(KernelParams kp, const GroupedGemmArgs& a, int dev, cudaStream_t stream) {
  constexpr bool kBf16 = bf16_mma(kOps);
  using L = Layout<kMathWG, kBf16, kEpi, kTma>;
  kp.stages = L::stages_for(kp.num_groups, kTma ? kMaxStagesTma : kMaxStagesCpAsync);
  MOEFQ_CHECK(kp.stages >= 2, "grouped GEMM: ", kp.num_groups, " groups leave too little shared memory");
  if constexpr (kTma) {
    const uint64_t b_rows = uint64_t(a.num_groups) * uint64_t(a.n);
    if constexpr (kBf16) {
      kp.tmap_b = make_tensor_map(a.b_all, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, uint64_t(a.k), b_rows, uint64_t(a.k) * 2, 64, kBN);
    } else {
      kp.tmap_b = make_tensor_map(a.b_all, CU_TENSOR_MAP_DATA_TYPE_UINT8, uint64_t(a.k), b_rows, uint64_t(a.k), 128, kBN);
      kp.tmap_a = make_tensor_map(a.a, CU_TENSOR_MAP_DATA_TYPE_UINT8, uint64_t(a.k), uint64_t(a.a_rows), uint64_t(a.lda), 128,
                                  L::kBM);
    }
  }
  const int64_t max_tiles = ((a.max_total_rows + L::kBM - 1) / L::kBM + kp.num_groups) * kp.n_tiles;
  const int grid = int(std::max<int64_t>(1, std::min<int64_t>(g_num_sms[dev], max_tiles)));
  launch_chained(grouped_gemm_kernel<kMathWG, kOps, kEpi, kTma>, dim3(grid), dim3(L::kThreads),
                 L::smem_bytes(kp.stages, kp.num_groups), stream, a.pdl, kp);
}

template <int kMathWG, Ops kOps, Epi kEpi>
void launch_path(KernelParams kp, const GroupedGemmArgs& a, int dev, cudaStream_t stream) {
  if (Layout<kMathWG, bf16_mma(kOps), kEpi, false>::kBlocks == 1) {  // one 128-column block per tile
    kp.n_tiles = int(a.n / kBN);
    kp.tile_step = kBN;
    kp.pair_step = a.n;
  }
  if constexpr (kHasTma<kOps>)
    if (use_tma(a)) return launch_kernel<kMathWG, kOps, kEpi, true>(kp, a, dev, stream);
  launch_kernel<kMathWG, kOps, kEpi, false>(kp, a, dev, stream);
}

template <int kMathWG, Epi kEpi>
void launch_ops(KernelParams kp, const GroupedGemmArgs& a, int dev, cudaStream_t stream) {
  switch (ops_of(a)) {
    case Ops::kFp8: return launch_path<kMathWG, Ops::kFp8, kEpi>(kp, a, dev, stream);
    case Ops::kA8W16: return launch_path<kMathWG, Ops::kA8W16, kEpi>(kp, a, dev, stream);
    case Ops::kBf16: return launch_path<kMathWG, Ops::kBf16, kEpi>(kp, a, dev, stream);
    case Ops::kA16W8: return launch_path<kMathWG, Ops::kA16W8, kEpi>(kp, a, dev, stream);
  }
}

template <Epi kEpi>
void launch_any(const GroupedGemmArgs& a, KernelParams kp, cudaStream_t stream) {
  MOEFQ_CHECK(use_tma(a) || a.b || a.b_all, "grouped GEMM: null b and b_all");
  const int dev = current_device();
  prepare_device(dev);
  int rows = a.tile_rows;
  if (rows == 0) {
    // 64-row tiles where groups average at most 64 rows, or where 128-row tiles (at most
    // ceil(rows / 128) + G - 1 m-tiles) would leave SMs idle: a few groups of a few hundred rows,
    // as the shared expert at small batches, whose weight read then has twice the CTAs.
    const int64_t m_tiles_128 = (a.max_total_rows + 127) / 128 + a.num_groups - 1;
    rows = a.max_total_rows <= 64 * int64_t(a.num_groups) || m_tiles_128 * kp.n_tiles < g_num_sms[dev] ? 64 : 128;
  }
  MOEFQ_CHECK(rows == 64 || rows == 128, "grouped GEMM: tile_rows must be 0, 64 or 128 (got ", rows, ")");
  if (rows == 64)
    launch_ops<1, kEpi>(kp, a, dev, stream);
  else
    launch_ops<2, kEpi>(kp, a, dev, stream);
}

KernelParams common_params(const GroupedGemmArgs& a, const char* what) {
  MOEFQ_CHECK(a.num_groups > 0, what, ": num_groups must be positive (got ", a.num_groups, ")");
  MOEFQ_CHECK(a.n > 0 && a.k > 0 && a.n % 128 == 0 && a.k % 128 == 0, what, ": n and k must be positive multiples of 128 (got n=",
              a.n, ", k=", a.k, ")");
  MOEFQ_CHECK(a.lda % 16 == 0 && a.lda >= a.k, what, ": lda must be a multiple of 16 and at least k (got ", a.lda, ")");
  const bool a8 = a.a_format == WeightFormat::kE4m3;
  MOEFQ_CHECK(!a8 || a.lda_scale >= a.k / 128, what, ": lda_scale must be at least k / 128 (got ", a.lda_scale, ")");
  MOEFQ_CHECK(a.counts && a.row_offset && a.a && (a.a_scale || !a8) && (a.b || a.b_all), what, ": null device pointer");
  MOEFQ_CHECK(a.b_format == WeightFormat::kBf16 || a.b_scale || (a.b_scale_all && (use_tma(a) || !a.b)), what,
              ": e4m3 weights need b_scale (or b_scale_all with b_all)");
  MOEFQ_CHECK(int64_t(a.num_groups) * a.n < (int64_t(1) << 31), what, ": G * n must stay below 2^31");
  KernelParams kp;
  kp.num_groups = a.num_groups;
  kp.num_kb = int(a.k / 128);
  kp.k = a.k;
  kp.n = a.n;
  kp.counts = a.counts;
  kp.row_offset = a.row_offset;
  kp.a = a.a;
  kp.lda = a.lda;
  kp.a_scale = a.a_scale;
  kp.lda_scale = a.lda_scale;
  kp.b = a.b;
  kp.b_scale = a.b_scale;
  kp.b_all = static_cast<const uint8_t*>(a.b_all);
  kp.b_scale_all = a.b_scale_all;
  return kp;
}

}  // namespace

void prepare_grouped_gemm() { prepare_device(current_device()); }

void launch_gemm_swiglu(const GroupedGemmArgs& args, const SwigluEpilogue& epi, cudaStream_t stream) {
  KernelParams kp = common_params(args, "launch_gemm_swiglu");
  MOEFQ_CHECK(args.n % 256 == 0, "launch_gemm_swiglu: n = 2I must be a multiple of 256 (got ", args.n, ")");
  MOEFQ_CHECK(epi.row_weight && (args.a_format == WeightFormat::kBf16 ? epi.h16 != nullptr : epi.h8 && epi.h_scale),
              "launch_gemm_swiglu: null epilogue pointer (h16 for bf16 A, h8 and h_scale for e4m3 A)");
  MOEFQ_CHECK(epi.ldh % 8 == 0 && epi.ldh >= args.n / 2 && epi.ldh_scale >= args.n / 256,
              "launch_gemm_swiglu: ldh must be a multiple of 8 and at least I; ldh_scale at least I / 128");
  if (args.max_total_rows <= 0) return;
  kp.n_tiles = int(args.n / 2 / kBN);
  kp.tile_step = kBN;
  kp.pair_step = args.n / 2;  // gate block n0, up block I + n0
  kp.swiglu = epi;
  kp.silu_clamp = epi.has_clamp ? silu_f32(epi.clamp) : 0.0f;
  launch_any<Epi::kSwiglu>(args, kp, stream);
}

void launch_gemm_store(const GroupedGemmArgs& args, const StoreEpilogue& epi, cudaStream_t stream) {
  KernelParams kp = common_params(args, "launch_gemm_store");
  MOEFQ_CHECK(epi.row_out, "launch_gemm_store: null row_out");
  if (args.max_total_rows <= 0) return;
  kp.n_tiles = int((args.n / kBN + 1) / 2);
  kp.tile_step = 2 * kBN;
  kp.pair_step = kBN;  // two adjacent blocks (the last tile's second one is absent when n / 128 is odd)
  kp.store = epi;
  launch_any<Epi::kStore>(args, kp, stream);
}

}  // namespace moefq::cuda
