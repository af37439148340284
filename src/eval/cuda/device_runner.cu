// The device-resident runner of the evaluation (eval/layer_runner.h): the layer lives on the GPU
// from start to finish. Synthetic weights are generated straight into the engine's weight sets
// (checkpoint weights, e4m3 with block scales or bf16, are read on the host and copied in),
// activations generated there (or copied from the file), routed by the CUDA router, run through
// FakeQuantMoe on CUDA, and reduced to metric
// sums in fp64 on the device: only the per-token and per-channel sums come back. Where the memory
// plan allows, the next layer's synthetic weights are generated on a second stream while the
// current layer is evaluated.
#include <chrono>
#include <cstring>
#include <future>

#include "cuda_base/cuda_check.h"
#include "moefq/cuda_device.h"
#include "engine/cuda/cuda_engine.cuh"
#include "cuda_base/device_buffer.h"
#include "engine/cuda/router_kernels.cuh"
#include "engine/cuda/synthetic_kernels.cuh"
#include "eval/cuda/calibration_kernels.cuh"
#include "eval/cuda/eval_kernels.cuh"
#include "eval/layer_runner.h"
#include "fakequant/cuda/cuda_fake_quant.cuh"
#include "moefq/errors.h"
#include "moefq/weights.h"

namespace moefq {
namespace cuda {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

class Stream {
 public:
  Stream() { MOEFQ_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// Copies host bytes to the device through two pinned staging buffers: filling one overlaps the
// copy of the other on the stream.
class PinnedStager {
 public:
  static constexpr size_t kChunk = size_t(64) << 20;
  PinnedStager() {
    for (int i = 0; i < 2; ++i) {
      MOEFQ_CUDA_CHECK(cudaMallocHost(&buf_[i], kChunk));
      MOEFQ_CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming));
    }
  }
  ~PinnedStager() {
    for (int i = 0; i < 2; ++i) {
      cudaEventSynchronize(done_[i]);
      cudaEventDestroy(done_[i]);
      cudaFreeHost(buf_[i]);
    }
  }
  PinnedStager(const PinnedStager&) = delete;
  PinnedStager& operator=(const PinnedStager&) = delete;

  void copy(void* dst, const void* src, size_t n, cudaStream_t stream) {
    for (size_t off = 0; off < n; off += kChunk) {
      const size_t m = std::min(kChunk, n - off);
      const int i = next_;
      next_ ^= 1;
      MOEFQ_CUDA_CHECK(cudaEventSynchronize(done_[i]));  // its previous copy has left the buffer
      std::memcpy(buf_[i], static_cast<const uint8_t*>(src) + off, m);
      MOEFQ_CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(dst) + off, buf_[i], m, cudaMemcpyHostToDevice, stream));
      MOEFQ_CUDA_CHECK(cudaEventRecord(done_[i], stream));
    }
  }
  // Every expert of `experts` into `out`, in the sets' layout: e4m3 codes and their block scales,
  // or bf16 values (no scales). Each expert must be in `format`, the sets' (one layer, one format).
  void copy_experts(const std::vector<ExpertWeights>& experts, WeightFormat format, const DeviceExpertSet& out,
                    cudaStream_t stream) {
    for (size_t e = 0; e < experts.size(); ++e) {
      const ExpertWeights& w = experts[e];
      MOEFQ_CHECK(w.format == format, "--device cuda: checkpoint expert ", e, " has ", weight_format_name(w.format),
                  " weights where the layer's are ", weight_format_name(format));
      if (format == WeightFormat::kBf16) {
        copy(out.gate_up + e * w.gate_up_bf16.size() * 2, w.gate_up_bf16.data(), w.gate_up_bf16.size() * 2, stream);
        copy(out.down + e * w.down_bf16.size() * 2, w.down_bf16.data(), w.down_bf16.size() * 2, stream);
        continue;
      }
      copy(out.gate_up + e * w.gate_up_e4m3.size(), w.gate_up_e4m3.data(), w.gate_up_e4m3.size(), stream);
      copy(out.gate_up_scale + e * w.gate_up_scale.size(), w.gate_up_scale.data(), w.gate_up_scale.size() * 4, stream);
      copy(out.down + e * w.down_e4m3.size(), w.down_e4m3.data(), w.down_e4m3.size(), stream);
      copy(out.down_scale + e * w.down_scale.size(), w.down_scale.data(), w.down_scale.size() * 4, stream);
    }
  }

