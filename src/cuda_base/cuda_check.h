// CUDA error checks: throw moefq::Error naming the failed call. Kernel launches are followed by
// MOEFQ_CUDA_CHECK_LAUNCH().
#pragma once

#include <cuda_runtime.h>

#include "moefq/errors.h"

#define MOEFQ_CUDA_CHECK(call)                                                                  \
  do {                                                                                          \
    const cudaError_t moefq_err_ = (call);                                                      \
    if (moefq_err_ != cudaSuccess)                                                              \
      ::moefq::detail::throw_error(::moefq::ErrorKind::kInternal, #call, __FILE__, __LINE__,   \
                                   ::moefq::detail::concat("CUDA error: ",                      \
                                                           cudaGetErrorString(moefq_err_)));    \
  } while (0)

#define MOEFQ_CUDA_CHECK_LAUNCH() MOEFQ_CUDA_CHECK(cudaGetLastError())
