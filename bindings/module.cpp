// module.cpp — tinyinfer._core: nanobind bindings only. Type conversion and argument checks, no math.
//   ModelConfig, SamplingConfig   plain structs
//   WeightStore                   named tensors in (numpy arrays), checked fp32 weights
//   CpuEngine                     the reference engine
//   ops                           single operations / kernels on numpy arrays, for tests and benchmarks
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "../cpp/config.h"
#include "../cpp/cpu_engine.h"
#include "../cpp/errors.h"
#include "../cpp/kv_pages.h"
#include "../cpp/quant.h"
#include "../cpp/rope.h"
#include "../cpp/sampling.h"
#include "../cpp/weights.h"
#ifdef TINYINFER_WITH_CUDA
#include "../cpp/cuda_engine.h"
#include "../cuda/bandwidth.cuh"
#include "../cuda/device.cuh"
#include "../cuda/kernel_tests.cuh"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using F32Out = nb::ndarray<nb::numpy, float, nb::ndim<2>>;
using F32In2 = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32In1 = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

#ifdef TINYINFER_WITH_CUDA
// The GEMV test ops' mode strings and vector lengths, checked the same way for every weight format.
std::pair<ti::cuda::GemvIn, ti::cuda::GemvOut> gemv_modes(const char* who, const std::string& in,
                                                          const std::string& out, int rows, int K, const F32In1& x,
                                                          const F32In1& norm_w, const F32In1& y_init) {
  const std::string w = who;
  if ((int)x.shape(0) != K) ti::fail(ti::ErrorKind::Request, w + ": len(x) != W.shape[1]");
  const ti::cuda::GemvIn gi = in == "f32norm" ? ti::cuda::GemvIn::F32Norm : ti::cuda::GemvIn::F16;
  const ti::cuda::GemvOut go = out == "add" ? ti::cuda::GemvOut::AddF32
                               : out == "swiglu" ? ti::cuda::GemvOut::Swiglu : ti::cuda::GemvOut::F32;
  if (gi == ti::cuda::GemvIn::F32Norm && (int)norm_w.shape(0) != K)
    ti::fail(ti::ErrorKind::Request, w + ": len(norm_w) != K");
  if (go == ti::cuda::GemvOut::AddF32 && (int)y_init.shape(0) != rows)
    ti::fail(ti::ErrorKind::Request, w + ": len(y_init) != rows");
  return {gi, go};
}

