// "mega_moe_cuda": the CUDA engine behind the host-tensor ExpertBackend interface, so everything
// written for the CPU back-ends (FakeQuantMoe, moefq eval) runs the GPU engine. Each forward
// uploads the batches, runs the layer and downloads the outputs (one synchronisation per call);
// combine_bytes() downloads the rank's combine region on first use after a forward. The
// graph-capturable path is CudaEngine / CudaFakeQuantMoe on device tensors.
#include <mutex>

#include "cuda_base/cuda_check.h"
#include "engine/cuda/cuda_engine.cuh"
#include "moefq/cuda.h"
#include "engine/expert_cpu.h"
#include "moefq/expert_backend.h"

namespace moefq::cuda {
namespace {

class CudaMegaMoeBackend final : public ExpertBackend {
 public:
  CudaMegaMoeBackend(const MoeConfig& cfg, int64_t R, int64_t T, const std::vector<LayerWeights>& w, EngineOptions o)
      : engine_(cfg, R, T, w, o) {
    const size_t H = size_t(cfg.hidden), K = size_t(cfg.top_k);
    for (int64_t r = 0; r < R; ++r) {
      x_.emplace_back(size_t(T) * H);
      y_.emplace_back(size_t(T) * H);
      idx_.emplace_back(size_t(T) * K);
      w_.emplace_back(size_t(T) * K);
    }
    mirror_.resize(size_t(R));
    mirror_valid_.assign(size_t(R), false);
    MOEFQ_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaMegaMoeBackend() override { cudaStreamDestroy(stream_); }

  std::string kind() const override { return "mega_moe_cuda"; }
  const MoeConfig& config() const override { return engine_.config(); }
  int64_t num_ranks() const override { return engine_.num_ranks(); }
  int64_t max_tokens() const override { return engine_.max_tokens(); }
  bool fused_shared() const override { return engine_.fused_shared(); }
  CombineWeighting combine_weighting() const override { return engine_.combine_weighting(); }
  std::optional<size_t> combine_offset() const override { return engine_.layout().combine_offset(); }
  size_t buffer_bytes() const override { return engine_.layout().total_bytes(); }

  void forward(std::span<const RankBatch> batches) override {
    const MoeConfig& c = engine_.config();
    validate_batches(batches, num_ranks(), max_tokens(), c.num_experts, c.top_k);
    std::vector<DeviceBatch> db(batches.size());
    for (size_t r = 0; r < batches.size(); ++r) {
      const RankBatch& b = batches[r];
      const size_t n = size_t(b.num_tokens), H = size_t(c.hidden), K = size_t(c.top_k);
      db[r] = {x_[r].get(), b.num_tokens, idx_[r].get(), w_[r].get(), y_[r].get()};
      if (n == 0) continue;
      MOEFQ_CUDA_CHECK(cudaMemcpyAsync(x_[r].get(), b.x, n * H * 2, cudaMemcpyHostToDevice, stream_));
      MOEFQ_CUDA_CHECK(cudaMemcpyAsync(idx_[r].get(), b.topk_idx, n * K * 4, cudaMemcpyHostToDevice, stream_));
      MOEFQ_CUDA_CHECK(cudaMemcpyAsync(w_[r].get(), b.topk_weights, n * K * 4, cudaMemcpyHostToDevice, stream_));
    }
    engine_.forward(db, stream_);
    for (size_t r = 0; r < batches.size(); ++r)
      if (batches[r].num_tokens)
        MOEFQ_CUDA_CHECK(cudaMemcpyAsync(batches[r].y, y_[r].get(), size_t(batches[r].num_tokens * c.hidden) * 2,
                                         cudaMemcpyDeviceToHost, stream_));
    MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    mirror_valid_.assign(mirror_valid_.size(), false);
  }

  // The whole buffer's size; the combine region holds the rows of the last call (the rest is
  // not copied back and reads as zeros).
  std::span<const uint8_t> combine_bytes(int64_t rank) const override {
    std::vector<uint8_t>& m = mirror_[size_t(rank)];
    if (!mirror_valid_[size_t(rank)]) {
      const BufferLayout& l = engine_.layout();
      m.assign(l.total_bytes(), 0);
      MOEFQ_CUDA_CHECK(cudaMemcpy(m.data() + l.combine.offset, engine_.buffer(rank) + l.combine.offset, l.combine.bytes,
                                  cudaMemcpyDeviceToHost));
      mirror_valid_[size_t(rank)] = true;
    }
    return m;
  }

  void shared_expert(int64_t rank, const bf16* x, int64_t n, bf16* y) const override {
    const int64_t H = engine_.config().hidden, T = max_tokens();
    for (int64_t s = 0; s < n; s += T) {  // in chunks of the buffer's token count
      const int64_t m = std::min(T, n - s);
      MOEFQ_CUDA_CHECK(cudaMemcpyAsync(x_[0].get(), x + s * H, size_t(m * H) * 2, cudaMemcpyHostToDevice, stream_));
      engine_.shared_expert(rank, x_[0].get(), m, y_[0].get(), stream_);
      MOEFQ_CUDA_CHECK(cudaMemcpyAsync(y + s * H, y_[0].get(), size_t(m * H) * 2, cudaMemcpyDeviceToHost, stream_));
      MOEFQ_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
  }

 private:
  mutable CudaEngine engine_;
  cudaStream_t stream_ = nullptr;
  std::vector<DeviceBuffer<bf16>> x_, y_;
  std::vector<DeviceBuffer<int32_t>> idx_;
  std::vector<DeviceBuffer<float>> w_;
  mutable std::vector<std::vector<uint8_t>> mirror_;
  mutable std::vector<bool> mirror_valid_;
};

}  // namespace

void register_cuda_backends() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_expert_backend("mega_moe_cuda", [](const MoeConfig& c, int64_t R, int64_t T,
                                                std::vector<LayerWeights> w, EngineOptions o) {
      return std::unique_ptr<ExpertBackend>(new CudaMegaMoeBackend(c, R, T, w, o));
    });
  });
}

}  // namespace moefq::cuda
