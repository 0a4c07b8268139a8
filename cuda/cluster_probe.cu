// cluster_probe.cu — the hand-off inside a thread-block cluster (cluster_probe.cuh): what one dependent step costs
// when its producers and consumers are the blocks of one cluster, which the hardware co-schedules on one GPC and
// lets meet at a barrier and share shared memory (sm_90).
//
// Computes (cluster_chain_kernel, 256-thread blocks, 1-D clusters): stage 0 writes v_0[j] = mix(seed, j, 0); stage
// s (1..stages) reads all of v_{s-1}, XORs it (x) and writes its slice of v_s[j] = mix(x, j, s), then the cluster
// meets at its barrier. The vectors alternate between two buffers: a block writes buffer s & 1 while its peers may
// still read buffer (s - 1) & 1, and every peer finished reading buffer s & 1 (in stage s - 1) before it arrived
// at the barrier that let the writer into stage s. Timing as in persistent_probe.cu: CUDA events, best of `reps`,
// the per-hand-off time a difference of two chain lengths.
//
// The one-way form (cluster_oneway_kernel) runs the same chain with no cluster barrier between stages: a block
// sends its slice of v_s as 16-byte st.async stores into buffer s & 1 of every block of the cluster, each store
// completing its bytes on the receiver's mbarrier for that buffer, and a block waits only on its own mbarrier
// (the whole vector's bytes arrived). Two buffers are enough without any signal back: a block's v_s reaches a peer
// only after the block has read all of v_{s-1} (block_xor's barriers; st.async is a generic-proxy store whose
// complete_tx releases at cluster scope), so by the time any peer can send v_{s+1} into the buffer v_{s-1} used,
// nobody reads it any more — provided every block sends something each stage, hence the vector padded to at least
// a 16-byte quad a block. st.async needs a cluster of two or more blocks (PTX ISA).
#include <algorithm>
#include <string>

#include "cluster_probe.cuh"
#include "common.cuh"
#include "probe_common.cuh"

namespace ti::cuda {

using namespace probe;  // kThreads, mix, span, block_xor, DeviceArray, Events

namespace {

constexpr int kMaxCluster = 16;
constexpr uint32_t kSeed = 0x5EEDu;

// The cluster primitives, as PTX (sm_90; the host refuses older GPUs before any launch).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ uint32_t cluster_blocks() {
  uint32_t n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
  return n;
}
// Every thread of every block of the cluster arrives (release: its earlier writes, shared and global, are
// visible to the cluster) and waits for all (acquire).
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// The barrier without the release (n_words = 0 only: nothing to hand over; the wait still acquires, as it has no
// relaxed form).
__device__ __forceinline__ void cluster_sync_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ uint32_t map_peer(uint32_t addr, uint32_t rank) {  // the same offset in block `rank`
  uint32_t r = addr;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
#endif
  return r;
}
// A 32-bit store into block `rank`'s copy of the shared variable at `local` (distributed shared memory).
__device__ __forceinline__ void store_peer(uint32_t* local, uint32_t rank, uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(map_peer(smem_addr(local), rank)), "r"(v) : "memory");
#endif
}

// The one-way form's primitives (sm_90).
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // visible to the peers' complete_tx
#endif
}
// This phase's one arrival, and `bytes` more to come before the phase can complete (a store's complete_tx may
// come first: the count goes below zero and the phase still waits for this arrival).
__device__ __forceinline__ void mbar_arrive_expect(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT_%=;\n}" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}
// 16 bytes into another block's shared memory (remote: a mapa address), counted on its mbarrier (remote_bar).
__device__ __forceinline__ void st_async16(uint32_t remote, const uint4& v, uint32_t remote_bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                   remote),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(remote_bar)
               : "memory");
#endif
}

struct ChainArgs {
  uint32_t* gvec;  // !DSMEM: 2 x n words per cluster
  uint32_t* out;   // n words: the first cluster's last vector
  int n, stages;
  bool relaxed;  // n == 0 only
};

