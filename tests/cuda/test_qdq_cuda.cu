// CUDA QDQ and staging kernels against the CPU reference, byte for byte; the hardware conversions
// the kernels use against the software ones on every binary32 input.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/device_buffer.h"
#include "cuda/qdq_kernels.cuh"
#include "moefq/qdq.h"
#include "test_util.h"

namespace moefq {
namespace {

using cuda::DeviceBuffer;

#define SKIP_WITHOUT_GPU() \
  if (cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"

// For every binary32 bit pattern u (in slices of 2^28), compares the hardware-backed conversion
// with the software one; counts mismatches and records the first.
__global__ void hw_vs_sw_kernel(uint32_t base, unsigned long long* mismatches, uint32_t* first) {
  const uint32_t u = base + blockIdx.x * blockDim.x + threadIdx.x;
  const float x = f32_from_bits(u);
  const uint32_t pair = bf16x2_round(x, -x);
  const bool bad_bf16 = bf16_round(x) != bf16_round_sw(x) || uint16_t(pair) != bf16_round_sw(x) ||
                        uint16_t(pair >> 16) != bf16_round_sw(-x);
  const bool bad_e4m3 = e4m3_encode_sat(x) != e4m3_encode_sat_sw(x);
  if (bad_bf16 || bad_e4m3) {
    atomicAdd(&mismatches[bad_bf16 ? 0 : 1], 1ull);
    atomicMin(&first[bad_bf16 ? 0 : 1], u);
  }
}

TEST(CudaNumerics, HardwareConversionsEqualSoftwareOnAllFloats) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer<unsigned long long> count(2);
  DeviceBuffer<uint32_t> first(2);
  count.upload({0, 0});
  first.upload({0xFFFFFFFFu, 0xFFFFFFFFu});
  constexpr uint32_t kSlice = 1u << 28;
  for (uint64_t base = 0; base < (1ull << 32); base += kSlice) {
    hw_vs_sw_kernel<<<kSlice / 256, 256>>>(uint32_t(base), count.get(), first.get());
    MOEFQ_CUDA_CHECK_LAUNCH();
  }
  const auto c = count.download();
  const auto f = first.download();
  EXPECT_EQ(c[0], 0u) << "cvt.rn.bf16.f32 or cvt.rn.bf16x2.f32 differs from bf16_round_sw, first input 0x" << std::hex << f[0];
  EXPECT_EQ(c[1], 0u) << "cvt.rn.satfinite.e4m3x2.f32 differs from e4m3_encode_sat_sw, first input 0x"
                      << std::hex << f[1];
}

__global__ void e4m3_decode_kernel(float* out) {
  const int c = threadIdx.x;
  out[c] = (c & 0x7F) == 0x7F ? 0.0f : e4m3_decode_finite(uint8_t(c));
}

TEST(CudaNumerics, HardwareE4m3DecodeIsExact) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer<float> out(256);
  e4m3_decode_kernel<<<1, 256>>>(out.get());
  MOEFQ_CUDA_CHECK_LAUNCH();
  std::vector<float> expected(256);
  for (int c = 0; c < 256; ++c) expected[size_t(c)] = (c & 0x7F) == 0x7F ? 0.0f : e4m3_decode_finite(uint8_t(c));
  EXPECT_TRUE(test::bytes_equal(expected, out.download()));
}

struct Shape {
  int64_t rows, cols;
};
// Odd shapes, short final blocks, unaligned row counts, and the deepseek hidden size.
const Shape kShapes[] = {{1, 7168}, {3, 7168}, {129, 7168}, {5, 33}, {7, 100}, {1, 7}, {2, 16},
                         {4, 48}, {17, 7168 + 5}, {0, 7168}, {33, 256}};

template <typename T>
std::vector<T> make_input(int64_t rows, int64_t cols, uint64_t seed);
template <>
std::vector<float> make_input<float>(int64_t rows, int64_t cols, uint64_t seed) {
  return test::activations(rows, cols, seed);
}
template <>
std::vector<bf16> make_input<bf16>(int64_t rows, int64_t cols, uint64_t seed) {
  return test::to_bf16(test::activations(rows, cols, seed));
}

template <typename T>
void check_qdq(Format f, const std::vector<T>& x, int64_t rows, int64_t cols, float amax,
               size_t offset = 0) {
  SCOPED_TRACE(testing::Message() << format_name(f) << " rows=" << rows << " cols=" << cols
                                  << " amax=" << amax << " offset=" << offset);
  const DType dt = sizeof(T) == 2 ? DType::kBF16 : DType::kF32;
  std::vector<T> expected(x.size());
  qdq_ref(f, x.data(), expected.data(), rows, cols, amax);
  // The device copy starts `offset` elements into the allocation, to exercise unaligned pointers.
  std::vector<T> padded(x.size() + offset);
  std::copy(x.begin(), x.end(), padded.begin() + ptrdiff_t(offset));
  DeviceBuffer<T> dx(padded), dy(padded.size());
  DeviceBuffer<float> damax(std::vector<float>{amax});
  cuda::launch_qdq(f, dt, dx.get() + offset, dy.get() + offset, rows, cols, damax.get(), nullptr);
  auto out = dy.download();
  std::vector<T> actual(out.begin() + ptrdiff_t(offset), out.end());
  EXPECT_TRUE(test::bytes_equal(expected, actual));
  // In place (y aliases x).
  cuda::launch_qdq(f, dt, dx.get() + offset, dx.get() + offset, rows, cols, damax.get(), nullptr);
  out = dx.download();
  EXPECT_TRUE(test::bytes_equal(expected, std::vector<T>(out.begin() + ptrdiff_t(offset), out.end())));
}

template <typename T>
void check_all_formats() {
  uint64_t seed = 1;
  for (const Shape& s : kShapes) {
    const auto x = make_input<T>(s.rows, s.cols, seed++);
    float dyn = 0.0f;
    for (const T& v : x) dyn = max_ignore_nan(dyn, abs_f32(to_f32(v)));
    for (Format f : kAllFormats) {
      for (float amax : {1.0f, 2688.0f, 37.25f, 1e-30f, 0.0f, 3e38f, INFINITY}) check_qdq(f, x, s.rows, s.cols, amax);
      check_qdq(f, x, s.rows, s.cols, dyn);
      check_qdq(f, x, s.rows, s.cols, 13.0f, 1);  // unaligned: the generic kernel
    }
  }
}

TEST(CudaQdq, Bf16EqualsReferenceAllFormatsAndShapes) {
  SKIP_WITHOUT_GPU();
  check_all_formats<bf16>();
}

TEST(CudaQdq, Fp32EqualsReferenceAllFormatsAndShapes) {
  SKIP_WITHOUT_GPU();
  check_all_formats<float>();
}

TEST(CudaQdq, EveryBf16PatternEqualsReference) {
  SKIP_WITHOUT_GPU();
  std::vector<bf16> x(65536);
  for (uint32_t i = 0; i < 65536; ++i) x[i].bits = uint16_t(i);
  for (Format f : kAllFormats)
    for (float amax : {1.0f, 448.0f, 2688.0f, 1e-3f, 3.3895314e38f}) {
      check_qdq(f, x, 512, 128, amax);
      check_qdq(f, x, 64, 1024, amax);
    }
}

TEST(CudaQdq, LargeTensorEqualsReference) {
  SKIP_WITHOUT_GPU();
  const int64_t rows = 4096 + 3, cols = 7168;
  const auto x = make_input<bf16>(rows, cols, 99);
  for (Format f : kAllFormats) check_qdq(f, x, rows, cols, 95.5f);
}

TEST(CudaQdq, AmaxEqualsReference) {
  SKIP_WITHOUT_GPU();
  for (const Shape& s : kShapes) {
    const auto xb = make_input<bf16>(s.rows, s.cols, 7);
    const auto xf = make_input<float>(s.rows, s.cols, 8);
    for (int pass = 0; pass < 2; ++pass) {
      const bool fp32 = pass == 1;
      const int64_t n = s.rows * s.cols;
      const float expected = fp32 ? amax_ref(xf.data(), n) : amax_ref(xb.data(), n);
      DeviceBuffer<float> damax(std::vector<float>{0.0f});
      if (fp32) {
        DeviceBuffer<float> dx(xf);
        cuda::launch_amax(DType::kF32, dx.get(), n, damax.get(), nullptr);
      } else {
        DeviceBuffer<bf16> dx(xb);
        cuda::launch_amax(DType::kBF16, dx.get(), n, damax.get(), nullptr);
      }
      const float got = damax.download()[0];
      EXPECT_EQ(f32_bits(expected), f32_bits(got)) << "rows=" << s.rows << " cols=" << s.cols << " fp32=" << fp32;
    }
  }
}

TEST(CudaQdq, StagingEqualsReference) {
  SKIP_WITHOUT_GPU();
  for (const Shape& s : kShapes) {
    const auto x = make_input<bf16>(s.rows, s.cols, 11);
    const int64_t nb = (s.cols + kStageBlock - 1) / kStageBlock;
    std::vector<uint8_t> x8(x.size());
    std::vector<float> sc(size_t(s.rows * nb));
    stage_e4m3_ref(x.data(), x8.data(), sc.data(), s.rows, s.cols);
    DeviceBuffer<bf16> dx(x);
    DeviceBuffer<uint8_t> dx8(x.size());
    DeviceBuffer<float> dsc(sc.size());
    cuda::launch_stage_e4m3(dx.get(), dx8.get(), dsc.get(), s.rows, s.cols, nullptr);
    SCOPED_TRACE(testing::Message() << "rows=" << s.rows << " cols=" << s.cols);
    EXPECT_TRUE(test::bytes_equal(x8, dx8.download()));
    EXPECT_TRUE(test::bytes_equal(sc, dsc.download()));
  }
}

}  // namespace
}  // namespace moefq
