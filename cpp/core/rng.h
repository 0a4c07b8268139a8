// rng.h — the counter-based random numbers of the samplers, identical on the host and the device:
// uniform(seed, step) needs no state, so the CPU sampler and the GPU sampling kernel draw the same stream.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define TI_HD __host__ __device__ __forceinline__
#else
#define TI_HD inline
#endif

namespace ti {

TI_HD uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A uniform float in [0, 1) from (seed, step): 24 random bits.
TI_HD float uniform_from_counter(uint64_t seed, uint64_t step) {
  const uint64_t r = splitmix64(splitmix64(seed) ^ step);
  return (float)(r >> 40) * (1.0f / 16777216.0f);
}

}  // namespace ti
