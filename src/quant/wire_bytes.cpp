// logfmt10's bytes on the wire (include/moefq/wire_bytes.h).
#include "moefq/wire_bytes.h"

#include "moefq/qdq.h"

namespace moefq {

// logfmt10_cast_groups is beside qdq_ref's logfmt10 (qdq_ref.cpp), which makes the same decision.

double logfmt10_bytes_per_row(int64_t cols, double cast_fraction) {
  return cast_fraction * wire_bytes_per_row(Format::kLogfmt10, cols) + (1.0 - cast_fraction) * 2.0 * double(cols);
}

}  // namespace moefq
