// ck.cuh — the standalone micro-benchmarks' error check (bench/tools/*.cu: compiled alone with nvcc, not part of
// the engine, so they do not use cuda/common.cuh's ti::Error machinery): print the CUDA error and exit.
#pragma once
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::printf("CUDA %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);     \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)
