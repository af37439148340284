// The GPU tests' common guard: GPU tests are built whenever nvcc is present and skip themselves when
// no CUDA device is visible (CI has none).
#pragma once

#include <gtest/gtest.h>

#include "cuda/host_api.h"

#define SKIP_WITHOUT_GPU() \
  if (::moefq::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device"
