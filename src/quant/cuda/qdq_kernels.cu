#include "quant/cuda/qdq_kernels.cuh"

#include <algorithm>

#include "cuda_base/cuda_check.h"
#include "quant/cuda/qdq_rules.cuh"
#include "moefq/numerics.h"

namespace moefq::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // 16-byte chunks per thread, all loaded before the first is used

using namespace rules;

// Vectorised QDQ over num_chunks 16-byte chunks. A block of the format spans kLanes consecutive
// lanes (1 for per-tensor formats), which exchange their partial maxima with shuffles; blocks are
// whole because cols is a multiple of the block and warps start on chunk multiples of 32.
template <typename T, Format F>
__global__ void __launch_bounds__(kThreads) qdq_vec_kernel(const T* __restrict__ x, T* y,
                                                           int64_t num_chunks, const float* amax) {
  using C = Chunk<T>;
  constexpr int kLanes = Rule<F>::kBlock ? Rule<F>::kBlock / C::kN : 1;
  static_assert(kLanes >= 1 && kLanes <= 32 && (32 % kLanes) == 0);
  __shared__ typename Rule<F>::Shared shared;
  const Rule<F> rule(amax, shared);
  const int64_t first = int64_t(blockIdx.x) * kUnroll * kThreads + threadIdx.x;
  C in[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t c = first + int64_t(u) * kThreads;
    in[u].raw = c < num_chunks ? __ldg(reinterpret_cast<const int4*>(x) + c) : make_int4(0, 0, 0, 0);
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t c = first + int64_t(u) * kThreads;
    float v[C::kN];
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < C::kN; ++i) {
      v[i] = to_f32(in[u].v[i]);
      m = rule.reduce(m, v[i]);
    }
#pragma unroll
    for (int o = 1; o < kLanes; o <<= 1) m = max_ignore_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
    const auto param = rule.block_param(m);
    if constexpr (requires { rule.apply_chunk(v, param); }) {
      rule.apply_chunk(v, param);
    } else {
#pragma unroll
      for (int i = 0; i < C::kN; ++i) v[i] = rule.apply(v[i], param);
    }
    if (c < num_chunks) __stcs(reinterpret_cast<int4*>(y) + c, pack(v));
  }
}

// Block b of a [rows, cols] tensor cut into blocks of `block` along each row (a short final
// block keeps the elements it has): its row and columns [c0, c1). valid is false past the end.
struct RowBlock {
  int64_t row, c0, c1;
  bool valid;
};
__device__ __forceinline__ RowBlock locate_block(int64_t b, int64_t rows, int64_t cols, int64_t block) {
  const int64_t per_row = (cols + block - 1) / block;
  if (b >= rows * per_row) return {0, 0, 0, false};
  const int64_t c0 = (b % per_row) * block;
  return {b / per_row, c0, c0 + block < cols ? c0 + block : cols, true};
}