 private:
  void* buf_[2] = {nullptr, nullptr};
  cudaEvent_t done_[2] = {nullptr, nullptr};
  int next_ = 0;
};

// A layer's engine with its weights, and what made them.
struct LayerEngine {
  int64_t layer = -1;
  std::unique_ptr<DeviceSyntheticLayer> model;  // synthetic weights and activations
  std::unique_ptr<CudaEngine> engine;
  std::vector<float> gate, bias;  // the router, on the host until the layer is loaded
  cudaEvent_t ready = nullptr;    // the weights are complete (recorded on the stream that made them)
  ~LayerEngine() {
    if (ready) cudaEventDestroy(ready);
  }
};

class DeviceRunner final : public LayerRunner {
 public:
  explicit DeviceRunner(const RunnerSetup& s) : s_(s) {
    const MoeConfig& c = s_.config;
    const int64_t R = s_.ranks, T = s_.tokens, H = c.hidden, K = c.top_k;
    const int64_t batches = s_.calib_batches + s_.eval_batches, eval_rows = int64_t(s_.eval_batches) * R * T;
    acts_ = DeviceBuffer<bf16>(size_t(s_.num_tokens() * H));
    idx_ = DeviceBuffer<int32_t>(size_t(batches * R * T * K));
    wts_ = DeviceBuffer<float>(size_t(batches * R * T * K));
    y_ = DeviceBuffer<bf16>(size_t(R * T * H));
    if (c.num_shared > 0) shared_ = DeviceBuffer<bf16>(size_t(eval_rows * H));
    ref_ = DeviceBuffer<bf16>(size_t(R * T * H));
    out_ = DeviceBuffer<bf16>(size_t(R * T * H));
    sums_ = DeviceBuffer<MetricSums>(size_t(R * T));
    route_ws_ = DeviceBuffer<uint8_t>(route_workspace_bytes(c, T));
    gate_ = DeviceBuffer<float>(size_t(c.num_experts * H));
    if (c.noaux_tc) bias_ = DeviceBuffer<float>(size_t(c.num_experts));
  }

  ~DeviceRunner() override {
    if (next_host_.valid()) next_host_.wait();
    cudaStreamSynchronize(side_);
  }

