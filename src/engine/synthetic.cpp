// The synthetic model of include/moefq/synthetic.h on the CPU. The per-layer parameters are made
// here (on the host, also for the GPU generator, which takes them as arrays); every element comes
// from the rules of engine/synthetic_rules.h.
#include "moefq/synthetic.h"

#include <algorithm>
#include <cmath>

#include "engine/expert_cpu.h"
#include "engine/parallel.h"
#include "engine/synthetic_rules.h"
#include "moefq/errors.h"

namespace moefq {
namespace {

using namespace synth;

constexpr int64_t kBlock = 128;

// Parameters of the model kind (docs/eval.md gives their sources).
constexpr float kInGainSigma = 0.5f;    // lognormal RMSNorm gains: inputs' 99th/median of |x| ~ 7
constexpr float kOutGainSigma = 0.15f;  // lognormal output-channel gains: outputs' 99th/median ~ 5.3
constexpr double kOutlierRate = 0.001;  // ~0.1% of the channels ...
constexpr float kOutlierMin = 15, kOutlierMax = 30;  // ... at 15-30x
constexpr int64_t kSeqMin = 2048, kSeqSpan = 2049;   // sequences of 2048-4096 tokens, a sink each
constexpr double kSinkOverMedian = 1000;             // massive activations: ~10^3 x the token's median
// Super experts: on a sink token their gate/up pre-activations reach ~kSuperPreact standard
// normals, their outputs on the sink channels ~kSuperOutput (10^2-10^3) at the hidden size of the
// models they were measured in (kSuperWidth), and the router's logit for them ~kSuperLogit per
// sink channel, so sink tokens route to them. At other widths the outputs scale with sqrt(H /
// kSuperWidth): a sink token's share of the layer's output energy stays what it is at full size
// (a small test model is not dominated by its one sink token).
constexpr double kSuperPreact = 6, kSuperOutput = 300, kSuperWidth = 7168, kSuperLogit = 8;
// A super expert's SwiGLU output on a sink token, for the down gain: silu(6) * 6 times a router
// weight of about 1/4.
constexpr double kSuperHidden = 9;

double unit(uint64_t bits) { return double(bits >> 11) * 0x1p-53; }

// k distinct values in [0, n) drawn from a stream (ascending).
std::vector<int32_t> pick_distinct(uint64_t key, int64_t n, int64_t k) {
  std::vector<int32_t> out;
  for (uint64_t i = 0; int64_t(out.size()) < std::min(k, n); ++i) {
    const auto v = int32_t(draw(key, i) % uint64_t(n));
    if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Scales g so that its mean square over the positions not in `skip` is 1 (fp32 result of a
// double computation in a fixed order: the same on every host).
void normalise(std::vector<float>& g, const std::vector<int32_t>& skip) {
  double sum = 0;
  int64_t n = 0;
  for (size_t h = 0; h < g.size(); ++h)
    if (!std::binary_search(skip.begin(), skip.end(), int32_t(h))) {
      sum += double(g[h]) * double(g[h]);
      ++n;
    }
  const float s = float(1.0 / std::sqrt(sum / double(std::max<int64_t>(n, 1))));
  for (float& v : g) v = mul_rn(v, s);
}

// One expert matrix [rows, cols] (multiples of 128): per 128 x 128 block, the values
// sigma * row_gain(r) * N(0, 1), their max, the scale bmax / 448 and the e4m3 codes.
template <typename RowGain, typename ColGain>
void generate_matrix(uint64_t key, int64_t rows, int64_t cols, float sigma, RowGain row_gain, ColGain col_gain,
                     std::vector<uint8_t>& codes, std::vector<float>& scales) {
  const int64_t bcols = cols / kBlock;
  codes.resize(size_t(rows * cols));
  scales.resize(size_t((rows / kBlock) * bcols));
  std::vector<float> v(static_cast<size_t>(kBlock * kBlock));
  std::vector<float> gain(static_cast<size_t>(kBlock)), cgain(static_cast<size_t>(cols));
  for (int64_t c = 0; c < cols; ++c) cgain[size_t(c)] = col_gain(c);
  const float* table = normal_table().q;
  for (int64_t br = 0; br < rows / kBlock; ++br) {
    for (int64_t r = 0; r < kBlock; ++r) gain[size_t(r)] = mul_rn(sigma, row_gain(br * kBlock + r));
    for (int64_t bc = 0; bc < bcols; ++bc) {
      float bmax = 0;
      for (int64_t r = 0; r < kBlock; ++r) {
        const int64_t row = br * kBlock + r;
        for (int64_t c = 0; c < kBlock; ++c) {
          const int64_t col = bc * kBlock + c;
          const float x = weight_value(key, uint64_t(row * cols + col), gain[size_t(r)], cgain[size_t(col)], table);
          v[size_t(r * kBlock + c)] = x;
          bmax = std::max(bmax, abs_f32(x));
        }
      }
      scales[size_t(br * bcols + bc)] = weight_block_scale(bmax);
      const float inv = weight_block_inv(bmax);
      for (int64_t r = 0; r < kBlock; ++r) {
        uint8_t* out = codes.data() + (br * kBlock + r) * cols + bc * kBlock;
        for (int64_t c = 0; c < kBlock; ++c) out[c] = weight_code(v[size_t(r * kBlock + c)], inv);
      }
    }
  }
}

ExpertWeights generate_expert(const SyntheticLayer& L, int64_t expert, bool shared, int64_t H, int64_t I,
                              WeightFormat format) {
  ExpertWeights w;
  w.hidden = H;
  w.intermediate = I;
  w.format = WeightFormat::kE4m3;
  const uint64_t stream = expert_stream(expert, shared);
  generate_matrix(stream_key(L.seed, kTagGateUp, stream), 2 * I, H, L.weight_sigma, [](int64_t) { return 1.0f; },
                  [&](int64_t h) { return L.gate_up_col_gain(expert, shared, h); }, w.gate_up_e4m3, w.gate_up_scale);
  generate_matrix(stream_key(L.seed, kTagDown, stream), H, I, L.weight_sigma,
                  [&](int64_t h) { return L.down_row_gain(expert, shared, h); }, [](int64_t) { return 1.0f; },
                  w.down_e4m3, w.down_scale);
  if (format == WeightFormat::kE4m3) return w;
  // bf16: the rounding of the same dequantized weights, so both formats describe one model.
  ExpertWeights b;
  b.hidden = H;
  b.intermediate = I;
  b.format = WeightFormat::kBf16;
  const auto round = [](const std::vector<float>& x) {
    std::vector<bf16> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i].bits = bf16_round(x[i]);
    return y;
  };
  b.gate_up_bf16 = round(w.gate_up_f32());
  b.down_bf16 = round(w.down_f32());
  return b;
}

}  // namespace

const synth::NormalTable& synth::normal_table() {
  static const NormalTable table = [] {
    NormalTable t{};
    for (int i = 1; i < kNormalCells; ++i) t.q[i] = normal_quantile(float(i) / float(kNormalCells));
    return t;
  }();
  return table;
}

const char* synthetic_kind_name(SyntheticKind k) { return k == SyntheticKind::kModel ? "model" : "gaussian"; }

std::optional<SyntheticKind> parse_synthetic_kind(std::string_view name) {
  if (name == "model") return SyntheticKind::kModel;
  if (name == "gaussian") return SyntheticKind::kGaussian;
  return std::nullopt;
}

SyntheticLayer synthetic_layer(const MoeConfig& cfg, uint64_t seed, SyntheticKind kind, bool early) {
  MOEFQ_CHECK(cfg.hidden > 0 && cfg.num_experts > 0, "synthetic layer: hidden ", cfg.hidden, " and experts ",
              cfg.num_experts, " must be positive");
  SyntheticLayer L;
  L.kind = kind;
  L.seed = seed;
  L.hidden = cfg.hidden;
  L.num_experts = cfg.num_experts;
  const int64_t H = cfg.hidden;
  L.in_gain.assign(size_t(H), 1.0f);
  L.out_gain.assign(size_t(H), 1.0f);
  if (kind == SyntheticKind::kGaussian) return L;

  const uint64_t in_key = stream_key(seed, kTagInGain, 0), out_key = stream_key(seed, kTagOutGain, 0);
  for (int64_t h = 0; h < H; ++h) {
    L.in_gain[size_t(h)] = exp_f32(mul_rn(kInGainSigma, gaussian(draw(in_key, uint64_t(h)))));
    L.out_gain[size_t(h)] = exp_f32(mul_rn(kOutGainSigma, gaussian(draw(out_key, uint64_t(h)))));
  }
  L.outlier_channels = pick_distinct(stream_key(seed, kTagLayout, 1), H,
                                     std::max<int64_t>(1, int64_t(std::llround(double(H) * kOutlierRate))));
  normalise(L.in_gain, L.outlier_channels);
  normalise(L.out_gain, {});
  const uint64_t pick_key = stream_key(seed, kTagLayout, 2);
  // Outlier channels at 15-30 times the median gain.
  std::vector<float> sorted = L.in_gain;
  std::nth_element(sorted.begin(), sorted.begin() + H / 2, sorted.end());
  const float median_gain = sorted[size_t(H / 2)];
  for (size_t i = 0; i < L.outlier_channels.size(); ++i) {
    const float f = float(kOutlierMin + (kOutlierMax - kOutlierMin) * unit(draw(pick_key, i)));
    const size_t ch = size_t(L.outlier_channels[i]);
    L.in_gain[ch] = mul_rn(median_gain, f);
  }
  L.sink_channels = pick_distinct(stream_key(seed, kTagLayout, 3), H, 1 + int64_t(draw(pick_key, 1000) % 3));
  if (early)
    L.super_experts = pick_distinct(stream_key(seed, kTagLayout, 4), cfg.num_experts, 1 + int64_t(draw(pick_key, 1001) % 3));
  // A sink token: its k sink channels at A = 1000 times its median |x| (the median of |N(0, 1)|,
  // 0.6745, times the median gain, times the scale e of its other channels) and an RMS of about 1
  // (as after RMSNorm): k A^2 / H + e^2 = 1 with A = c e, c = 1000 * 0.6745 * median gain.
  const double c = kSinkOverMedian * 0.6745 * double(median_gain);
  const double k = double(L.sink_channels.size());
  const double e = 1.0 / std::sqrt(1.0 + k * c * c / double(H));
  L.sink_scale = float(e);
  L.sink_value = float(c * e);
  L.super_up_gain = float(kSuperPreact / (double(L.sink_value) * double(L.weight_sigma)));
  if (cfg.intermediate > 0)
    L.super_down_gain = float(kSuperOutput * std::sqrt(double(H) / kSuperWidth) /
                              (kSuperHidden * std::sqrt(double(cfg.intermediate)) * double(L.weight_sigma)));
  L.router_sink_super = float(kSuperLogit / double(L.sink_value));
  return L;
}

std::vector<int64_t> SyntheticLayer::sink_tokens(int64_t n) const {
  std::vector<int64_t> out;
  if (kind == SyntheticKind::kGaussian) return out;
  const uint64_t key = stream_key(seed, kTagSink, 0);
  int64_t p = 0;
  for (uint64_t i = 0; p < n; ++i) {
    out.push_back(p);
    p += kSeqMin + int64_t(draw(key, i) % uint64_t(kSeqSpan));
  }
  return out;
}

bool SyntheticLayer::is_super(int64_t expert, bool shared) const {
  return !shared && std::binary_search(super_experts.begin(), super_experts.end(), int32_t(expert));
}

bool SyntheticLayer::is_sink_channel(int64_t h) const {
  return std::binary_search(sink_channels.begin(), sink_channels.end(), int32_t(h));
}

float SyntheticLayer::down_row_gain(int64_t expert, bool shared, int64_t h) const {
  const float g = out_gain[size_t(h)];
  return is_super(expert, shared) && is_sink_channel(h) ? mul_rn(g, super_down_gain) : g;
}

float SyntheticLayer::gate_up_col_gain(int64_t expert, bool shared, int64_t h) const {
  return is_super(expert, shared) && is_sink_channel(h) ? super_up_gain : 1.0f;
}

void synthetic_router(const SyntheticLayer& L, const MoeConfig& cfg, std::vector<float>& gate,
                      std::vector<float>& bias) {
  const int64_t H = cfg.hidden, E = cfg.num_experts;
  // Router: bf16 values of N(0, 1/sqrt(H)); at the sink channels strongly positive for the super
  // experts. Bias N(0, 0.01) in fp32, as checkpoints hold it.
  const float inv_sqrt_h = float(1.0 / std::sqrt(double(H)));
  const uint64_t rkey = stream_key(L.seed, kTagRouter, 0);
  gate.resize(size_t(E * H));
  for (int64_t e = 0; e < E; ++e) {
    const bool super = L.is_super(e, false);
    for (int64_t h = 0; h < H; ++h) {
      float g = mul_rn(normal_at(rkey, uint64_t(e * H + h), normal_table().q), inv_sqrt_h);
      if (super && L.is_sink_channel(h)) g = L.router_sink_super;
      gate[size_t(e * H + h)] = bf16_to_f32(bf16_round(g));
    }
  }
  if (cfg.noaux_tc) {
    const uint64_t bkey = stream_key(L.seed, kTagBias, 0);
    bias.resize(size_t(E));
    for (int64_t e = 0; e < E; ++e) bias[size_t(e)] = mul_rn(gaussian(draw(bkey, uint64_t(e))), 0.01f);
  }
}

LayerWeights synthetic_layer_weights(const SyntheticLayer& L, const MoeConfig& cfg, WeightFormat format,
                                     int64_t first_expert, int64_t num_local, int num_threads,
                                     const ExpertProgress& on_progress) {
  const int64_t H = cfg.hidden, I = cfg.intermediate, E = cfg.num_experts;
  MOEFQ_CHECK(H > 0 && H % kBlock == 0 && I > 0 && I % kBlock == 0, "synthetic weights: hidden size ", H,
              " and intermediate size ", I, " must be positive multiples of 128");
  MOEFQ_CHECK(E > 0 && cfg.num_shared >= 0, "synthetic weights: ", E, " experts and ", cfg.num_shared,
              " shared experts: need at least one routed expert");
  MOEFQ_CHECK(first_expert >= 0 && num_local >= 0 && num_local <= E && first_expert <= E - num_local,
              "synthetic weights: expert range [", first_expert, ", ", first_expert + num_local, ") (first_expert ",
              first_expert, ", num_local ", num_local, ") is outside the routed experts [0, ", E, ")");
  MOEFQ_CHECK(L.hidden == H && L.num_experts == E, "synthetic weights: the layer model was made for H=", L.hidden,
              " E=", L.num_experts, ", the config has H=", H, " E=", E);
  LayerWeights lw;
  lw.first_expert = first_expert;
  const bool shared = cfg.num_shared > 0;
  std::vector<ExpertWeights> all(size_t(num_local + (shared ? 1 : 0)));
  // In groups of a few experts per thread, so that progress can be told between them; the experts
  // cost the same, so a group that is a multiple of the threads keeps every thread busy.
  const int threads = resolve_threads(num_threads);
  const int64_t n = int64_t(all.size()), group = on_progress ? int64_t(threads) * 4 : n;
  for (int64_t g = 0; g < n; g += group) {
    const int64_t m = std::min(group, n - g);
    parallel_for(m, threads, [&](int64_t j) {
      const int64_t i = g + j;
      all[size_t(i)] = i < num_local ? generate_expert(L, first_expert + i, false, H, I, format)
                                     : generate_expert(L, 0, true, H, I * cfg.num_shared, format);
    });
    if (on_progress) on_progress(g + m);
  }
  if (shared) {
    lw.shared.push_back(std::move(all.back()));
    all.pop_back();
  }
  lw.experts = std::move(all);

  synthetic_router(L, cfg, lw.gate, lw.gate_bias);
  return lw;
}

LayerWeights synthetic_weights(const MoeConfig& cfg, WeightFormat format, uint64_t seed, int64_t first_expert,
                               int64_t num_local) {
  MOEFQ_CHECK(cfg.hidden > 0 && cfg.num_experts > 0, "synthetic weights: hidden size ", cfg.hidden, " and ",
              cfg.num_experts, " routed experts: both must be positive");
  return synthetic_layer_weights(synthetic_layer(cfg, seed), cfg, format, first_expert, num_local);
}

std::vector<bf16> synthetic_activations(const SyntheticLayer& L, int64_t first_token, int64_t n, int num_threads) {
  MOEFQ_CHECK(first_token >= 0 && n >= 0, "synthetic activations: tokens [", first_token, ", ", first_token + n,
              ")");
  const int64_t H = L.hidden;
  std::vector<bf16> x(size_t(n * H));
  const uint64_t key = stream_key(L.seed, kTagActivation, 0);
  parallel_for(n, resolve_threads(num_threads), [&](int64_t t) {
    for (int64_t h = 0; h < H; ++h)
      x[size_t(t * H + h)].bits =
          bf16_round(activation_value(key, first_token + t, H, h, L.in_gain[size_t(h)], normal_table().q));
  });
  for (int64_t s : L.sink_tokens(first_token + n)) {
    if (s < first_token) continue;
    for (int64_t h = 0; h < H; ++h) {
      const float v = activation_value(key, s, H, h, L.in_gain[size_t(h)], normal_table().q);
      x[size_t((s - first_token) * H + h)].bits =
          bf16_round(sink_token_value(v, L.is_sink_channel(h), L.sink_value, L.sink_scale));
    }
  }
  return x;
}

std::vector<float> synthetic_activations(int64_t rows, int64_t cols, uint64_t seed) {
  MoeConfig c;
  c.hidden = cols;
  c.num_experts = 1;
  const SyntheticLayer L = synthetic_layer(c, seed);
  const uint64_t key = stream_key(L.seed, kTagActivation, 0);
  std::vector<float> x(size_t(rows * cols));
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < cols; ++h)
      x[size_t(t * cols + h)] = activation_value(key, t, cols, h, L.in_gain[size_t(h)], normal_table().q);
  for (int64_t s : L.sink_tokens(rows))
    for (int64_t h = 0; h < cols; ++h) {
      float& v = x[size_t(s * cols + h)];
      v = sink_token_value(v, L.is_sink_channel(h), L.sink_value, L.sink_scale);
    }
  return x;
}

}  // namespace moefq
