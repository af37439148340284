// What a format actually puts on the wire where it depends on the data: logfmt10 casts a group of
// 128-element blocks (numerics.h: 8 blocks when the row length is a multiple of 1024, else 4) only
// when every block of it can be cast (amax < 1 and amin < amax over its bf16 magnitudes), and sends
// the other groups as bf16. The figures here follow qdq_ref's decision exactly.
#pragma once

#include <cstdint>

#include "moefq/numerics.h"

namespace moefq {

struct CastGroups {
  uint64_t cast = 0, total = 0;
  double fraction() const { return total ? double(cast) / double(total) : 0.0; }
  void merge(const CastGroups& o) {
    cast += o.cast;
    total += o.total;
  }
};

// The cast groups of logfmt10 over `rows` rows of `cols` elements.
CastGroups logfmt10_cast_groups(const bf16* x, int64_t rows, int64_t cols);
CastGroups logfmt10_cast_groups(const float* x, int64_t rows, int64_t cols);

// Bytes per row actually sent with a fraction f of the cast groups cast: f of the row at logfmt10's
// wire_bytes_per_row, the rest at 2 bytes per element (bf16).
double logfmt10_bytes_per_row(int64_t cols, double cast_fraction);

}  // namespace moefq
