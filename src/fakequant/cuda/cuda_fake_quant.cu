// The CUDA implementation of FakeQuantMoe: the shared fake-quantization driver over device
// primitives (kernels and their launches on the caller's stream), the CudaFakeQuantMoe face on it,
// and its registration as FakeQuantMoe::make's CUDA factory (cuda.h's register_cuda_backends).
#include "fakequant/cuda/cuda_fake_quant.cuh"

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "cuda_base/cuda_check.h"
#include "engine/cuda/combine_kernels.cuh"
#include "fakequant/cuda/add_shared_kernels.cuh"
#include "moefq/cuda.h"
#include "quant/cuda/qdq_kernels.cuh"
#include "fakequant/fake_quant_driver.h"
#include "moefq/errors.h"

namespace moefq::cuda {
namespace {

constexpr int kThreads = 256;

// One CTA per token. slot_stride == 0: the token's own row rows + t * H, when the token has an
// active routed slot (dispatch). Otherwise the active routed rows rows + k * slot_stride + t * H
// (combine). With stats: folds max |x| over non-NaN elements, the seen flag and the non-finite
// count into *st. With clip: counts the elements with |x| > *amax and all elements into *clip.
__global__ void __launch_bounds__(kThreads) masked_rows_kernel(const bf16* rows, int64_t slot_stride,
                                                               const int32_t* topk_idx, int K, int H, AmaxStats* st,
                                                               const float* amax, ClipCounts* clip) {
  const int t = blockIdx.x;
  const float limit = clip ? *amax : 0.0f;
  float m = 0.0f;
  unsigned nonfinite = 0, above = 0, rows_seen = 0;
  bool any = false;
  auto fold = [&](const bf16* row) {
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
      const float v = bf16_to_f32(row[h].bits);
      m = max_ignore_nan(m, abs_f32(v));  // amax over non-NaN values (numerics.h)
      if (!is_finite(v)) ++nonfinite;
      if (abs_f32(v) > limit) ++above;
    }
    ++rows_seen;
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
    above += __shfl_xor_sync(0xffffffffu, above, o);
  }
  __shared__ float wm[kThreads / 32];
  __shared__ unsigned wn[kThreads / 32], wa[kThreads / 32];
  if ((threadIdx.x & 31) == 0) {
    wm[threadIdx.x >> 5] = m;
    wn[threadIdx.x >> 5] = nonfinite;
    wa[threadIdx.x >> 5] = above;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x >> 5); ++w) {
      m = fmaxf(m, wm[w]);
      nonfinite += wn[w];
      above += wa[w];
    }
    if (st) {
      atomicMax(reinterpret_cast<unsigned*>(&st->max), __float_as_uint(m));
      atomicOr(&st->seen, 1u);
      if (nonfinite) atomicAdd(&st->nonfinite, nonfinite);
    }
    if (clip) {
      atomicAdd(reinterpret_cast<unsigned long long*>(&clip->clipped), (unsigned long long)above);
      atomicAdd(reinterpret_cast<unsigned long long*>(&clip->total), (unsigned long long)rows_seen * H);
    }
  }
}

void launch_masked_rows(const bf16* rows, int64_t slot_stride, const RankBatch& b, int64_t K, int64_t H,
                        AmaxStats* st, const float* amax, ClipCounts* clip, cudaStream_t stream) {
  if (b.num_tokens == 0) return;
  masked_rows_kernel<<<unsigned(b.num_tokens), kThreads, 0, stream>>>(rows, slot_stride, b.topk_idx, int(K), int(H),
                                                                      st, amax, clip);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

bool env_trap() {
  const char* v = std::getenv("MOEFQ_LAYOUT_CHECK_TRAP");
  return v && std::strcmp(v, "1") == 0;
}

}  // namespace