using U16Pages = nb::ndarray<uint16_t, nb::ndim<4>, nb::c_contig, nb::device::cpu>;
using I32In1 = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A paged cache as the attention test ops take it (pools (n_pages, n_kv_heads, page_size, head_dim) of fp16 bits and
// a page table), checked: the pools agree in shape, page_size is a power of two, the table reaches n_positions
// and its entries for positions [0, n_positions) name pages of the pool.
ti::cuda::HostPages host_pages(const char* who, U16Pages& k, U16Pages& v, const I32In1& table, int64_t n_positions) {
  const std::string w = who;
  for (size_t d = 0; d < 4; d++)
    if (k.shape(d) != v.shape(d)) ti::fail(ti::ErrorKind::Request, w + ": k and v pages differ in shape");
  ti::cuda::HostPages h;
  h.k = k.data();
  h.v = v.data();
  h.table = table.data();
  h.table_len = (int)table.shape(0);
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
#endif

// The Python exception types of tinyinfer.errors, one per ti::ErrorKind (references kept for the process).
struct ErrorTypes {
  PyObject* model_format;
  PyObject* unsupported;
  PyObject* request;
  PyObject* device;
};

F32Out new_f32_array(size_t rows, size_t cols, float** data) {
  float* buf = new float[rows * cols];
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  *data = buf;
  return F32Out(buf, {rows, cols}, owner);
}

// A new numpy array owning a copy of `v`, reshaped (rows, cols).
template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<2>> numpy_copy(const std::vector<T>& v, size_t rows, size_t cols) {
  T* buf = new T[v.size() ? v.size() : 1];
  std::copy(v.begin(), v.end(), buf);
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<2>>(buf, {rows, cols}, owner);
}

// The packed matrix as numpy: q (rows, ld) uint8; int8 scales (rows, 1) float32; int4 (rows, K/32 * 2) fp16 bits.
nb::dict quant_dict(const std::vector<uint8_t>& q, const std::vector<uint8_t>& scale_bytes, int64_t rows, int64_t ld,
                    ti::WFormat f, int64_t K) {
  nb::dict d;
  d["q"] = numpy_copy(q, (size_t)rows, (size_t)ld);
  if (f == ti::WFormat::I8) {
    std::vector<float> sc((size_t)rows);
    std::memcpy(sc.data(), scale_bytes.data(), sc.size() * 4);
    d["scales"] = numpy_copy(sc, (size_t)rows, 1);
  } else {
    std::vector<uint16_t> sm(scale_bytes.size() / 2);
    std::memcpy(sm.data(), scale_bytes.data(), sm.size() * 2);
    d["scales"] = numpy_copy(sm, (size_t)rows, (size_t)(K / ti::kI4Group * 2));
  }
  return d;
}

std::vector<int32_t> to_ids(const std::vector<int64_t>& ids) {
  std::vector<int32_t> r(ids.size());
  for (size_t i = 0; i < ids.size(); i++) {
    if (ids[i] < INT32_MIN || ids[i] > INT32_MAX)
      ti::fail(ti::ErrorKind::Request, "token id " + std::to_string(ids[i]) + " is out of range");
    r[i] = (int32_t)ids[i];
  }
  return r;
}

void bind_errors(nb::module_& m) {
  static ErrorTypes types{PyExc_RuntimeError, PyExc_RuntimeError, PyExc_RuntimeError, PyExc_RuntimeError};
  // tinyinfer/__init__.py imports tinyinfer.errors before this module. Imported on its own instead (only
  // nanobind's stubgen does that, at build time) it must not import the package — that would load an installed
  // tinyinfer._core next to this one — so every kind stays a plain RuntimeError there.
  nb::dict modules = nb::borrow<nb::dict>(nb::module_::import_("sys").attr("modules"));
  if (modules.contains("tinyinfer.errors")) {
    nb::handle errors = modules["tinyinfer.errors"];
    types = ErrorTypes{errors.attr("ModelFormatError").inc_ref().ptr(),
                       errors.attr("UnsupportedModelError").inc_ref().ptr(),
                       errors.attr("InvalidRequestError").inc_ref().ptr(),
                       errors.attr("DeviceError").inc_ref().ptr()};
  }
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void* payload) {
        auto* t = static_cast<ErrorTypes*>(payload);
        try {
          std::rethrow_exception(p);
        } catch (const ti::Error& e) {
          PyObject* type = t->request;
          switch (e.kind()) {
            case ti::ErrorKind::ModelFormat: type = t->model_format; break;
            case ti::ErrorKind::Unsupported: type = t->unsupported; break;
            case ti::ErrorKind::Request: type = t->request; break;
            case ti::ErrorKind::Device: type = t->device; break;
          }
          PyErr_SetString(type, e.what());
        }
      },
      &types);
  (void)m;
}

