// decode_persistent.cu — the persistent decode step's host side (see decode_persistent.h).
#include "decode_persistent.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "../../cuda/common.cuh"
#include "../../cuda/sync.cuh"
#include "../core/errors.h"

namespace ti {

const char* decode_path_name(DecodePath p) {
  switch (p) {
    case DecodePath::Graph: return "graph";
    case DecodePath::Persistent: return "persistent";
    case DecodePath::Auto: return "auto";
  }
  return "?";
}

std::string PersistentDecode::unsupported(const ModelConfig& c, const DeviceWeights& w, const DecodeBuffers& b) {
  (void)w;  // fp16, int8 and int4 matrices all run (gemv_dot.cuh's dot products)
  if (c.head_dim % 2 || c.head_dim > 256) return "the persistent decode step needs an even head_dim <= 256";
  if (b.attn_chunk > 128) return "the persistent decode step needs attn_chunk <= 128";
  if (b.kv_layer_elems >= (size_t)1 << 31)  // (its attention keeps a chunk's cache rows as int offsets)
    return "the persistent decode step needs a KV cache of < 2^31 elements per layer";
  return "";
}

PersistentDecode::PersistentDecode(const ModelConfig& c, const DeviceWeights& w, const DecodeBuffers& b,
                                   const PersistentOptions& o, DeviceArena& arena, cudaStream_t s) {
  using Kind = DeviceArena::Kind;
  cuda::PersistentParams& p = p_;
  p.prefetch = o.prefetch;
  p.fused_merge = o.fused_merge;
  p.timeout_ns = (unsigned long long)o.timeout_ms * 1000000ull;
  p.hidden = (int)c.hidden;
  p.q_dim = (int)c.q_dim;
  p.kv_dim = (int)c.kv_dim;
  p.intermediate = (int)c.intermediate;
  p.n_heads = (int)c.n_heads;
  p.n_kv_heads = (int)c.n_kv_heads;
  p.head_dim = (int)c.head_dim;
  p.vocab = (int)c.vocab;
  p.ld_h = w.ld_h;
  p.eps = (float)c.rms_eps;
  p.scale = 1.0f / std::sqrt((float)c.head_dim);
  p.x = b.x;
  p.qkv = b.qkv;
  p.att = b.att;
  p.h = b.h;
  p.logits = b.logits;
  p.part_o = b.part_o;
  p.part_ml = b.part_ml;
  p.rope_cos = b.rope_cos;
  p.rope_sin = b.rope_sin;
  p.k_pages = b.k_pages;
  p.v_pages = b.v_pages;
  p.kv_layer_elems = b.kv_layer_elems;
  p.page_table = b.page_table;
  p.page_shift = b.page_shift;
  p.chunk = b.attn_chunk;
  p.max_chunks = (int)((b.max_seq + b.attn_chunk - 1) / b.attn_chunk);
  p.state = b.state;
  p.embedding = w.embedding;
  p.lm_head = w.lm_head;
  p.final_norm = w.final_norm;
  // the widest staged input (halves): I4 rows of ld bytes span 2 ld weights
  auto staged = [](const cuda::QMat& m) { return m.fmt == WFormat::I4 ? 2 * m.ld : m.ld; };
  p.stage_max = staged(w.lm_head);
  for (const DeviceLayer& L : w.layers)
    for (const cuda::QMat* m : {&L.qkv, &L.o, &L.gate_up, &L.down}) p.stage_max = std::max(p.stage_max, staged(*m));

  // The co-resident grid: at most o.blocks_per_sm per SM (default 2; more blocks, more participants in every
  // hand-off, fewer rows each).
  const size_t smem = cuda::persistent_smem(p);
  max_coresident_ = cuda::persistent_max_coresident(smem);
  int dev = 0, sms = 0;
  TI_CUDA_CHECK(cudaGetDevice(&dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (max_coresident_ < 1)
    fail(ErrorKind::Unsupported, "persistent decode: no block of " + std::to_string(smem) +
                                     " bytes of shared memory fits an SM");
  ScheduleShape shape;
  shape.hidden = p.hidden;
  shape.q_dim = p.q_dim;
  shape.kv_dim = p.kv_dim;
  shape.intermediate = p.intermediate;
  shape.n_layers = (int)c.n_layers;
  shape.n_heads = p.n_heads;
  shape.n_kv_heads = p.n_kv_heads;
  shape.vocab = p.vocab;
  shape.max_chunks = p.max_chunks;
  shape.grid = std::min(max_coresident_, o.blocks_per_sm * sms);
  shape.fused_merge = o.fused_merge;
  sched_ = build_persistent_schedule(shape);
  check_persistent_schedule(sched_, max_coresident_);

  // Upload: the tasks flattened with per-block offsets, the layers' pointers, the synchronisation words.
  std::vector<PTask> tasks;
  std::vector<int> begin(1, 0);
  for (const auto& list : sched_.blocks) {
    tasks.insert(tasks.end(), list.begin(), list.end());
    begin.push_back((int)tasks.size());
  }
  std::vector<cuda::PLayer> layers;
  for (const DeviceLayer& L : w.layers)
    layers.push_back(cuda::PLayer{L.qkv, L.o, L.gate_up, L.down, L.attn_norm, L.mlp_norm});
  PTask* d_tasks = arena.alloc_n<PTask>(tasks.size(), Kind::Scratch);
  int* d_begin = arena.alloc_n<int>(begin.size(), Kind::Scratch);
  cuda::PLayer* d_layers = arena.alloc_n<cuda::PLayer>(layers.size(), Kind::Scratch);
  TI_CUDA_CHECK(cudaMemcpy(d_tasks, tasks.data(), tasks.size() * sizeof(PTask), cudaMemcpyHostToDevice));
  TI_CUDA_CHECK(cudaMemcpy(d_begin, begin.data(), begin.size() * sizeof(int), cudaMemcpyHostToDevice));
  TI_CUDA_CHECK(cudaMemcpy(d_layers, layers.data(), layers.size() * sizeof(cuda::PLayer), cudaMemcpyHostToDevice));
  if (b.trace) {  // (a TINYINFER_TRACE build stamps them; another leaves zeros)
    p.trace = arena.alloc_n<unsigned long long>(tasks.size() * cuda::kTaskStamps, Kind::Scratch);
    clear_trace(s);
  }
  p.tasks = d_tasks;
  p.begin = d_begin;
  p.layers = d_layers;
  // counters (one 128-byte line each), then epoch, finish and the 3 error words on lines of their own, then the
  // fused merge's arrival counts (one word per layer and KV head): all zeroed together (check() after an error)
  const size_t counter_words = (size_t)sched_.n_counters * cuda::sync::kCounterStride;
  const size_t arrival_words = (size_t)c.n_layers * c.n_kv_heads;
  sync_words_ = counter_words + 3 * cuda::sync::kCounterStride + arrival_words;
  sync_base_ = arena.alloc_n<uint32_t>(sync_words_, Kind::Scratch);
  TI_CUDA_CHECK(cudaMemsetAsync(sync_base_, 0, sync_words_ * sizeof(uint32_t), s));
  p.counters = sync_base_;
  p.epoch = sync_base_ + counter_words;
  p.finish = p.epoch + cuda::sync::kCounterStride;
  p.error = p.finish + cuda::sync::kCounterStride;
  p.arrivals = p.error + cuda::sync::kCounterStride;
  TI_CUDA_CHECK(cudaStreamSynchronize(s));
}

void PersistentDecode::record(cudaStream_t s) const { cuda::persistent_step(p_, sched_.grid, s); }

void PersistentDecode::skew_epoch(int by, cudaStream_t s) const {
  uint32_t e = 0;
  TI_CUDA_CHECK(cudaMemcpyAsync(&e, p_.epoch, sizeof(e), cudaMemcpyDeviceToHost, s));
  TI_CUDA_CHECK(cudaStreamSynchronize(s));
  e += (uint32_t)by;
  TI_CUDA_CHECK(cudaMemcpyAsync(p_.epoch, &e, sizeof(e), cudaMemcpyHostToDevice, s));
  TI_CUDA_CHECK(cudaStreamSynchronize(s));
}

void PersistentDecode::clear_trace(cudaStream_t s) const {
  if (p_.trace)
    TI_CUDA_CHECK(cudaMemsetAsync(p_.trace, 0, sched_.n_tasks() * cuda::kTaskStamps * sizeof(*p_.trace), s));
}

std::vector<int64_t> PersistentDecode::read_trace(cudaStream_t s) const {
  if (!p_.trace) fail(ErrorKind::Request, "persistent trace: the engine was built without CudaOptions.trace");
  std::vector<unsigned long long> t(sched_.n_tasks() * cuda::kTaskStamps);
  TI_CUDA_CHECK(cudaMemcpyAsync(t.data(), p_.trace, t.size() * sizeof(t[0]), cudaMemcpyDeviceToHost, s));
  TI_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<int64_t> rows;
  rows.reserve(sched_.n_tasks() * kTraceColumns);
  size_t i = 0;
  for (int blk = 0; blk < sched_.grid; blk++)
    for (const PTask& k : sched_.blocks[(size_t)blk]) {
      for (int64_t v : {(int64_t)blk, (int64_t)k.type, (int64_t)k.layer, (int64_t)k.a, (int64_t)k.b}) rows.push_back(v);
      for (int j = 0; j < cuda::kTaskStamps; j++) rows.push_back((int64_t)t[i * cuda::kTaskStamps + j]);
      i++;
    }
  return rows;
}

void PersistentDecode::check(cudaStream_t s) const {
  uint32_t err[3] = {0, 0, 0};
  TI_CUDA_CHECK(cudaMemcpyAsync(err, p_.error, sizeof(err), cudaMemcpyDeviceToHost, s));
  TI_CUDA_CHECK(cudaStreamSynchronize(s));
  if (err[0] == 0) return;
  TI_CUDA_CHECK(cudaMemsetAsync(sync_base_, 0, sync_words_ * sizeof(uint32_t), s));
  TI_CUDA_CHECK(cudaStreamSynchronize(s));
  fail(ErrorKind::Device, "persistent decode step: a wait on counter " + std::to_string(err[1]) +
                              " timed out at value " + std::to_string(err[2]) +
                              " (a broken schedule or blocks not co-resident); this step's tokens are invalid");
}

}  // namespace ti
