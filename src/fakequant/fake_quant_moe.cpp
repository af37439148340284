// FakeQuantMoe: the layer facade over the shared fake-quantization driver, and the CPU's
// primitives (host loops on an expert back-end's host tensors). The CUDA primitives are in
// fakequant/cuda, registered as make()'s factory for LayerDevice::kCuda.
#include "moefq/fake_quant_moe.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "engine/expert_cpu.h"
#include "fakequant/fake_quant_driver.h"
#include "moefq/combine_qdq.h"
#include "moefq/errors.h"
#include "moefq/qdq.h"

namespace moefq {
namespace {

bool has_active_slot(const RankBatch& b, int64_t t, int64_t K) {
  for (int64_t k = 0; k < K; ++k)
    if (b.topk_idx[t * K + k] >= 0) return true;
  return false;
}

void fold(AmaxStats& s, const bf16* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(x[i]);
    s.max = max_ignore_nan(s.max, abs_f32(v));
    s.nonfinite += is_finite(v) ? 0u : 1u;
  }
  s.seen = 1;
}

uint64_t count_above(const bf16* x, int64_t n, float amax) {
  uint64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += abs_f32(to_f32(x[i])) > amax ? 1u : 0u;
  return c;
}

class CpuFakeQuantOps final : public FakeQuantOps {
 public:
  CpuFakeQuantOps(std::unique_ptr<ExpertBackend> backend, std::shared_ptr<FakeQuantMoe::CalibrationObserver> observer)
      : backend_(std::move(backend)), observer_(std::move(observer)) {
    const size_t R = size_t(backend_->num_ranks());
    amax_.assign(2 * R, 0.0f);
    calib_.assign(2 * R, AmaxStats{});
    dynamic_.assign(R, AmaxStats{});
    clips_.assign(2 * R, ClipCounts{});
    xq_.resize(R);
    mismatch_.resize(R);
  }
  ExpertBackend& backend() { return *backend_; }

  std::string kind() const override { return backend_->kind(); }
  const MoeConfig& config() const override { return backend_->config(); }
  int64_t first_rank() const override { return 0; }
  int64_t num_local_ranks() const override { return backend_->num_ranks(); }
  int64_t max_tokens() const override { return backend_->max_tokens(); }
  bool fused_shared() const override { return backend_->fused_shared(); }
  CombineWeighting combine_weighting() const override { return backend_->combine_weighting(); }
  std::optional<size_t> combine_offset() const override { return backend_->combine_offset(); }
  size_t buffer_bytes() const override { return backend_->buffer_bytes(); }

  void set_amax(const std::vector<float>& amax) override { amax_ = amax; }
  void reset_calibration() override { std::fill(calib_.begin(), calib_.end(), AmaxStats{}); }
  void token_stats(int64_t r, const RankBatch& b, TokenStats where) override {
    AmaxStats& s = where == TokenStats::kCalibration ? calib_[size_t(r)] : dynamic_[size_t(r)];
    const int64_t K = config().top_k, H = config().hidden;
    const bool observe = where == TokenStats::kCalibration && *observer_;
    for (int64_t t = 0; t < b.num_tokens; ++t)
      if (has_active_slot(b, t, K)) {
        fold(s, b.x + t * H, H);
        if (observe) (*observer_)(0, r, b.x + t * H, H);
      }
  }
  void row_stats(int64_t r, const RankBatch& b) override {
    AmaxStats& s = calib_[size_t(num_local_ranks() + r)];
    const int64_t K = config().top_k, H = config().hidden;
    for (int64_t t = 0; t < b.num_tokens; ++t)
      for (int64_t k = 0; k < K; ++k)
        if (b.topk_idx[t * K + k] >= 0) {
          fold(s, row(r, k, t), H);
          if (*observer_) (*observer_)(1, r, row(r, k, t), H);
        }
  }
  std::vector<AmaxStats> read_calibration() override { return calib_; }
  void reset_dynamic(int64_t r) override { dynamic_[size_t(r)] = AmaxStats{}; }
  void count_clipped(int64_t r, const RankBatch& b, int which) override {
    const int64_t K = config().top_k, H = config().hidden, R = num_local_ranks();
    ClipCounts& c = clips_[size_t(which * R + r)];
    const float amax = amax_[size_t(which * R + r)];
    for (int64_t t = 0; t < b.num_tokens; ++t) {
      if (which == 0) {
        if (!has_active_slot(b, t, K)) continue;
        c.clipped += count_above(b.x + t * H, H, amax);
        c.total += uint64_t(H);
        continue;
      }
      for (int64_t k = 0; k < K; ++k)
        if (b.topk_idx[t * K + k] >= 0) {
          c.clipped += count_above(row(r, k, t), H, amax);
          c.total += uint64_t(H);
        }
    }
  }
  std::vector<ClipCounts> read_clip_counts() override {
    std::vector<ClipCounts> out = clips_;
    std::fill(clips_.begin(), clips_.end(), ClipCounts{});
    return out;
  }

