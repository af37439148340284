#include "cuda/cuda_fake_quant.cuh"

#include <cstdlib>
#include <cstring>

#include "cuda/cuda_check.h"
#include "cuda/qdq_kernels.cuh"
#include "moefq/errors.h"

namespace moefq::cuda {
namespace {

constexpr int kThreads = 256;

// One CTA per token. slot_stride == 0: the token's own row rows + t * H, counted when the token
// has an active routed slot (dispatch). Otherwise the active routed rows rows + k * slot_stride +
// t * H (combine). Folds max |x| over non-NaN elements, the seen flag and the non-finite count
// into *st.
__global__ void __launch_bounds__(kThreads) masked_amax_kernel(const bf16* rows, int64_t slot_stride,
                                                               const int32_t* topk_idx, int K, int H, DeviceAmax* st) {
  const int t = blockIdx.x;
  float m = 0.0f;
  unsigned nonfinite = 0;
  bool any = false;
  auto fold = [&](const bf16* row) {
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
      const float v = bf16_to_f32(row[h].bits);
      m = max_ignore_nan(m, abs_f32(v));  // amax over non-NaN values (numerics.h)
      if (!is_finite(v)) ++nonfinite;
    }
  };
  for (int k = 0; k < K; ++k) {
    const bool active = topk_idx[int64_t(t) * K + k] >= 0;
    if (active && slot_stride != 0) fold(rows + k * slot_stride + int64_t(t) * H);
    any = any || active;
  }
  if (!any) return;  // uniform over the CTA
  if (slot_stride == 0) fold(rows + int64_t(t) * H);
  for (int o = 16; o > 0; o >>= 1) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    nonfinite += __shfl_xor_sync(0xffffffffu, nonfinite, o);
  }
  __shared__ float wm[kThreads / 32];
  __shared__ unsigned wn[kThreads / 32];
  if ((threadIdx.x & 31) == 0) {
    wm[threadIdx.x >> 5] = m;
    wn[threadIdx.x >> 5] = nonfinite;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x >> 5); ++w) {
      m = fmaxf(m, wm[w]);
      nonfinite += wn[w];
    }
    atomicMax(reinterpret_cast<unsigned*>(&st->max), __float_as_uint(m));
    atomicOr(&st->seen, 1u);
    if (nonfinite) atomicAdd(&st->nonfinite, nonfinite);
  }
}

void launch_masked_amax(const bf16* rows, int64_t slot_stride, const int32_t* topk_idx, int64_t num_tokens, int64_t K,
                        int64_t H, DeviceAmax* st, cudaStream_t stream) {
  if (num_tokens == 0) return;
  masked_amax_kernel<<<unsigned(num_tokens), kThreads, 0, stream>>>(rows, slot_stride, topk_idx, int(K), int(H), st);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

bool env_trap() {
  const char* v = std::getenv("MOEFQ_LAYOUT_CHECK_TRAP");
  return v && std::strcmp(v, "1") == 0;
}

}  // namespace

CudaFakeQuantMoe::CudaFakeQuantMoe(std::unique_ptr<CudaEngine> engine, int64_t layer)
    : engine_(std::move(engine)), q_(layer, engine_->num_local_ranks()), trap_(env_trap()) {
  const int64_t R = engine_->num_local_ranks();
  xq_ = DeviceBuffer<bf16>(size_t(R * engine_->max_tokens() * engine_->config().hidden));
  calib_ = DeviceBuffer<DeviceAmax>(std::vector<DeviceAmax>(size_t(2 * R), DeviceAmax{}));
  dynamic_ = DeviceBuffer<DeviceAmax>(std::vector<DeviceAmax>(size_t(R), DeviceAmax{}));
  amax_ = DeviceBuffer<float>(std::vector<float>(size_t(2 * R), 0.0f));
  records_ = DeviceBuffer<CheckRecord>(std::vector<CheckRecord>(size_t(R), CheckRecord{~0ull, 0}));
  checked_.assign(size_t(R), false);
  pending_.assign(size_t(R), false);
  combine_offset_ = engine_->layout().combine_offset();
}

CudaFakeQuantMoe::~CudaFakeQuantMoe() = default;

void CudaFakeQuantMoe::upload_amax() {
  const int64_t R = engine_->num_local_ranks();
  std::vector<float> v(size_t(2 * R));
  for (int64_t r = 0; r < R; ++r) {
    v[size_t(r)] = q_.dispatch(r).amax().value_or(0.0f);
    v[size_t(R + r)] = q_.combine(r).amax().value_or(0.0f);
  }
  amax_.upload(v);
}