// Any shape and alignment: one thread per block of the format (per element for per-tensor
// formats); a short final block uses the elements it has.
template <typename T, Format F>
__global__ void qdq_generic_kernel(const T* x, T* y, int64_t rows, int64_t cols, const float* amax) {
  constexpr int64_t kBlock = Rule<F>::kBlock ? Rule<F>::kBlock : 1;
  __shared__ typename Rule<F>::Shared shared;
  const Rule<F> rule(amax, shared);
  __syncthreads();
  const RowBlock blk = locate_block(int64_t(blockIdx.x) * blockDim.x + threadIdx.x, rows, cols, kBlock);
  if (!blk.valid) return;
  const T* xr = x + blk.row * cols;
  T* yr = y + blk.row * cols;
  float m = 0.0f;
  for (int64_t c = blk.c0; c < blk.c1; ++c) m = rule.reduce(m, to_f32(xr[c]));
  const auto param = rule.block_param(m);
  for (int64_t c = blk.c0; c < blk.c1; ++c) store_out(&yr[c], rule.apply(to_f32(xr[c]), param));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

unsigned grid_for(int64_t work, int64_t per_block) {
  return unsigned((work + per_block - 1) / per_block);
}

template <typename T, Format F>
void launch_format(const T* x, T* y, int64_t rows, int64_t cols, const float* amax, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (n == 0) return;
  constexpr int64_t kN = Chunk<T>::kN;
  constexpr int64_t kBlock = Rule<F>::kBlock;
  const bool vec = aligned16(x) && aligned16(y) && (kBlock ? cols % kBlock == 0 : true);
  if (!vec) {
    const int64_t blocks = rows * ((cols + (kBlock ? kBlock : 1) - 1) / (kBlock ? kBlock : 1));
    qdq_generic_kernel<T, F><<<grid_for(blocks, kThreads), kThreads, 0, stream>>>(x, y, rows, cols, amax);
    MOEFQ_CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t num_chunks = n / kN;
  if (num_chunks > 0) {
    qdq_vec_kernel<T, F><<<grid_for(num_chunks, kThreads * kUnroll), kThreads, 0, stream>>>(
        x, y, num_chunks, amax);
    MOEFQ_CUDA_CHECK_LAUNCH();
  }
  const int64_t tail = n - num_chunks * kN;  // per-tensor formats only: the last < 16 bytes
  if (tail > 0) {
    const int64_t off = num_chunks * kN;
    qdq_generic_kernel<T, F><<<1, kThreads, 0, stream>>>(x + off, y + off, 1, tail, amax);
    MOEFQ_CUDA_CHECK_LAUNCH();
  }
}

// logfmt10 (numerics.h): one CTA per cast group of a row, warp w on the group's block w (up to 8
// blocks of 128; a short last group or block keeps what it has), lane l on the block's elements
// l, l + 32, .... The group is cast when every block can be (__syncthreads_and); the values are
// the input rounded to bf16, as on the CPU. Any shape and alignment.
constexpr int kLogFmtThreads = 8 * 32;

template <typename T>
__global__ void __launch_bounds__(kLogFmtThreads) logfmt_kernel(const T* x, T* y, int64_t cols, int64_t groups_per_row,
                                                                int64_t group) {
  constexpr int kPerLane = kLogFmtBlock / 32;
  const int64_t row = int64_t(blockIdx.x) / groups_per_row;
  const int64_t g0 = (int64_t(blockIdx.x) % groups_per_row) * group;
  const int64_t b0 = g0 + int64_t(threadIdx.x >> 5) * kLogFmtBlock;
  const int64_t b1 = min(min(b0 + kLogFmtBlock, g0 + group), cols);
  const int lane = int(threadIdx.x) & 31;
  const T* xr = x + row * cols;
  float v[kPerLane];
  float amax = 0.0f, amin = f32_from_bits(0x7F800000u);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t c = b0 + lane + 32 * i;
    v[i] = c < b1 ? bf16_to_f32(bf16_round(to_f32(xr[c]))) : canonical_nan_f32();  // NaN: left out
    const float a = abs_f32(v[i]);
    if (is_nan(a)) continue;
    amax = a > amax ? a : amax;
    amin = a < amin ? a : amin;
  }
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float xa = __shfl_xor_sync(0xFFFFFFFFu, amax, o), xi = __shfl_xor_sync(0xFFFFFFFFu, amin, o);
    amax = xa > amax ? xa : amax;
    amin = xi < amin ? xi : amin;
  }
  const LogFmtBlock b = logfmt_block(amax, amin);
  const bool cast = __syncthreads_and(b0 >= b1 || b.ok);  // a warp past the group votes to cast
  T* yr = y + row * cols;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t c = b0 + lane + 32 * i;
    if (c < b1) store_out(&yr[c], cast ? logfmt_qdq(v[i], b) : v[i]);
  }
}

template <typename T>
void launch_logfmt(const T* x, T* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows * cols == 0) return;
  const int64_t group = int64_t(logfmt_group_blocks(cols)) * kLogFmtBlock;
  const int64_t groups_per_row = (cols + group - 1) / group;
  MOEFQ_CHECK(rows * groups_per_row <= int64_t(0x7FFFFFFF), "launch_qdq: logfmt10 on ", rows, " rows of ", cols,
              " is more cast groups than one launch holds");
  logfmt_kernel<T><<<unsigned(rows * groups_per_row), kLogFmtThreads, 0, stream>>>(x, y, cols, groups_per_row, group);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