void bind_config(nb::module_& m) {
  nb::class_<ti::ModelConfig>(m, "ModelConfig", "The shape of a Llama-family model (see cpp/config.h).")
      .def(nb::init<>())
      .def_rw("hidden", &ti::ModelConfig::hidden)
      .def_rw("intermediate", &ti::ModelConfig::intermediate)
      .def_rw("n_layers", &ti::ModelConfig::n_layers)
      .def_rw("n_heads", &ti::ModelConfig::n_heads)
      .def_rw("n_kv_heads", &ti::ModelConfig::n_kv_heads)
      .def_rw("head_dim", &ti::ModelConfig::head_dim)
      .def_rw("vocab", &ti::ModelConfig::vocab)
      .def_rw("rms_eps", &ti::ModelConfig::rms_eps)
      .def_rw("rope_theta", &ti::ModelConfig::rope_theta)
      .def_prop_rw(
          "rope_scaling", [](const ti::ModelConfig& c) { return std::string(ti::rope_scaling_name(c.rope_scaling)); },
          [](ti::ModelConfig& c, const std::string& s) {
            if (s == "none") c.rope_scaling = ti::RopeScaling::None;
            else if (s == "linear") c.rope_scaling = ti::RopeScaling::Linear;
            else if (s == "llama3") c.rope_scaling = ti::RopeScaling::Llama3;
            else ti::fail(ti::ErrorKind::Unsupported, "rope scaling '" + s + "' (supported: none, linear, llama3)");
          },
          "'none' | 'linear' | 'llama3'")
      .def_rw("rope_factor", &ti::ModelConfig::rope_factor)
      .def_rw("rope_low_freq_factor", &ti::ModelConfig::rope_low_freq_factor)
      .def_rw("rope_high_freq_factor", &ti::ModelConfig::rope_high_freq_factor)
      .def_rw("rope_original_max_pos", &ti::ModelConfig::rope_original_max_pos)
      .def_rw("tie_word_embeddings", &ti::ModelConfig::tie_word_embeddings)
      .def_rw("max_position_embeddings", &ti::ModelConfig::max_position_embeddings)
      .def_rw("bos_token_id", &ti::ModelConfig::bos_token_id)
      .def_rw("eos_token_ids", &ti::ModelConfig::eos_token_ids)
      .def_ro("q_dim", &ti::ModelConfig::q_dim)
      .def_ro("kv_dim", &ti::ModelConfig::kv_dim)
      .def_ro("group", &ti::ModelConfig::group)
      .def("validate", &ti::ModelConfig::validate, "Check every field and compute q_dim, kv_dim, group.")
      .def("__repr__", &ti::ModelConfig::to_string);

  nb::class_<ti::SamplingConfig>(m, "SamplingConfig")
      .def(nb::init<>())
      .def_rw("temperature", &ti::SamplingConfig::temperature)
      .def_rw("top_k", &ti::SamplingConfig::top_k)
      .def_rw("top_p", &ti::SamplingConfig::top_p)
      .def_rw("min_p", &ti::SamplingConfig::min_p)
      .def_rw("repetition_penalty", &ti::SamplingConfig::repetition_penalty)
      .def_rw("seed", &ti::SamplingConfig::seed)
      .def("validate", [](const ti::SamplingConfig& s) { ti::validate(s); });
}

// forward / decode / state: the same Python surface for every engine class.
template <typename E, typename Cls>
void bind_engine_common(Cls& cls) {
  cls.def_prop_ro("config", &E::config)
      .def_prop_ro("max_seq_len", &E::max_seq_len)
      .def_prop_ro("position", &E::position)
      .def_prop_ro("tokens", [](const E& e) { return e.tokens(); })
      .def("reset", &E::reset)
      .def(
          "forward",
          [](E& e, const std::vector<int64_t>& tokens, bool all_logits) {
            std::vector<int32_t> ids = to_ids(tokens);
            if (ids.empty()) ti::fail(ti::ErrorKind::Request, "forward: no tokens given");
            const size_t rows = all_logits ? ids.size() : 1;
            float* out = nullptr;
            F32Out arr = new_f32_array(rows, (size_t)e.config().vocab, &out);
            {
              nb::gil_scoped_release release;
              e.forward(ids.data(), (int64_t)ids.size(), all_logits, out);
            }
            return arr;
          },
          "tokens"_a, "all_logits"_a = false,
          "Run tokens at the current position; logits (len(tokens) or 1, vocab) float32.")
      .def(
          "decode",
          [](E& e, int64_t max_steps, const ti::SamplingConfig& s, const std::vector<int64_t>& stop_ids,
             uint64_t step0) {
            std::vector<int32_t> stops = to_ids(stop_ids);
            nb::gil_scoped_release release;
            return e.decode(max_steps, s, stops, step0);
          },
          "max_steps"_a, "sampling"_a, "stop_ids"_a, "step0"_a = 0,
          "Sample and run up to max_steps tokens; stops after a stop id (included).");
}

