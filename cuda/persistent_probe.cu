// persistent_probe.cu — micro-benchmarks of the persistent decode step (issue 16: predict, measure, then build)
// and the test drivers of its synchronisation (sync.cuh) and weight ring (ring.cuh).
//
// Computes (every kernel a co-resident grid of 256-thread blocks, launched cooperatively so that the launch fails
// rather than deadlocks when the grid cannot be co-resident):
//   handoff_chain_kernel:   a chain of hand-offs. Stage k (1..K): wait for stage k-1's counter of the group read,
//                           XOR that group's part of vector k-1 (16-byte loads from L2), write this block's slice
//                           of vector k as mix(X, word, k, epoch), signal stage k's counter of its own group. Stage
//                           1 starts from seed(epoch). Each stage has its own vector and counters: no reuse hazard.
//   reduction_chain_kernel: an exact 64-bit sum carried through `stages` all-to-all hand-offs (the tests' oracle).
//   stream_kernel<C, S>:    every block streams grid-strided chunks of a weight buffer through a WeightRing<C, S>
//                           and XORs them; with hand-offs on, every `chunks_per_stage` chunks it also does an
//                           all-to-all hand-off of a vector (two vectors alternate: every block has read vector
//                           k-1 before it signals k, and a writer of k+1 has waited for that signal).
// Values are 32-bit words; the mixes below and their host replicas make any stale or missing read visible in the
// checksums. Timing: CUDA events, best of `reps`; the hand-off chain's per-hand-off time is a difference of two
// chain lengths so that the launch and the first stage cancel out.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "bandwidth.cuh"
#include "common.cuh"
#include "persistent_probe.cuh"
#include "probe_common.cuh"
#include "sync.cuh"