  const bf16* dispatch_qdq(int64_t r, const RankBatch& b, Format f, bool dynamic) override {
    const int64_t H = config().hidden;
    std::vector<bf16>& xq = xq_[size_t(r)];
    xq.resize(size_t(b.num_tokens * H));
    qdq_ref(f, b.x, xq.data(), b.num_tokens, H, dynamic ? dynamic_[size_t(r)].max : amax_[size_t(r)]);
    return xq.data();
  }
  void engine_forward(std::span<const RankBatch> batches, const std::vector<bool>&) override {
    backend_->forward(batches);  // the host engines always combine: the caller overwrites y
  }
  bool has_routed_rows(int64_t, const RankBatch& b) override {
    for (int64_t t = 0; t < b.num_tokens; ++t)
      if (has_active_slot(b, t, config().top_k)) return true;
    return false;
  }
  void combine(int64_t r, const RankBatch& b, std::optional<Format> format, CombineWeighting weighting,
               bool check) override {
    const int64_t K = config().top_k, H = config().hidden;
    const bool fused = fused_shared();
    const float amax = amax_[size_t(num_local_ranks() + r)];
    const float* weights = weighting == CombineWeighting::kAfter ? b.topk_weights : nullptr;
    // The layout check: the engine's output (still in y) against the plain re-sum of the rows read
    // where this layer expects them.
    std::vector<bf16> resum(static_cast<size_t>(H));
    for (int64_t t = 0; check && t < b.num_tokens; ++t) {
      combine_token(b.topk_idx + t * K, weights ? weights + t * K : nullptr, K, fused, H,
                    [&](int64_t k) { return row(r, k, t); }, resum.data());
      for (int64_t h = 0; h < H && !mismatch_[size_t(r)]; ++h)
        if (resum[size_t(h)].bits != b.y[t * H + h].bits)
          mismatch_[size_t(r)] = LayoutMismatch{t, h, b.y[t * H + h].bits, resum[size_t(h)].bits};
    }
    // QDQ each active routed row (read in place), then the engine's re-sum with the shared slot
    // last and unquantized: combine_qdq_ref on the rows where the buffer holds them.
    HostCombineRows rows;
    rows.rows = row(r, 0, 0);
    rows.slot_stride = max_tokens() * H;
    rows.top_k = K;
    rows.num_tokens = b.num_tokens;
    rows.hidden = H;
    rows.topk_idx = b.topk_idx;
    rows.shared = fused ? row(r, K, 0) : nullptr;
    rows.topk_weights = weights;
    combine_qdq_ref(rows, format, amax, b.y);
  }
  std::optional<LayoutMismatch> read_check(int64_t r) override { return std::exchange(mismatch_[size_t(r)], {}); }
  void synchronize() override {}