template <bool DSMEM>
__global__ void __launch_bounds__(kThreads) cluster_chain_kernel(ChainArgs a) {
  extern __shared__ __align__(16) uint32_t sv[];  // DSMEM: the two vectors (2 x n words)
  __shared__ uint32_t red[kThreads / 32];
  const int C = (int)cluster_blocks(), b = (int)cluster_rank(), cid = (int)blockIdx.x / C;
  uint32_t* gv = a.gvec + (size_t)cid * 2 * a.n;
  const int lo = span(b, a.n, C), hi = span(b + 1, a.n, C);
  auto put = [&](int at, uint32_t v) {  // word `at` of both buffers' 2n, into every block of the cluster
    if constexpr (DSMEM) {
      for (int r = 0; r < C; r++) store_peer(sv + at, (uint32_t)r, v);
    } else {
      gv[at] = v;
    }
  };
  cluster_sync();  // every block of the cluster has started (its shared memory exists) before any store into it
  for (int j = lo + (int)threadIdx.x; j < hi; j += kThreads) put(j, mix(kSeed, (uint32_t)j, 0, 0));
  cluster_sync();
  for (int s = 1; s <= a.stages; s++) {
    const uint32_t* src = (DSMEM ? sv : gv) + ((s - 1) & 1) * a.n;
    uint32_t acc = 0;
    for (int j = (int)threadIdx.x; j < a.n; j += kThreads) acc ^= DSMEM ? src[j] : __ldcg(src + j);
    const uint32_t x = block_xor(acc, red);
    for (int j = lo + (int)threadIdx.x; j < hi; j += kThreads)
      put((s & 1) * a.n + j, mix(x, (uint32_t)j, (uint32_t)s, 0));
    if (a.relaxed) cluster_sync_relaxed();
    else cluster_sync();
  }
  // (No block touches another's shared memory after the last barrier, so none may exit too early for a peer.)
  if (cid == 0 && b == 0) {
    const uint32_t* last = (DSMEM ? sv : gv) + (a.stages & 1) * a.n;
    for (int j = (int)threadIdx.x; j < a.n; j += kThreads) a.out[j] = DSMEM ? last[j] : __ldcg(last + j);
  }
}

__global__ void __launch_bounds__(kThreads) cluster_oneway_kernel(ChainArgs a) {
  extern __shared__ __align__(16) uint32_t sv[];  // the two vectors, each padded to whole 16-byte quads
  __shared__ __align__(8) uint64_t bar[2];          // bar[i]: buffer i's bytes have arrived
  __shared__ uint32_t red[kThreads / 32];
  const int C = (int)cluster_blocks(), b = (int)cluster_rank(), cid = (int)blockIdx.x / C;
  // The vector in quads, at least one a block: a block that sent nothing would feed no peer's wait, and its peers
  // could then run a stage ahead of it, into the buffer it still reads (padding words are 0 and never read).
  const int nq = max((a.n + 3) / 4, C), n4 = 4 * nq;
  const int lo = span(b, nq, C), hi = span(b + 1, nq, C);      // this block's quads
  const uint32_t bytes = 16u * (uint32_t)nq;                   // what a block receives a stage
  if (threadIdx.x == 0) {
    mbar_init(&bar[0], 1);
    mbar_init(&bar[1], 1);
    mbar_arrive_expect(&bar[0], bytes);  // v_0's phase
    mbar_arrive_expect(&bar[1], bytes);  // v_1's
  }
  cluster_sync();  // every block's barriers exist before any store counts on them
  auto send = [&](int s, uint32_t x) {  // this block's slice of v_s into buffer s & 1 of every block (itself too)
    const uint32_t buf = smem_addr(sv + (s & 1) * n4), mb = smem_addr(&bar[s & 1]);
    // One quad a thread at a time, its peers' addresses mapped at each store: the form §42 measured. Four quads a
    // thread with each peer mapped once per four stores was slower, the more so the larger the cluster
    // (docs/perf/persistent.md §45).
    for (int i = lo + (int)threadIdx.x; i < hi; i += kThreads) {
      uint32_t w[4];
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int j = 4 * i + e;
        w[e] = j < a.n ? mix(x, (uint32_t)j, (uint32_t)s, 0) : 0u;
      }
      const uint4 v = make_uint4(w[0], w[1], w[2], w[3]);
      for (int r = 0; r < C; r++) st_async16(map_peer(buf, (uint32_t)r) + 16u * (uint32_t)i, v, map_peer(mb, (uint32_t)r));
    }
  };
  send(0, kSeed);  // v_0[j] = mix(kSeed, j, 0, 0)
  for (int s = 1; s <= a.stages; s++) {
    const int pb = (s - 1) & 1;
    mbar_wait(&bar[pb], (uint32_t)((s - 1) >> 1) & 1u);  // v_{s-1} is here (its phase: (s - 1) / 2)
    uint32_t acc = 0;
    for (int j = (int)threadIdx.x; j < a.n; j += kThreads) acc ^= sv[pb * n4 + j];
    const uint32_t x = block_xor(acc, red);  // every thread has read buffer pb
    if (threadIdx.x == 0 && s + 1 <= a.stages) mbar_arrive_expect(&bar[pb], bytes);  // its next phase: v_{s+1}
    send(s, x);
  }
  const int last = a.stages & 1;
  mbar_wait(&bar[last], (uint32_t)(a.stages >> 1) & 1u);  // v_stages is here: no store into this block is left
  if (cid == 0 && b == 0)
    for (int j = (int)threadIdx.x; j < a.n; j += kThreads) a.out[j] = sv[last * n4 + j];
  cluster_sync();  // (this block's own stores have completed on the peers before it exits)
}

