// Test helpers shared by the CPU and GPU suites: data that exercises every special case, a byte
// comparison that reports the first mismatch and the number of mismatches, the message of a
// bad-input error, and a temporary directory.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "moefq/errors.h"
#include "moefq/numerics.h"
#include "moefq/synthetic.h"

// Expects `part` inside the message string (an error's text), showing both when it is not.
#define EXPECT_HAS(message, part)                                                  \
  EXPECT_NE(std::string(message).find(part), std::string::npos)                    \
      << "expected \"" << (part) << "\" in: " << (message)

namespace moefq::test {

// [rows, cols] synthetic activations (heavy-tailed, outlier channels), plus (if specials) NaN,
// +-inf, +-0, fp32 and bf16 subnormals, a whole zero block and a whole NaN block in some rows.
inline std::vector<float> activations(int64_t rows, int64_t cols, uint64_t seed, bool specials = true) {
  std::vector<float> x = synthetic_activations(rows, cols, seed);
  std::mt19937_64 rng(seed + 1);
  if (!specials || x.empty()) return x;
  const float kSpecials[] = {std::nanf(""), -std::nanf(""), INFINITY, -INFINITY, 0.0f, -0.0f,
                             1e-40f, -3e-45f, 9.2e-41f /* bf16 subnormal */, 1e-39f, 448.0f, 1e30f};
  for (int64_t i = 0; i < rows * cols / 50 + 1; ++i)
    x[size_t(rng() % uint64_t(rows * cols))] = kSpecials[rng() % (sizeof(kSpecials) / 4)];
  for (int64_t r = 0; r < rows; r += 3) {
    const int64_t c0 = std::min<int64_t>(cols - 1, int64_t(rng() % uint64_t(cols)) / 32 * 32);
    const bool nan_block = (r / 3) % 2;
    for (int64_t c = c0; c < std::min(cols, c0 + 32); ++c)
      x[size_t(r * cols + c)] = nan_block ? std::nanf("") : 0.0f;
  }
  return x;
}

inline std::vector<bf16> to_bf16(const std::vector<float>& x) {
  std::vector<bf16> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i].bits = bf16_round(x[i]);
  return y;
}

// The bytes of a vector, as SafetensorsWriter::add takes them.
template <typename T>
std::span<const uint8_t> span_of(const std::vector<T>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(T)};
}

// Byte-for-byte equality of two arrays of elements of `elem` bytes.
inline ::testing::AssertionResult bytes_equal(const void* expected, const void* actual, size_t count,
                                              size_t elem) {
  const auto* e = static_cast<const uint8_t*>(expected);
  const auto* a = static_cast<const uint8_t*>(actual);
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < count; ++i)
    if (std::memcmp(e + i * elem, a + i * elem, elem) != 0 && mismatches++ == 0) first = i;
  if (mismatches == 0) return ::testing::AssertionSuccess();
  auto hex = [elem](const uint8_t* p) {
    uint64_t v = 0;
    std::memcpy(&v, p, elem);
    std::ostringstream os;
    os << "0x" << std::hex << v;
    return os.str();
  };
  return ::testing::AssertionFailure() << mismatches << " of " << count
                                       << " elements differ; first at index " << first
                                       << ": expected " << hex(e + first * elem) << ", actual "
                                       << hex(a + first * elem);
}

template <typename T>
::testing::AssertionResult bytes_equal(const std::vector<T>& expected, const std::vector<T>& actual) {
  if (expected.size() != actual.size())
    return ::testing::AssertionFailure() << "sizes differ: " << expected.size() << " vs " << actual.size();
  return bytes_equal(expected.data(), actual.data(), expected.size(), sizeof(T));
}

// The message of the moefq::Error that f throws, which must be a bad-input error; fails the test
// when f throws something else (a library exception, e.g. yaml-cpp's, must never escape) or nothing.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kBadInput) << e.what();
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "a non-moefq exception escaped: " << e.what();
    return "";
  } catch (...) {
    ADD_FAILURE() << "a non-std exception escaped";
    return "";
  }
  ADD_FAILURE() << "no error was raised";
  return "";
}

// A fresh directory under the system's temporary directory, removed with everything in it at the
// end of its scope.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "moefq_test_") {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            (prefix + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }
  // Writes `text` to the file `name` (folders created), returning its path.
  std::string write(const std::string& name, const std::string& text) const {
    const std::filesystem::path p = path_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p) << text;
    return p.string();
  }

 private:
  std::filesystem::path path_;
};

}  // namespace moefq::test
