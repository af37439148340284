// Error handling for the whole project: one exception type and check macros that name the failed
// statement, file and line, plus a message the user can act on.
// CUDA and NCCL checks live in errors_cuda.h so this header stays free of CUDA types.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
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

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
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
