// ops.cpp — tinyinfer._core.ops: single operations on numpy arrays, for tests and benchmarks. The CPU ops are
// the reference (cpp/core, cpp/cpu); the GPU ops run one kernel each through bindings/kernel_tests.h. Modes are
// enums (ops.GemvIn, ops.GemvOut, ops.GemmOut): a misspelled mode is an error, never a fallback.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "../cpp/core/quant.h"
#include "../cpp/core/rope.h"
#include "../cpp/core/sampling.h"
#include "../cpp/cpu/cpu_engine.h"
#include "common.h"
#ifdef TINYINFER_WITH_CUDA
#include "../cuda/bandwidth.cuh"
#include "../cuda/device.cuh"
#include "../cuda/sm_partition.cuh"
#include "kernel_tests.h"
#endif

namespace tinyinfer_bindings {

using namespace nb::literals;

namespace {

// A new 1-D numpy array owning a copy of `v`.
template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> numpy_vec(const std::vector<T>& v) {
  T* buf = new T[v.size() ? v.size() : 1];
  std::copy(v.begin(), v.end(), buf);
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(buf, {v.size()}, owner);
}

#ifdef TINYINFER_WITH_CUDA
// The GEMV test ops' vector lengths, checked the same way for every weight format.
void check_gemv_args(const char* who, ti::cuda::GemvIn in, ti::cuda::GemvOut out, int rows, int K, const F32In1& x,
                     const F32In1& norm_w, const F32In1& y_init) {
  const std::string w = who;
  if ((int)x.shape(0) != K) ti::fail(ti::ErrorKind::Request, w + ": len(x) != W.shape[1]");
  if (in == ti::cuda::GemvIn::F32Norm && (int)norm_w.shape(0) != K)
    ti::fail(ti::ErrorKind::Request, w + ": len(norm_w) != K");
  if (out == ti::cuda::GemvOut::AddF32 && (int)y_init.shape(0) != rows)
    ti::fail(ti::ErrorKind::Request, w + ": len(y_init) != rows");
}

using U16Pages = nb::ndarray<uint16_t, nb::ndim<4>, nb::c_contig, nb::device::cpu>;
using I32In1 = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using I32In2 = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// A paged cache as the attention test ops take it (pools (n_pages, n_kv_heads, page_size, head_dim) of fp16 bits and
// a page table), checked: the pools agree in shape, page_size is a power of two, the table reaches n_positions
// and its entries for positions [0, n_positions) name pages of the pool.
ti::cuda::HostPages host_pages(const char* who, U16Pages& k, U16Pages& v, const int32_t* table, int table_len,
                               int64_t n_positions) {
  const std::string w = who;
  for (size_t d = 0; d < 4; d++)
    if (k.shape(d) != v.shape(d)) ti::fail(ti::ErrorKind::Request, w + ": k and v pages differ in shape");
  ti::cuda::HostPages h;
  h.k = k.data();
  h.v = v.data();
  h.table = table;
  h.table_len = table_len;
  h.n_pages = (int)k.shape(0);
  h.n_kv_heads = (int)k.shape(1);
  h.page_size = (int)k.shape(2);
  h.head_dim = (int)k.shape(3);
  if (h.page_size < 1 || (h.page_size & (h.page_size - 1)))
    ti::fail(ti::ErrorKind::Request, w + ": page size (pages.shape[2]) must be a power of two, got " +
                                         std::to_string(h.page_size));
  if (n_positions < 0 || n_positions > (int64_t)h.table_len * h.page_size)
    ti::fail(ti::ErrorKind::Request, w + ": positions out of range of a page table of " +
                                         std::to_string(h.table_len) + " pages");
  for (int64_t j = 0; j < (n_positions + h.page_size - 1) / h.page_size; j++)
    if (h.table[j] < 0 || h.table[j] >= h.n_pages)
      ti::fail(ti::ErrorKind::Request, w + ": page_table[" + std::to_string(j) + "] = " +
                                           std::to_string(h.table[j]) + " is not a page of a pool of " +
                                           std::to_string(h.n_pages));
  return h;
}

ti::cuda::HostPages host_pages(const char* who, U16Pages& k, U16Pages& v, const I32In1& table, int64_t n_positions) {
  return host_pages(who, k, v, table.data(), (int)table.shape(0), n_positions);
}

#endif

}  // namespace

void bind_ops(nb::module_& m) {
  nb::module_ ops = m.def_submodule("ops", "Single operations on numpy arrays, for tests and benchmarks.");
  ops.def("rope_inv_freq", &ti::rope_inv_freq, "config"_a, "The (head_dim/2) scaled RoPE inverse frequencies.");
  ops.def(
      "quantize_ref",
      [](F32In2 W, const FormatArg& f) {
        const ti::WFormat fmt = to_format(f);
        ti::QuantMatrix m = ti::quantize(fmt, W.data(), (int64_t)W.shape(0), (int64_t)W.shape(1));
        return quant_dict(m.q, m.sm, m.rows, m.ld, fmt, m.K);
      },
      "W"_a, "format"_a, "The reference packer (cpp/core/quant.cpp): {'q': (rows, ld) uint8, 'scales': ...}.");
  ops.def(
      "dequantize_ref",
      [](F32In2 W, const FormatArg& f) {
        std::vector<float> w(W.data(), W.data() + W.size());
        ti::quantize_dequantize(to_format(f), w.data(), (int64_t)W.shape(0), (int64_t)W.shape(1));
        return numpy_copy(w, W.shape(0), W.shape(1));
      },
      "W"_a, "format"_a, "dequantize(quantize(fp16(W))): the numbers the CPU engine computes with.");
  ops.def(
      "act8_ref",
      [](F32In2 X) {
        std::vector<float> x(X.data(), X.data() + X.size());
        for (size_t r = 0; r < X.shape(0); r++) ti::act8_round(x.data() + r * X.shape(1), (int64_t)X.shape(1));
        return numpy_copy(x, X.shape(0), X.shape(1));
      },
      "X"_a, "act8's rounding (cpp/core/quant.h act8_round) of each row of X: the CPU engine's twin of the GPU's "
      "int8 inputs, d xq per group of 32 of the fp16-rounded values.");
  ops.def(
      "matmul",
      [](F32In2 x, F32In2 w) {
        if (x.shape(1) != w.shape(1)) ti::fail(ti::ErrorKind::Request, "matmul: x and W have different widths");
        float* out = nullptr;
        F32Out y = new_f32_array(x.shape(0), w.shape(0), &out);
        ti::matmul(out, x.data(), w.data(), (int64_t)x.shape(0), (int64_t)w.shape(0), (int64_t)x.shape(1));
        return y;
      },
      "x"_a, "w"_a, "x @ w.T in fp32 (the CPU twin of the GEMV/GEMM kernels).");
  ops.def(
      "rmsnorm",
      [](F32In2 x, F32In1 w, float eps) {
        if (x.shape(1) != w.shape(0)) ti::fail(ti::ErrorKind::Request, "rmsnorm: weight length != row width");
        float* out = nullptr;
        F32Out y = new_f32_array(x.shape(0), x.shape(1), &out);
        ti::rmsnorm(out, x.data(), w.data(), (int64_t)x.shape(0), (int64_t)x.shape(1), eps);
        return y;
      },
      "x"_a, "weight"_a, "eps"_a);
  ops.def("uniform_from_counter", &ti::uniform_from_counter, "seed"_a, "step"_a);
  ops.def(
      "sample_row",
      [](F32In1 logits, const ti::SamplingConfig& cfg, uint64_t step, const std::vector<int64_t>& prompt_ids,
         const std::vector<int64_t>& generated_ids, int top_logprobs) {
        const int64_t vocab = (int64_t)logits.shape(0);
        if (vocab < 1) ti::fail(ti::ErrorKind::Request, "sample_row: empty logits");
        ti::validate(cfg, vocab);
        ti::TokenHistory h(vocab);
        for (int32_t t : to_ids(prompt_ids)) h.add_prompt(t);
        for (int32_t t : to_ids(generated_ids)) h.add_generated(t);
        std::vector<float> scratch;
        std::vector<int32_t> scratch_ids;
        const ti::SampleResult r = ti::sample_row(logits.data(), vocab, cfg, step, h, top_logprobs, scratch,
                                                  scratch_ids);
        return nb::make_tuple(r.token, r.logprob, numpy_vec(r.top_ids), numpy_vec(r.top_logprobs));
      },
      "logits"_a, "cfg"_a, "step"_a, "prompt_ids"_a, "generated_ids"_a, "top_logprobs"_a = 0,
      "The reference sampler of one row (cpp/core/sampling.cpp sample_row) over a history of prompt and generated "
      "ids: (token, logprob, top_ids int32[k], top_logprobs float32[k]).");

#ifdef TINYINFER_WITH_CUDA
  nb::enum_<ti::cuda::GemvIn>(ops, "GemvIn", "A GEMV's input: an fp16 vector, or the fp32 residual RMS-normed.")
      .value("F16", ti::cuda::GemvIn::F16)
      .value("F32Norm", ti::cuda::GemvIn::F32Norm);
  nb::enum_<ti::cuda::GemvOut>(ops, "GemvOut", "A GEMV's output: fp32, fp32 added in place, or silu(g) * u fp16.")
      .value("F32", ti::cuda::GemvOut::F32)
      .value("AddF32", ti::cuda::GemvOut::AddF32)
      .value("Swiglu", ti::cuda::GemvOut::Swiglu);
  nb::enum_<ti::cuda::GemmOut>(ops, "GemmOut", "A GEMM's output: fp32, fp32 accumulated (beta = 1), or fp16.")
      .value("F32", ti::cuda::GemmOut::F32)
      .value("AddF32", ti::cuda::GemmOut::AddF32)
      .value("F16", ti::cuda::GemmOut::F16);
  ops.def("cuda_compiled", []() { return true; });
  ops.def(
      "restrict_to_sms",
      [](int sms) {
        const ti::cuda::SmPartition p = ti::cuda::restrict_to_sms(sms);
        nb::dict d;
        d["sms"] = p.sms;
        d["device_sms"] = p.device_sms;
        d["min_partition"] = p.min_partition;
        d["alignment"] = p.alignment;
        return d;
      },
      "sms"_a,
      "Hold this thread's CUDA work (engines made after the call included) to a green context of at least `sms` "
      "SMs of GPU 0 (cuda/sm_partition.cuh): benchmarks only. Call before anything else uses CUDA.");
  ops.def("device_status", []() {
    ti::cuda::DeviceStatus s = ti::cuda::device_status();
    nb::dict d;
    d["usable"] = s.usable;
    d["count"] = s.count;
    d["name"] = s.name;
    d["compute_capability"] = std::to_string(s.cc_major) + "." + std::to_string(s.cc_minor);
    d["total_mem"] = s.total_mem;
    d["reason"] = s.reason;
    return d;
  });
  ops.def(
      "read_bandwidth",
      [](size_t bytes, int iters) {
        ti::cuda::BandwidthResult r;
        {
          nb::gil_scoped_release release;
          r = ti::cuda::measure_read_bandwidth(bytes, iters);
        }
        nb::dict d;
        d["gb_per_s"] = r.gb_per_s;
        d["bytes"] = r.bytes;
        d["best_ms"] = r.best_ms;
        d["blocks"] = r.blocks;
        d["sm_mhz"] = r.sm_mhz;
        return d;
      },
      "bytes"_a = (size_t)1 << 31, "iters"_a = 20,
      "Streaming-read bandwidth of GPU 0 (cuda/bandwidth.cu): best of `iters` passes over `bytes`.");
  ops.def(
      "kernel_chain_us",
      [](int kernels, int blocks, bool pdl, bool early) {
        nb::gil_scoped_release release;
        return ti::cuda::kernel_chain_us(kernels, blocks, pdl, early);
      },
      "kernels"_a = 200, "blocks"_a = 132, "pdl"_a = true, "early"_a = false,
      "Microseconds per kernel of a graph-replayed chain of dependent near-empty kernels (cuda/bandwidth.cu).");
  ops.def(
      "stream_read_xor",
      [](nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> a, int blocks) {
        if (blocks < 1) ti::fail(ti::ErrorKind::Request, "blocks must be >= 1");
        nb::gil_scoped_release release;
        return ti::cuda::stream_read_xor(a.data(), a.shape(0), blocks);
      },
      "data"_a, "blocks"_a, "Runs the bandwidth kernel over `data`; the XOR of all its 32-bit words.");
  bind_persistent_probe(ops);
  ops.def(
      "gemv",
      [](nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> W, F32In1 x, F32In1 norm_w,
         float eps, F32In1 y_init, int R, ti::cuda::GemvIn in, ti::cuda::GemvOut out, int grid) {
        const int rows = (int)W.shape(0), K = (int)W.shape(1);
        check_gemv_args("gemv", in, out, rows, K, x, norm_w, y_init);
        std::vector<float> y;
        {
          nb::gil_scoped_release release;
          y = ti::cuda::run_gemv(W.data(), rows, K, x.data(), norm_w.data(), eps, y_init.data(), R, in, out, grid);
        }
        return y;
      },
      "W_f16_bits"_a, "x"_a, "norm_w"_a, "eps"_a, "y_init"_a, "R"_a, "input"_a, "output"_a, "grid"_a = 0,
      "One GEMV launch (cuda/gemv.cu). input: GemvIn; output: GemvOut; grid: "
      "GemvParams.blocks_per_sm (0: a block per tile; n > 0: n per SM; n < 0: exactly -n blocks).");
  ops.def(
      "decode_attention",
      [](F32In1 qkv, U16Pages k_pages, U16Pages v_pages, I32In1 page_table, F32In2 cos, F32In2 sin, int pos,
         int n_heads, int chunk, bool tensor_cores) {
        const int max_seq = (int)cos.shape(0);
        if (pos < 0 || pos >= max_seq) ti::fail(ti::ErrorKind::Request, "attention: pos out of range");
        const ti::cuda::HostPages h =
            host_pages("attention", k_pages, v_pages, page_table.data(), (int)page_table.shape(0), max_seq);
        const int hd = h.head_dim;
        if ((int)qkv.shape(0) != (n_heads + 2 * h.n_kv_heads) * hd) ti::fail(ti::ErrorKind::Request, "attention: bad qkv length");
        if ((int)cos.shape(1) != hd / 2 || sin.shape(0) != cos.shape(0) || sin.shape(1) != cos.shape(1))
          ti::fail(ti::ErrorKind::Request, "attention: bad rope table");
        std::vector<float> o;
        {
          nb::gil_scoped_release release;
          o = ti::cuda::run_decode_attention(qkv.data(), h, cos.data(), sin.data(), pos, n_heads, max_seq, chunk,
                                             tensor_cores);
        }
        return o;
      },
      "qkv"_a, "k_pages"_a, "v_pages"_a, "page_table"_a, "cos"_a, "sin"_a, "pos"_a, "n_heads"_a, "chunk"_a,
      "tensor_cores"_a = true,
      "One decode-attention call (cuda/attention.cu) over a paged cache: pages (n_pages, n_kv_heads, page_size, "
      "head_dim) of fp16 bits, updated in place; the table covers max_seq = len(cos) positions.");
  ops.def(
      "decode_attention_rows",
      [](F32In2 qkv, U16Pages k_pages, U16Pages v_pages, I32In2 tables, F32In2 cos, F32In2 sin, I32In1 row_pos,
         I32In1 row_slot, int n_heads, int grid_x, int span, int heads, bool act8_out) {
        const int max_seq = (int)cos.shape(0), n_rows = (int)qkv.shape(0), n_slots = (int)tables.shape(0);
        const int stride = (int)tables.shape(1);
        if (n_rows < 1 || (int)row_pos.shape(0) != n_rows || (int)row_slot.shape(0) != n_rows)
          ti::fail(ti::ErrorKind::Request, "attention_rows: qkv, row_pos and row_slot need one row per row");
        ti::cuda::HostPages h{};
        for (int r = 0; r < n_rows; r++) {  // each live row's table checked up to its position
          const int pos = row_pos.data()[r], slot = row_slot.data()[r];
          if (pos >= max_seq || slot < 0 || slot >= n_slots)
            ti::fail(ti::ErrorKind::Request,
                     "attention_rows: row " + std::to_string(r) + ": position or slot out of range");
          h = host_pages("attention_rows", k_pages, v_pages, tables.data() + (size_t)slot * stride, stride,
                         pos < 0 ? 0 : pos + 1);
        }
        h.table = tables.data();
        h.table_len = n_slots * stride;
        const int hd = h.head_dim;
        if ((int)qkv.shape(1) != (n_heads + 2 * h.n_kv_heads) * hd)
          ti::fail(ti::ErrorKind::Request, "attention_rows: bad qkv width");
        if ((int)cos.shape(1) != hd / 2 || sin.shape(0) != cos.shape(0) || sin.shape(1) != cos.shape(1))
          ti::fail(ti::ErrorKind::Request, "attention_rows: bad rope table");
        std::vector<float> o;
        {
          nb::gil_scoped_release release;
          o = ti::cuda::run_decode_attention_rows(qkv.data(), h, stride, cos.data(), sin.data(), row_pos.data(),
                                                  row_slot.data(), n_rows, n_heads, max_seq, grid_x, span,
                                                  heads, act8_out);
        }
        return numpy_copy(o, (size_t)n_rows, (size_t)(n_heads * hd));
      },
      "qkv"_a, "k_pages"_a, "v_pages"_a, "tables"_a, "cos"_a, "sin"_a, "row_pos"_a, "row_slot"_a, "n_heads"_a,
      "grid_x"_a = 0, "span"_a = 0, "heads"_a = 0, "act8_out"_a = false,
      "One batched decode-attention call (cuda/attention_rows.cu): row r of qkv (n_rows, q_dim + 2 kv_dim) at "
      "position row_pos[r] (< 0: padding) through page table tables[row_slot[r]] (n_slots, pages) into the paged "
      "pools (updated in place); run twice; grid_x / span / heads / act8_out: DecodeAttnParams' (0: the engine's; "
      "act8_out: the output as fp16(d xq) per group of 32). Returns (n_rows, q_dim) float32 (padding rows NaN).");
  ops.def(
      "rope_rows",
      [](F32In2 qkv, U16Pages k_pages, U16Pages v_pages, I32In1 page_table, F32In2 cos, F32In2 sin, int pos0,
         int n_heads) {
        const int T = (int)qkv.shape(0);
        if (T < 1 || pos0 < 0 || (int64_t)pos0 + T > (int64_t)cos.shape(0))
          ti::fail(ti::ErrorKind::Request, "rope_rows: positions out of range of the rope table");
        const ti::cuda::HostPages h = host_pages("rope_rows", k_pages, v_pages, page_table.data(),
                                                 (int)page_table.shape(0), (int64_t)pos0 + T);
        const int hd = h.head_dim;
        if ((int)qkv.shape(1) != (n_heads + 2 * h.n_kv_heads) * hd)
          ti::fail(ti::ErrorKind::Request, "rope_rows: qkv must be (T, (n_heads + 2 n_kv_heads) head_dim)");
        if ((int)cos.shape(1) != hd / 2 || sin.shape(0) != cos.shape(0) || sin.shape(1) != cos.shape(1))
          ti::fail(ti::ErrorKind::Request, "rope_rows: bad rope table");
        std::vector<float> q;
        {
          nb::gil_scoped_release release;
          q = ti::cuda::run_rope_rows(qkv.data(), h, cos.data(), sin.data(), T, pos0, n_heads);
        }
        return numpy_copy(q, (size_t)T, (size_t)n_heads * hd);
      },
      "qkv"_a, "k_pages"_a, "v_pages"_a, "page_table"_a, "cos"_a, "sin"_a, "pos0"_a, "n_heads"_a,
      "The prefill's RoPE + cache write (cuda/prefill.cu) for T tokens at pos0..: rope(k), v into the pages "
      "(updated in place); returns rope(q) (T, n_heads * head_dim) from fp16.");
  ops.def(
      "quantize_gpu",
      [](F32In2 W, const FormatArg& f) {
        const ti::WFormat fmt = to_format(f);
        ti::cuda::QuantBytes b;
        {
          nb::gil_scoped_release release;
          b = ti::cuda::run_quantize(W.data(), (int)W.shape(0), (int)W.shape(1), fmt);
        }
        return quant_dict(b.q, b.scales, (int64_t)W.shape(0), b.ld, fmt, (int64_t)W.shape(1));
      },
      "W"_a, "format"_a, "The device quantizer (cuda/quant.cu) on W: {'q', 'scales'} as ops.quantize_ref gives.");
  ops.def(
      "dequantize_gpu",
      [](F32In2 W, const FormatArg& f) {
        const ti::WFormat fmt = to_format(f);
        std::vector<float> w;
        {
          nb::gil_scoped_release release;
          w = ti::cuda::run_dequantize(W.data(), (int)W.shape(0), (int)W.shape(1), fmt);
        }
        return numpy_copy(w, W.shape(0), W.shape(1));
      },
      "W"_a, "format"_a, "Quantize W on the device, dequantize to fp16 rows (the prefill's path): (rows, K) floats.");
  ops.def(
      "gemv_quant",
      [](F32In2 W, const FormatArg& f, F32In1 x, F32In1 norm_w, float eps, F32In1 y_init, int R,
         ti::cuda::GemvIn in, ti::cuda::GemvOut out, int grid, bool act8) {
        const int rows = (int)W.shape(0), K = (int)W.shape(1);
        const ti::WFormat fmt = to_format(f);
        check_gemv_args("gemv_quant", in, out, rows, K, x, norm_w, y_init);
        if (act8 && fmt == ti::WFormat::F16)
          ti::fail(ti::ErrorKind::Request, "gemv_quant: act8 is for int8 and int4 weights");
        std::vector<float> y;
        {
          nb::gil_scoped_release release;
          y = ti::cuda::run_gemv_quant(W.data(), rows, K, fmt, x.data(), norm_w.data(), eps, y_init.data(), R, in,
                                       out, grid, act8);
        }
        return y;
      },
      "W"_a, "format"_a, "x"_a, "norm_w"_a, "eps"_a, "y_init"_a, "R"_a, "input"_a, "output"_a, "grid"_a = 0,
      "act8"_a = false,
      "One quantized GEMV (cuda/gemv.cu) over W quantized on the device; grid as in gemv; act8: the input "
      "quantized to int8 per group of 32 (cuda/gemv_dot.cuh, kI8A8 / kI4A8).");
  ops.def(
      "gemv_batch",
      [](F32In2 W, const FormatArg& f, F32In2 X, F32In1 norm_w, float eps, F32In2 Y_init, ti::cuda::GemvIn in,
         ti::cuda::GemvOut out, bool mma, int m_tiles, bool smem_ring, bool one_row, bool act8) {
        const int rows = (int)W.shape(0), K = (int)W.shape(1), n = (int)X.shape(0);
        if ((int)X.shape(1) != K) ti::fail(ti::ErrorKind::Request, "gemv_batch: X.shape[1] != W.shape[1]");
        if (in == ti::cuda::GemvIn::F32Norm && (int)norm_w.shape(0) != K)
          ti::fail(ti::ErrorKind::Request, "gemv_batch: len(norm_w) != K");
        if (out == ti::cuda::GemvOut::AddF32 && ((int)Y_init.shape(0) != n || (int)Y_init.shape(1) != rows))
          ti::fail(ti::ErrorKind::Request, "gemv_batch: Y_init must be (n, rows)");
        const ti::WFormat fmt = to_format(f);
        std::vector<float> y;
        {
          nb::gil_scoped_release release;
          y = ti::cuda::run_gemv_batch(W.data(), rows, K, fmt, X.data(), n, norm_w.data(), eps, Y_init.data(), in,
                                       out, mma, m_tiles, smem_ring, one_row, act8);
        }
        return numpy_copy(y, (size_t)n, y.size() / (size_t)n);
      },
      "W"_a, "format"_a, "X"_a, "norm_w"_a, "eps"_a, "Y_init"_a, "input"_a, "output"_a, "mma"_a = false,
      "m_tiles"_a = 0, "smem_ring"_a = true, "one_row"_a = false, "act8"_a = false,
      "One small-N product over the rows of X: the CUDA-core cuda/gemv_batch.cu, or with mma the tensor-core "
      "cuda/mma_small_n.cu (n <= 64; f32norm: rmsnorm_rows first; m_tiles: its 16-row tiles per block, 0 auto; "
      "smem_ring: fp16 through "
      "its shared-memory ring, else its register ring; one_row: the decode step's one-row tensor-core kernel, "
      "cuda/mma_one_row.cu, n = 1, an f32norm row normed inside it); act8: the inputs rounded to fp16(d xq) per "
      "group of 32 first, as the batched step does for a product whose decode GEMV takes int8 inputs; "
      "W quantized on the device unless fp16: "
      "(n, rows) floats, (n, rows / 2) for swiglu.");
  ops.def("sm_count", [] { return ti::cuda::device_sm_count(); }, "The CUDA device's streaming multiprocessors.");
  ops.def(
      "rmsnorm_rows",
      [](F32In2 X, F32In1 w, float eps, bool in_registers, bool act8) {
        const int T = (int)X.shape(0), H = (int)X.shape(1);
        if ((int)w.shape(0) != H) ti::fail(ti::ErrorKind::Request, "rmsnorm_rows: len(w) != X.shape[1]");
        if (T < 1 || H < 1) ti::fail(ti::ErrorKind::Request, "rmsnorm_rows: X must have rows and columns");
        std::vector<float> y;
        {
          nb::gil_scoped_release release;
          y = ti::cuda::run_rmsnorm_rows(X.data(), T, H, w.data(), eps, in_registers, act8);
        }
        return numpy_copy(y, (size_t)T, (size_t)H);
      },
      "X"_a, "w"_a, "eps"_a, "in_registers"_a = true, "act8"_a = false,
      "cuda/prefill.cu's rmsnorm_rows over the rows of X: fp16(x / rms(x) * w) widened to floats; in_registers "
      "false takes the grid-stride kernel; act8 rounds the fp16 values to fp16(d xq) per group of 32 "
      "(cuda/act8.cuh).");
  ops.def(
      "act8_round_rows",
      [](F32In2 X) {
        const int T = (int)X.shape(0), K = (int)X.shape(1);
        std::vector<float> y;
        {
          nb::gil_scoped_release release;
          y = ti::cuda::run_act8_round_rows(X.data(), T, K);
        }
        return numpy_copy(y, (size_t)T, (size_t)K);
      },
      "X"_a,
      "cuda/batch_rows.cu's act8_round_rows over the rows of X rounded to fp16: each group of 32 as fp16(d xq), "
      "d = amax / 127, xq = round(x / d) (cuda/act8.cuh), widened to floats; K % 32 == 0.");
  ops.def(
      "gemm",
      [](nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> W, F32In2 X, F32In2 y_init,
         ti::cuda::GemmOut go, bool autotune) {
        const int M = (int)W.shape(0), K = (int)W.shape(1), N = (int)X.shape(0);
        if ((int)X.shape(1) != K) ti::fail(ti::ErrorKind::Request, "gemm: X.shape[1] != W.shape[1]");
        if (go == ti::cuda::GemmOut::AddF32 && ((int)y_init.shape(0) != N || (int)y_init.shape(1) != M))
          ti::fail(ti::ErrorKind::Request, "gemm: y_init must be (N, M)");
        std::vector<float> y;
        {
          nb::gil_scoped_release release;
          y = ti::cuda::run_gemm(W.data(), X.data(), y_init.data(), M, N, K, go, autotune);
        }
        float* o = nullptr;
        F32Out arr = new_f32_array(N, M, &o);
        std::copy(y.begin(), y.end(), o);
        return arr;
      },
      "W_f16_bits"_a, "X"_a, "y_init"_a, "output"_a, "autotune"_a = true,
      "One cuBLASLt GEMM (cuda/gemm.cu): X @ W.T (+ y_init for output GemmOut.AddF32).");
  ops.def(
      "sliced_residual_norm",
      [](nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> W, F32In2 X, F32In2 x_init,
         F32In1 norm_w, float eps, int slices, bool autotune) {
        const int M = (int)W.shape(0), K = (int)W.shape(1), N = (int)X.shape(0);
        if ((int)X.shape(1) != K) ti::fail(ti::ErrorKind::Request, "sliced_residual_norm: X.shape[1] != W.shape[1]");
        if ((int)x_init.shape(0) != N || (int)x_init.shape(1) != M || (int)norm_w.shape(0) != M)
          ti::fail(ti::ErrorKind::Request, "sliced_residual_norm: x_init must be (N, M), norm_w (M)");
        std::pair<std::vector<float>, std::vector<float>> r;
        {
          nb::gil_scoped_release release;
          r = ti::cuda::run_sliced_residual_norm(W.data(), X.data(), x_init.data(), norm_w.data(), eps, M, N, K,
                                                 slices, autotune);
        }
        return nb::make_tuple(numpy_copy(r.first, (size_t)N, (size_t)M), numpy_copy(r.second, (size_t)N, (size_t)M));
      },
      "W_f16_bits"_a, "X"_a, "x_init"_a, "norm_w"_a, "eps"_a, "slices"_a, "autotune"_a = true,
      "The batched step's down product in K slices (cuBLASLt, GemmArgs::k_slices) and residual_norm_rows after it "
      "(cuda/batch_rows.cuh): (x_init + X @ W.T, fp16(rmsnorm(that) * norm_w)).");
  ops.def(
      "prefill_attention",
      [](F32In2 q, U16Pages k_pages, U16Pages v_pages, I32In1 page_table, int pos0, int n_heads, int stages) {
        const int T = (int)q.shape(0);
        if (pos0 < 0) ti::fail(ti::ErrorKind::Request, "prefill_attention: positions out of range");
        const ti::cuda::HostPages h = host_pages("prefill_attention", k_pages, v_pages, page_table.data(),
                                                 (int)page_table.shape(0), (int64_t)pos0 + T);
        if ((int)q.shape(1) != n_heads * h.head_dim)
          ti::fail(ti::ErrorKind::Request, "prefill_attention: q must be (T, n_heads * head_dim)");
        std::vector<float> o;
        {
          nb::gil_scoped_release release;
          o = ti::cuda::run_prefill_attention(q.data(), h, T, pos0, n_heads, stages);
        }
        float* out = nullptr;
        F32Out arr = new_f32_array(T, (size_t)n_heads * h.head_dim, &out);
        std::copy(o.begin(), o.end(), out);
        return arr;
      },
      "q"_a, "k_pages"_a, "v_pages"_a, "page_table"_a, "pos0"_a, "n_heads"_a, "stages"_a = 0,
      "One prefill-attention call (cuda/prefill_attention.cu): T queries at pos0.. over a paged cache (pages "
      "(n_pages, n_kv_heads, page_size, head_dim) of fp16 bits); stages 1 | 2 forces that variant (0: the "
      "launcher's choice).");
  ops.def(
      "prefill_attention_varlen",
      [](F32In2 q, U16Pages k_pages, U16Pages v_pages, I32In2 tables, const std::vector<int>& seq_T,
         const std::vector<int>& seq_pos0, int n_heads, int stages) {
        auto bad = [](const std::string& m) { ti::fail(ti::ErrorKind::Request, "prefill_attention_varlen: " + m); };
        const int n = (int)seq_T.size(), row_len = (int)tables.shape(1);
        if (n < 1 || seq_pos0.size() != seq_T.size() || (int)tables.shape(0) != n)
          bad("one T, pos0 and table row per sequence (at least one)");
        int64_t rows = 0;
        for (int s = 0; s < n; s++) {
          if (seq_T[s] < 1 || seq_pos0[s] < 0) bad("every sequence needs T >= 1 and pos0 >= 0");
          rows += seq_T[s];
          // each row checked as the one-sequence op checks its table
          host_pages("prefill_attention_varlen", k_pages, v_pages, tables.data() + (size_t)s * row_len, row_len,
                     (int64_t)seq_pos0[s] + seq_T[s]);
        }
        ti::cuda::HostPages h =
            host_pages("prefill_attention_varlen", k_pages, v_pages, tables.data(), n * row_len, 0);
        if ((int64_t)q.shape(0) != rows || (int)q.shape(1) != n_heads * h.head_dim)
          bad("q must be (sum of T, n_heads * head_dim)");
        std::vector<float> o;
        {
          nb::gil_scoped_release release;
          o = ti::cuda::run_prefill_attention_varlen(q.data(), h, row_len, seq_T.data(), seq_pos0.data(), n,
                                                     n_heads, stages);
        }
        float* out = nullptr;
        F32Out arr = new_f32_array((size_t)rows, (size_t)n_heads * h.head_dim, &out);
        std::copy(o.begin(), o.end(), out);
        return arr;
      },
      "q"_a, "k_pages"_a, "v_pages"_a, "tables"_a, "seq_T"_a, "seq_pos0"_a, "n_heads"_a, "stages"_a = 0,
      "prefill_attention over many sequences in one launch (varlen): sequence s's seq_T[s] query rows follow "
      "the previous ones in q, sit at positions seq_pos0[s].. and read the pool through tables[s].");
  ops.def(
      "sample",
      [](F32In1 logits, float temperature, int top_k, float top_p, float min_p, float rep, unsigned long long seed,
         int step, nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> seen) {
        if (seen.shape(0) != logits.shape(0)) ti::fail(ti::ErrorKind::Request, "sample: len(seen) != vocab");
        nb::gil_scoped_release release;
        return ti::cuda::run_sample(logits.data(), (int)logits.shape(0), temperature, top_k, top_p, min_p, rep, seed,
                                    step, seen.data());
      },
      "logits"_a, "temperature"_a, "top_k"_a, "top_p"_a, "min_p"_a, "repetition_penalty"_a, "seed"_a, "step"_a,
      "seen"_a, "One on-device sampling call (cuda/sampling.cu).");
  ops.def(
      "sample_rows",
      [](F32In2 logits, const std::vector<ti::SamplingConfig>& cfgs, const std::vector<uint64_t>& steps,
         const std::vector<int64_t>& slots, nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> seen,
         nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> counts, int top_k, int64_t vocab) {
        auto bad = [](const std::string& m) { ti::fail(ti::ErrorKind::Request, "sample_rows: " + m); };
        const int64_t n = (int64_t)logits.shape(0), ld = (int64_t)logits.shape(1);
        if (vocab < 0) vocab = ld;
        if (n < 1 || vocab < 1 || vocab > ld) bad("logits must be (n_rows >= 1, ld >= vocab >= 1)");
        if ((int64_t)cfgs.size() != n || (int64_t)steps.size() != n || (int64_t)slots.size() != n)
          bad("cfgs, steps and slots need one entry per row");
        const int64_t n_slots = (int64_t)seen.shape(0);
        if ((int64_t)seen.shape(1) != vocab || counts.shape(0) != seen.shape(0) || (int64_t)counts.shape(1) != vocab)
          bad("seen and counts must both be (n_slots, vocab)");
        std::vector<ti::cuda::RowSampling> rows((size_t)n);
        std::vector<ti::cuda::LogitBias> bias;
        std::vector<uint32_t> masks;
        std::vector<char> taken((size_t)n_slots, 0);
        for (int64_t r = 0; r < n; r++) {
          ti::validate(cfgs[(size_t)r], vocab);
          const int64_t slot = slots[(size_t)r];
          if (slot < 0 || slot >= n_slots || taken[(size_t)slot]) bad("slots must be distinct, in 0..n_slots-1");
          taken[(size_t)slot] = 1;
          const ti::SamplingConfig& c = cfgs[(size_t)r];
          rows[(size_t)r] = {ti::device_sampling(c), steps[(size_t)r], (int)slot, (int)r, (int)bias.size(),
                             (int)masks.size()};
          bias.resize(bias.size() + c.bias_ids.size());
          ti::device_bias(c, bias.data() + bias.size() - c.bias_ids.size());
          masks.insert(masks.end(), c.allowed.begin(), c.allowed.end());
        }
        std::vector<uint8_t> seen_v(seen.data(), seen.data() + seen.size());
        std::vector<int32_t> counts_v(counts.data(), counts.data() + counts.size());
        ti::cuda::SampleRowsOut o;
        {
          nb::gil_scoped_release release;
          o = ti::cuda::run_sample_rows(logits.data(), ld, (int)n, (int)vocab, rows.data(), bias.data(),
                                        (int)bias.size(), masks.data(), (int)masks.size(), seen_v.data(),
                                        counts_v.data(), (int)n_slots, top_k);
        }
        nb::dict d;
        d["tokens"] = numpy_vec(o.tokens);
        d["logprob"] = numpy_vec(o.logprob);
        d["top_ids"] = numpy_copy(o.top_ids, (size_t)n, (size_t)top_k);
        d["top_lp"] = numpy_copy(o.top_lp, (size_t)n, (size_t)top_k);
        d["seen"] = numpy_copy(seen_v, (size_t)n_slots, (size_t)vocab);
        d["counts"] = numpy_copy(counts_v, (size_t)n_slots, (size_t)vocab);
        d["logits"] = numpy_copy(o.logits, (size_t)n, (size_t)ld);
        return d;
      },
      "logits"_a, "cfgs"_a, "steps"_a, "slots"_a, "seen"_a, "counts"_a, "top_k"_a = 0, "vocab"_a = -1,
      "One batched on-device sampling call (cuda/sampling.cu sample_rows): row r of logits (n_rows, ld; the "
      "first vocab columns, default all) with cfgs[r], steps[r], history slot slots[r] of seen (n_slots, vocab) "
      "uint8 and counts (n_slots, vocab) int32. Returns {'tokens', 'logprob', 'top_ids' (n_rows, top_k), "
      "'top_lp', 'seen', 'counts' (the histories after the call), 'logits' (the device's, after the call)}.");
#else
  ops.def("cuda_compiled", []() { return false; });
  ops.def(
      "restrict_to_sms",
      [](int) -> nb::dict { ti::fail(ti::ErrorKind::Device, "restrict_to_sms: tinyinfer was built without CUDA"); },
      "sms"_a);
  ops.def("device_status", []() {
    nb::dict d;
    d["usable"] = false;
    d["count"] = 0;
    d["reason"] = "tinyinfer was built without CUDA";
    return d;
  });
  ops.def(
      "read_bandwidth",
      [](size_t, int) -> nb::dict {
        ti::fail(ti::ErrorKind::Device, "read_bandwidth: tinyinfer was built without CUDA");
      },
      "bytes"_a = (size_t)1 << 31, "iters"_a = 20);
#endif
}

}  // namespace tinyinfer_bindings
