// Error handling for the whole project: one exception type and check macros that name the failed
// statement, file and line, plus a message the user can act on.
// CUDA and NCCL checks live in cuda_check.h and nccl_check.h: this header has no CUDA types.
#pragma once

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace moefq {

// Why an operation failed; the CLI maps it to its exit status (bad input 2, failed check 1).
enum class ErrorKind { kBadInput, kFailedCheck, kInternal };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message) : std::runtime_error(std::move(message)), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// A tensor shape for messages: "[4, 128]". Past max_shown dimensions the rest is elided as
// ", ... (N dims)", so that a shape from a hostile file cannot bloat a message.
std::string shape_str(std::span<const int64_t> shape, size_t max_shown = SIZE_MAX);

namespace detail {
// One part of a message, appended as `std::ostream <<` would print it. Numbers are formatted
// without iostreams (std::to_chars, and "%g" as an ostream's default): in a Python extension
// loaded into a process that holds another copy of the C++ runtime, an ostream's numeric facet can
// resolve to the other copy's, and printing a number through it crashed the interpreter.
template <typename T>
void append_part(std::string& s, const T& v) {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, char*> || std::is_same_v<U, const char*>) {
    s += v ? v : "(null)";
  } else if constexpr (std::is_convertible_v<const U&, std::string_view>) {
    s += std::string_view(v);
  } else if constexpr (std::is_same_v<U, bool>) {
    s += v ? '1' : '0';
  } else if constexpr (std::is_same_v<U, char> || std::is_same_v<U, signed char> || std::is_same_v<U, unsigned char>) {
    s += char(v);
  } else if constexpr (std::is_integral_v<U>) {
    char buf[24];
    s.append(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
  } else if constexpr (std::is_floating_point_v<U>) {
    char buf[40];
    const int n = std::snprintf(buf, sizeof buf, "%Lg", static_cast<long double>(v));
    s.append(buf, size_t(n > 0 ? n : 0));
  } else {
    std::ostringstream os;
    os << v;
    s += os.str();
  }
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string s;
  (append_part(s, args), ...);
  return s;
}
[[noreturn]] void throw_error(ErrorKind kind, const char* stmt, const char* file, int line,
                              const std::string& message);
}  // namespace detail

}  // namespace moefq

// Throws moefq::Error(kBadInput) with the message when cond is false. Use for anything a user
// can cause (files, arguments, recipes); the message says what to change.
#define MOEFQ_CHECK(cond, ...)                                                                  \
  do {                                                                                          \
    if (!(cond))                                                                                \
      ::moefq::detail::throw_error(::moefq::ErrorKind::kBadInput, #cond, __FILE__, __LINE__,   \
                                   ::moefq::detail::concat(__VA_ARGS__));                       \
  } while (0)

// Same, for a violated invariant of the program itself (a bug, not bad input).
#define MOEFQ_ASSERT(cond, ...)                                                                 \
  do {                                                                                          \
    if (!(cond))                                                                                \
      ::moefq::detail::throw_error(::moefq::ErrorKind::kInternal, #cond, __FILE__, __LINE__,   \
                                   ::moefq::detail::concat(__VA_ARGS__));                       \
  } while (0)

// Throws unconditionally with the given kind.
#define MOEFQ_FAIL(kind, ...)                                                                   \
  ::moefq::detail::throw_error((kind), "", __FILE__, __LINE__, ::moefq::detail::concat(__VA_ARGS__))
