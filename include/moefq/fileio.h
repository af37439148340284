// Writing files so that a failure never leaves a half-written output.
#pragma once

#include <string>
#include <string_view>

namespace moefq {

// Writes `content` to a temporary file beside `path`, then renames it over `path`. On failure the
// temporary is removed, an existing `path` is untouched, and moefq::Error (bad input) is thrown.
void write_file_atomic(const std::string& path, std::string_view content);

}  // namespace moefq
