// NCCL error checks: throw moefq::Error naming the failed call, NCCL's error string and its last
// error message. ncclInProgress is not an error: a non-blocking communicator returns it while an
// operation is still under way, and the caller then waits for it (NcclComm's bounded waits).
#pragma once

#include <nccl.h>

#include "moefq/errors.h"

#define MOEFQ_NCCL_CHECK(call)                                                                    \
  do {                                                                                            \
    const ncclResult_t moefq_nccl_ = (call);                                                      \
    if (moefq_nccl_ != ncclSuccess && moefq_nccl_ != ncclInProgress)                              \
      ::moefq::detail::throw_error(::moefq::ErrorKind::kInternal, #call, __FILE__, __LINE__,     \
                                   ::moefq::detail::concat("NCCL error: ", ncclGetErrorString(moefq_nccl_), \
                                                           " (", ncclGetLastError(nullptr), ")")); \
  } while (0)