// The paged KV cache's host bookkeeping (cpp/kv_pages.h), bound for its CPU tests and a later scheduler.
void bind_kv_pages(nb::module_& m) {
  nb::class_<ti::KvPagePool>(m, "KvPagePool", "A pool of KV-cache page ids with a free list.")
      .def(nb::init<int64_t, int, uint64_t>(), "n_pages"_a, "page_size"_a, "shuffle_seed"_a = 0)
      .def_prop_ro("page_size", &ti::KvPagePool::page_size)
      .def_prop_ro("n_pages", &ti::KvPagePool::n_pages)
      .def_prop_ro("free_pages", &ti::KvPagePool::free_pages)
      .def("pages_for", &ti::KvPagePool::pages_for, "positions"_a);
  nb::class_<ti::KvSequence>(m, "KvSequence", "One sequence's page table over a KvPagePool.")
      .def(nb::init<const ti::KvPagePool&, int64_t>(), "pool"_a, "max_positions"_a)
      .def("grow", &ti::KvSequence::grow, "pool"_a, "positions"_a,
           "Cover positions [0, positions) with pages; returns the first table index that changed.")
      .def("release", &ti::KvSequence::release, "pool"_a)
      .def_prop_ro("table", &ti::KvSequence::table)
      .def_prop_ro("max_pages", &ti::KvSequence::max_pages);
}

