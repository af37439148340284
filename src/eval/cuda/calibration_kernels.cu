#include "eval/cuda/calibration_kernels.cuh"

#include <algorithm>

#include "cuda_base/cuda_check.h"

namespace moefq::cuda {
namespace {

constexpr int kBins = AbsHistogram::kBins;
constexpr int kHistThreads = 512;
constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// Calls row(x) for every row a quantizer saw of token t (CTA-uniform: it depends on t alone).
template <typename Row>
__device__ void for_each_row(const CalibrationRows& in, int64_t t, Row&& row) {
  const int64_t H = in.hidden, K = in.top_k;
  bool any = false;
  for (int64_t k = 0; k < K; ++k) {
    const bool active = in.topk_idx[t * K + k] >= 0;
    if (active && in.slot_stride != 0) row(in.rows + k * in.slot_stride + t * H, k);
    any = any || active;
  }
  if (any && in.slot_stride == 0) row(in.rows + t * H, int64_t(-1));
}

// A CTA folds its tokens (t = blockIdx.x, += gridDim.x) into a private histogram: in shared memory
// (kShared, 32-bit counts, which the grid size keeps from overflowing), added to the global one at
// the end; without, straight into the global bins.
template <bool kShared>
__global__ void __launch_bounds__(kHistThreads) abs_histogram_kernel(CalibrationRows in, unsigned long long* bins,
                                                                     unsigned long long* nonfinite) {
  extern __shared__ unsigned int sh_bins[];  // [kBins] with kShared
  __shared__ unsigned int sh_nonfinite;
  if (kShared)
    for (int i = threadIdx.x; i < kBins; i += blockDim.x) sh_bins[i] = 0;
  if (threadIdx.x == 0) sh_nonfinite = 0;
  __syncthreads();
  unsigned int bad = 0;
  for (int64_t t = blockIdx.x; t < in.num_tokens; t += gridDim.x)
    for_each_row(in, t, [&](const bf16* x, int64_t) {
      for (int64_t h = threadIdx.x; h < in.hidden; h += blockDim.x) {
        const int bin = AbsHistogram::bin_of(x[h].bits);
        if (bin < 0) {
          ++bad;
        } else if (kShared) {
          atomicAdd(&sh_bins[bin], 1u);
        } else {
          atomicAdd(&bins[bin], 1ull);
        }
      }
    });
  if (bad) atomicAdd(&sh_nonfinite, bad);
  __syncthreads();
  if (kShared)
    for (int i = threadIdx.x; i < kBins; i += blockDim.x)
      if (sh_bins[i]) atomicAdd(&bins[i], (unsigned long long)sh_bins[i]);
  if (threadIdx.x == 0 && sh_nonfinite) atomicAdd(nonfinite, (unsigned long long)sh_nonfinite);
}

// One CTA per token. Per row: each warp takes 128-element blocks, its lanes' amax and amin of |x|
// over the non-NaN elements reduced (max and min do not depend on the order), the block's cast
// decision from logfmt_block (the one qdq_ref and logfmt10_cast_groups use); then a thread per cast
// group ANDs its blocks'.
__global__ void __launch_bounds__(kThreads) logfmt10_cast_groups_kernel(CalibrationRows in, unsigned long long* counts) {
  extern __shared__ unsigned char block_ok[];  // [blocks of a row]
  __shared__ unsigned int sh_cast, sh_total;
  if (threadIdx.x == 0) sh_cast = sh_total = 0;
  __syncthreads();
  const int64_t H = in.hidden;
  const int num_blocks = int((H + kLogFmtBlock - 1) / kLogFmtBlock), G = logfmt_group_blocks(H);
  const int num_groups = (num_blocks + G - 1) / G;
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31), num_warps = int(blockDim.x >> 5);
  for_each_row(in, int64_t(blockIdx.x), [&](const bf16* x, int64_t) {
    for (int b = warp; b < num_blocks; b += num_warps) {
      float amax = 0.0f, amin = f32_from_bits(0x7F800000u);
      const int64_t c1 = std::min<int64_t>(H, int64_t(b + 1) * kLogFmtBlock);
      for (int64_t c = int64_t(b) * kLogFmtBlock + lane; c < c1; c += 32) {
        const float a = abs_f32(bf16_to_f32(x[c].bits));
        if (is_nan(a)) continue;
        amax = a > amax ? a : amax;
        amin = a < amin ? a : amin;
      }
      for (int o = 16; o > 0; o >>= 1) {
        const float oa = __shfl_xor_sync(kFullMask, amax, o), oi = __shfl_xor_sync(kFullMask, amin, o);
        amax = oa > amax ? oa : amax;
        amin = oi < amin ? oi : amin;
      }
      if (lane == 0) block_ok[b] = logfmt_block(amax, amin).ok ? 1 : 0;
    }
    __syncthreads();
    for (int g = threadIdx.x; g < num_groups; g += blockDim.x) {
      bool cast = true;
      for (int b = g * G; b < std::min(num_blocks, (g + 1) * G); ++b) cast = cast && block_ok[b];
      if (cast) atomicAdd(&sh_cast, 1u);
    }
    if (threadIdx.x == 0) sh_total += unsigned(num_groups);
    __syncthreads();  // block_ok is the next row's
  });
  if (threadIdx.x == 0 && sh_total) {
    atomicAdd(&counts[0], (unsigned long long)sh_cast);
    atomicAdd(&counts[1], (unsigned long long)sh_total);
  }
}

// One CTA per token: its rows the plan keeps, copied to their slots.
__global__ void __launch_bounds__(kThreads) sample_rows_kernel(CalibrationRows in, uint64_t first_token,
                                                               SampleRows plan, bf16* sample, uint8_t* valid) {
  const int64_t t = blockIdx.x, H = in.hidden;
  for_each_row(in, t, [&](const bf16* x, int64_t k) {
    const uint64_t token = first_token + uint64_t(t);
    const int64_t j = plan.slot(k < 0 ? token : token * uint64_t(in.top_k) + uint64_t(k));
    if (j < 0) return;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) sample[j * H + h] = x[h];
    if (threadIdx.x == 0) valid[j] = 1;
  });
}

