// CUDA kernels of the QDQ functions of docs/numerics.md and the e4m3 staging cast, bit-identical to
// the CPU reference (qdq.h). Plain host launchers: device pointers, sizes, a stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moefq/qdq.h"

namespace moefq::cuda {

// y = QDQ_f(x). x, y: [rows, cols] device tensors of dtype dt (y may alias x). d_amax: device
// pointer to the fp32 global amax (read by fp8, nvfp4 and int8; may be null for mxfp8/mxfp4).
// Reads the amax on the device, so the launch is graph-capturable with no host synchronisation.
void launch_qdq(Format f, DType dt, const void* x, void* y, int64_t rows, int64_t cols,
                const float* d_amax, cudaStream_t stream);

// *d_amax = max(*d_amax, max |x| over non-NaN elements). x: [n] of dtype dt. The caller zeroes
// *d_amax first (or keeps a running max, as calibration does).
void launch_amax(DType dt, const void* x, int64_t n, float* d_amax, cudaStream_t stream);

// The engine's e4m3 staging. x: [rows, cols] bf16; x8: [rows, cols] e4m3;
// scales: [rows, ceil(cols / 128)] fp32.
void launch_stage_e4m3(const bf16* x, uint8_t* x8, float* scales, int64_t rows, int64_t cols,
                       cudaStream_t stream);

}  // namespace moefq::cuda
