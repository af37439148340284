// The evaluation's reductions on the GPU (eval/layer_runner.h): the metric sums of an output against
// the reference, per token and per channel, in fp64. Plain host launchers on a stream. (The
// layer's output, routed + shared expert, is FakeQuantMoe::add_shared's.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moefq/metrics.h"
#include "moefq/numerics.h"

namespace moefq::cuda {

// sums[t] = MetricSums of out[t] against ref[t] (each [H] bf16), for t < n: the same sums as
// MetricSums::add over the row (the order of the additions within a row may differ).
void launch_token_sums(const bf16* out, const bf16* ref, int64_t n, int64_t H, MetricSums* sums, cudaStream_t stream);

// err2[h] += sum over the n rows of (out - ref)^2, ref2[h] += sum of ref^2, over the positions with
// a finite reference (either may be null; out null: only ref2). [H] fp64, added row by row in
// ascending order onto what the arrays hold (successive batches sum as one pass over all rows).
void launch_channel_sums(const bf16* out, const bf16* ref, int64_t n, int64_t H, double* err2, double* ref2,
                         cudaStream_t stream);

}  // namespace moefq::cuda