  void shared_expert(int64_t r, const bf16* x, int64_t n, bf16* y) override { backend_->shared_expert(r, x, n, y); }
  void add_shared(const bf16* routed, const bf16* shared, bf16* out, int64_t n) override {
    const size_t count = size_t(n * config().hidden);
    if (!shared) {
      if (out != routed) std::copy(routed, routed + count, out);
      return;
    }
    for (size_t i = 0; i < count; ++i) out[i].bits = bf16_round(add_rn(to_f32(routed[i]), to_f32(shared[i])));
  }

 private:
  const bf16* row(int64_t r, int64_t slot, int64_t token) const {
    const int64_t T = max_tokens(), H = config().hidden;
    const size_t offset = *backend_->combine_offset() + size_t((slot * T + token) * H) * 2;
    return reinterpret_cast<const bf16*>(backend_->combine_bytes(r).data() + offset);
  }

  std::unique_ptr<ExpertBackend> backend_;
  std::shared_ptr<FakeQuantMoe::CalibrationObserver> observer_;
  std::vector<float> amax_;         // [2][R]
  std::vector<AmaxStats> calib_;    // [2][R]
  std::vector<AmaxStats> dynamic_;  // [R]
  std::vector<ClipCounts> clips_;   // [2][R]
  std::vector<std::vector<bf16>> xq_;
  std::vector<std::optional<LayoutMismatch>> mismatch_;
};

std::mutex& factory_mutex() {
  static std::mutex m;
  return m;
}
std::map<LayerDevice, FakeQuantMoe::DeviceFactory>& factories() {
  static std::map<LayerDevice, FakeQuantMoe::DeviceFactory> f;
  return f;
}

}  // namespace

const char* layer_device_name(LayerDevice device) { return device == LayerDevice::kCuda ? "cuda" : "cpu"; }

std::unique_ptr<FakeQuantMoe> FakeQuantMoe::make(LayerDevice device, const MoeConfig& config, int64_t num_ranks,
                                                 int64_t max_tokens, std::vector<LayerWeights> weights,
                                                 const EngineOptions& options, int64_t layer) {
  if (device == LayerDevice::kCpu)
    return std::make_unique<FakeQuantMoe>(
        make_expert_backend("mega_moe", config, num_ranks, max_tokens, std::move(weights), options), layer);
  DeviceFactory f;
  {
    const std::lock_guard<std::mutex> lock(factory_mutex());
    const auto it = factories().find(device);
    if (it != factories().end()) f = it->second;
  }
  MOEFQ_CHECK(f != nullptr, "fake-quantized layer on ", layer_device_name(device), ": this build has no CUDA "
              "support (rebuild with nvcc) or its layers were not registered (cuda::register_cuda_backends())");
  return f(config, num_ranks, max_tokens, std::move(weights), options, layer);
}

void FakeQuantMoe::register_device_factory(LayerDevice device, DeviceFactory factory) {
  const std::lock_guard<std::mutex> lock(factory_mutex());
  factories()[device] = std::move(factory);
}

FakeQuantMoe::FakeQuantMoe(std::unique_ptr<ExpertBackend> backend, int64_t layer) : device_(LayerDevice::kCpu) {
  observer_ = std::make_shared<CalibrationObserver>();
  auto ops = std::make_unique<CpuFakeQuantOps>(std::move(backend), observer_);
  backend_ = &ops->backend();
  ops_ = ops.get();
  driver_ = std::make_unique<FakeQuantDriver>(std::move(ops), layer);
}
FakeQuantMoe::FakeQuantMoe(std::unique_ptr<FakeQuantOps> ops, LayerDevice device, int64_t layer)
    : device_(device), ops_(ops.get()) {
  driver_ = std::make_unique<FakeQuantDriver>(std::move(ops), layer);
}
FakeQuantMoe::~FakeQuantMoe() = default;

