// cluster_probe.cuh — a micro-benchmark of the hand-off inside a thread-block cluster (sm_90), beside the two the
// decode step has today: the kernel boundary under PDL (bandwidth.cu's kernel chain) and the counter hand-off in
// global memory (persistent_probe.cuh). Why: docs/perf/persistent.md §22.
#pragma once
#include <cstdint>
#include <vector>

namespace ti::cuda {

// A chain of `stages` hand-offs inside each cluster of `cluster` blocks (256 threads). In each stage every block
// reads the whole vector of n_words 32-bit words, XORs it, writes its 1/cluster slice of the next vector and the
// cluster meets at its barrier (barrier.cluster arrive.release / wait.acquire). Where the vector lives:
// dsmem = true: double-buffered in every block's shared memory, each slice stored into every block of the cluster
// (distributed shared memory); false: in global memory, read back from the L2. n_words = 0: the barrier alone.
// one_way (dsmem only): no cluster barrier between stages; each slice goes out as 16-byte st.async stores into
// every block's buffer, completed on that block's mbarrier (the bytes it expects), and a block waits on its own
// mbarrier alone — the producer-to-consumer hand-off of Hopper's pipelined kernels (§41).
// The grid is as many clusters as can be resident at once (cudaOccupancyMaxActiveClusters), each running the same
// chain on its own, or at most max_clusters of them (the SMs / cluster: about one block a SM, so that a stage's time
// is its latency, not the co-resident blocks' shared issue slots).
struct ClusterHandoffConfig {
  int n_words = 2048;
  int cluster = 8;  // blocks per cluster: 1 to 16 (above 8: the non-portable sizes)
  bool dsmem = true;
  int stages = 256;
  int reps = 10;
  bool relaxed_barrier = false;  // n_words = 0 only: the barrier's arrive without its release
  bool one_way = false;          // dsmem only, n_words >= 1, cluster >= 2
  int max_clusters = 0;          // 0: as many as fit
};
struct ClusterHandoffResult {
  double ns_per_handoff = 0;  // (time of 2 x stages - time of stages) / stages: launch and ramp-up cancel out
  int clusters = 0, blocks = 0;
  bool checksum_ok = false;   // the first cluster's last vector equals the host's replica of the chain
};
// Throws ti::Error(Device) below sm_90 and ti::Error(Request) for a size that cannot run (no cluster fits).
ClusterHandoffResult measure_cluster_handoff(const ClusterHandoffConfig& c);

// The chain's last vector after `stages` stages (the kernel, one cluster of `cluster` blocks) and its host replica
// (the CPU twin): the tests compare them on awkward sizes.
std::vector<uint32_t> run_cluster_chain(int n_words, int cluster, bool dsmem, int stages, bool one_way = false);
std::vector<uint32_t> cluster_chain_reference(int n_words, int stages);

}  // namespace ti::cuda
