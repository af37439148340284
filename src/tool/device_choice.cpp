#include "tool/device_choice.h"

#include <algorithm>
#include <thread>

#include "moefq/errors.h"
#ifdef MOEFQ_HAS_CUDA
#include "moefq/cuda_device.h"
#endif

namespace moefq::tool {

bool use_cuda(const std::string& device) {
  MOEFQ_CHECK(device == "auto" || device == "cpu" || device == "cuda", "--device: unknown device '",
              device, "' (expected auto, cpu or cuda)");
  if (device == "cpu") return false;
#ifdef MOEFQ_HAS_CUDA
  const bool gpu = cuda::device_count() > 0;
#else
  const bool gpu = false;
#endif
  MOEFQ_CHECK(gpu || device == "auto", "--device cuda: no CUDA device is visible",
#ifdef MOEFQ_HAS_CUDA
              ""
#else
              " (this moefq was built without CUDA)"
#endif
  );
  return gpu;
}

std::string cpu_device_name(int num_threads) {
  const unsigned n = num_threads > 0 ? unsigned(num_threads) : std::max(1u, std::thread::hardware_concurrency());
  return "cpu (" + std::to_string(n) + (n == 1 ? " thread)" : " threads)");
}

}  // namespace moefq::tool