// One chain length on one grid: the launch configuration and its buffers.
struct Chain {
  void (*kernel)(ChainArgs) = nullptr;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  int clusters = 0;
  ChainArgs args{};
  Chain(int n, int cluster, bool dsmem, int stages, int clusters_wanted, const char* who, bool relaxed = false,
        bool one_way = false) {
    int dev = 0, major = 0, max_smem = 0;
    TI_CUDA_CHECK(cudaGetDevice(&dev));
    TI_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    TI_CUDA_CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    if (major < 9) fail(ErrorKind::Device, std::string(who) + ": thread-block clusters need sm_90+");
    if (cluster < 1 || cluster > kMaxCluster)
      fail(ErrorKind::Request, std::string(who) + ": cluster must be 1 to " + std::to_string(kMaxCluster));
    if (n < 0 || stages < 1 || stages > (1 << 24))
      fail(ErrorKind::Request, std::string(who) + ": n_words >= 0 and stages in 1..2^24");
    if (relaxed && n != 0) fail(ErrorKind::Request, std::string(who) + ": relaxed_barrier needs n_words = 0");
    if (one_way && (!dsmem || n < 1 || cluster < 2))  // (st.async needs a cluster of two or more: PTX ISA)
      fail(ErrorKind::Request, std::string(who) + ": one_way needs dsmem, n_words >= 1 and cluster >= 2");
    kernel = one_way ? cluster_oneway_kernel : dsmem ? cluster_chain_kernel<true> : cluster_chain_kernel<false>;
    cudaFuncAttributes fa{};
    TI_CUDA_CHECK(cudaFuncGetAttributes(&fa, kernel));
    if (fa.binaryVersion < 90)  // (a build without sm_90 code: the cluster instructions would be compiled away)
      fail(ErrorKind::Device, std::string(who) + ": this build has no sm_90 code for the cluster kernel");
    const size_t smem =
        !dsmem ? 0 : (size_t)2 * (one_way ? 4 * std::max((n + 3) / 4, cluster) : n) * sizeof(uint32_t);
    if (smem + 1024 > (size_t)max_smem)
      fail(ErrorKind::Request, std::string(who) + ": n_words=" + std::to_string(n) + " in shared memory needs " +
                                   std::to_string(smem) + " bytes a block, more than the " + std::to_string(max_smem) +
                                   " this GPU allows");
    if (smem > 48 * 1024)
      TI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    if (cluster > 8 && cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
      cudaGetLastError();  // (cleared: a refused size is the request's problem, not the context's)
      fail(ErrorKind::Request, std::string(who) + ": this GPU does not allow clusters of " + std::to_string(cluster));
    }
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    cfg.gridDim = dim3((unsigned)cluster);
    int fit = 0;
    if (cudaOccupancyMaxActiveClusters(&fit, kernel, &cfg) != cudaSuccess) {
      cudaGetLastError();
      fit = 0;
    }
    if (fit < 1)
      fail(ErrorKind::Request, std::string(who) + ": no cluster of " + std::to_string(cluster) + " blocks with " +
                                   std::to_string(smem) + " bytes of shared memory each fits on this GPU");
    clusters = clusters_wanted > 0 ? std::min(fit, clusters_wanted) : fit;
    cfg.gridDim = dim3((unsigned)(clusters * cluster));
    args.n = n;
    args.stages = stages;
    args.relaxed = relaxed;
  }
  void run() { TI_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args)); }
};