class CudaFakeQuantOps final : public FakeQuantOps {
 public:
  explicit CudaFakeQuantOps(std::unique_ptr<CudaEngine> engine) : engine_(std::move(engine)), trap_(env_trap()) {
    const int64_t R = engine_->num_local_ranks();
    xq_ = DeviceBuffer<bf16>(size_t(R * engine_->max_tokens() * engine_->config().hidden));
    calib_ = DeviceBuffer<AmaxStats>(std::vector<AmaxStats>(size_t(2 * R), AmaxStats{}));
    dynamic_ = DeviceBuffer<AmaxStats>(std::vector<AmaxStats>(size_t(R), AmaxStats{}));
    amax_ = DeviceBuffer<float>(std::vector<float>(size_t(2 * R), 0.0f));
    records_ = DeviceBuffer<CheckRecord>(std::vector<CheckRecord>(size_t(R), CheckRecord{~0ull, 0}));
    clips_ = DeviceBuffer<ClipCounts>(std::vector<ClipCounts>(size_t(2 * R), ClipCounts{}));
    combine_offset_ = engine_->layout().combine_offset();
  }

  CudaEngine& engine() { return *engine_; }
  void set_stream(void* s) override { stream_ = static_cast<cudaStream_t>(s); }
  cudaStream_t stream() const { return stream_; }
  DeviceBuffer<float>& device_amax() { return amax_; }
  void set_trap(bool trap) { trap_ = trap; }
  void set_combine_offset(size_t offset) { combine_offset_ = offset; }

  std::string kind() const override { return "mega_moe_cuda"; }
  const MoeConfig& config() const override { return engine_->config(); }
  int64_t first_rank() const override { return engine_->first_rank(); }
  int64_t num_local_ranks() const override { return engine_->num_local_ranks(); }
  int64_t max_tokens() const override { return engine_->max_tokens(); }
  bool fused_shared() const override { return engine_->fused_shared(); }
  CombineWeighting combine_weighting() const override { return engine_->combine_weighting(); }
  std::optional<size_t> combine_offset() const override { return combine_offset_; }
  size_t buffer_bytes() const override { return engine_->layout().total_bytes(); }
  bool capturing() const override {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    MOEFQ_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
    return capture != cudaStreamCaptureStatusNone;
  }
  bool real_ranks() const override { return engine_->link() != nullptr; }

  void set_amax(const std::vector<float>& amax) override { amax_.upload(amax); }
  void reset_calibration() override {
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    calib_.upload(std::vector<AmaxStats>(calib_.size(), AmaxStats{}));
  }
  void token_stats(int64_t r, const RankBatch& b, TokenStats where) override {
    AmaxStats* st = where == TokenStats::kCalibration ? calib_.get() + r : dynamic_.get() + r;
    launch_masked_rows(b.x, 0, b, config().top_k, config().hidden, st, nullptr, nullptr, stream_);
  }
  void row_stats(int64_t r, const RankBatch& b) override {
    launch_masked_rows(rows_base(r), max_tokens() * config().hidden, b, config().top_k, config().hidden,
                       calib_.get() + num_local_ranks() + r, nullptr, nullptr, stream_);
  }
  std::vector<AmaxStats> read_calibration() override {
    MOEFQ_CUDA_CHECK(cudaDeviceSynchronize());
    // Real ranks: docs/fake_quant.md's MAX over every expert-parallel rank (AmaxStats' words order like
    // their bits, so one MAX over the words reduces them all).
    if (RankLink* link = engine_->link())
      link->all_reduce_max(reinterpret_cast<uint32_t*>(calib_.get()), calib_.bytes() / 4, nullptr);
    return calib_.download();
  }
  void reset_dynamic(int64_t r) override {
    MOEFQ_CUDA_CHECK(cudaMemsetAsync(dynamic_.get() + r, 0, sizeof(AmaxStats), stream_));
  }
  void count_clipped(int64_t r, const RankBatch& b, int which) override {
    const int64_t R = num_local_ranks(), H = config().hidden;
    const bf16* rows = which == 0 ? b.x : rows_base(r);
    launch_masked_rows(rows, which == 0 ? 0 : max_tokens() * H, b, config().top_k, H, nullptr,
                       amax_.get() + which * R + r, clips_.get() + which * R + r, stream_);
  }
  std::vector<ClipCounts> read_clip_counts() override {
    MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<ClipCounts> out = clips_.download();
    MOEFQ_CUDA_CHECK(cudaMemsetAsync(clips_.get(), 0, clips_.bytes(), stream_));
    return out;
  }

