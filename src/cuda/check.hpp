// The CUDA runtime error checks of every CUDA lane (SM90 backend, cuBLAS lane, tensor-parallel
// device operations): each runtime call and launch goes through them and throws detlogp::Error with
// file:line and the CUDA error name. Sticky errors (a faulted context) cannot be recovered and say so.
#pragma once

#include <cuda_runtime.h>

#include "detlogp/error.hpp"

#define DETLOGP_CUDA_CHECK(expr)                                                                  \
  do {                                                                                            \
    const cudaError_t detlogp_err_ = (expr);                                                      \
    if (detlogp_err_ != cudaSuccess) {                                                            \
      DETLOGP_FAIL("CUDA call failed: " #expr " -> " << cudaGetErrorName(detlogp_err_) << " ("    \
                                                     << cudaGetErrorString(detlogp_err_) << ")"); \
    }                                                                                             \
  } while (0)

// Checks the launch itself (bad configuration, too much shared memory): kernels never assert.
#define DETLOGP_CUDA_CHECK_LAUNCH() DETLOGP_CUDA_CHECK(cudaGetLastError())
