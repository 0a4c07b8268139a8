// bandwidth.cuh — launchers of the streaming-read kernel (see bandwidth.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace ti::cuda {

// One pass over n_vec 16-byte words; each block writes one word of sink so the reads cannot be removed.
// clk (optional, device): block 0's SM cycles and nanoseconds over the pass.
void launch_stream_read(const uint4* data, size_t n_vec, uint32_t* sink, int blocks, cudaStream_t stream,
                        unsigned long long* clk = nullptr);

struct BandwidthResult {
  double gb_per_s = 0;   // 1e9 bytes per second, best of the timed passes
  double bytes = 0;      // bytes read per pass
  double best_ms = 0;
  int blocks = 0;
  double sm_mhz = 0;     // one SM's clock during the best pass (cycles over the global timer's ns)
};

// Measures this GPU's read bandwidth: allocates `bytes` (rounded to 16), warms up, times `iters` passes with
// CUDA events, returns the best. Throws ti::Error(Device) without a usable GPU.
BandwidthResult measure_read_bandwidth(size_t bytes, int iters);

// Keeps the memory busy for `ms` milliseconds with the passes above (at most 1 GiB, and no more than a quarter of
// the free memory; nothing where that cannot be had). Run before a load's tuning: the first load of a process, timed
// right after the GPU's idle, kept slower picks than loads timed after ~1 s of such traffic (docs/perf/persistent.md
// §45). Returns the passes' best bandwidth (0 where nothing ran).
double warm_memory(double ms);

// For the tests: uploads `bytes` of host data (zero-padded to 16), runs the kernel with `blocks` blocks and
// returns the XOR of all sink words = the XOR of every 32-bit word of the data (the CPU twin is one line).
uint32_t stream_read_xor(const void* host, size_t bytes, int blocks);

// Microseconds per kernel of a graph-replayed chain of `kernels` dependent near-empty kernels of `blocks` blocks
// (PDL when `pdl`; `early`: each triggers its successor at its start): a decode step's cost per kernel boundary.
double kernel_chain_us(int kernels, int blocks, bool pdl, bool early);

}  // namespace ti::cuda