  void load(int64_t layer, bool need_calibration) override {
    const MoeConfig& c = s_.config;
    const int64_t R = s_.ranks, T = s_.tokens, H = c.hidden, K = c.top_k;
    fq_ = nullptr;
    cuda_fq_.reset();  // the previous layer's engine goes before this one's is made
    std::unique_ptr<LayerEngine> le = next_ && next_->layer == layer ? std::move(next_) : make_engine(layer, stream_);
    next_.reset();
    MOEFQ_CUDA_CHECK(cudaStreamWaitEvent(stream_, le->ready, 0));
    gate_.upload(le->gate);
    if (c.noaux_tc) bias_.upload(le->bias);
    // Activations of every batch from the first one needed.
    b0_ = need_calibration ? 0 : s_.calib_batches;
    const int64_t first = int64_t(b0_) * R * T, rows = s_.num_tokens() - first;
    // Synthetic activations only without an activations file: synthetic weights with a captured
    // file (--activations) take the file's rows, as the CPU runner does.
    if (le->model && s_.acts == nullptr) {
      le->model->generate_activations(first, rows, acts_.get(), stream_);
    } else {
      const std::vector<bf16> x = layer_activations(s_, layer, first, rows);
      MOEFQ_CUDA_CHECK(cudaMemcpyAsync(acts_.get(), x.data(), x.size() * 2, cudaMemcpyHostToDevice, stream_));
      MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    for (int b = b0_; b < s_.calib_batches + s_.eval_batches; ++b)
      for (int64_t r = 0; r < R; ++r)
        launch_route(c, x_of(b, r), T, gate_.get(), c.noaux_tc ? bias_.get() : nullptr, nullptr, route_ws_.get(),
                     idx_.get() + slot(b, r) * T * K, wts_.get() + slot(b, r) * T * K, stream_);
    model_ = std::move(le->model);
    cuda_fq_ = std::make_unique<CudaFakeQuantMoe>(std::move(le->engine), layer);
    fq_ = &cuda_fq_->layer();
    // The shared expert on the unquantized x of the evaluation batches, as the model runs it.
    if (c.num_shared > 0)
      for (int i = 0; i < s_.eval_batches; ++i)
        for (int64_t r = 0; r < R; ++r)
          fq_->shared_expert(r, x_of(s_.calib_batches + i, r), T, shared_.get() + (i * R + r) * T * H, stream_);
    MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

  // Synthetic weights are generated on the side stream, concurrently with this layer's
  // evaluation; a checkpoint's next layer is read from the shards by a host thread meanwhile.
  void prefetch(int64_t layer) override {
    if (!s_.prefetch) return;
    if (s_.checkpoint_dir.empty()) {
      next_ = make_engine(layer, side_);
      return;
    }
    next_host_layer_ = layer;
    next_host_ = std::async(std::launch::async, [this, layer] { return all_rank_weights(s_, layer); });
  }

  void configure(const std::map<std::string, QuantizerConfig>& configs) override { fq_->configure(configs); }
  void set_calibrated_amax(float d, float c) override { fq_->set_calibrated_amax(d, c); }
  const MoeQuantizers& quantizers() const override { return fq_->quantizers(); }
  bool layout_checked(int64_t r) const override { return fq_->layout_checked(r); }

  LayerCalibration calibrate() override {
    const bool stats = s_.calibration_stats, sample = s_.nvfp4_sample_elements > 0;
    if (!stats && !sample)
      return calibrate_with(*fq_, s_.calib_batches, [&](int b) { fq_->forward(views(b), stream_); });
    // The statistics the CPU runner derives from its observer, collected here on the device after
    // each forward, from the same rows (the tokens and routing held, the engine's combine rows), and
    // brought back once at the end.
    const int64_t H = s_.config.hidden;
    constexpr size_t kHist = size_t(AbsHistogram::kBins) + 1;  // the bins, then the non-finite count
    DeviceBuffer<unsigned long long> hist, cast;                // [2][kHist], [2][cast, total]
    if (stats) {
      hist = DeviceBuffer<unsigned long long>(2 * kHist);
      cast = DeviceBuffer<unsigned long long>(4);
      MOEFQ_CUDA_CHECK(cudaMemsetAsync(hist.get(), 0, hist.bytes(), stream_));
      MOEFQ_CUDA_CHECK(cudaMemsetAsync(cast.get(), 0, cast.bytes(), stream_));
    }
    SampleRows plan[2];
    DeviceBuffer<bf16> rows[2];
    DeviceBuffer<uint8_t> valid[2];
    if (sample)
      for (int which = 0; which < 2; ++which) {
        plan[which] = nvfp4_sample_rows(s_, which);
        rows[which] = DeviceBuffer<bf16>(size_t(plan[which].num_slots) * size_t(H));
        valid[which] = DeviceBuffer<uint8_t>(size_t(plan[which].num_slots));
        MOEFQ_CUDA_CHECK(cudaMemsetAsync(valid[which].get(), 0, valid[which].bytes(), stream_));
      }
    LayerCalibration c = calibrate_with(*fq_, s_.calib_batches, [&](int b) {
      fq_->forward(views(b), stream_);
      for (int64_t r = 0; r < s_.ranks; ++r)
        for (int which = 0; which < 2; ++which) {
          const CalibrationRows in = calibration_rows(b, r, which);
          if (stats) {
            launch_abs_histogram(in, hist.get() + which * kHist, hist.get() + which * kHist + AbsHistogram::kBins,
                                 stream_);
            launch_logfmt10_cast_groups(in, cast.get() + 2 * which, stream_);
          }
          if (sample)
            launch_sample_rows(in, uint64_t((int64_t(b) * s_.ranks + r) * s_.tokens), plan[which], rows[which].get(),
                               valid[which].get(), stream_);
        }
    });
    MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    if (stats) {
      const std::vector<unsigned long long> h = hist.download(), g = cast.download();
      std::shared_ptr<AbsHistogram> side[2];
      for (int which = 0; which < 2; ++which) {
        side[which] = std::make_shared<AbsHistogram>();
        const std::vector<uint64_t> counts(h.begin() + which * kHist, h.begin() + (which + 1) * kHist);
        side[which]->add_counts(counts.data(), counts[AbsHistogram::kBins]);
      }
      c.dispatch_hist = side[0];
      c.combine_hist = side[1];
      c.dispatch_logfmt = CastGroups{g[0], g[1]};
      c.combine_logfmt = CastGroups{g[2], g[3]};
    }
    if (sample) {
      std::shared_ptr<const Nvfp4Blocks> blocks[2];
      for (int which = 0; which < 2; ++which) {
        const std::vector<bf16> x = rows[which].download();
        const std::vector<uint8_t> v = valid[which].download();
        blocks[which] = std::make_shared<Nvfp4Blocks>(x.data(), v.data(), int64_t(plan[which].num_slots), H);
      }
      c.dispatch_nvfp4 = blocks[0];
      c.combine_nvfp4 = blocks[1];
    }
    return c;
  }

  EvalPassStats evaluate(const std::vector<RecipeStep>& steps, float dispatch_amax, float combine_amax,
                         const std::function<void(const std::string&)>& on_step) override {
    const auto say = [&](int i, const std::string& what) {
      if (on_step) on_step("batch " + std::to_string(i + 1) + "/" + std::to_string(s_.eval_batches) + " " + what);
    };
    const int64_t H = s_.config.hidden, R = s_.ranks, T = s_.tokens, n = R * T;
    EvalPassStats st;
    st.steps.resize(steps.size());
    // Per-channel sums on the device, [1 + steps][H]: the reference's, then each step's error.
    DeviceBuffer<double> channels(std::vector<double>(size_t(H) * (1 + steps.size()), 0.0));
    std::vector<MetricSums> sums(static_cast<size_t>(n));
    for (RecipeStats& r : st.steps) r.clips.assign(size_t(2 * R), ClipCounts{});
    fq_->set_count_clipping(true);
    for (int i = 0; i < s_.eval_batches; ++i) {
      const int b = s_.calib_batches + i;
      say(i, "reference");
      auto t = Clock::now();
      fq_->configure({});
      fq_->forward(views(b), stream_);
      assemble(i, ref_.get());
      launch_channel_sums(nullptr, ref_.get(), n, H, nullptr, channels.get(), stream_);
      fq_->synchronize(stream_);
      st.reference_seconds += seconds_since(t);
      for (size_t k = 0; k < steps.size(); ++k) {
        say(i, steps[k].name);
        t = Clock::now();
        fq_->configure(steps[k].configs);
        fq_->set_calibrated_amax(steps[k].dispatch_amax.value_or(dispatch_amax), steps[k].combine_amax.value_or(combine_amax));
        if (steps[k].with_engine)
          fq_->forward(views(b), stream_);
        else
          fq_->quantizers_only(views(b), stream_);
        assemble(i, out_.get());
        fq_->synchronize(stream_);
        st.recipes_seconds += seconds_since(t);
        t = Clock::now();
        launch_token_sums(out_.get(), ref_.get(), n, H, sums_.get(), stream_);
        launch_channel_sums(out_.get(), ref_.get(), n, H, channels.get() + (k + 1) * H, nullptr, stream_);
        MOEFQ_CUDA_CHECK(cudaMemcpyAsync(sums.data(), sums_.get(), sums.size() * sizeof(MetricSums),
                                         cudaMemcpyDeviceToHost, stream_));
        RecipeStats& rs = st.steps[k];
        const std::vector<ClipCounts> clips = fq_->read_clip_counts(stream_);  // synchronises
        rs.tokens.insert(rs.tokens.end(), sums.begin(), sums.end());
        for (size_t c = 0; c < clips.size(); ++c) {
          rs.clips[c].clipped += clips[c].clipped;
          rs.clips[c].total += clips[c].total;
        }
        st.metrics_seconds += seconds_since(t);
      }
    }
    const std::vector<double> ch = channels.download();
    st.reference_channels.assign(ch.begin(), ch.begin() + H);
    for (size_t k = 0; k < steps.size(); ++k)
      st.steps[k].channel_err2.assign(ch.begin() + int64_t(k + 1) * H, ch.begin() + int64_t(k + 2) * H);
    return st;
  }

 private:
  // Batch b's rank r: its index among the batches held, its tokens.
  int64_t slot(int b, int64_t r) const { return int64_t(b - b0_) * s_.ranks + r; }
  const bf16* x_of(int b, int64_t r) const { return acts_.get() + slot(b, r) * s_.tokens * s_.config.hidden; }

  // The rows quantizer `which` (0 dispatch, 1 combine) of rank r saw in calibration batch b's
  // forward: the batch's tokens, or the combine rows the engine left in the rank's buffer.
  CalibrationRows calibration_rows(int b, int64_t r, int which) {
    const int64_t T = s_.tokens, H = s_.config.hidden, K = s_.config.top_k;
    CalibrationRows in;
    in.topk_idx = idx_.get() + slot(b, r) * T * K;
    in.num_tokens = T;
    in.top_k = K;
    in.hidden = H;
    if (which == 0) {
      in.rows = x_of(b, r);
    } else {
      CudaEngine& e = cuda_fq_->engine();
      in.rows = reinterpret_cast<const bf16*>(e.buffer(e.first_rank() + r) + cuda_fq_->combine_offset());
      in.slot_stride = e.max_tokens() * H;
    }
    return in;
  }

  std::vector<DeviceBatch> views(int b) {
    const int64_t T = s_.tokens, H = s_.config.hidden, K = s_.config.top_k;
    std::vector<DeviceBatch> v;
    for (int64_t r = 0; r < s_.ranks; ++r)
      v.push_back({x_of(b, r), T, idx_.get() + slot(b, r) * T * K, wts_.get() + slot(b, r) * T * K,
                   y_.get() + r * T * H});
    return v;
  }

  // Evaluation batch i's output after a call into out ([rank][token][H]): bf16(routed + shared).
  void assemble(int i, bf16* out) {
    const int64_t R = s_.ranks, T = s_.tokens, H = s_.config.hidden;
    fq_->add_shared(y_.get(), shared_.get() ? shared_.get() + int64_t(i) * R * T * H : nullptr, out, R * T, stream_);
  }

  // The engine of `layer` with its weights, made on `stream` (synthetic: generated there;
  // checkpoint: read on the host, rank by rank, and copied).
  std::unique_ptr<LayerEngine> make_engine(int64_t layer, cudaStream_t stream) {
    const MoeConfig& c = s_.config;
    const int64_t R = s_.ranks, T = s_.tokens, el = c.num_experts / R;
    auto le = std::make_unique<LayerEngine>();
    le->layer = layer;
    MOEFQ_CUDA_CHECK(cudaEventCreateWithFlags(&le->ready, cudaEventDisableTiming));
    EngineOptions eo;
    eo.fuse_shared = false;  // the model's shared expert runs on the unquantized x
    eo.combine_weighting = s_.combine_weighting;
    eo.staging = s_.staging;
    if (s_.checkpoint_dir.empty()) {
      const SyntheticLayer L = s_.synthetic_layer(layer);
      le->model = std::make_unique<DeviceSyntheticLayer>(L, c);
      synthetic_router(L, c, le->gate, le->bias);
      const DeviceSyntheticLayer& m = *le->model;
      le->engine = std::make_unique<CudaEngine>(
          c, R, T, WeightFormat::kE4m3,
          [&](int64_t rank, const DeviceExpertSet& routed, const DeviceExpertSet& shared) {
            m.generate_experts(rank * el, false, routed, stream);
            m.generate_experts(0, true, shared, stream);
          },
          eo);
    } else {
      // The checkpoint's layer: read on the host (by the prefetch thread when it ran ahead), then
      // copied through pinned staging buffers straight into the engine's weight sets.
      std::vector<LayerWeights> w;
      if (next_host_.valid() && next_host_layer_ == layer) {
        w = next_host_.get();
      } else {
        if (next_host_.valid()) next_host_.wait();
        w = all_rank_weights(s_, layer, on_weights);  // on this thread: its progress can be told
      }
      le->gate = w[0].gate;
      le->bias = w[0].gate_bias;
      PinnedStager stager;
      // The engine's weight sets in the checkpoint's format as loaded (e4m3 with block scales, or
      // bf16: a bf16 checkpoint, or an MXFP4 one decoded at load); the GEMMs take either weight
      // format with either staging.
      const WeightFormat f = s_.weight_format;
      le->engine = std::make_unique<CudaEngine>(
          c, R, T, f,
          [&](int64_t rank, const DeviceExpertSet& routed, const DeviceExpertSet& shared) {
            stager.copy_experts(w[size_t(rank)].experts, f, routed, stream);
            if (shared.count) stager.copy_experts(w[size_t(rank)].shared, f, shared, stream);
          },
          eo);
      MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream));  // the host weights go when the copies are done
    }
    MOEFQ_CUDA_CHECK(cudaEventRecord(le->ready, stream));
    return le;
  }