void CudaFakeQuantMoe::configure(const std::map<std::string, QuantizerConfig>& configs) {
  q_.configure(configs, engine_->fused_shared(), true, "mega_moe_cuda");
  upload_amax();
}

void CudaFakeQuantMoe::start_calibration() {
  q_.start_calibration();
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  calib_.upload(std::vector<DeviceAmax>(calib_.size(), DeviceAmax{}));
}

void CudaFakeQuantMoe::finish_calibration() {
  const int64_t R = engine_->num_local_ranks();
  MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
  engine_->synchronize(nullptr);  // a barrier that timed out during calibration, before the all-reduce
  RankLink* link = engine_->link();
  // Real ranks: fake_quant.md's MAX over every expert-parallel rank, here before the replicas
  // collect (the simulated ones are reduced by q_.finish_calibration). Every word of DeviceAmax
  // is a non-negative number ordered like its bits (max >= 0), so one MAX over the words reduces
  // them all: the largest |x|, whether any rank saw data, the largest non-finite count of a rank.
  if (link) link->all_reduce_max(reinterpret_cast<uint32_t*>(calib_.get()), calib_.bytes() / 4, nullptr);
  const std::vector<DeviceAmax> seen = calib_.download();
  for (int64_t r = 0; r < R; ++r)
    for (int which = 0; which < 2; ++which) {
      Quantizer& q = which == 0 ? q_.dispatch(r) : q_.combine(r);
      const DeviceAmax& s = seen[size_t(which * R + r)];
      if (!q.enabled() || !q.calibrating()) continue;
      MOEFQ_CHECK(s.nonfinite == 0, q.name(), ": ", s.nonfinite, " NaN or inf values in the calibration data of ",
                  link ? "one of the expert-parallel ranks" : "rank " + std::to_string(r),
                  " (calibration needs finite data)");
      if (s.seen) q.collect_max(s.max);
    }
  q_.finish_calibration();
  upload_amax();
}

void CudaFakeQuantMoe::load_calibration_file(const std::string& path) {
  q_.load_calibration_file(path);
  upload_amax();
}

void CudaFakeQuantMoe::forward(std::span<const DeviceBatch> batches, cudaStream_t stream) {
  run(batches, stream, true);
}

void CudaFakeQuantMoe::quantizers_only(std::span<const DeviceBatch> batches, cudaStream_t stream) {
  run(batches, stream, false);
}

