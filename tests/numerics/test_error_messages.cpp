// Error messages are built without iostreams for numbers (moefq/errors.h): each part must read as
// `std::ostream <<` prints it, so that no message changes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <sstream>
#include <string>

#include "moefq/errors.h"

namespace moefq {
namespace {

template <typename... Args>
std::string streamed(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <typename... Args>
void expect_as_streamed(const Args&... args) {
  EXPECT_EQ(detail::concat(args...), streamed(args...));
}

TEST(ErrorMessages, NumbersReadAsAnOstreamPrintsThem) {
  expect_as_streamed(int8_t(-5), uint8_t(65), 'x', true, false);
  expect_as_streamed(int16_t(-32768), uint16_t(65535), -7, 4000000000u);
  expect_as_streamed(std::numeric_limits<int64_t>::min(), std::numeric_limits<uint64_t>::max(), size_t(0));
  for (double v : {0.0, -0.0, 1.0, 0.1, 1e-7, 123456.0, 1234567.0, 2.5e300, -3.75, 1.0 / 3.0,
                   std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                   std::nan("")}) {
    expect_as_streamed(v);
    expect_as_streamed(float(v));
  }
  expect_as_streamed(std::numeric_limits<float>::denorm_min(), 5.96e-8f, 448.0f, 1e10L);
}

TEST(ErrorMessages, TextAndOtherTypesAreUnchanged) {
  const char* null = nullptr;
  EXPECT_EQ(detail::concat("a", null, "b"), "a(null)b");
  const std::string s = "shape";
  const std::string_view sv = "view";
  char buf[8] = "buf";
  expect_as_streamed("literal ", s, " ", sv, " ", static_cast<char*>(buf), " ", static_cast<const char*>(buf));
  expect_as_streamed(std::filesystem::path("dir/file.json"));  // quoted, as an ostream prints a path
  EXPECT_EQ(detail::concat(), "");
  EXPECT_EQ(detail::concat("--tokens ", int64_t(-5), ": expected 1 to ", 1 << 20),
            "--tokens -5: expected 1 to 1048576");
}

}  // namespace
}  // namespace moefq