std::vector<std::string> FakeQuantMoe::quantizer_names() const { return driver_->quantizers().names(); }
void FakeQuantMoe::configure(const std::map<std::string, QuantizerConfig>& configs) { driver_->configure(configs); }
void FakeQuantMoe::set_calibration_observer(CalibrationObserver observer) {
  MOEFQ_CHECK(observer_ != nullptr, "set_calibration_observer: the CPU only (the ", layer_device_name(device_),
              " layer keeps its calibration statistics on the device)");
  *observer_ = std::move(observer);
}
void FakeQuantMoe::start_calibration() { driver_->start_calibration(); }
void FakeQuantMoe::finish_calibration() { driver_->finish_calibration(); }
void FakeQuantMoe::abort_calibration() { driver_->abort_calibration(); }
const std::vector<float>& FakeQuantMoe::rank_amax(int which) const { return driver_->rank_amax(which); }
void FakeQuantMoe::forward(std::span<const RankBatch> batches, StreamHandle stream) {
  ops_->set_stream(stream);
  driver_->forward(batches);
}
void FakeQuantMoe::quantizers_only(std::span<const RankBatch> batches, StreamHandle stream) {
  ops_->set_stream(stream);
  driver_->forward(batches, false);
}
void FakeQuantMoe::synchronize(StreamHandle stream) {
  ops_->set_stream(stream);
  driver_->synchronize();
}
void FakeQuantMoe::shared_expert(int64_t rank, const bf16* x, int64_t n, bf16* y, StreamHandle stream) {
  MOEFQ_CHECK(rank >= 0 && rank < ops_->num_local_ranks(), "shared_expert: rank ", rank, " is not in [0, ",
              ops_->num_local_ranks(), ")");
  ops_->set_stream(stream);
  ops_->shared_expert(rank, x, n, y);
}
void FakeQuantMoe::add_shared(const bf16* routed, const bf16* shared, bf16* out, int64_t n, StreamHandle stream) {
  ops_->set_stream(stream);
  ops_->add_shared(routed, shared, out, n);
}
void FakeQuantMoe::forward_with_shared(std::span<const RankBatch> batches, std::span<bf16* const> shared,
                                       StreamHandle stream) {
  forward(batches, stream);
  if (ops_->config().num_shared == 0) return;
  MOEFQ_CHECK(shared.size() == batches.size(), "forward_with_shared: ", shared.size(), " shared outputs for ",
              batches.size(), " ranks");
  for (size_t r = 0; r < batches.size(); ++r) {
    const RankBatch& b = batches[r];
    shared_expert(int64_t(r), b.x, b.num_tokens, shared[r], stream);
    add_shared(b.y, shared[r], b.y, b.num_tokens, stream);
  }
}
ExpertBackend& FakeQuantMoe::backend() {
  MOEFQ_CHECK(backend_ != nullptr, "backend: the host-tensor expert back-end of a CPU layer; this layer is on ",
              layer_device_name(device_));
  return *backend_;
}
const MoeQuantizers& FakeQuantMoe::quantizers() const { return driver_->quantizers(); }
const Quantizer& FakeQuantMoe::dispatch_quantizer(int64_t rank) const { return driver_->quantizers().dispatch(rank); }
const Quantizer& FakeQuantMoe::combine_quantizer(int64_t rank) const { return driver_->quantizers().combine(rank); }
std::vector<const Quantizer*> FakeQuantMoe::calibration_state() const {
  return driver_->quantizers().calibration_state();
}
void FakeQuantMoe::load_calibration_file(const std::string& path) { driver_->load_calibration_file(path); }
void FakeQuantMoe::set_calibrated_amax(float dispatch_amax, float combine_amax) {
  driver_->set_calibrated_amax(dispatch_amax, combine_amax);
}
CombineWeighting FakeQuantMoe::combine_weighting() const { return driver_->combine_weighting(); }
void FakeQuantMoe::set_combine_weighting(CombineWeighting w) { driver_->set_combine_weighting(w); }
bool FakeQuantMoe::layout_checked(int64_t rank) const { return driver_->layout_checked(rank); }
void FakeQuantMoe::set_count_clipping(bool on) { driver_->set_count_clipping(on); }
std::vector<ClipCounts> FakeQuantMoe::read_clip_counts(StreamHandle stream) {
  ops_->set_stream(stream);
  return driver_->read_clip_counts();
}

}  // namespace moefq
