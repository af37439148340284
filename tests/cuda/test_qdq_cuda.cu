// CUDA QDQ and staging kernels against the CPU reference, byte for byte; the hardware conversions
// the kernels use against the software ones on every binary32 input.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda_base/cuda_check.h"
#include "cuda_base/device_buffer.h"
#include "quant/cuda/qdq_kernels.cuh"
#include "gpu_test.h"
#include "moefq/qdq.h"
#include "test_util.h"

namespace moefq {
namespace {

using cuda::DeviceBuffer;

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

// The wire formats on data they cast: activations scaled below 1, so most LogFMT groups are cast
// (the sample activations reach 1 and keep most groups bf16). Rows of 1024 multiples (groups of 8
// blocks), of 512 multiples, others with a short last group or block; aligned and not.
TEST(CudaQdq, WireFormatsOnSmallActivationsEqualReference) {
  SKIP_WITHOUT_GPU();
  // (A last block of 1 element would keep its row bf16: amin == amax cannot be cast.)
  const Shape shapes[] = {{8, 7168}, {5, 1536}, {7, 640}, {3, 700}, {4, 130}, {2, 2048 + 128}};
  uint64_t seed = 40;
  for (const Shape& s : shapes) {
    std::vector<float> xf = test::activations(s.rows, s.cols, seed++, false);
    for (float& v : xf) v = std::ldexp(v, -8);
    const std::vector<bf16> xb = test::to_bf16(xf);
    for (Format f : {Format::kFp8Block128, Format::kFp8Block128Ue8m0, Format::kLogfmt10,
                     Format::kFp8Block128Ue8m0NoFloor, Format::kFp8Block128Mori, Format::kFp4Block128Mori,
                     Format::kFp8Block128DeepGemm, Format::kFp8Block128Vllm, Format::kFp8Cast,
                     Format::kFp4Block16FlashInfer}) {
      check_qdq(f, xb, s.rows, s.cols, 0.0f);
      check_qdq(f, xb, s.rows, s.cols, 0.0f, 3);
      check_qdq(f, xf, s.rows, s.cols, 0.0f);
      // The data must be cast (this data: 0.56-0.67 of the elements change in logfmt10, over 0.9 in fp8).
      std::vector<bf16> y(xb.size());
      qdq_ref(f, xb.data(), y.data(), s.rows, s.cols, 0.0f);
      int64_t changed = 0;
      for (size_t i = 0; i < y.size(); ++i) changed += y[i].bits != xb[i].bits;
      EXPECT_GT(changed, int64_t(y.size()) / 3) << format_name(f) << " " << s.cols;
    }
  }
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

namespace moefq {
namespace {

// nvfp4 as NVIDIA Model Optimizer's CUDA kernel computes it: the element division |x| / scale with
// the approximate instruction (div.approx.f32), everything else as docs/numerics.md.
__global__ void nvfp4_approx_div_kernel(const bf16* x, bf16* y, int64_t n, float amax) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b * kNvfp4Block >= n) return;
  const float gs = nvfp4_global_scale(amax);
  float bmax = 0.0f;
  for (int i = 0; i < kNvfp4Block; ++i) bmax = max_ignore_nan(bmax, abs_f32(to_f32(x[b * kNvfp4Block + i])));
  const float scale = nvfp4_block_scale(bmax, gs);
  for (int i = 0; i < kNvfp4Block; ++i) {
    const float v = to_f32(x[b * kNvfp4Block + i]);
    const float q = e2m1_round_sat(__fdividef(abs_f32(v), scale));
    store_out(&y[b * kNvfp4Block + i], q == 0.0f ? 0.0f : copysign_f32(mul_rn(q, scale), v));
  }
}

// docs/numerics.md: Model Optimizer's kernel divides approximately, we divide exactly; elements on an
// e2m1 rounding boundary may differ by one e2m1 step. Measures that fraction on random data and on
// vectors whose quotients sit exactly on, and one ulp beside, every boundary.
TEST(CudaQdq, Nvfp4ApproximateDivisionDiffersOnlyOnBoundaries) {
  SKIP_WITHOUT_GPU();
  struct Case {
    const char* name;
    std::vector<bf16> x;
  };
  std::vector<Case> cases;
  cases.push_back({"random activations", test::to_bf16(test::activations(1024, 7168, 5, false))});
  {
    // Each block: its max 6 * m (with amax 2688 the global scale is 1 and the block scale exactly
    // m, an e4m3 value that is not a power of two), then values on the e2m1 boundaries times m and
    // their bf16 neighbours.
    std::vector<float> v;
    const float kBoundaries[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    const float kScales[] = {1.125f, 1.375f, 1.625f, 1.875f, 0.5625f, 2.25f, 2.75f, 0.8125f};
    for (int rep = 0; rep < 256; ++rep)
      for (float t : kBoundaries) {
        const float m = kScales[rep % 8];
        const uint16_t b = bf16_round(t * m);
        const float on = bf16_to_f32(b), up = bf16_to_f32(uint16_t(b + 1)), down = bf16_to_f32(uint16_t(b - 1));
        const float block[kNvfp4Block] = {6.0f * m, on, up, down, -on, -up, -down, on, 0.0f, m, 2.0f * m,
                                          3.0f * m, 4.0f * m, 0.5f * m, 1.5f * m, -6.0f * m};
        v.insert(v.end(), block, block + kNvfp4Block);
      }
    cases.push_back({"boundary vectors", test::to_bf16(v)});
  }
  for (const Case& c : cases) {
    const int64_t n = int64_t(c.x.size());
    const float amax = 2688.0f;
    std::vector<bf16> exact(c.x.size());
    qdq_ref(Format::kNvfp4, c.x.data(), exact.data(), n / kNvfp4Block, kNvfp4Block, amax);
    DeviceBuffer<bf16> dx(c.x), dy(c.x.size());
    nvfp4_approx_div_kernel<<<unsigned((n / kNvfp4Block + 255) / 256), 256>>>(dx.get(), dy.get(), n, amax);
    MOEFQ_CUDA_CHECK_LAUNCH();
    const auto approx = dy.download();
    int64_t differ = 0, not_one_step = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (exact[size_t(i)].bits == approx[size_t(i)].bits) continue;
      ++differ;
      // One e2m1 step: the two values are neighbours in {0, 0.5, 1, 1.5, 2, 3, 4, 6} x scale.
      const int64_t blk = i / kNvfp4Block;
      float bmax = 0.0f;
      for (int j = 0; j < kNvfp4Block; ++j) bmax = max_ignore_nan(bmax, abs_f32(to_f32(c.x[size_t(blk * kNvfp4Block + j)])));
      const float scale = nvfp4_block_scale(bmax, nvfp4_global_scale(amax));
      const int ce = e2m1_encode_sat(to_f32(exact[size_t(i)]) / scale) & 7;
      const int ca = e2m1_encode_sat(to_f32(approx[size_t(i)]) / scale) & 7;
      if (std::abs(ce - ca) != 1) ++not_one_step;
    }
    const double fraction = double(differ) / double(n);
    std::printf("nvfp4 exact vs approximate division, %s: %lld of %lld elements differ (%.3g%%)\n", c.name,
                (long long)differ, (long long)n, 100.0 * fraction);
    RecordProperty(std::string("differing_fraction_") + (c.name[0] == 'r' ? "random" : "boundary"),
                   std::to_string(fraction));
    EXPECT_EQ(not_one_step, 0) << c.name;
    EXPECT_LT(fraction, c.name[0] == 'r' ? 1e-3 : 0.5) << c.name;
  }
}

}  // namespace
}  // namespace moefq

namespace moefq {
namespace {

__global__ void rcp_approx_ftz_kernel(const float* d, float* r, int n) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r[i]) : "f"(d[i]));
}