std::vector<uint32_t> read_back(const DeviceArray<uint32_t>& out, int n) {
  std::vector<uint32_t> v((size_t)n);
  if (n > 0) TI_CUDA_CHECK(cudaMemcpy(v.data(), out.p, (size_t)n * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  return v;
}

}  // namespace

std::vector<uint32_t> cluster_chain_reference(int n_words, int stages) {
  std::vector<uint32_t> v((size_t)std::max(n_words, 0));
  for (int j = 0; j < n_words; j++) v[j] = mix(kSeed, (uint32_t)j, 0, 0);
  for (int s = 1; s <= stages; s++) {
    uint32_t x = 0;
    for (uint32_t w : v) x ^= w;
    for (int j = 0; j < n_words; j++) v[j] = mix(x, (uint32_t)j, (uint32_t)s, 0);
  }
  return v;
}

std::vector<uint32_t> run_cluster_chain(int n_words, int cluster, bool dsmem, int stages, bool one_way) {
  Chain c(n_words, cluster, dsmem, stages, 1, "cluster_chain", false, one_way);
  DeviceArray<uint32_t> gvec((size_t)2 * std::max(n_words, 1) * c.clusters), out((size_t)std::max(n_words, 1));
  c.args.gvec = gvec.p;
  c.args.out = out.p;
  c.run();
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  return read_back(out, n_words);
}

ClusterHandoffResult measure_cluster_handoff(const ClusterHandoffConfig& cfg) {
  if (cfg.max_clusters < 0) fail(ErrorKind::Request, "measure_cluster_handoff: max_clusters >= 0");
  Chain one(cfg.n_words, cfg.cluster, cfg.dsmem, cfg.stages, cfg.max_clusters, "measure_cluster_handoff",
            cfg.relaxed_barrier, cfg.one_way),
      two(cfg.n_words, cfg.cluster, cfg.dsmem, 2 * cfg.stages, cfg.max_clusters, "measure_cluster_handoff",
          cfg.relaxed_barrier, cfg.one_way);
  const size_t words = (size_t)2 * std::max(cfg.n_words, 1) * one.clusters;
  DeviceArray<uint32_t> gvec(words), out1((size_t)std::max(cfg.n_words, 1)), out2((size_t)std::max(cfg.n_words, 1));
  one.args.gvec = two.args.gvec = gvec.p;  // the two chains never run at once (one stream)
  one.args.out = out1.p;
  two.args.out = out2.p;
  ClusterHandoffResult res;
  res.ns_per_handoff = ns_per_stage(one, two, cfg.stages, cfg.reps);
  res.clusters = one.clusters;
  res.blocks = one.clusters * cfg.cluster;
  res.checksum_ok = read_back(out1, cfg.n_words) == cluster_chain_reference(cfg.n_words, cfg.stages) &&
                    read_back(out2, cfg.n_words) == cluster_chain_reference(cfg.n_words, 2 * cfg.stages);
  return res;
}

}  // namespace ti::cuda
