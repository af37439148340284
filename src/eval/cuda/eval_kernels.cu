#include "eval/cuda/eval_kernels.cuh"

#include "cuda_base/cuda_check.h"

namespace moefq::cuda {
namespace {

constexpr int kThreads = 256;

// A thread's partial sums; folded over the CTA in a fixed tree, so a run is deterministic.
struct Partial {
  double v[6];  // err2, ref2, out2, dot, dot1, sq1
  double max_abs;
  long long count, skipped, nonfinite;
};

__device__ void fold(Partial& p, const Partial& q) {
  for (int i = 0; i < 6; ++i) p.v[i] += q.v[i];
  if (!(q.max_abs <= p.max_abs)) p.max_abs = q.max_abs;  // NaN propagates
  p.count += q.count;
  p.skipped += q.skipped;
  p.nonfinite += q.nonfinite;
}

__global__ void __launch_bounds__(kThreads) token_sums_kernel(const bf16* out, const bf16* ref, int64_t H,
                                                              MetricSums* sums) {
  const int64_t t = blockIdx.x;
  Partial p{};
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const double r = bf16_to_f32(ref[t * H + h].bits), y = bf16_to_f32(out[t * H + h].bits);
    if (!isfinite(r)) {
      ++p.skipped;
      continue;
    }
    ++p.count;
    if (!isfinite(y)) ++p.nonfinite;
    const double d = y - r;
    p.v[0] += d * d;
    p.v[1] += r * r;
    p.v[2] += y * y;
    p.v[3] += y * r;
    p.v[4] += (y + 1) * (r + 1);
    p.v[5] += (y + 1) * (y + 1) + (r + 1) * (r + 1);
    const double ad = fabs(d);
    if (!(ad <= p.max_abs)) p.max_abs = ad;
  }
  __shared__ Partial sh[kThreads];
  sh[threadIdx.x] = p;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) fold(sh[threadIdx.x], sh[threadIdx.x + w]);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const Partial& q = sh[0];
    MetricSums s;
    s.err2 = q.v[0];
    s.ref2 = q.v[1];
    s.out2 = q.v[2];
    s.dot = q.v[3];
    s.dot1 = q.v[4];
    s.sq1 = q.v[5];
    s.max_abs = q.max_abs;
    s.count = q.count;
    s.skipped = q.skipped;
    s.nonfinite_out = q.nonfinite;
    sums[t] = s;
  }
}

// One thread per channel, the rows in ascending order (reads coalesced across the channels).
__global__ void channel_sums_kernel(const bf16* out, const bf16* ref, int64_t n, int64_t H, double* err2,
                                    double* ref2) {
  const int64_t h = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (h >= H) return;
  double e = err2 ? err2[h] : 0, q = ref2 ? ref2[h] : 0;
  for (int64_t t = 0; t < n; ++t) {
    const double r = bf16_to_f32(ref[t * H + h].bits);
    if (!isfinite(r)) continue;
    if (ref2) q += r * r;
    if (out && err2) {
      const double d = double(bf16_to_f32(out[t * H + h].bits)) - r;
      e += d * d;
    }
  }
  if (err2) err2[h] = e;
  if (ref2) ref2[h] = q;
}

}  // namespace

void launch_token_sums(const bf16* out, const bf16* ref, int64_t n, int64_t H, MetricSums* sums, cudaStream_t stream) {
  if (n == 0) return;
  token_sums_kernel<<<unsigned(n), kThreads, 0, stream>>>(out, ref, H, sums);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

void launch_channel_sums(const bf16* out, const bf16* ref, int64_t n, int64_t H, double* err2, double* ref2,
                         cudaStream_t stream) {
  channel_sums_kernel<<<unsigned((H + kThreads - 1) / kThreads), kThreads, 0, stream>>>(out, ref, n, H, err2, ref2);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

}  // namespace moefq::cuda