// fp4_block16_flashinfer takes RN(1 / d) where FlashInfer's Mega-MoE takes rcp.approx.ftz.f32(d)
// (docs/numerics.md): on every scale d = bf16 maximum * RN(1/6) of a normal bf16 maximum, the
// hardware reciprocal is within one ulp of RN(1 / d); how many differ is printed for the docs, and
// whether rcp(448) is RN(1/448) (FlashInferMxfp8ScaleIsMxfp8s in test_qdq_peers says why).
TEST(CudaQdq, FlashInferReciprocalWithinOneUlp) {
  SKIP_WITHOUT_GPU();
  std::vector<float> d;
  for (uint32_t b = 0x0080; b < 0x7F80; ++b) {
    const float v = mul_rn(bf16_to_f32(uint16_t(b)), kInvE2m1Max);
    if (v >= kFltMin) d.push_back(v);
  }
  d.push_back(448.0f);  // TensorRT-LLM's mxfp8 scale multiplies by rcp.approx.ftz(448)
  const int n = int(d.size());
  DeviceBuffer<float> dd(d);
  DeviceBuffer<float> dr(d.size());
  rcp_approx_ftz_kernel<<<(n + 255) / 256, 256>>>(dd.get(), dr.get(), n);
  MOEFQ_CUDA_CHECK(cudaGetLastError());
  const std::vector<float> r = dr.download();
  int differ = 0;
  for (int i = 0; i < n; ++i) {
    const float exact = div_rn(1.0f, d[size_t(i)]);
    const int64_t ulps = int64_t(f32_bits(r[size_t(i)])) - int64_t(f32_bits(exact));
    ASSERT_LE(ulps < 0 ? -ulps : ulps, 1) << "d " << d[size_t(i)];
    differ += ulps != 0;
  }
  std::printf("rcp.approx.ftz.f32 differs from RN(1/d) on %d of %d FlashInfer fp4 scales and 448; "
              "rcp(448) %s RN(1/448)\n",
              differ, n, f32_bits(r.back()) == f32_bits(div_rn(1.0f, 448.0f)) ? "equals" : "differs from");
}

}  // namespace
}  // namespace moefq
