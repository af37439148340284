// The calibration statistics of the device-resident evaluation (eval/layer_runner.h), collected
// on the device from the rows a quantizer saw in one calibration forward of one rank, with
// integer atomics only, so the totals do not depend on the order: the exact bf16 |x| histogram
// of AbsHistogram, logfmt10's cast groups of logfmt10_cast_groups, and the rows SampleRows keeps
// for nvfp4's mse (calibration_stats.h). Plain host launchers on a stream; nothing synchronises.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "moefq/calibration_stats.h"
#include "moefq/numerics.h"

namespace moefq::cuda {

// The rows one quantizer saw in a calibration forward of one rank. slot_stride == 0 (dispatch):
// the tokens rows[t * H] that have an active routed slot; otherwise (combine) the active routed
// rows, slot k of token t at rows[k * slot_stride + t * H]. topk_idx: [num_tokens, top_k] int32,
// -1 inactive.
struct CalibrationRows {
  const bf16* rows = nullptr;
  int64_t slot_stride = 0;
  const int32_t* topk_idx = nullptr;
  int64_t num_tokens = 0, top_k = 0, hidden = 0;
};

// bins[m] += the elements with bf16 magnitude bits m (< AbsHistogram::kBins), *nonfinite += the NaN
// and inf elements. bins: [AbsHistogram::kBins] u64.
void launch_abs_histogram(const CalibrationRows& rows, unsigned long long* bins, unsigned long long* nonfinite,
                          cudaStream_t stream);

// counts[0] += the rows' logfmt10 cast groups that are cast, counts[1] += all of them. counts: [2] u64.
void launch_logfmt10_cast_groups(const CalibrationRows& rows, unsigned long long* counts, cudaStream_t stream);

// The rows `plan` keeps, each at its slot: a dispatch row's position is first_token + t, a combine
// row's (first_token + t) * top_k + k (first_token = (batch * ranks + rank) * num_tokens). sample:
// [plan.num_slots, H] bf16; valid: [plan.num_slots] u8, set to 1 where a row was written.
void launch_sample_rows(const CalibrationRows& rows, uint64_t first_token, const SampleRows& plan, bf16* sample,
                        uint8_t* valid, cudaStream_t stream);

}  // namespace moefq::cuda