void bind_engine(nb::module_& m) {
  nb::class_<ti::WeightStore>(m, "WeightStore", "Named host tensors in, checked fp32 weights out.")
      .def(nb::init<const ti::ModelConfig&>(), "config"_a)
      .def(
          "add",
          [](ti::WeightStore& w, const std::string& name, nb::ndarray<nb::c_contig, nb::device::cpu, nb::ro> a,
             const std::string& dtype) {
            const ti::DType t = ti::dtype_from_string(dtype);
            if (a.itemsize() != ti::dtype_size(t))
              ti::fail(ti::ErrorKind::Request, "tensor '" + name + "': array item size " +
                                                   std::to_string(a.itemsize()) + " does not match dtype " + dtype);
            std::vector<int64_t> shape(a.ndim());
            for (size_t i = 0; i < a.ndim(); i++) shape[i] = (int64_t)a.shape(i);
            nb::gil_scoped_release release;
            w.add(name, t, a.data(), shape);
          },
          "name"_a, "array"_a, "dtype"_a,
          "Copy one tensor in. dtype: 'f32' | 'f16' | 'bf16' (bf16 passed as a uint16 array).")
      .def("finish", &ti::WeightStore::finish)
      .def(
          "quantize", [](ti::WeightStore& w, const std::string& f) { w.quantize(ti::wformat_from_string(f)); },
          "format"_a, nb::call_guard<nb::gil_scoped_release>(),
          "The CPU engine's view of a quantized model: every matrix := dequantize(quantize(fp16(w))).")
      .def_prop_ro("format", [](const ti::WeightStore& w) { return ti::to_string(w.format()); })
      .def(
          "add_int4",
          [](ti::WeightStore& w, const std::string& name,
             nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> q,
             nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> sm) {
            const int64_t rows = (int64_t)q.shape(0), K = (int64_t)q.shape(1) * 2;
            if ((int64_t)sm.shape(0) != rows || (int64_t)sm.shape(1) != K / ti::kI4Group * 2)
              ti::fail(ti::ErrorKind::Request, "add_int4 '" + name + "': sm must be (rows, K / 32 * 2)");
            w.add_int4(name, q.data(), sm.data(), rows, K);
          },
          "name"_a, "q"_a, "sm"_a,
          "An already-int4 matrix (cpp/quant.h layout; a GGUF Q4_0/Q4_1 tensor converted block for block).")
      .def("is_imported", [](const ti::WeightStore& w, const std::string& n) { return w.imported(n) != nullptr; })
      .def("expected_shape", &ti::WeightStore::expected_shape, "name"_a)
      .def("required_names", &ti::WeightStore::required_names)
      .def_prop_ro("config", &ti::WeightStore::config);

  auto cpu = nb::class_<ti::CpuEngine>(m, "CpuEngine", "The fp32 reference engine (one sequence).");
  cpu.def(nb::init<std::shared_ptr<const ti::WeightStore>, int64_t>(), "weights"_a, "max_seq_len"_a);
  bind_engine_common<ti::CpuEngine>(cpu);

#ifdef TINYINFER_WITH_CUDA
  nb::class_<ti::CudaOptions>(m, "CudaOptions")
      .def(nb::init<>())
      .def_rw("pdl", &ti::CudaOptions::pdl)
      .def_rw("early_trigger", &ti::CudaOptions::early_trigger)
      .def_rw("trace", &ti::CudaOptions::trace)
      .def_rw("graphs", &ti::CudaOptions::graphs)
      .def_rw("attn_chunk", &ti::CudaOptions::attn_chunk)
      .def_rw("gemv_rows", &ti::CudaOptions::gemv_rows)
      .def_rw("gemv_grid", &ti::CudaOptions::gemv_grid)
      .def_rw("gemv_resident_margin", &ti::CudaOptions::gemv_resident_margin)
      .def_rw("gemv_small_tiles", &ti::CudaOptions::gemv_small_tiles)
      .def_rw("gemv_force", &ti::CudaOptions::gemv_force)
      .def_rw("decode_long_from", &ti::CudaOptions::decode_long_from)
      .def_rw("batched_prefill", &ti::CudaOptions::batched_prefill)
      .def_rw("prefill_chunk", &ti::CudaOptions::prefill_chunk)
      .def_rw("gemm_autotune", &ti::CudaOptions::gemm_autotune)
      .def_rw("kv_page_size", &ti::CudaOptions::kv_page_size)
      .def_rw("kv_pool_pages", &ti::CudaOptions::kv_pool_pages)
      .def_rw("kv_page_shuffle", &ti::CudaOptions::kv_page_shuffle)
      .def_prop_rw(
          "weights", [](const ti::CudaOptions& o) { return ti::to_string(o.weights); },
          [](ti::CudaOptions& o, const std::string& f) { o.weights = ti::wformat_from_string(f); },
          "The matrices' format on the device: 'fp16' | 'int8' | 'int4' (quantized at load).");
  auto gpu = nb::class_<ti::CudaEngine>(m, "CudaEngine", "The GPU engine: fp16 weights, graph-replayed decode.");
  // (a reference, not a shared_ptr: a shared_ptr to a Python-owned store dying inside the constructor would
  // drop a Python reference with the GIL released)
  gpu.def(nb::init<const ti::WeightStore&, int64_t, ti::CudaOptions>(), "weights"_a,
          "max_seq_len"_a, "options"_a = ti::CudaOptions(), nb::call_guard<nb::gil_scoped_release>())
      .def_static(
          "random",
          [](const ti::ModelConfig& c, int64_t max_seq_len, uint64_t seed, ti::CudaOptions opt) {
            nb::gil_scoped_release release;
            return new ti::CudaEngine(c, max_seq_len, seed, opt);
          },
          "config"_a, "max_seq_len"_a, "seed"_a = 0, "options"_a = ti::CudaOptions(),
          nb::rv_policy::take_ownership, "Random fp16 weights at the config's shape, made on the GPU (benchmarks).")
      .def_prop_ro("last_decode_ms", &ti::CudaEngine::last_decode_ms)
      .def_prop_ro("weight_bytes", &ti::CudaEngine::weight_bytes)
      .def_prop_ro("kv_cache_bytes", &ti::CudaEngine::kv_cache_bytes)
      .def_prop_ro("scratch_bytes", &ti::CudaEngine::scratch_bytes)
      .def_prop_ro("kv_pages",
                   [](const ti::CudaEngine& e) {
                     const auto [size, pool, used] = e.kv_pages();
                     return nb::make_tuple(size, pool, used);
                   },
                   "The paged KV cache: (positions per page, pages in the pool, pages the sequence holds).")
      .def_prop_ro("uses_pdl", &ti::CudaEngine::uses_pdl)
      .def_prop_ro("uses_graphs", &ti::CudaEngine::uses_graphs)
      .def_prop_ro("decode_long",
                   [](const ti::CudaEngine& e) {
                     const auto [from, R, bps] = e.decode_long();
                     return nb::make_tuple(from, R, bps);
                   },
                   "The long-context decode graph: (from context, qkv R, qkv blocks per SM); from = -1: none.")
      .def_prop_ro("device_name", &ti::CudaEngine::device_name)
      .def("gemv_table",
           [](const ti::CudaEngine& e) {
             nb::list out;
             for (const ti::GemvChoice& g : e.gemv_table()) {
               nb::dict d;
               d["name"] = g.name;
               d["rows"] = g.rows;
               d["K"] = g.K;
               d["copies"] = g.copies;
               d["R"] = g.R;
               d["blocks_per_sm"] = g.blocks_per_sm;
               d["tried_R"] = g.tried_R;
               d["tried_blocks_per_sm"] = g.tried_bps;
               d["us"] = g.us;
               d["gb_per_s"] = g.gb_per_s;
               out.append(d);
             }
             return out;
           })
      .def("gemm_table",
           [](const ti::CudaEngine& e) {
             nb::list out;
             for (const auto& [name, t] : e.gemm_table()) {
               nb::dict d;
               d["name"] = name;
               d["M"] = t.M;
               d["N"] = t.N;
               d["K"] = t.K;
               d["out"] = t.out == ti::cuda::GemmOut::F16 ? "f16" : t.out == ti::cuda::GemmOut::AddF32 ? "add_f32" : "f32";
               d["candidates"] = t.candidates;
               d["default_us"] = t.default_us;
               d["tuned_us"] = t.tuned_us;
               d["chosen"] = t.chosen;
               d["algo"] = t.algo;
               d["offered"] = t.offered;
               d["from_file"] = t.from_file;
               out.append(d);
             }
             return out;
           },
           "Every GEMM shape tuned so far: cuBLASLt's default vs the fastest candidate (µs, at the bucket's N).")
      .def_prop_ro("batched_prefill", &ti::CudaEngine::batched_prefill)
      .def("save_tactics", &ti::CudaEngine::save_tactics, "The tuned GEMM tactics as text (see load_tactics).")
      .def("load_tactics", &ti::CudaEngine::load_tactics, "text"_a,
           "Restore tactics saved by save_tactics (entries cuBLASLt still accepts); returns how many.")
      .def_prop_ro("tuned_gemms", &ti::CudaEngine::tuned_gemms)
      .def_static("gemm_fingerprint", &ti::cuda::Gemm::fingerprint,
                  "What saved tactics are valid for: the cuBLASLt version and the GPU.")
      .def("time_prefill", &ti::CudaEngine::time_prefill, "n_tokens"_a, "reps"_a,
           nb::call_guard<nb::gil_scoped_release>(), "GPU ms of one prefill of n_tokens at position 0 (resets).")
      .def("time_decode_step", &ti::CudaEngine::time_decode_step, "context"_a, "steps"_a,
           nb::call_guard<nb::gil_scoped_release>(), "GPU ms per graph-replayed decode step at this context.")
      .def(
          "trace_step",
          [](ti::CudaEngine& e, int64_t context) {
            auto [names, t] = e.trace_step(context);
            const size_t per = names.empty() ? 0 : t.size() / names.size();
            nb::list out;
            for (size_t k = 0; k < names.size(); k++)
              out.append(nb::make_tuple(names[k], std::vector<uint64_t>(t.begin() + k * per, t.begin() + (k + 1) * per)));
            return out;
          },
          "context"_a,
          "CudaOptions.trace engines: one decode step; per kernel (name, kTraceBlocks x 4 global-timer ns: start, "
          "after the PDL wait, after the prologue, end; 0 = block absent).")
      .def("time_attention", &ti::CudaEngine::time_attention, "context"_a, "reps"_a,
           nb::call_guard<nb::gil_scoped_release>(), "GPU µs of one layer's decode attention at this context.");
  bind_engine_common<ti::CudaEngine>(gpu);
#endif
}