  RunnerSetup s_;
  Stream stream_, side_;
  std::future<std::vector<LayerWeights>> next_host_;
  int64_t next_host_layer_ = -1;
  int b0_ = 0;  // the first batch held (0, or the first evaluation batch with a loaded calibration)
  // The layer: its CUDA face (the engine and its combine rows, for the calibration statistics),
  // and the facade every call goes through.
  std::unique_ptr<CudaFakeQuantMoe> cuda_fq_;
  FakeQuantMoe* fq_ = nullptr;
  std::unique_ptr<DeviceSyntheticLayer> model_;
  std::unique_ptr<LayerEngine> next_;
  DeviceBuffer<bf16> acts_;       // [batches held][R][T][H]
  DeviceBuffer<int32_t> idx_;     // [batches][R][T][K]
  DeviceBuffer<float> wts_;       // [batches][R][T][K]
  DeviceBuffer<bf16> y_;          // [R][T][H] the routed output of one call
  DeviceBuffer<bf16> shared_;     // [eval][R][T][H]
  DeviceBuffer<bf16> ref_, out_;  // [R][T][H] one batch's reference and a step's output
  DeviceBuffer<MetricSums> sums_; // [R * T]
  DeviceBuffer<uint8_t> route_ws_;
  DeviceBuffer<float> gate_, bias_;
};

}  // namespace
}  // namespace cuda

void register_cuda_layer_runner() {
  register_layer_runner(EvalDevice::kCuda, [](const RunnerSetup& s) -> std::unique_ptr<LayerRunner> {
    return std::make_unique<cuda::DeviceRunner>(s);
  });
  // Also asked for a CPU run that is refused (whether --device cuda would fit): none visible, none free.
  set_device_memory_query([] {
    if (cuda::device_count() == 0) return std::pair<double, double>(0, 0);
    size_t free = 0, total = 0;
    MOEFQ_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return std::pair<double, double>(double(free), double(total));
  });
}

}  // namespace moefq
