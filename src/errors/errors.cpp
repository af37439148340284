#include "moefq/errors.h"

#include <cstdlib>
#include <cstring>

namespace moefq {

std::string shape_str(std::span<const int64_t> shape, size_t max_shown) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size() && i < max_shown; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() > max_shown) s += ", ... (" + std::to_string(shape.size()) + " dims)";
  return s + "]";
}

namespace detail {

void throw_error(ErrorKind kind, const char* stmt, const char* file, int line,
                 const std::string& message) {
  // Users read the message; the location helps a developer. MOEFQ_ERROR_LOCATION=1 appends it to
  // bad-input errors too (it is always appended for internal errors).
  const char* loc = std::getenv("MOEFQ_ERROR_LOCATION");
  if (kind != ErrorKind::kInternal && !(loc && std::strcmp(loc, "1") == 0)) throw Error(kind, message);
  const char* base = std::strrchr(file, '/');
  throw Error(kind, concat(message, " [", stmt[0] ? stmt : "failed", " at ", base ? base + 1 : file, ":", line, "]"));
}

}  // namespace detail
}  // namespace moefq
