// For *_gpu_test.cc: skip when no CUDA device is present; check CUDA calls.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "tests/test_util.h"

#define PENUMBRA_SKIP_WITHOUT_GPU()                                            \
  do {                                                                         \
    int _n = 0;                                                                \
    if (cudaGetDeviceCount(&_n) != cudaSuccess || _n == 0) {                   \
      (void)cudaGetLastError();                                                \
      GTEST_SKIP() << "no CUDA device";                                        \
    }                                                                          \
  } while (0)

#define PENUMBRA_CUDA_OK(expr)                                                 \
  do {                                                                         \
    cudaError_t _e = (expr);                                                   \
    ASSERT_EQ(_e, cudaSuccess) << #expr << ": " << cudaGetErrorString(_e);     \
  } while (0)
