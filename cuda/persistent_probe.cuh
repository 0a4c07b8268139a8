// persistent_probe.cuh — micro-benchmarks of the persistent decode step's two costs, and the test drivers of its
// synchronisation (see persistent_probe.cu, sync.cuh, ring.cuh; the time model is docs/perf/persistent.md).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "ring.cuh"

namespace ti::cuda {

// The hand-off chain: `stages` dependent hand-offs across a co-resident grid. In each, every block waits for the
// previous stage, reads a part of an activation vector of n_words 32-bit words with 16-byte loads, reduces it and
// writes its own slice of the next vector. groups = 1: every block reads the whole vector (all-to-all: the input
// of a GEMV); groups = G: the blocks fall into G groups, each waits on one other group's counter and reads only
// that group's part (groups = blocks: one producer per consumer, the QKV rows of a head before its attention).
struct HandoffConfig {
  int n_words = 2048;
  int groups = 1;
  int stages = 256;
  int blocks_per_sm = 1;      // the grid: blocks_per_sm x the SM count (checked against the occupancy API)
  uint32_t max_sleep_ns = 0;  // sync::WaitPolicy
  int reps = 10;
};
struct HandoffResult {
  double ns_per_handoff = 0;  // (time of 2 x stages - time of stages) / stages: launch and ramp-up cancel out
  double wait_ns = 0;         // mean time a block's thread 0 spent in a wait, per hand-off
  int blocks = 0, stages = 0;
  bool checksum_ok = false;   // the last vector equals the host's replica of the chain
};
HandoffResult measure_handoff(const HandoffConfig& c);

// The weight ring alone: every block (blocks_per_sm x the SM count) streams its chunks (grid-strided chunks of
// slot_kib KiB) of a `bytes` buffer through a ring of `stages` slots and XORs them. Throws ti::Error(Request) for a configuration that does
// not fit (shared memory) and ti::Error(Device) for Bulk below sm_90.
struct RingConfig {
  RingCopy copy = RingCopy::Bulk;
  int stages = 4;
  int slot_kib = 16;
  size_t bytes = (size_t)2 << 30;
  int reps = 10;
  int blocks_per_sm = 1;  // the persistent kernel's grid: one (or two) blocks per SM, each with its own ring
  int issuer_warp = 0;    // Bulk: the warp whose lane 0 issues the copies (stream_handoff: warp 0 waits and signals)
};
struct RingResult {
  double gb_per_s = 0, best_ms = 0, bytes = 0;
  int blocks = 0, blocks_per_sm = 0;
  bool checksum_ok = false;   // the ring's XOR equals cuda/bandwidth.cu's over the same buffer
};
RingResult measure_ring(const RingConfig& c);

// Both at once, as the persistent step runs: the ring streams the buffer while an all-to-all hand-off of an
// n_words vector happens every ~bytes_per_handoff bytes (rounded to whole chunks per block). The same kernel with
// the hand-offs switched off gives the stream alone; the difference per hand-off is the latency the stream did
// not hide.
struct StreamHandoffConfig {
  RingConfig ring;
  double bytes_per_handoff = 4e6;
  int n_words = 2048;
  uint32_t max_sleep_ns = 0;
};
struct StreamHandoffResult {
  double gb_per_s_alone = 0, gb_per_s_with = 0;
  double ns_lost_per_handoff = 0;  // (time with - time alone) / hand-offs
  double wait_ns = 0;              // mean wait of a block's thread 0 per hand-off
  double bytes_per_handoff = 0;    // as run
  int handoffs = 0, blocks = 0;
  bool checksum_ok = false;
};
StreamHandoffResult measure_stream_handoff(const StreamHandoffConfig& c);

// ---- test drivers ----

// Runs the hand-off chain `epochs` times on one set of counters (never reset) and returns the last vector.
std::vector<uint32_t> run_handoff_chain(int n_words, int groups, int stages, int blocks, int epochs);
// The host's replica of the chain's last vector at `epoch` (1-based) — the CPU twin of the kernel.
std::vector<uint32_t> handoff_chain_reference(int n_words, int groups, int stages, uint32_t epoch);

// The ring over host data (bytes: a multiple of slot_kib KiB) with `blocks` blocks: the XOR of its 32-bit words.
uint32_t ring_xor(const void* host, size_t bytes, RingCopy copy, int stages, int slot_kib, int blocks);

// A reduction chain through the counters: x is (stages, n) uint32. Stage s: every block waits for stage s-1, sums
// all blocks' stage s-1 partials (block 0 carries the total forward), adds its slice of x[s] + epoch and
// publishes a 64-bit partial. Run `epochs` times on the same counters; returns each epoch's total, which must be
// sum(x) + epoch * stages * n exactly.
std::vector<uint64_t> run_reduction_chain(const uint32_t* x, int stages, int n, int blocks, int epochs);

}  // namespace ti::cuda