  const bf16* dispatch_qdq(int64_t r, const RankBatch& b, Format f, bool dynamic) override {
    const int64_t T = max_tokens(), H = config().hidden;
    const float* amax = dynamic ? &(dynamic_.get() + r)->max : amax_.get() + r;
    bf16* xq = xq_.get() + r * T * H;
    launch_qdq(f, DType::kBF16, b.x, xq, b.num_tokens, H, amax, stream_);
    return xq;
  }
  void engine_forward(std::span<const RankBatch> batches, const std::vector<bool>& skip) override {
    engine_->forward(batches, stream_, skip);
  }
  bool has_routed_rows(int64_t, const RankBatch& b) override {
    std::vector<int32_t> idx(size_t(b.num_tokens * config().top_k));
    MOEFQ_CUDA_CHECK(cudaMemcpyAsync(idx.data(), b.topk_idx, idx.size() * 4, cudaMemcpyDeviceToHost, stream_));
    MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (int32_t e : idx)
      if (e >= 0) return true;
    return false;
  }
  void combine(int64_t r, const RankBatch& b, std::optional<Format> format, CombineWeighting weighting,
               bool check) override {
    CombineRows rows;
    rows.buffer = engine_->buffer(first_rank() + r);
    rows.combine_offset = combine_offset_;
    rows.max_tokens = max_tokens();
    rows.top_k = config().top_k;
    rows.hidden = config().hidden;
    rows.fused_shared = fused_shared();
    rows.topk_idx = b.topk_idx;
    if (weighting == CombineWeighting::kAfter) rows.topk_weights = b.topk_weights;
    rows.num_tokens = b.num_tokens;
    CombineCheck c;
    if (check) {
      c.y_engine = b.y;
      c.record = records_.get() + r;
      c.trap = trap_;
    }
    launch_combine_qdq(rows, format.has_value(), format.value_or(Format::kFp8),
                       amax_.get() + num_local_ranks() + r, c, b.y, stream_);
  }
  std::optional<LayoutMismatch> read_check(int64_t r) override {
    // A barrier timeout first: the rows a peer never wrote would otherwise be reported as a
    // layout mismatch.
    engine_->synchronize(stream_);
    const auto m = moefq::cuda::read_check(records_.get() + r, config().hidden, stream_);
    if (!m) return std::nullopt;
    return LayoutMismatch{m->token, m->element, m->engine_bits, m->resum_bits};
  }
  void synchronize() override { engine_->synchronize(stream_); }

  void shared_expert(int64_t r, const bf16* x, int64_t n, bf16* y) override {
    engine_->shared_expert(first_rank() + r, x, n, y, stream_);
  }
  void add_shared(const bf16* routed, const bf16* shared, bf16* out, int64_t n) override {
    launch_add_shared(routed, shared, out, n, config().hidden, stream_);
  }

 private:
  const bf16* rows_base(int64_t r) const {
    return reinterpret_cast<const bf16*>(engine_->buffer(first_rank() + r) + combine_offset_);
  }

  std::unique_ptr<CudaEngine> engine_;
  cudaStream_t stream_ = nullptr;
  DeviceBuffer<bf16> xq_;              // [R][T][H] dispatch-quantized tokens
  DeviceBuffer<AmaxStats> calib_;      // [2][R]: dispatch, combine
  DeviceBuffer<AmaxStats> dynamic_;    // [R]: per-call dispatch amax
  DeviceBuffer<float> amax_;           // [2][R]: the global amax each QDQ reads
  DeviceBuffer<CheckRecord> records_;  // [R]
  DeviceBuffer<ClipCounts> clips_;     // [2][R]
  size_t combine_offset_ = 0;
  bool trap_ = false;
};