template <typename T>
void launch_typed(Format f, const T* x, T* y, int64_t rows, int64_t cols, const float* amax,
                  cudaStream_t stream) {
  switch (f) {
    case Format::kFp8: return launch_format<T, Format::kFp8>(x, y, rows, cols, amax, stream);
    case Format::kNvfp4: return launch_format<T, Format::kNvfp4>(x, y, rows, cols, amax, stream);
    case Format::kMxfp8: return launch_format<T, Format::kMxfp8>(x, y, rows, cols, amax, stream);
    case Format::kMxfp4: return launch_format<T, Format::kMxfp4>(x, y, rows, cols, amax, stream);
    case Format::kInt8: return launch_format<T, Format::kInt8>(x, y, rows, cols, amax, stream);
    case Format::kFp8Block128: return launch_format<T, Format::kFp8Block128>(x, y, rows, cols, amax, stream);
    case Format::kFp8Block128Ue8m0:
      return launch_format<T, Format::kFp8Block128Ue8m0>(x, y, rows, cols, amax, stream);
    case Format::kLogfmt10: return launch_logfmt(x, y, rows, cols, stream);
    case Format::kFp8Cast: return launch_format<T, Format::kFp8Cast>(x, y, rows, cols, amax, stream);
    case Format::kFp8CastNan: return launch_format<T, Format::kFp8CastNan>(x, y, rows, cols, amax, stream);
    case Format::kFp8Block128Ue8m0NoFloor: return launch_format<T, Format::kFp8Block128Ue8m0NoFloor>(x, y, rows, cols, amax, stream);
    case Format::kFp8Block128Mori: return launch_format<T, Format::kFp8Block128Mori>(x, y, rows, cols, amax, stream);
    case Format::kFp4Block128Mori: return launch_format<T, Format::kFp4Block128Mori>(x, y, rows, cols, amax, stream);
    case Format::kFp8Block128DeepGemm: return launch_format<T, Format::kFp8Block128DeepGemm>(x, y, rows, cols, amax, stream);
    case Format::kFp8Block128Vllm: return launch_format<T, Format::kFp8Block128Vllm>(x, y, rows, cols, amax, stream);
    case Format::kFp4Block16FlashInfer:
      return launch_format<T, Format::kFp4Block16FlashInfer>(x, y, rows, cols, amax, stream);
  }
}

// Running max of |x| into *amax (non-negative floats order like their bit patterns).
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* __restrict__ x, int64_t n, float* amax) {
  float m = 0.0f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    m = max_ignore_nan(m, abs_f32(to_f32(x[i])));
  const unsigned w = __reduce_max_sync(0xFFFFFFFFu, f32_bits(m));
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<unsigned*>(amax), w);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) amax_vec_kernel(const T* __restrict__ x, int64_t num_chunks, float* amax) {
  using C = Chunk<T>;
  float m = 0.0f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; c < num_chunks; c += stride) {
    C in;
    in.raw = __ldg(reinterpret_cast<const int4*>(x) + c);
#pragma unroll
    for (int i = 0; i < C::kN; ++i) m = max_ignore_nan(m, abs_f32(to_f32(in.v[i])));
  }
  const unsigned w = __reduce_max_sync(0xFFFFFFFFu, f32_bits(m));
  if ((threadIdx.x & 31) == 0) atomicMax(reinterpret_cast<unsigned*>(amax), w);
}

template <typename T>
void launch_amax_typed(const T* x, int64_t n, float* amax, cudaStream_t stream) {
  if (n == 0) return;
  int sms = 0, dev = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFQ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const unsigned grid_cap = unsigned(sms) * 8;
  constexpr int64_t kN = Chunk<T>::kN;
  if (aligned16(x) && n % kN == 0) {
    const int64_t chunks = n / kN;
    amax_vec_kernel<T><<<std::min(grid_cap, grid_for(chunks, kThreads)), kThreads, 0, stream>>>(x, chunks, amax);
  } else {
    amax_kernel<T><<<std::min(grid_cap, grid_for(n, kThreads)), kThreads, 0, stream>>>(x, n, amax);
  }
  MOEFQ_CUDA_CHECK_LAUNCH();
}