int device_attribute(cudaDeviceAttr attr) {
  int dev = 0, v = 0;
  MOEFQ_CUDA_CHECK(cudaGetDevice(&dev));
  MOEFQ_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, dev));
  return v;
}

}  // namespace

void launch_abs_histogram(const CalibrationRows& rows, unsigned long long* bins, unsigned long long* nonfinite,
                          cudaStream_t stream) {
  if (rows.num_tokens == 0 || rows.hidden == 0) return;
  // A CTA per SM (or two) is enough to fill the device; more where a CTA's tokens could otherwise
  // hold 2^31 elements (its 32-bit shared counts).
  const int64_t per_token = (rows.slot_stride != 0 ? rows.top_k : 1) * rows.hidden;
  const int64_t tokens_per_cta = std::max<int64_t>(1, (int64_t(1) << 31) / per_token);
  const int64_t grid = std::min<int64_t>(
      rows.num_tokens, std::max<int64_t>(2 * device_attribute(cudaDevAttrMultiProcessorCount),
                                         (rows.num_tokens + tokens_per_cta - 1) / tokens_per_cta));
  const size_t shared = size_t(kBins) * sizeof(unsigned int);
  if (size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin)) >= shared + 64) {
    MOEFQ_CUDA_CHECK(cudaFuncSetAttribute(abs_histogram_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(shared)));
    abs_histogram_kernel<true><<<unsigned(grid), kHistThreads, shared, stream>>>(rows, bins, nonfinite);
  } else {
    abs_histogram_kernel<false><<<unsigned(grid), kHistThreads, 0, stream>>>(rows, bins, nonfinite);
  }
  MOEFQ_CUDA_CHECK_LAUNCH();
}

void launch_logfmt10_cast_groups(const CalibrationRows& rows, unsigned long long* counts, cudaStream_t stream) {
  if (rows.num_tokens == 0 || rows.hidden == 0) return;
  const size_t shared = size_t((rows.hidden + kLogFmtBlock - 1) / kLogFmtBlock);
  logfmt10_cast_groups_kernel<<<unsigned(rows.num_tokens), kThreads, shared, stream>>>(rows, counts);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

void launch_sample_rows(const CalibrationRows& rows, uint64_t first_token, const SampleRows& plan, bf16* sample,
                        uint8_t* valid, cudaStream_t stream) {
  if (rows.num_tokens == 0 || rows.hidden == 0) return;
  sample_rows_kernel<<<unsigned(rows.num_tokens), kThreads, 0, stream>>>(rows, first_token, plan, sample, valid);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

}  // namespace moefq::cuda