namespace {

// The layer, and where its primitives are (for CudaFakeQuantMoe's device-only knobs).
std::unique_ptr<FakeQuantMoe> make_fake_quant_moe(std::unique_ptr<CudaEngine> engine, int64_t layer,
                                                  CudaFakeQuantOps** ops) {
  auto o = std::make_unique<CudaFakeQuantOps>(std::move(engine));
  if (ops) *ops = o.get();
  return std::make_unique<FakeQuantMoe>(std::move(o), LayerDevice::kCuda, layer);
}

}  // namespace

std::unique_ptr<FakeQuantMoe> make_fake_quant_moe(std::unique_ptr<CudaEngine> engine, int64_t layer) {
  return make_fake_quant_moe(std::move(engine), layer, nullptr);
}

void register_cuda_backends() {
  static std::once_flag once;
  std::call_once(once, [] {
    FakeQuantMoe::register_device_factory(
        LayerDevice::kCuda, [](const MoeConfig& c, int64_t R, int64_t T, std::vector<LayerWeights> w,
                               const EngineOptions& o, int64_t layer) {
          // The host weights go once uploaded (the engine copies them).
          auto engine = std::make_unique<CudaEngine>(c, R, T, w, o);
          w.clear();
          return make_fake_quant_moe(std::move(engine), layer);
        });
  });
}

CudaFakeQuantMoe::CudaFakeQuantMoe(std::unique_ptr<CudaEngine> engine, int64_t layer)
    : layer_(make_fake_quant_moe(std::move(engine), layer, &ops_)) {}
CudaFakeQuantMoe::~CudaFakeQuantMoe() = default;

std::vector<std::string> CudaFakeQuantMoe::quantizer_names() const { return layer_->quantizer_names(); }
void CudaFakeQuantMoe::configure(const std::map<std::string, QuantizerConfig>& configs) { layer_->configure(configs); }
void CudaFakeQuantMoe::start_calibration() { layer_->start_calibration(); }
void CudaFakeQuantMoe::finish_calibration() { layer_->finish_calibration(); }
void CudaFakeQuantMoe::abort_calibration() { layer_->abort_calibration(); }
const std::vector<float>& CudaFakeQuantMoe::rank_amax(int which) const { return layer_->rank_amax(which); }
void CudaFakeQuantMoe::load_calibration_file(const std::string& path) { layer_->load_calibration_file(path); }
void CudaFakeQuantMoe::set_calibrated_amax(float dispatch_amax, float combine_amax) {
  layer_->set_calibrated_amax(dispatch_amax, combine_amax);
}
void CudaFakeQuantMoe::forward(std::span<const DeviceBatch> batches, cudaStream_t stream) {
  layer_->forward(batches, stream);
}
void CudaFakeQuantMoe::quantizers_only(std::span<const DeviceBatch> batches, cudaStream_t stream) {
  layer_->quantizers_only(batches, stream);
}
void CudaFakeQuantMoe::synchronize(cudaStream_t stream) { layer_->synchronize(stream); }
void CudaFakeQuantMoe::set_trap_on_mismatch(bool trap) { ops_->set_trap(trap); }
void CudaFakeQuantMoe::set_count_clipping(bool on) { layer_->set_count_clipping(on); }
std::vector<ClipCounts> CudaFakeQuantMoe::read_clip_counts(cudaStream_t stream) {
  return layer_->read_clip_counts(stream);
}
DeviceBuffer<float>& CudaFakeQuantMoe::device_amax() { return ops_->device_amax(); }
CudaEngine& CudaFakeQuantMoe::engine() { return ops_->engine(); }
const MoeQuantizers& CudaFakeQuantMoe::quantizers() const { return layer_->quantizers(); }
bool CudaFakeQuantMoe::layout_checked(int64_t rank) const { return layer_->layout_checked(rank); }
CombineWeighting CudaFakeQuantMoe::combine_weighting() const { return layer_->combine_weighting(); }
void CudaFakeQuantMoe::set_combine_weighting(CombineWeighting w) { layer_->set_combine_weighting(w); }
size_t CudaFakeQuantMoe::combine_offset() const { return *ops_->combine_offset(); }
void CudaFakeQuantMoe::set_combine_offset(size_t offset) { ops_->set_combine_offset(offset); }

}  // namespace moefq::cuda
