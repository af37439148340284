#include "engine/cuda/synthetic_kernels.cuh"

#include "cuda_base/cuda_check.h"
#include "engine/synthetic_rules.h"

namespace moefq::cuda {
namespace {

using namespace synth;

constexpr int kBlock = 128, kThreads = 256, kPerThread = kBlock * kBlock / kThreads;

// What a matrix generation needs, by value.
struct MatrixArgs {
  uint64_t seed, tag;
  int64_t first_expert;
  bool shared;
  int64_t rows, cols;
  float sigma;
  const float* table;
  // Row gains (down: the output channel's, boosted at the sink channels of super experts) and
  // column gains (gate/up: boosted at the sink channels of super experts); null: 1.
  const float* out_gain;           // [rows] or null
  const uint8_t* sink_channel;     // [H]
  const uint8_t* super_expert;     // [E]
  float super_up_gain, super_down_gain;
  uint8_t* codes;
  float* scales;
};

// One CTA per 128 x 128 block of one expert's matrix (grid: col blocks, row blocks, experts): the
// values in registers, their max over the CTA, then the codes and the block scale.
__global__ void __launch_bounds__(kThreads) synthetic_matrix_kernel(MatrixArgs a) {
  const int bc = blockIdx.x, br = blockIdx.y, e = blockIdx.z;
  const int64_t expert = a.first_expert + e;
  const bool super = !a.shared && a.super_expert[expert] != 0;
  const uint64_t key = stream_key(a.seed, a.tag, expert_stream(expert, a.shared));
  float v[kPerThread];
  float m = 0.0f;
#pragma unroll 4
  for (int j = 0; j < kPerThread; ++j) {
    const int idx = int(threadIdx.x) + kThreads * j, r = idx / kBlock, c = idx % kBlock;
    const int64_t row = int64_t(br) * kBlock + r, col = int64_t(bc) * kBlock + c;
    float rg = 1.0f, cg = 1.0f;
    if (a.out_gain) {  // down: row gains
      rg = a.out_gain[row];
      if (super && a.sink_channel[row]) rg = mul_rn(rg, a.super_down_gain);
    } else if (super && a.sink_channel[col]) {  // gate/up: column gains
      cg = a.super_up_gain;
    }
    v[j] = weight_value(key, uint64_t(row * a.cols + col), mul_rn(a.sigma, rg), cg, a.table);
    m = fmaxf(m, abs_f32(v[j]));
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ float wm[kThreads / 32];
  if ((threadIdx.x & 31) == 0) wm[threadIdx.x >> 5] = m;
  __syncthreads();
  float bmax = wm[0];
  for (int w = 1; w < kThreads / 32; ++w) bmax = fmaxf(bmax, wm[w]);
  const float inv = weight_block_inv(bmax);
  uint8_t* codes = a.codes + int64_t(e) * a.rows * a.cols;
#pragma unroll 4
  for (int j = 0; j < kPerThread; ++j) {
    const int idx = int(threadIdx.x) + kThreads * j, r = idx / kBlock, c = idx % kBlock;
    codes[(int64_t(br) * kBlock + r) * a.cols + int64_t(bc) * kBlock + c] = weight_code(v[j], inv);
  }
  if (threadIdx.x == 0)
    a.scales[int64_t(e) * (a.rows / kBlock) * (a.cols / kBlock) + int64_t(br) * (a.cols / kBlock) + bc] =
        weight_block_scale(bmax);
}

struct ActArgs {
  uint64_t key;
  int64_t first_token, hidden;
  const float* table;
  const float* in_gain;
  const uint8_t* sink_channel;
  const int64_t* sink_tokens;
  int num_sinks;
  float sink_value, sink_scale;
  bf16* x;
};

// One CTA per token.
__global__ void __launch_bounds__(kThreads) synthetic_activations_kernel(ActArgs a) {
  const int64_t t = a.first_token + blockIdx.x;
  bool sink = false;
  for (int i = 0; i < a.num_sinks; ++i) sink = sink || a.sink_tokens[i] == t;
  bf16* row = a.x + int64_t(blockIdx.x) * a.hidden;
  for (int64_t h = threadIdx.x; h < a.hidden; h += blockDim.x) {
    float v = activation_value(a.key, t, a.hidden, h, a.in_gain[h], a.table);
    if (sink) v = sink_token_value(v, a.sink_channel[h] != 0, a.sink_value, a.sink_scale);
    row[h].bits = bf16_round(v);
  }
}

}  // namespace

DeviceSyntheticLayer::DeviceSyntheticLayer(const SyntheticLayer& layer, const MoeConfig& cfg)
    : layer_(layer), cfg_(cfg) {
  const NormalTable& t = normal_table();
  table_ = DeviceBuffer<float>(std::vector<float>(t.q, t.q + kNormalCells + 1));
  in_gain_ = DeviceBuffer<float>(layer.in_gain);
  out_gain_ = DeviceBuffer<float>(layer.out_gain);
  std::vector<uint8_t> sink(size_t(cfg.hidden), 0), super(size_t(cfg.num_experts), 0);
  for (int32_t c : layer.sink_channels) sink[size_t(c)] = 1;
  for (int32_t e : layer.super_experts) super[size_t(e)] = 1;
  sink_channel_ = DeviceBuffer<uint8_t>(sink);
  super_expert_ = DeviceBuffer<uint8_t>(super);
}

void DeviceSyntheticLayer::generate_experts(int64_t first_expert, bool shared, const DeviceExpertSet& out,
                                            cudaStream_t stream) const {
  if (out.count == 0) return;
  const int64_t H = cfg_.hidden, I = out.inter;
  MOEFQ_CHECK(H % kBlock == 0 && I % kBlock == 0, "synthetic weights: H ", H, " and I ", I,
              " must be multiples of 128");
  MatrixArgs a{};
  a.seed = layer_.seed;
  a.first_expert = first_expert;
  a.shared = shared;
  a.sigma = layer_.weight_sigma;
  a.table = table_.get();
  a.sink_channel = sink_channel_.get();
  a.super_expert = super_expert_.get();
  a.super_up_gain = layer_.super_up_gain;
  a.super_down_gain = layer_.super_down_gain;
  // gate/up [2I, H]
  a.tag = kTagGateUp;
  a.rows = 2 * I;
  a.cols = H;
  a.out_gain = nullptr;
  a.codes = out.gate_up;
  a.scales = out.gate_up_scale;
  synthetic_matrix_kernel<<<dim3(unsigned(H / kBlock), unsigned(2 * I / kBlock), unsigned(out.count)), kThreads, 0,
                            stream>>>(a);
  MOEFQ_CUDA_CHECK_LAUNCH();
  // down [H, I]
  a.tag = kTagDown;
  a.rows = H;
  a.cols = I;
  a.out_gain = out_gain_.get();
  a.codes = out.down;
  a.scales = out.down_scale;
  synthetic_matrix_kernel<<<dim3(unsigned(I / kBlock), unsigned(H / kBlock), unsigned(out.count)), kThreads, 0,
                            stream>>>(a);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

void DeviceSyntheticLayer::generate_activations(int64_t first_token, int64_t n, bf16* x, cudaStream_t stream) {
  if (n == 0) return;
  if (sinks_known_for_ < first_token + n) {
    sink_tokens_ = DeviceBuffer<int64_t>(layer_.sink_tokens(first_token + n));
    sinks_known_for_ = first_token + n;
  }
  ActArgs a{};
  a.key = stream_key(layer_.seed, kTagActivation, 0);
  a.first_token = first_token;
  a.hidden = cfg_.hidden;
  a.table = table_.get();
  a.in_gain = in_gain_.get();
  a.sink_channel = sink_channel_.get();
  a.sink_tokens = sink_tokens_.get();
  a.num_sinks = int(sink_tokens_.size());
  a.sink_value = layer_.sink_value;
  a.sink_scale = layer_.sink_scale;
  a.x = x;
  synthetic_activations_kernel<<<unsigned(n), kThreads, 0, stream>>>(a);
  MOEFQ_CUDA_CHECK_LAUNCH();
}

}  // namespace moefq::cuda
