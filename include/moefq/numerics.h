// Every number format and every QDQ rule of the project (docs/numerics.md), written
// once as host+device scalar functions. The CPU reference and the CUDA kernels call these, so they
// produce the same bits on every input, NaN, +-inf, +-0 and subnormals included.
// Invariants: binary32 round-to-nearest-even everywhere, no FMA contraction (mul_rn/add_rn),
// exact division (div_rn); NaN results are canonical (f32 0x7FFFFFFF, bf16 0x7FFF, e4m3 0x7F).
//
// The functions live in numerics/, one header per job; this umbrella includes them all:
//   host_device.h   the MOEFQ_HD qualifiers
//   formats.h       bf16 storage, format limits, NaN codes and block sizes
//   binary32.h      bit access and the RN arithmetic (mul_rn, add_rn, div_rn, fma_rn)
//   conversions.h   bf16, e4m3, e5m2, e2m1, ue8m0 and int8 conversions
//   qdq_rules.h     the QDQ rules of fp8, nvfp4, mxfp8, mxfp4, int8, staging and fp8_block128
//   elementary.h    exp, SiLU, log1p, sigmoid, softplus, sqrt, exp2 and log2
//   peer_rules.h    the other expert-parallel libraries' wire formats
//   logfmt.h        LogFMT-10
//   sum_exact.h     the combine's sum-exact forms of the rules
//   bf16x2_rules.h  the same on packed bf16x2 words
#pragma once

#include "moefq/numerics/host_device.h"
#include "moefq/numerics/formats.h"
#include "moefq/numerics/binary32.h"
#include "moefq/numerics/conversions.h"
#include "moefq/numerics/qdq_rules.h"
#include "moefq/numerics/elementary.h"
#include "moefq/numerics/peer_rules.h"
#include "moefq/numerics/logfmt.h"
#include "moefq/numerics/sum_exact.h"
#include "moefq/numerics/bf16x2_rules.h"
