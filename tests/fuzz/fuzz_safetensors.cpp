// libFuzzer target for the safetensors header parser: any input either parses into a header that
// satisfies the documented invariants or is rejected with moefq::Error. Anything else (another
// exception, a sanitizer report, a broken invariant) is a bug.
#include <cstddef>
#include <cstdint>
#include <span>

#include "moefq/errors.h"
#include "moefq/safetensors.h"

namespace {

// Traps (a crash libFuzzer records) when a header accepted by the parser breaks its contract.
void check_invariants(const moefq::SafetensorsHeader& h, size_t file_size) {
  if (h.data_start < 8 || h.data_start > file_size) __builtin_trap();
  const uint64_t data_size = file_size - h.data_start;
  uint64_t cursor = 0;
  for (const moefq::TensorInfo& t : h.tensors) {
    if (t.begin != cursor || t.end < t.begin) __builtin_trap();  // sorted, no hole, no overlap
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * moefq::st_dtype_size(t.dtype);
    if (bytes != t.end - t.begin) __builtin_trap();
    cursor = t.end;
  }
  if (cursor != data_size) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const moefq::SafetensorsHeader h = moefq::parse_safetensors({data, size}, "fuzz.safetensors");
    check_invariants(h, size);
  } catch (const moefq::Error& e) {
    // Rejection is the expected outcome for most inputs; it must be classed as bad input.
    if (e.kind() != moefq::ErrorKind::kBadInput) __builtin_trap();
  }
  return 0;
}