void CudaFakeQuantMoe::run(std::span<const DeviceBatch> batches, cudaStream_t stream, bool with_engine) {
  const int64_t R = engine_->num_local_ranks(), T = engine_->max_tokens(), K = engine_->config().top_k;
  const int64_t H = engine_->config().hidden;
  MOEFQ_CHECK(int64_t(batches.size()) == R, "forward: ", batches.size(), " batches for ", R, " ranks");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  MOEFQ_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture != cudaStreamCaptureStatusNone;
  // The rows the combine quantizer reads must lie inside the buffer (the last one: the last slot
  // of the last token).
  const BufferLayout& layout = engine_->layout();
  const int64_t slots = K + (engine_->fused_shared() ? 1 : 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = batches[size_t(r)].num_tokens;
    const size_t end = combine_offset_ + size_t(((slots - 1) * T + n) * H) * 2;
    if (q_.combine(r).enabled() && n > 0 && end > layout.total_bytes())
      MOEFQ_FAIL(ErrorKind::kFailedCheck, q_.combine(r).name(), ": combine rows read at offset ", combine_offset_,
                 " would run past the end of the ", layout.total_bytes(), "-byte buffer of rank ", engine_->first_rank() + r,
                 "; the layout does not match engine.md's [K + shared][T][H]");
  }

  // Dispatch: QDQ out of place; calibration and a dynamic amax see the tokens that are sent.
  std::vector<DeviceBatch> sent(batches.begin(), batches.end());
  for (int64_t r = 0; r < R; ++r) {
    const Quantizer& q = q_.dispatch(r);
    const DeviceBatch& b = batches[size_t(r)];
    if (!q.enabled() || b.num_tokens == 0) continue;
    if (q.calibrating()) {
      launch_masked_amax(b.x, 0, b.topk_idx, b.num_tokens, K, H, calib_.get() + r, stream);
      continue;
    }
    const float* amax = amax_.get() + r;
    if (q.spec().amax_source == AmaxSource::kDynamic && format_has_global_amax(q.spec().format)) {
      MOEFQ_CUDA_CHECK(cudaMemsetAsync(dynamic_.get() + r, 0, sizeof(DeviceAmax), stream));
      launch_masked_amax(b.x, 0, b.topk_idx, b.num_tokens, K, H, dynamic_.get() + r, stream);
      amax = &(dynamic_.get() + r)->max;
    }
    bf16* xq = xq_.get() + r * T * H;
    launch_qdq(q.spec().format, DType::kBF16, b.x, xq, b.num_tokens, H, amax, stream);
    sent[size_t(r)].x = xq;
  }
  // A rank whose combine quantizer has passed the layout check replaces y with its own re-sum of
  // the rows: the engine's combine would be overwritten unread, so it is skipped (the check, while
  // it is still to come, compares with the engine's y).
  std::vector<bool> replaced(size_t(R), false);
  for (int64_t r = 0; r < R; ++r) {
    const Quantizer& q = q_.combine(r);
    replaced[size_t(r)] = q.enabled() && !q.calibrating() && checked_[size_t(r)];
  }
  if (with_engine) engine_->forward(sent, stream, replaced);

  // Combine: the layout check (until the buffer passed one), calibration or QDQ + re-sum.
  for (int64_t r = 0; r < R; ++r) {
    const Quantizer& q = q_.combine(r);
    const DeviceBatch& b = batches[size_t(r)];
    if (!q.enabled() || b.num_tokens == 0) continue;
    CombineRows rows;
    rows.buffer = engine_->buffer(engine_->first_rank() + r);
    rows.combine_offset = combine_offset_;
    rows.max_tokens = T;
    rows.top_k = K;
    rows.hidden = H;
    rows.fused_shared = engine_->fused_shared();
    rows.topk_idx = b.topk_idx;
    rows.num_tokens = b.num_tokens;
    CombineCheck check;
    bool eager_check = false;
    if (!checked_[size_t(r)]) {
      if (!capturing) {
        // The eager check waits for a call with routed rows: look at this call's slots (a host
        // synchronisation, only until the buffer is checked).
        std::vector<int32_t> idx(size_t(b.num_tokens * K));
        MOEFQ_CUDA_CHECK(cudaMemcpyAsync(idx.data(), b.topk_idx, idx.size() * 4, cudaMemcpyDeviceToHost, stream));
        MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream));
        for (int32_t e : idx) eager_check = eager_check || e >= 0;
        if (!eager_check) continue;  // padding only: nothing to check, collect or quantize
      }
      check.y_engine = b.y;
      check.record = records_.get() + r;
      check.trap = trap_;
    }
    const auto* base = reinterpret_cast<const bf16*>(rows.buffer + combine_offset_);
    if (q.calibrating()) {
      launch_masked_amax(base, T * H, b.topk_idx, b.num_tokens, K, H, calib_.get() + R + r, stream);
      if (check.y_engine) launch_combine_qdq(rows, false, q.spec().format, nullptr, check, b.y, stream);
    } else {
      launch_combine_qdq(rows, true, q.spec().format, amax_.get() + R + r, check, b.y, stream);
    }
    if (eager_check) {
      raise_recorded(r, stream);
      checked_[size_t(r)] = true;
    } else if (check.y_engine) {
      pending_[size_t(r)] = true;  // a graph carries the check; synchronize() reads its record
    }
  }
}

void CudaFakeQuantMoe::raise_recorded(int64_t rank, cudaStream_t stream) {
  // A barrier timeout first: the rows a peer never wrote would otherwise be reported as a layout
  // mismatch.
  engine_->synchronize(stream);
  const auto m = read_check(records_.get() + rank, engine_->config().hidden, stream);
  if (m)
    q_.fail_layout_check(engine_->first_rank() + rank, m->token, m->element, m->engine_bits, m->resum_bits,
                         combine_offset_);
}

void CudaFakeQuantMoe::synchronize(cudaStream_t stream) {
  engine_->synchronize(stream);
  for (int64_t r = 0; r < engine_->num_local_ranks(); ++r)
    if (pending_[size_t(r)]) raise_recorded(r, stream);
}

}  // namespace moefq::cuda