// e4m3 staging: 16 lanes x 8 bf16 per 1 x 128 block.
__global__ void __launch_bounds__(kThreads) stage_vec_kernel(const bf16* __restrict__ x, uint8_t* x8,
                                                             float* scales, int64_t num_chunks) {
  using C = Chunk<bf16>;
  constexpr int kLanes = kStageBlock / C::kN;
  const int64_t c = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  C in;
  in.raw = c < num_chunks ? __ldg(reinterpret_cast<const int4*>(x) + c) : make_int4(0, 0, 0, 0);
  float v[C::kN];
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < C::kN; ++i) {
    v[i] = to_f32(in.v[i]);
    m = max_ignore_nan(m, abs_f32(v[i]));
  }
#pragma unroll
  for (int o = 1; o < kLanes; o <<= 1) m = max_ignore_nan(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  const float sf = stage_scale(m);
  const float inv = div_rn(1.0f, sf);
  union {
    uint2 raw;
    uint8_t b[8];
  } out;
#pragma unroll
  for (int i = 0; i < C::kN; ++i) out.b[i] = stage_encode(v[i], inv);
  if (c < num_chunks) {
    reinterpret_cast<uint2*>(x8)[c] = out.raw;
    if (c % kLanes == 0) scales[c / kLanes] = sf;
  }
}

__global__ void stage_generic_kernel(const bf16* x, uint8_t* x8, float* scales, int64_t rows, int64_t cols) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const RowBlock blk = locate_block(b, rows, cols, kStageBlock);
  if (!blk.valid) return;
  const bf16* xr = x + blk.row * cols;
  uint8_t* x8r = x8 + blk.row * cols;
  float m = 0.0f;
  for (int64_t c = blk.c0; c < blk.c1; ++c) m = max_ignore_nan(m, abs_f32(to_f32(xr[c])));
  const float sf = stage_scale(m);
  const float inv = div_rn(1.0f, sf);
  for (int64_t c = blk.c0; c < blk.c1; ++c) x8r[c] = stage_encode(to_f32(xr[c]), inv);
  scales[b] = sf;
}

}  // namespace

void launch_qdq(Format f, DType dt, const void* x, void* y, int64_t rows, int64_t cols,
                const float* d_amax, cudaStream_t stream) {
  MOEFQ_ASSERT(rows >= 0 && cols >= 0, "launch_qdq: negative shape");
  MOEFQ_ASSERT(d_amax != nullptr || !format_has_global_amax(f), "launch_qdq: ", format_name(f),
               " needs a device amax");
  if (dt == DType::kBF16)
    launch_typed(f, static_cast<const bf16*>(x), static_cast<bf16*>(y), rows, cols, d_amax, stream);
  else
    launch_typed(f, static_cast<const float*>(x), static_cast<float*>(y), rows, cols, d_amax, stream);
}

void launch_amax(DType dt, const void* x, int64_t n, float* d_amax, cudaStream_t stream) {
  if (dt == DType::kBF16)
    launch_amax_typed(static_cast<const bf16*>(x), n, d_amax, stream);
  else
    launch_amax_typed(static_cast<const float*>(x), n, d_amax, stream);
}

void launch_stage_e4m3(const bf16* x, uint8_t* x8, float* scales, int64_t rows, int64_t cols,
                       cudaStream_t stream) {
  if (rows * cols == 0) return;
  if (cols % kStageBlock == 0 && aligned16(x) && (reinterpret_cast<uintptr_t>(x8) & 7u) == 0) {
    const int64_t chunks = rows * cols / Chunk<bf16>::kN;
    stage_vec_kernel<<<grid_for(chunks, kThreads), kThreads, 0, stream>>>(x, x8, scales, chunks);
  } else {
    const int64_t blocks = rows * ((cols + kStageBlock - 1) / kStageBlock);
    stage_generic_kernel<<<grid_for(blocks, kThreads), kThreads, 0, stream>>>(x, x8, scales, rows, cols);
  }
  MOEFQ_CUDA_CHECK_LAUNCH();
}

}  // namespace moefq::cuda