namespace ti::cuda {

using namespace probe;  // kThreads, mix, span, block_xor, DeviceArray, Events

namespace {

__host__ __device__ inline uint32_t seed(uint32_t epoch) { return mix(0x5EEDu, 0, 0, epoch); }

// Blocks into groups, the other way round from span: group of block b = b * groups / blocks, its first block =
// ceil(g * blocks / groups) (consistent with it).
__host__ __device__ inline int group_of(int b, int blocks, int groups) { return (int)((int64_t)b * groups / blocks); }
__host__ __device__ inline int first_block(int g, int blocks, int groups) {
  return (int)(((int64_t)g * blocks + groups - 1) / groups);
}

__device__ __forceinline__ uint32_t xor4(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

// XOR of vec[q0, q1) (uint4 units), produced by other blocks during this kernel.
__device__ __forceinline__ uint32_t read_produced_xor(const uint4* vec, int q0, int q1, uint32_t* red) {
  uint32_t acc = 0;
  for (int q = q0 + threadIdx.x; q < q1; q += kThreads) acc ^= xor4(sync::load_produced(vec + q));
  return block_xor(acc, red);
}

// This block's slice [q0, q1) of vector k: words mix(x, word, k, epoch).
__device__ __forceinline__ void write_slice(uint4* vec, int q0, int q1, uint32_t x, uint32_t k, uint32_t epoch) {
  for (int q = q0 + threadIdx.x; q < q1; q += kThreads) {
    const uint32_t i = 4u * q;
    vec[q] = make_uint4(mix(x, i, k, epoch), mix(x, i + 1, k, epoch), mix(x, i + 2, k, epoch), mix(x, i + 3, k, epoch));
  }
}

struct ChainArgs {
  uint32_t* act;  // (stages + 1) vectors of n_words; vector k written by stage k
  uint32_t* counters;  // (stages + 1) * groups counters, kCounterStride apart
  uint32_t* error;     // 3 words (sync.cuh)
  unsigned long long* waited;  // per block: ns thread 0 spent waiting
  int n_words, groups, stages;
  uint32_t epoch;
  sync::WaitPolicy policy;
};

__global__ void __launch_bounds__(kThreads) handoff_chain_kernel(ChainArgs a) {
  __shared__ uint32_t red[kThreads / 32];
  const int G = gridDim.x, H = a.groups, n4 = a.n_words / 4, b = blockIdx.x;
  const int own = group_of(b, G, H), src = (own + 1) % H;  // read another group's part (H = 1: the whole vector)
  const int fb = first_block(own, G, H), cnt = first_block(own + 1, G, H) - fb;
  const int src_producers = first_block(src + 1, G, H) - first_block(src, G, H);
  const int p0 = span(own, n4, H), p1 = span(own + 1, n4, H);
  const int q0 = p0 + span(b - fb, p1 - p0, cnt), q1 = p0 + span(b - fb + 1, p1 - p0, cnt);
  unsigned long long waited = 0;
  for (int k = 1; k <= a.stages; k++) {
    uint32_t x = seed(a.epoch);
    if (k > 1) {
      const int c = (k - 1) * H + src;
      sync::block_wait_timed(a.counters + (size_t)c * sync::kCounterStride,
                             sync::epoch_target(a.epoch, src_producers), a.policy, a.error, c, &waited);
      x = read_produced_xor(reinterpret_cast<const uint4*>(a.act + (size_t)(k - 1) * a.n_words), span(src, n4, H),
                            span(src + 1, n4, H), red);
    }
    write_slice(reinterpret_cast<uint4*>(a.act + (size_t)k * a.n_words), q0, q1, x, k, a.epoch);
    sync::block_signal(a.counters + (size_t)(k * H + own) * sync::kCounterStride);
  }
  if (threadIdx.x == 0) a.waited[b] = waited;
}

struct ReductionArgs {
  const uint32_t* x;     // (stages, n)
  unsigned long long* partials;  // (stages, blocks)
  unsigned long long* total;
  uint32_t* counters;    // stages counters
  uint32_t* error;
  int n, stages;
  uint32_t epoch;
  sync::WaitPolicy policy;
};

__global__ void __launch_bounds__(kThreads) reduction_chain_kernel(ReductionArgs a) {
  __shared__ unsigned long long red[kThreads / 32 + 1];
  const int G = gridDim.x, b = blockIdx.x;
  auto block_sum = [&](unsigned long long v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long r = 0;
    for (int w = 0; w < kThreads / 32; w++) r += red[w];
    return r;
  };
  auto wait_stage = [&](int s) {
    sync::block_wait(a.counters + (size_t)s * sync::kCounterStride, sync::epoch_target(a.epoch, G), a.policy,
                     a.error, s);
  };
  auto carried = [&](int s) {  // every block reads every partial of stage s (all-to-all), block 0 uses it
    unsigned long long v = 0;
    for (int j = threadIdx.x; j < G; j += kThreads) v += __ldcg(a.partials + (size_t)s * G + j);
    return block_sum(v);
  };
  for (int s = 0; s < a.stages; s++) {
    unsigned long long carry = 0;
    if (s > 0) {
      wait_stage(s - 1);
      carry = carried(s - 1);
    }
    unsigned long long v = 0;
    for (int i = span(b, a.n, G) + threadIdx.x; i < span(b + 1, a.n, G); i += kThreads)
      v += (unsigned long long)a.x[(size_t)s * a.n + i] + a.epoch;
    v = block_sum(v);
    if (threadIdx.x == 0) a.partials[(size_t)s * G + b] = v + (b == 0 ? carry : 0);
    sync::block_signal(a.counters + (size_t)s * sync::kCounterStride);
  }
  if (b == 0) {
    wait_stage(a.stages - 1);
    const unsigned long long t = carried(a.stages - 1);
    if (threadIdx.x == 0) *a.total = t;
  }
}

struct StreamArgs {
  const uint8_t* data;
  size_t n_chunks;
  uint32_t chunk_bytes;
  int stages, chunks_per_stage, handoffs;  // handoffs = 0: the stream alone
  uint32_t* act;                           // 2 vectors of n_words
  int n_words;
  uint32_t* counters;  // stages + 1 counters
  uint32_t* error;
  unsigned long long* waited;
  uint32_t* sink;  // per block: XOR of its chunks
  uint32_t epoch;
  sync::WaitPolicy policy;
  uint32_t issuer = 0;  // Bulk: the thread that issues the copies (thread 0 also waits and signals)
};

template <RingCopy C, int S>
__global__ void __launch_bounds__(kThreads) stream_kernel(StreamArgs a) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint32_t red[kThreads / 32];
  WeightRing<C, S> ring(smem, a.chunk_bytes);
  ring.issuer = a.issuer;
  const int G = gridDim.x, b = blockIdx.x, n4 = a.n_words / 4;
  const size_t per_block = (size_t)a.stages * a.chunks_per_stage;
  auto src = [&](size_t j) -> const uint8_t* {  // this block's j-th chunk, nullptr past its last
    const size_t c = (size_t)b + j * G;
    return j < per_block && c < a.n_chunks ? a.data + c * a.chunk_bytes : nullptr;
  };
  for (int s = 0; s < S - 1; s++) ring.issue(src(s));
  uint32_t acc = 0;
  unsigned long long waited = 0;
  size_t j = 0;
  for (int k = 1; k <= a.stages; k++) {
    uint32_t x = seed(a.epoch);
    if (a.handoffs && k > 1) {
      sync::block_wait_timed(a.counters + (size_t)(k - 1) * sync::kCounterStride, sync::epoch_target(a.epoch, G),
                             a.policy, a.error, k - 1, &waited);
      x = read_produced_xor(reinterpret_cast<const uint4*>(a.act + (size_t)((k - 1) & 1) * a.n_words), 0, n4, red);
    }
    for (int t = 0; t < a.chunks_per_stage && src(j) != nullptr; t++, j++) {
      ring.issue(src(j + S - 1));
      const uint8_t* p = ring.acquire();
      for (uint32_t o = threadIdx.x * 16; o < a.chunk_bytes; o += kThreads * 16)
        acc ^= xor4(*reinterpret_cast<const uint4*>(p + o));
      ring.release();
    }
    if (a.handoffs) {
      write_slice(reinterpret_cast<uint4*>(a.act + (size_t)(k & 1) * a.n_words), span(b, n4, G), span(b + 1, n4, G), x,
                  k, a.epoch);
      sync::block_signal(a.counters + (size_t)k * sync::kCounterStride);
    }
  }
  acc = block_xor(acc, red);
  if (threadIdx.x == 0) {
    a.sink[b] = acc;
    a.waited[b] = waited;
  }
}

__global__ void fill_kernel(uint32_t* w, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    w[i] = mix((uint32_t)i, (uint32_t)(i >> 32), 7, 1);
}

// ---- host helpers ----



struct DeviceInfo {
  int sms = 0, cc_major = 0, max_smem = 0;
};
DeviceInfo device_info(const char* who) {
  int dev = 0, coop = 0;
  DeviceInfo d;
  TI_CUDA_CHECK(cudaGetDevice(&dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&d.cc_major, cudaDevAttrComputeCapabilityMajor, dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&d.max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev));
  if (!coop) fail(ErrorKind::Device, std::string(who) + ": this GPU does not support cooperative launches");
  return d;
}

// The grid a persistent kernel may use: `blocks` (0: every co-resident block), checked against the occupancy API.
int coresident_grid(const void* kernel, size_t smem, int blocks, const char* who) {
  int dev = 0, sms = 0, per_sm = 0;
  TI_CUDA_CHECK(cudaGetDevice(&dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (smem > 48 * 1024)
    TI_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  TI_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const int max_blocks = per_sm * sms;
  if (blocks == 0) blocks = max_blocks;
  if (blocks < 1 || blocks > max_blocks)
    fail(ErrorKind::Request, std::string(who) + ": " + std::to_string(blocks) + " blocks requested, " +
                                 std::to_string(max_blocks) + " can be co-resident (" + std::to_string(per_sm) +
                                 " per SM x " + std::to_string(sms) + " SMs)");
  return blocks;
}

template <typename Args>
void launch_cooperative(const void* kernel, int blocks, size_t smem, Args& args) {
  void* params[] = {&args};
  TI_CUDA_CHECK(cudaLaunchCooperativeKernel(kernel, dim3(blocks), dim3(kThreads), params, smem, 0));
}

// A failed wait's record, as an error naming the counter (after the kernel).
void check_waits(const uint32_t* error, const char* who) {
  uint32_t e[3] = {0, 0, 0};
  TI_CUDA_CHECK(cudaMemcpy(e, error, sizeof(e), cudaMemcpyDeviceToHost));
  if (e[0] != 0)
    fail(ErrorKind::Device, std::string(who) + ": a wait timed out on counter " + std::to_string(e[1]) +
                                " (value " + std::to_string(e[2]) + "): the grid is not co-resident or the "
                                "schedule waits for a signal nobody sends");
}

void check_chain_args(int n_words, int groups, int stages, const char* who) {
  const std::string w = who;
  if (n_words < 4 || n_words % 4) fail(ErrorKind::Request, w + ": n_words must be a positive multiple of 4");
  if (groups < 1 || groups > n_words / 4)
    fail(ErrorKind::Request, w + ": groups must be in 1..n_words / 4 (every group's part non-empty)");
  if (stages < 1) fail(ErrorKind::Request, w + ": stages must be >= 1");
}

// One chain of `stages` on its own counters; epochs count its launches.
struct Chain {
  int n_words, groups, stages, blocks;
  sync::WaitPolicy policy;
  DeviceArray<uint32_t> act, counters, error;
  DeviceArray<unsigned long long> waited;
  uint32_t epoch = 0;
  Chain(int n, int g, int s, int b, sync::WaitPolicy p)
      : n_words(n), groups(g), stages(s), blocks(b), policy(p), act((size_t)(s + 1) * n),
        counters((size_t)(s + 1) * g * sync::kCounterStride), error(3), waited((size_t)b) {
    if (blocks < groups) fail(ErrorKind::Request, "hand-off chain: groups must be <= blocks");
  }
  void run() {
    ChainArgs a{act.p, counters.p, error.p, waited.p, n_words, groups, stages, ++epoch, policy};
    launch_cooperative((const void*)handoff_chain_kernel, blocks, 0, a);
  }
  std::vector<uint32_t> last_vector() const {
    std::vector<uint32_t> v((size_t)n_words);
    TI_CUDA_CHECK(cudaMemcpy(v.data(), act.p + (size_t)stages * n_words, v.size() * 4, cudaMemcpyDeviceToHost));
    return v;
  }
  double mean_wait_ns() const {
    std::vector<unsigned long long> w((size_t)blocks);
    TI_CUDA_CHECK(cudaMemcpy(w.data(), waited.p, w.size() * 8, cudaMemcpyDeviceToHost));
    double s = 0;
    for (auto x : w) s += (double)x;
    return stages > 1 ? s / blocks / (stages - 1) : 0.0;
  }
};

template <RingCopy C>
const void* stream_kernel_for(int stages) {
  switch (stages) {
    case 2: return (const void*)stream_kernel<C, 2>;
    case 3: return (const void*)stream_kernel<C, 3>;
    case 4: return (const void*)stream_kernel<C, 4>;
    case 6: return (const void*)stream_kernel<C, 6>;
    case 8: return (const void*)stream_kernel<C, 8>;
  }
  fail(ErrorKind::Request, "ring: stages must be one of 2, 3, 4, 6, 8, got " + std::to_string(stages));
}

// A stream over a device buffer: the kernel for (copy, stages), its grid and its launches. blocks_wanted: > 0
// exactly, 0 every co-resident block, < 0 -n per SM.
struct Stream {
  const void* kernel;
  size_t smem;
  int blocks, blocks_per_sm;
  uint32_t chunk_bytes;
  Stream(RingCopy copy, int stages, int slot_kib, int blocks_wanted, const char* who) {
    const DeviceInfo d = device_info(who);
    if (copy == RingCopy::Bulk && d.cc_major < 9)
      fail(ErrorKind::Device, std::string(who) + ": the Bulk ring (cp.async.bulk) needs sm_90+");
    if (slot_kib < 1 || slot_kib > 64) fail(ErrorKind::Request, std::string(who) + ": slot_kib must be in 1..64");
    kernel = copy == RingCopy::Bulk ? stream_kernel_for<RingCopy::Bulk>(stages) : stream_kernel_for<RingCopy::CpAsync>(stages);
    chunk_bytes = (uint32_t)slot_kib * 1024;
    smem = ring_smem_bytes(stages, chunk_bytes);
    if (smem + 1024 > (size_t)d.max_smem)
      fail(ErrorKind::Request, std::string(who) + ": " + std::to_string(stages) + " slots of " +
                                   std::to_string(slot_kib) + " KiB need " + std::to_string(smem) +
                                   " bytes of shared memory, this GPU gives a block " + std::to_string(d.max_smem));
    if (blocks_wanted < 0) blocks_wanted *= -d.sms;
    blocks = coresident_grid(kernel, smem, blocks_wanted, who);
    blocks_per_sm = (blocks + d.sms - 1) / d.sms;
  }
  void run(StreamArgs& a) const { launch_cooperative(kernel, blocks, smem, a); }
};

uint32_t xor_of(const DeviceArray<uint32_t>& sink, int n) {
  std::vector<uint32_t> s((size_t)n);
  TI_CUDA_CHECK(cudaMemcpy(s.data(), sink.p, s.size() * 4, cudaMemcpyDeviceToHost));
  uint32_t r = 0;
  for (uint32_t v : s) r ^= v;
  return r;
}

// A weight buffer of `bytes` filled on the device, and the XOR of its words by cuda/bandwidth.cu's kernel.
struct FilledBuffer {
  DeviceArray<uint32_t> w;
  uint32_t expected = 0;
  explicit FilledBuffer(size_t bytes) : w(bytes / 4) {
    fill_kernel<<<1024, 256>>>(w.p, bytes / 4);
    TI_CUDA_CHECK(cudaGetLastError());
    DeviceArray<uint32_t> sink(1024);
    launch_stream_read(reinterpret_cast<const uint4*>(w.p), bytes / 16, sink.p, 1024, 0);
    TI_CUDA_CHECK(cudaGetLastError());
    expected = xor_of(sink, 1024);
  }
};

}  // namespace

// ---- the hand-off chain ----

std::vector<uint32_t> handoff_chain_reference(int n_words, int groups, int stages, uint32_t epoch) {
  check_chain_args(n_words, groups, stages, "handoff_chain_reference");
  const int n4 = n_words / 4, H = groups;
  std::vector<uint32_t> prev((size_t)n_words, 0), cur((size_t)n_words);
  for (int k = 1; k <= stages; k++) {
    std::vector<uint32_t> X((size_t)H, seed(epoch));
    if (k > 1)
      for (int g = 0; g < H; g++) {
        uint32_t x = 0;
        for (int i = 4 * span(g, n4, H); i < 4 * span(g + 1, n4, H); i++) x ^= prev[(size_t)i];
        X[(size_t)g] = x;
      }
    for (int g = 0; g < H; g++)  // group g's words are written by g's blocks, which read group g + 1
      for (int i = 4 * span(g, n4, H); i < 4 * span(g + 1, n4, H); i++) cur[(size_t)i] = mix(X[(size_t)((g + 1) % H)], i, k, epoch);
    std::swap(prev, cur);
  }
  return prev;
}

std::vector<uint32_t> run_handoff_chain(int n_words, int groups, int stages, int blocks, int epochs) {
  check_chain_args(n_words, groups, stages, "handoff_chain");
  if (epochs < 1) fail(ErrorKind::Request, "handoff_chain: epochs must be >= 1");
  device_info("handoff_chain");
  blocks = coresident_grid((const void*)handoff_chain_kernel, 0, blocks, "handoff_chain");
  Chain c(n_words, groups, stages, blocks, sync::WaitPolicy{});
  for (int e = 0; e < epochs; e++) c.run();
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  check_waits(c.error.p, "handoff_chain");
  return c.last_vector();
}

HandoffResult measure_handoff(const HandoffConfig& cfg) {
  check_chain_args(cfg.n_words, cfg.groups, cfg.stages, "measure_handoff");
  const DeviceInfo d = device_info("measure_handoff");
  if (cfg.blocks_per_sm < 1) fail(ErrorKind::Request, "measure_handoff: blocks_per_sm must be >= 1");
  const int blocks = coresident_grid((const void*)handoff_chain_kernel, 0, cfg.blocks_per_sm * d.sms, "measure_handoff");
  sync::WaitPolicy policy;
  policy.max_sleep_ns = cfg.max_sleep_ns;
  Chain one(cfg.n_words, cfg.groups, cfg.stages, blocks, policy), two(cfg.n_words, cfg.groups, 2 * cfg.stages, blocks, policy);
  const double ns = ns_per_stage(one, two, cfg.stages, cfg.reps);
  check_waits(one.error.p, "measure_handoff");
  check_waits(two.error.p, "measure_handoff");
  HandoffResult res;
  res.blocks = blocks;
  res.stages = cfg.stages;
  res.ns_per_handoff = ns;
  res.wait_ns = two.mean_wait_ns();
  res.checksum_ok = two.last_vector() == handoff_chain_reference(cfg.n_words, cfg.groups, 2 * cfg.stages, two.epoch) &&
                    one.last_vector() == handoff_chain_reference(cfg.n_words, cfg.groups, cfg.stages, one.epoch);
  return res;
}

// ---- the reduction chain (tests) ----

std::vector<uint64_t> run_reduction_chain(const uint32_t* x, int stages, int n, int blocks, int epochs) {
  if (stages < 1 || n < 1 || epochs < 1) fail(ErrorKind::Request, "reduction_chain: stages, n, epochs must be >= 1");
  device_info("reduction_chain");
  blocks = coresident_grid((const void*)reduction_chain_kernel, 0, blocks, "reduction_chain");
  DeviceArray<uint32_t> dx((size_t)stages * n), counters((size_t)stages * sync::kCounterStride), error(3);
  DeviceArray<unsigned long long> partials((size_t)stages * blocks, 0xFF), total(1);
  TI_CUDA_CHECK(cudaMemcpy(dx.p, x, (size_t)stages * n * 4, cudaMemcpyHostToDevice));
  std::vector<uint64_t> totals;
  for (int e = 1; e <= epochs; e++) {
    ReductionArgs a{dx.p, partials.p, total.p, counters.p, error.p, n, stages, (uint32_t)e, sync::WaitPolicy{}};
    launch_cooperative((const void*)reduction_chain_kernel, blocks, 0, a);
    unsigned long long t = 0;
    TI_CUDA_CHECK(cudaMemcpy(&t, total.p, 8, cudaMemcpyDeviceToHost));
    check_waits(error.p, "reduction_chain");
    totals.push_back(t);
  }
  return totals;
}

// ---- the ring, alone and with hand-offs ----

uint32_t ring_xor(const void* host, size_t bytes, RingCopy copy, int stages, int slot_kib, int blocks) {
  if (blocks < 0) fail(ErrorKind::Request, "ring_xor: blocks must be >= 0");
  Stream st(copy, stages, slot_kib, blocks, "ring_xor");
  if (bytes == 0 || bytes % st.chunk_bytes)
    fail(ErrorKind::Request, "ring_xor: len(data) must be a positive multiple of slot_kib KiB");
  DeviceArray<uint32_t> data(bytes / 4), sink((size_t)st.blocks, 0xAB), counters(sync::kCounterStride), error(3);
  DeviceArray<unsigned long long> waited((size_t)st.blocks);
  TI_CUDA_CHECK(cudaMemcpy(data.p, host, bytes, cudaMemcpyHostToDevice));
  const size_t n_chunks = bytes / st.chunk_bytes;
  StreamArgs a{reinterpret_cast<const uint8_t*>(data.p), n_chunks, st.chunk_bytes, 1,
               (int)((n_chunks + st.blocks - 1) / st.blocks), 0, nullptr, 0, counters.p, error.p, waited.p, sink.p,
               1, sync::WaitPolicy{}};
  st.run(a);
  TI_CUDA_CHECK(cudaDeviceSynchronize());
  return xor_of(sink, st.blocks);
}

uint32_t issuer_thread(const RingConfig& c) {
  if (c.issuer_warp < 0 || c.issuer_warp >= kThreads / 32)
    fail(ErrorKind::Request, "issuer_warp must be 0 to " + std::to_string(kThreads / 32 - 1));
  return (uint32_t)c.issuer_warp * 32;
}

RingResult measure_ring(const RingConfig& c) {
  if (c.blocks_per_sm < 1) fail(ErrorKind::Request, "measure_ring: blocks_per_sm must be >= 1");
  const uint32_t issuer = issuer_thread(c);  // (checked before any allocation)
  Stream st(c.copy, c.stages, c.slot_kib, -c.blocks_per_sm, "measure_ring");
  const size_t n_chunks = c.bytes / st.chunk_bytes;
  if (n_chunks < (size_t)st.blocks) fail(ErrorKind::Request, "measure_ring: bytes must give every block a chunk");
  FilledBuffer buf(n_chunks * st.chunk_bytes);
  DeviceArray<uint32_t> sink((size_t)st.blocks), counters(sync::kCounterStride), error(3);
  DeviceArray<unsigned long long> waited((size_t)st.blocks);
  StreamArgs a{reinterpret_cast<const uint8_t*>(buf.w.p), n_chunks, st.chunk_bytes, 1,
               (int)((n_chunks + st.blocks - 1) / st.blocks), 0, nullptr, 0, counters.p, error.p, waited.p, sink.p,
               1, sync::WaitPolicy{}, issuer};
  Events ev;
  st.run(a);  // warm-up
  float best = 1e30f;
  for (int r = 0; r < std::max(c.reps, 1); r++) best = std::min(best, ev.ms([&] { st.run(a); }));
  RingResult res;
  res.bytes = (double)n_chunks * st.chunk_bytes;
  res.best_ms = best;
  res.gb_per_s = res.bytes / (best * 1e-3) / 1e9;
  res.blocks = st.blocks;
  res.blocks_per_sm = st.blocks_per_sm;
  res.checksum_ok = xor_of(sink, st.blocks) == buf.expected;
  return res;
}

StreamHandoffResult measure_stream_handoff(const StreamHandoffConfig& c) {
  check_chain_args(c.n_words, 1, 1, "measure_stream_handoff");
  if (c.ring.blocks_per_sm < 1) fail(ErrorKind::Request, "measure_stream_handoff: blocks_per_sm must be >= 1");
  const uint32_t issuer = issuer_thread(c.ring);
  Stream st(c.ring.copy, c.ring.stages, c.ring.slot_kib, -c.ring.blocks_per_sm, "measure_stream_handoff");
  const double per_stage_all = (double)st.blocks * st.chunk_bytes;  // one chunk per block
  const int m = std::max(1, (int)std::lround(c.bytes_per_handoff / per_stage_all));
  const int K = (int)(c.ring.bytes / (per_stage_all * m));
  if (K < 2) fail(ErrorKind::Request, "measure_stream_handoff: bytes must hold at least 2 hand-offs");
  const size_t n_chunks = (size_t)K * m * st.blocks;
  FilledBuffer buf(n_chunks * st.chunk_bytes);
  DeviceArray<uint32_t> sink((size_t)st.blocks), act((size_t)2 * c.n_words),
      counters((size_t)(K + 1) * sync::kCounterStride), error(3);
  DeviceArray<unsigned long long> waited((size_t)st.blocks);
  sync::WaitPolicy policy;
  policy.max_sleep_ns = c.max_sleep_ns;
  uint32_t epoch = 0;
  auto args = [&](int handoffs) {
    return StreamArgs{reinterpret_cast<const uint8_t*>(buf.w.p), n_chunks, st.chunk_bytes, K, m, handoffs, act.p,
                      c.n_words, counters.p, error.p, waited.p, sink.p, handoffs ? ++epoch : 1u, policy,
                      issuer};
  };
  Events ev;
  float alone = 1e30f, with = 1e30f;
  for (int r = 0; r < std::max(c.ring.reps, 1) + 1; r++) {  // the first round is a warm-up
    StreamArgs a0 = args(0), a1 = args(1);
    const float t0 = ev.ms([&] { st.run(a0); }), t1 = ev.ms([&] { st.run(a1); });
    if (r > 0) alone = std::min(alone, t0), with = std::min(with, t1);
  }
  check_waits(error.p, "measure_stream_handoff");
  StreamHandoffResult res;
  const double bytes = (double)n_chunks * st.chunk_bytes;
  res.gb_per_s_alone = bytes / (alone * 1e-3) / 1e9;
  res.gb_per_s_with = bytes / (with * 1e-3) / 1e9;
  res.handoffs = K - 1;
  res.ns_lost_per_handoff = (double)(with - alone) * 1e6 / (K - 1);
  res.bytes_per_handoff = per_stage_all * m;
  res.blocks = st.blocks;
  std::vector<unsigned long long> w((size_t)st.blocks);
  TI_CUDA_CHECK(cudaMemcpy(w.data(), waited.p, w.size() * 8, cudaMemcpyDeviceToHost));
  double ws = 0;
  for (auto x : w) ws += (double)x;
  res.wait_ns = ws / st.blocks / (K - 1);
  std::vector<uint32_t> last((size_t)c.n_words);
  TI_CUDA_CHECK(cudaMemcpy(last.data(), act.p + (size_t)(K & 1) * c.n_words, last.size() * 4, cudaMemcpyDeviceToHost));
  res.checksum_ok = xor_of(sink, st.blocks) == buf.expected && last == handoff_chain_reference(c.n_words, 1, K, epoch);
  return res;
}

}  // namespace ti::cuda
