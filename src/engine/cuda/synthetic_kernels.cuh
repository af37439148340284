// The synthetic model (moefq/synthetic.h) generated on the GPU, bit-identical to the CPU generator:
// both call the element rules of engine/synthetic_rules.h. A layer's model (its per-channel gains,
// sink channels and super experts) is uploaded once; experts are written straight into an
// engine's weight sets, activations into a device tensor. Plain host launchers on a stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "engine/cuda/cuda_engine.cuh"
#include "cuda_base/device_buffer.h"
#include "moefq/synthetic.h"

namespace moefq::cuda {

// One layer's synthetic model on the device.
class DeviceSyntheticLayer {
 public:
  DeviceSyntheticLayer(const SyntheticLayer& layer, const MoeConfig& cfg);

  // Experts [first_expert, first_expert + count) of the layer (or, shared, the shared expert of
  // intermediate I * S) into `out` (e4m3 codes and 128 x 128 block scales = block max / 448).
  void generate_experts(int64_t first_expert, bool shared, const DeviceExpertSet& out, cudaStream_t stream) const;
  // Tokens [first_token, first_token + n) of the layer's stream into x ([n, H] bf16).
  void generate_activations(int64_t first_token, int64_t n, bf16* x, cudaStream_t stream);

 private:
  SyntheticLayer layer_;
  MoeConfig cfg_;
  DeviceBuffer<float> table_, in_gain_, out_gain_;
  DeviceBuffer<uint8_t> sink_channel_, super_expert_;  // [H], [E]
  DeviceBuffer<int64_t> sink_tokens_;                  // grows with the tokens asked for
  int64_t sinks_known_for_ = -1;
};

}  // namespace moefq::cuda
