// The CPU runner of the evaluation (layer_runner.h): FakeQuantMoe on the CPU engine, with the data,
// routing, reference and metric sums in host memory. Also the runners' shared helpers (the layer's
// activations and weights) and their registry.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>

#include "engine/expert_cpu.h"
#include "engine/parallel.h"
#include "eval/layer_runner.h"
#include "moefq/checkpoint.h"
#include "moefq/errors.h"
#include "moefq/fake_quant_moe.h"
#include "moefq/router.h"
#include "moefq/weight_cache.h"
#include "moefq/weights.h"

namespace moefq {

uint64_t RunnerSetup::layer_seed(int64_t layer) const {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * uint64_t(layer + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

SyntheticLayer RunnerSetup::synthetic_layer(int64_t layer) const {
  return moefq::synthetic_layer(config, layer_seed(layer), synthetic, layer < kEarlySyntheticLayers);
}

std::vector<bf16> layer_activations(const RunnerSetup& s, int64_t layer, int64_t first, int64_t n) {
  const int64_t H = s.config.hidden;
  if (!s.acts) return synthetic_activations(s.synthetic_layer(layer), first, n, s.num_threads);
  const TensorInfo& t = *s.acts->find(s.act_tensor.at(layer));
  std::vector<bf16> out(size_t(n * H));
  if (t.dtype == StDtype::kBF16) {
    s.acts->read_into(t, {reinterpret_cast<uint8_t*>(out.data()), out.size() * 2}, uint64_t(first * H) * 2);
  } else {
    std::vector<float> v(out.size());
    s.acts->read_into(t, {reinterpret_cast<uint8_t*>(v.data()), v.size() * 4}, uint64_t(first * H) * 4);
    for (size_t i = 0; i < out.size(); ++i) out[i].bits = bf16_round(v[i]);
  }
  return out;
}

LayerWeights rank_weights(const RunnerSetup& s, int64_t layer, int64_t rank, const ExpertProgress& on_progress) {
  const int64_t el = s.config.num_experts / s.ranks;
  if (!s.checkpoint_dir.empty())
    return load_checkpoint_layer(s.checkpoint_dir, layer, s.config, rank * el, el, on_progress);
  // Through the disk cache (weight_cache.h): a full-size layer is read back instead of made again.
  return cached_synthetic_layer_weights(s.synthetic_layer(layer), s.config, WeightFormat::kE4m3, rank * el, el,
                                        s.num_threads, on_progress, WeightCacheSettings::from_env());
}

SampleRows nvfp4_sample_rows(const RunnerSetup& s, int which) {
  const uint64_t tokens = uint64_t(s.calib_batches) * uint64_t(s.ranks) * uint64_t(s.tokens);
  return SampleRows::plan(which == 0 ? tokens : tokens * uint64_t(s.config.top_k), s.config.hidden,
                          s.nvfp4_sample_elements);
}

std::vector<LayerWeights> all_rank_weights(const RunnerSetup& s, int64_t layer,
                                           const std::function<void(int64_t, int64_t)>& on_weights) {
  const int64_t R = s.ranks, per_rank = s.config.num_experts / R + (s.config.num_shared > 0 ? 1 : 0);
  std::vector<LayerWeights> w;
  for (int64_t r = 0; r < R; ++r) {
    const auto told = [&](int64_t n) { on_weights(r * per_rank + n, R * per_rank); };
    w.push_back(rank_weights(s, layer, r, on_weights ? ExpertProgress(told) : ExpertProgress()));
  }
  return w;
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<EvalDevice, LayerRunnerFactory>& registry() {
  static std::map<EvalDevice, LayerRunnerFactory> r;
  return r;
}

// One batch: every rank's tokens (pointing into the layer's activations), routing and output.
struct Batch {
  std::vector<const bf16*> x;             // [R] -> [T, H]
  std::vector<Routing> routing;           // [R]
  std::vector<std::vector<bf16>> y;       // [R][T * H]
  std::vector<std::vector<bf16>> shared;  // [R][T * H] the separately run shared expert (evaluation)
  std::vector<RankBatch> views() {
    std::vector<RankBatch> b;
    for (size_t r = 0; r < x.size(); ++r)
      b.push_back({x[r], routing[r].num_tokens, routing[r].topk_idx.data(), routing[r].topk_weights.data(),
                   y[r].data()});
    return b;
  }
};

class CpuRunner final : public LayerRunner {
 public:
  explicit CpuRunner(const RunnerSetup& s) : s_(s), threads_(resolve_threads(s.num_threads)) {}

  void load(int64_t layer, bool need_calibration) override {
    const MoeConfig& cfg = s_.config;
    const int64_t R = s_.ranks, T = s_.tokens, H = cfg.hidden;
    fq_.reset();  // the previous layer's weights go before the next one's arrive
    calib_.clear();
    eval_.clear();
    std::vector<LayerWeights> w = all_rank_weights(s_, layer, on_weights);
    const std::vector<float> gate = w[0].gate, bias = w[0].gate_bias;
    const int64_t first = need_calibration ? 0 : int64_t(s_.calib_batches) * s_.batch_tokens();
    acts_ = layer_activations(s_, layer, first, s_.num_tokens() - first);
    EngineOptions eo;
    eo.fuse_shared = false;  // the model's shared expert runs on the unquantized x
    eo.combine_weighting = s_.combine_weighting;
    eo.staging = s_.staging;
    eo.num_threads = s_.num_threads;
    fq_ = FakeQuantMoe::make(LayerDevice::kCpu, cfg, R, T, std::move(w), eo, layer);
    const auto make_batch = [&](int64_t b) {
      Batch batch;
      for (int64_t r = 0; r < R; ++r) {
        const bf16* x = acts_.data() + ((b * R + r) * T - first) * H;
        batch.x.push_back(x);
        batch.routing.push_back(route(cfg, x, T, gate, bias, {}, s_.num_threads));
        batch.y.emplace_back(size_t(T * H));
      }
      return batch;
    };
    if (need_calibration)
      for (int64_t b = 0; b < s_.calib_batches; ++b) calib_.push_back(make_batch(b));
    for (int64_t b = 0; b < s_.eval_batches; ++b) eval_.push_back(make_batch(s_.calib_batches + b));
    if (cfg.num_shared > 0)
      for (Batch& b : eval_)
        for (int64_t r = 0; r < R; ++r) {
          b.shared.emplace_back(size_t(T * H));
          fq_->shared_expert(r, b.x[size_t(r)], T, b.shared.back().data());
        }
  }

  void configure(const std::map<std::string, QuantizerConfig>& configs) override { fq_->configure(configs); }
  void set_calibrated_amax(float d, float c) override { fq_->set_calibrated_amax(d, c); }
  const MoeQuantizers& quantizers() const override { return fq_->quantizers(); }
  bool layout_checked(int64_t r) const override { return fq_->layout_checked(r); }

  LayerCalibration calibrate() override {
    const bool sample = s_.nvfp4_sample_elements > 0;
    if (!s_.calibration_stats && !sample)
      return calibrate_with(*fq_, int(calib_.size()), [&](int b) { fq_->forward(calib_[size_t(b)].views()); });
    // Per quantizer and rank (the observer hears one rank at a time), merged after.
    const int64_t R = s_.ranks, H = s_.config.hidden;
    std::vector<AbsHistogram> hist(size_t(2 * R));
    std::vector<CastGroups> cast(size_t(2 * R));
    if (s_.calibration_stats)
      fq_->set_calibration_observer([&](int which, int64_t r, const bf16* x, int64_t n) {
        hist[size_t(which * R + r)].add(x, n);
        cast[size_t(which * R + r)].merge(logfmt10_cast_groups(x, n / H, H));
      });
    RowSample rows[2];
    if (sample)
      for (int which = 0; which < 2; ++which) rows[which].reset(nvfp4_sample_rows(s_, which), H);
    LayerCalibration c;
    try {
      c = calibrate_with(*fq_, int(calib_.size()), [&](int b) {
        fq_->forward(calib_[size_t(b)].views());
        if (sample) sample_rows(b, rows);
      });
    } catch (...) {
      fq_->set_calibration_observer({});
      throw;
    }
    fq_->set_calibration_observer({});
    if (s_.calibration_stats) {
      auto d = std::make_shared<AbsHistogram>(), m = std::make_shared<AbsHistogram>();
      for (int64_t r = 0; r < R; ++r) {
        d->merge(hist[size_t(r)]);
        m->merge(hist[size_t(R + r)]);
        c.dispatch_logfmt.merge(cast[size_t(r)]);
        c.combine_logfmt.merge(cast[size_t(R + r)]);
      }
      c.dispatch_hist = std::move(d);
      c.combine_hist = std::move(m);
    }
    if (sample) {
      c.dispatch_nvfp4 = rows[0].blocks(H);
      c.combine_nvfp4 = rows[1].blocks(H);
    }
    return c;
  }

  EvalPassStats evaluate(const std::vector<RecipeStep>& steps, float dispatch_amax, float combine_amax,
                         const std::function<void(const std::string&)>& on_step) override {
    const auto say = [&](int i, const std::string& what) {
      if (on_step) on_step("batch " + std::to_string(i + 1) + "/" + std::to_string(s_.eval_batches) + " " + what);
    };
    const int64_t H = s_.config.hidden, R = s_.ranks, T = s_.tokens;
    EvalPassStats st;
    st.reference_channels.assign(size_t(H), 0.0);
    st.steps.resize(steps.size());
    for (RecipeStats& r : st.steps) {
      r.channel_err2.assign(size_t(H), 0.0);
      r.clips.assign(size_t(2 * R), ClipCounts{});
    }
    fq_->set_count_clipping(true);
    for (size_t i = 0; i < eval_.size(); ++i) {
      Batch& b = eval_[i];
      say(int(i), "reference");
      auto t = Clock::now();
      fq_->configure({});
      fq_->forward(b.views());
      const std::vector<bf16> ref = output(b);
      for (size_t i = 0; i < ref.size(); ++i) {
        const double r = to_f32(ref[i]);
        if (std::isfinite(r)) st.reference_channels[i % size_t(H)] += r * r;
      }
      st.reference_seconds += seconds_since(t);
      for (size_t k = 0; k < steps.size(); ++k) {
        say(int(i), steps[k].name);
        t = Clock::now();
        fq_->configure(steps[k].configs);
        fq_->set_calibrated_amax(steps[k].dispatch_amax.value_or(dispatch_amax), steps[k].combine_amax.value_or(combine_amax));
        if (steps[k].with_engine)
          fq_->forward(b.views());
        else
          fq_->quantizers_only(b.views());
        const std::vector<bf16> out = output(b);
        st.recipes_seconds += seconds_since(t);
        t = Clock::now();
        RecipeStats& rs = st.steps[k];
        const size_t first = rs.tokens.size();
        rs.tokens.resize(first + size_t(R * T));
        parallel_for(R * T, threads_, [&](int64_t i) {
          MetricSums& m = rs.tokens[first + size_t(i)];
          for (int64_t h = 0; h < H; ++h) m.add(to_f32(out[size_t(i * H + h)]), to_f32(ref[size_t(i * H + h)]));
        });
        for (size_t i = 0; i < out.size(); ++i) {
          const double r = to_f32(ref[i]);
          if (!std::isfinite(r)) continue;
          const double d = double(to_f32(out[i])) - r;
          rs.channel_err2[i % size_t(H)] += d * d;
        }
        const std::vector<ClipCounts> clips = fq_->read_clip_counts();
        for (size_t i = 0; i < clips.size(); ++i) {
          rs.clips[i].clipped += clips[i].clipped;
          rs.clips[i].total += clips[i].total;
        }
        st.metrics_seconds += seconds_since(t);
      }
    }
    return st;
  }

 private:
  // The rows SampleRows keeps of one quantizer's calibration: [slots][H] bf16 and which slots hold one.
  struct RowSample {
    SampleRows plan;
    std::vector<bf16> data;
    std::vector<uint8_t> valid;
    void reset(const SampleRows& p, int64_t H) {
      plan = p;
      data.assign(size_t(p.num_slots * uint64_t(H)), bf16{});
      valid.assign(size_t(p.num_slots), 0);
    }
    void keep(uint64_t position, const bf16* row, int64_t H) {
      const int64_t j = plan.slot(position);
      if (j < 0) return;
      std::copy(row, row + H, data.begin() + j * H);
      valid[size_t(j)] = 1;
    }
    std::shared_ptr<const Nvfp4Blocks> blocks(int64_t H) const {
      return std::make_shared<Nvfp4Blocks>(data.data(), valid.data(), int64_t(plan.num_slots), H);
    }
  };

  // Calibration batch b's rows as its quantizers saw them (dispatch: the tokens with an active routed
  // slot; combine: the active routed rows in the back-end's buffer) into the samples, by position.
  void sample_rows(int b, RowSample* rows) {
    const int64_t R = s_.ranks, T = s_.tokens, H = s_.config.hidden, K = s_.config.top_k;
    const ExpertBackend& be = fq_->backend();
    const int64_t stride = be.max_tokens() * H;  // the combine rows: [K][max tokens][H] bf16
    MOEFQ_ASSERT(be.combine_offset().has_value(), "the nvfp4 row sample needs the combine rows of ", be.kind());
    for (int64_t r = 0; r < R; ++r) {
      const Batch& batch = calib_[size_t(b)];
      const int32_t* idx = batch.routing[size_t(r)].topk_idx.data();
      const bf16* combine = reinterpret_cast<const bf16*>(be.combine_bytes(r).data() + *be.combine_offset());
      for (int64_t t = 0; t < T; ++t) {
        const uint64_t token = uint64_t((int64_t(b) * R + r) * T + t);
        bool active = false;
        for (int64_t k = 0; k < K; ++k) {
          if (idx[t * K + k] < 0) continue;
          active = true;
          rows[1].keep(token * uint64_t(K) + uint64_t(k), combine + k * stride + t * H, H);
        }
        if (active) rows[0].keep(token, batch.x[size_t(r)] + t * H, H);
      }
    }
  }

  // A batch's output after a call, [rank][token][H]: bf16(routed + shared), as the model adds them.
  std::vector<bf16> output(const Batch& b) const {
    const int64_t T = s_.tokens, H = s_.config.hidden, R = s_.ranks;
    std::vector<bf16> out(size_t(R * T * H));
    for (int64_t r = 0; r < R; ++r)
      fq_->add_shared(b.y[size_t(r)].data(), b.shared.empty() ? nullptr : b.shared[size_t(r)].data(),
                      out.data() + r * T * H, T);
    return out;
  }

  RunnerSetup s_;
  int threads_;
  std::unique_ptr<FakeQuantMoe> fq_;
  std::vector<bf16> acts_;  // the layer's activations from the first batch loaded
  std::vector<Batch> calib_, eval_;
};

}  // namespace

void register_layer_runner(EvalDevice device, LayerRunnerFactory factory) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[device] = std::move(factory);
}

std::unique_ptr<LayerRunner> make_layer_runner(EvalDevice device, const RunnerSetup& setup) {
  if (device == EvalDevice::kCpu) return make_cpu_runner(setup);
  LayerRunnerFactory f;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    const auto it = registry().find(device);
    if (it != registry().end()) f = it->second;
  }
  MOEFQ_CHECK(f != nullptr, "--device cuda: this build has no CUDA support (rebuild with nvcc) or the GPU "
              "back-ends were not registered");
  return f(setup);
}

std::unique_ptr<LayerRunner> make_cpu_runner(const RunnerSetup& setup) { return std::make_unique<CpuRunner>(setup); }

}  // namespace moefq
