// ops_probe.cpp — tinyinfer._core.ops' probes of the persistent decode kernel's parts (cuda/persistent_probe.cuh):
// counter hand-off latency, the weight ring's bandwidth, the synchronisation tests. CUDA builds only.
#ifdef TINYINFER_WITH_CUDA
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "../cuda/cluster_probe.cuh"
#include "../cuda/persistent_probe.cuh"
#include "common.h"

namespace tinyinfer_bindings {

using namespace nb::literals;

// The persistent kernel's probes and synchronisation tests (cuda/persistent_probe.cuh).
void bind_persistent_probe(nb::module_& ops) {
  nb::enum_<ti::cuda::RingCopy>(ops, "RingCopy", "How the weight ring copies: cp.async per thread, or one bulk copy.")
      .value("CpAsync", ti::cuda::RingCopy::CpAsync)
      .value("Bulk", ti::cuda::RingCopy::Bulk);
  ops.def(
      "handoff_latency",
      [](int n_words, int groups, int stages, int blocks_per_sm, uint32_t max_sleep_ns, int reps) {
        ti::cuda::HandoffConfig c{n_words, groups, stages, blocks_per_sm, max_sleep_ns, reps};
        ti::cuda::HandoffResult r;
        {
          nb::gil_scoped_release release;
          r = ti::cuda::measure_handoff(c);
        }
        nb::dict d;
        d["ns_per_handoff"] = r.ns_per_handoff;
        d["wait_ns"] = r.wait_ns;
        d["blocks"] = r.blocks;
        d["stages"] = r.stages;
        d["checksum_ok"] = r.checksum_ok;
        return d;
      },
      "n_words"_a = 2048, "groups"_a = 1, "stages"_a = 256, "blocks_per_sm"_a = 1, "max_sleep_ns"_a = 0,
      "reps"_a = 10,
      "ns per hand-off of a chain across a persistent grid (cuda/persistent_probe.cu): groups = 1 all-to-all, "
      "groups = blocks one producer per consumer.");
  ops.def(
      "ring_bandwidth",
      [](ti::cuda::RingCopy copy, int stages, int slot_kib, size_t bytes, int reps, int blocks_per_sm,
         int issuer_warp) {
        ti::cuda::RingConfig c{copy, stages, slot_kib, bytes, reps, blocks_per_sm, issuer_warp};
        ti::cuda::RingResult r;
        {
          nb::gil_scoped_release release;
          r = ti::cuda::measure_ring(c);
        }
        nb::dict d;
        d["gb_per_s"] = r.gb_per_s;
        d["best_ms"] = r.best_ms;
        d["bytes"] = r.bytes;
        d["blocks"] = r.blocks;
        d["blocks_per_sm"] = r.blocks_per_sm;
        d["checksum_ok"] = r.checksum_ok;
        return d;
      },
      "copy"_a, "stages"_a, "slot_kib"_a, "bytes"_a = (size_t)1 << 31, "reps"_a = 10, "blocks_per_sm"_a = 1,
      "issuer_warp"_a = 0,
      "Steady-state bandwidth of the weight ring (cuda/ring.cuh) streaming `bytes` on blocks_per_sm blocks per SM "
      "(Bulk: lane 0 of issuer_warp issues the copies).");
  ops.def(
      "stream_handoff",
      [](ti::cuda::RingCopy copy, int stages, int slot_kib, size_t bytes, double bytes_per_handoff, int n_words,
         uint32_t max_sleep_ns, int reps, int blocks_per_sm, int issuer_warp) {
        ti::cuda::StreamHandoffConfig c{{copy, stages, slot_kib, bytes, reps, blocks_per_sm, issuer_warp},
                                        bytes_per_handoff, n_words, max_sleep_ns};
        ti::cuda::StreamHandoffResult r;
        {
          nb::gil_scoped_release release;
          r = ti::cuda::measure_stream_handoff(c);
        }
        nb::dict d;
        d["gb_per_s_alone"] = r.gb_per_s_alone;
        d["gb_per_s_with"] = r.gb_per_s_with;
        d["ns_lost_per_handoff"] = r.ns_lost_per_handoff;
        d["wait_ns"] = r.wait_ns;
        d["bytes_per_handoff"] = r.bytes_per_handoff;
        d["handoffs"] = r.handoffs;
        d["blocks"] = r.blocks;
        d["checksum_ok"] = r.checksum_ok;
        return d;
      },
      "copy"_a, "stages"_a, "slot_kib"_a, "bytes"_a = (size_t)1 << 31, "bytes_per_handoff"_a = 4e6,
      "n_words"_a = 2048, "max_sleep_ns"_a = 0, "reps"_a = 5, "blocks_per_sm"_a = 1, "issuer_warp"_a = 0,
      "(Bulk: lane 0 of issuer_warp issues the copies; thread 0 waits and signals.) The ring streaming while an all-to-all hand-off happens every ~bytes_per_handoff bytes: GB/s with and "
      "without the hand-offs, and the ns per hand-off the stream did not hide.");
  ops.def(
      "handoff_chain",
      [](int n_words, int groups, int stages, int blocks, int epochs) {
        nb::gil_scoped_release release;
        return ti::cuda::run_handoff_chain(n_words, groups, stages, blocks, epochs);
      },
      "n_words"_a, "groups"_a, "stages"_a, "blocks"_a, "epochs"_a,
      "Runs the hand-off chain `epochs` times on counters never reset (blocks 0: every co-resident block); the "
      "last vector (uint32 words).");
  ops.def("handoff_chain_reference", &ti::cuda::handoff_chain_reference, "n_words"_a, "groups"_a, "stages"_a,
          "epoch"_a, "The host's replica of handoff_chain's last vector at `epoch` (1-based).");
  ops.def(
      "ring_xor",
      [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> a, ti::cuda::RingCopy copy,
         int stages, int slot_kib, int blocks) {
        nb::gil_scoped_release release;
        return ti::cuda::ring_xor(a.data(), a.shape(0), copy, stages, slot_kib, blocks);
      },
      "data"_a, "copy"_a, "stages"_a, "slot_kib"_a, "blocks"_a,
      "Streams `data` through the weight ring (blocks 0: every co-resident block): the XOR of its 32-bit words.");
  ops.def(
      "reduction_chain",
      [](nb::ndarray<const uint32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> x, int blocks, int epochs) {
        nb::gil_scoped_release release;
        return ti::cuda::run_reduction_chain(x.data(), (int)x.shape(0), (int)x.shape(1), blocks, epochs);
      },
      "x"_a, "blocks"_a, "epochs"_a,
      "A 64-bit sum of x (stages, n) carried through an all-to-all hand-off per stage, `epochs` times on counters "
      "never reset: each epoch's total (sum(x) + epoch * x.size).");
  ops.def(
      "cluster_handoff_latency",
      [](int n_words, int cluster, bool dsmem, int stages, int reps, bool relaxed_barrier, bool one_way,
         int max_clusters) {
        ti::cuda::ClusterHandoffConfig c{n_words, cluster, dsmem, stages, reps, relaxed_barrier, one_way, max_clusters};
        ti::cuda::ClusterHandoffResult r;
        {
          nb::gil_scoped_release release;
          r = ti::cuda::measure_cluster_handoff(c);
        }
        nb::dict d;
        d["ns_per_handoff"] = r.ns_per_handoff;
        d["clusters"] = r.clusters;
        d["blocks"] = r.blocks;
        d["checksum_ok"] = r.checksum_ok;
        return d;
      },
      "n_words"_a = 2048, "cluster"_a = 8, "dsmem"_a = true, "stages"_a = 256, "reps"_a = 10,
      "relaxed_barrier"_a = false, "one_way"_a = false, "max_clusters"_a = 0,
      "ns per hand-off of a chain inside thread-block clusters (cuda/cluster_probe.cu): the vector in distributed "
      "shared memory (dsmem) or in global memory, the cluster's barrier between stages; n_words 0: the barrier "
      "(relaxed_barrier: its arrive without the release); one_way (dsmem): st.async stores counted on each "
      "receiver's mbarrier, no cluster barrier; max_clusters: at most that many clusters (0: as many as fit).");
  ops.def(
      "cluster_chain",
      [](int n_words, int cluster, bool dsmem, int stages, bool one_way) {
        nb::gil_scoped_release release;
        return ti::cuda::run_cluster_chain(n_words, cluster, dsmem, stages, one_way);
      },
      "n_words"_a, "cluster"_a, "dsmem"_a, "stages"_a, "one_way"_a = false,
      "The cluster chain's last vector (one cluster; uint32 words).");
  ops.def("cluster_chain_reference", &ti::cuda::cluster_chain_reference, "n_words"_a, "stages"_a,
          "The host's replica of cluster_chain's last vector.");
}

}  // namespace tinyinfer_bindings
#endif