void bind_ops(nb::module_& m) {
  nb::module_ ops = m.def_submodule("ops", "Single operations on numpy arrays, for tests and benchmarks.");
  ops.def("rope_inv_freq", &ti::rope_inv_freq, "config"_a, "The (head_dim/2) scaled RoPE inverse frequencies.");
  ops.def(
      "quantize_ref",
      [](F32In2 W, const std::string& f) {
        const ti::WFormat fmt = ti::wformat_from_string(f);
        ti::QuantMatrix m = ti::quantize(fmt, W.data(), (int64_t)W.shape(0), (int64_t)W.shape(1));
        std::vector<uint8_t> sc(fmt == ti::WFormat::I8 ? m.scale.size() * 4 : m.sm.size() * 2);
        if (fmt == ti::WFormat::I8) std::memcpy(sc.data(), m.scale.data(), sc.size());
        else std::memcpy(sc.data(), m.sm.data(), sc.size());
        return quant_dict(m.q, sc, m.rows, m.ld, fmt, m.K);
      },
      "W"_a, "format"_a, "The reference packer (cpp/quant.cpp): {'q': (rows, ld) uint8, 'scales': ...}.");
  ops.def(
      "dequantize_ref",
      [](F32In2 W, const std::string& f) {
        std::vector<float> w(W.data(), W.data() + W.size());
        ti::quantize_dequantize(ti::wformat_from_string(f), w.data(), (int64_t)W.shape(0), (int64_t)W.shape(1));
        return numpy_copy(w, W.shape(0), W.shape(1));
      },
      "W"_a, "format"_a, "dequantize(quantize(fp16(W))): the numbers the CPU engine computes with.");
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

#ifdef TINYINFER_WITH_CUDA
  ops.def("cuda_compiled", []() { return true; });
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
  ops.def(
      "gemv",
      [](nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> W, F32In1 x, F32In1 norm_w,
         float eps, F32In1 y_init, int R, const std::string& in, const std::string& out, int grid) {
        const int rows = (int)W.shape(0), K = (int)W.shape(1);
        const auto [gi, go] = gemv_modes("gemv", in, out, rows, K, x, norm_w, y_init);
        std::vector<float> y;
        {
          nb::gil_scoped_release release;
          y = ti::cuda::run_gemv(W.data(), rows, K, x.data(), norm_w.data(), eps, y_init.data(), R, gi, go, grid);
        }
        return y;
      },
      "W_f16_bits"_a, "x"_a, "norm_w"_a, "eps"_a, "y_init"_a, "R"_a, "input"_a, "output"_a, "grid"_a = 0,
      "One GEMV launch (cuda/gemv.cu). input: 'f16' | 'f32norm'; output: 'f32' | 'add' | 'swiglu'; grid: "
      "GemvParams.blocks_per_sm (0: a block per tile; n > 0: n per SM; n < 0: exactly -n blocks).");
  ops.def(
      "decode_attention",
      [](F32In1 qkv, U16Pages k_pages, U16Pages v_pages, I32In1 page_table, F32In2 cos, F32In2 sin, int pos,
         int n_heads, int chunk) {
        const int max_seq = (int)cos.shape(0);
        if (pos < 0 || pos >= max_seq) ti::fail(ti::ErrorKind::Request, "attention: pos out of range");
        const ti::cuda::HostPages h = host_pages("attention", k_pages, v_pages, page_table, max_seq);
        const int hd = h.head_dim;
        if ((int)qkv.shape(0) != (n_heads + 2 * h.n_kv_heads) * hd) ti::fail(ti::ErrorKind::Request, "attention: bad qkv length");
        if ((int)cos.shape(1) != hd / 2 || sin.shape(0) != cos.shape(0) || sin.shape(1) != cos.shape(1))
          ti::fail(ti::ErrorKind::Request, "attention: bad rope table");
        std::vector<float> o;
        {
          nb::gil_scoped_release release;
          o = ti::cuda::run_decode_attention(qkv.data(), h, cos.data(), sin.data(), pos, n_heads, max_seq, chunk);
        }
        return o;
      },
      "qkv"_a, "k_pages"_a, "v_pages"_a, "page_table"_a, "cos"_a, "sin"_a, "pos"_a, "n_heads"_a, "chunk"_a,
      "One decode-attention call (cuda/attention.cu) over a paged cache: pages (n_pages, n_kv_heads, page_size, "
      "head_dim) of fp16 bits, updated in place; the table covers max_seq = len(cos) positions.");
  ops.def(
      "rope_rows",
      [](F32In2 qkv, U16Pages k_pages, U16Pages v_pages, I32In1 page_table, F32In2 cos, F32In2 sin, int pos0,
         int n_heads) {
        const int T = (int)qkv.shape(0);
        if (T < 1 || pos0 < 0 || (int64_t)pos0 + T > (int64_t)cos.shape(0))
          ti::fail(ti::ErrorKind::Request, "rope_rows: positions out of range of the rope table");
        const ti::cuda::HostPages h = host_pages("rope_rows", k_pages, v_pages, page_table, (int64_t)pos0 + T);
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
      [](F32In2 W, const std::string& f) {
        const ti::WFormat fmt = ti::wformat_from_string(f);
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
      [](F32In2 W, const std::string& f) {
        std::vector<float> w;
        {
          nb::gil_scoped_release release;
          w = ti::cuda::run_dequantize(W.data(), (int)W.shape(0), (int)W.shape(1), ti::wformat_from_string(f));
        }
        return numpy_copy(w, W.shape(0), W.shape(1));
      },
      "W"_a, "format"_a, "Quantize W on the device, dequantize to fp16 rows (the prefill's path): (rows, K) floats.");
  ops.def(
      "gemv_quant",
      [](F32In2 W, const std::string& f, F32In1 x, F32In1 norm_w, float eps, F32In1 y_init, int R,
         const std::string& in, const std::string& out, int grid) {
        const int rows = (int)W.shape(0), K = (int)W.shape(1);
        const auto [gi, go] = gemv_modes("gemv_quant", in, out, rows, K, x, norm_w, y_init);
        std::vector<float> y;
        {
          nb::gil_scoped_release release;
          y = ti::cuda::run_gemv_quant(W.data(), rows, K, ti::wformat_from_string(f), x.data(), norm_w.data(), eps,
                                       y_init.data(), R, gi, go, grid);
        }
        return y;
      },
      "W"_a, "format"_a, "x"_a, "norm_w"_a, "eps"_a, "y_init"_a, "R"_a, "input"_a, "output"_a, "grid"_a = 0,
      "One quantized GEMV (cuda/gemv.cu) over W quantized on the device; grid as in gemv.");
  ops.def(
      "gemm",
      [](nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> W, F32In2 X, F32In2 y_init,
         const std::string& out, bool autotune) {
        const int M = (int)W.shape(0), K = (int)W.shape(1), N = (int)X.shape(0);
        if ((int)X.shape(1) != K) ti::fail(ti::ErrorKind::Request, "gemm: X.shape[1] != W.shape[1]");
        const ti::cuda::GemmOut go = out == "add" ? ti::cuda::GemmOut::AddF32
                                     : out == "f16" ? ti::cuda::GemmOut::F16 : ti::cuda::GemmOut::F32;
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
      "One cuBLASLt GEMM (cuda/gemm.cu): X @ W.T (+ y_init for output 'add'); output 'f32' | 'add' | 'f16'.");
  ops.def(
      "prefill_attention",
      [](F32In2 q, U16Pages k_pages, U16Pages v_pages, I32In1 page_table, int pos0, int n_heads, int stages) {
        const int T = (int)q.shape(0);
        if (pos0 < 0) ti::fail(ti::ErrorKind::Request, "prefill_attention: positions out of range");
        const ti::cuda::HostPages h = host_pages("prefill_attention", k_pages, v_pages, page_table, (int64_t)pos0 + T);
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
#else
  ops.def("cuda_compiled", []() { return false; });
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

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "tinyinfer's C++/CUDA core (private: use the tinyinfer package)";
  bind_errors(m);
  bind_config(m);
  bind_kv_pages(m);
  bind_engine(m);
  bind_ops(m);
  nb::dict info;
  info["cuda"] = nb::bool_(
#ifdef TINYINFER_WITH_CUDA
      true
#else
      false
#endif
  );
  info["cuda_architectures"] = TINYINFER_CUDA_ARCHS;
  info["no_cuda_reason"] = TINYINFER_NO_CUDA_REASON;  // empty in a CUDA build
  info["openmp"] = nb::bool_(
#ifdef _OPENMP
      true
#else
      false
#endif
  );
  info["version"] = TINYINFER_VERSION;
  m.attr("build_info") = info;
}
