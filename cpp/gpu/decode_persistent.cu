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

namespace {

// A matrix kind's rows as the ring plan sees them (the same in every layer: ring_unsupported checks it).
RingMatrix ring_matrix(const cuda::QMat& m) {
  RingMatrix r;
  r.rows = m.rows;
  r.row_bytes = m.fmt == WFormat::F16 ? 2 * m.ld : m.ld;
  r.scale_row_bytes = m.fmt == WFormat::I8 ? m.ld / kI8Block * 2 : m.fmt == WFormat::I4 ? m.K / kI4Group * 4 : 0;
  r.scale_alloc = r.rows * r.scale_row_bytes;  // (DeviceWeights::alloc_matrix)
  return r;
}

bool same_layout(const cuda::QMat& a, const cuda::QMat& b) {
  return a.fmt == b.fmt && a.rows == b.rows && a.K == b.K && a.ld == b.ld;
}

}  // namespace

// Why the ring cannot run ("": it can): it needs sm_90's bulk copies, and one layout per matrix kind.
std::string PersistentDecode::ring_unsupported(const DeviceWeights& w) {
  int dev = 0, major = 0;
  TI_CUDA_CHECK(cudaGetDevice(&dev));
  TI_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major < 9) return "the weight ring needs sm_90 (cp.async.bulk)";
  for (const DeviceLayer& L : w.layers)
    if (!same_layout(L.qkv, w.layers[0].qkv) || !same_layout(L.o, w.layers[0].o) ||
        !same_layout(L.gate_up, w.layers[0].gate_up) || !same_layout(L.down, w.layers[0].down))
      return "the weight ring needs every layer's matrices in one format";
  return "";
}

// The ring plan's tiles resolved to addresses (PTileCopy), per-block offsets, and per task its tile rows.
void PersistentDecode::upload_ring(const DeviceWeights& w, const std::vector<cuda::PLayer>& layers,
                                   DeviceArena& arena) {
  using Kind = DeviceArena::Kind;
  std::vector<cuda::PTileCopy> copies;
  std::vector<int> begin(1, 0), tile_rows;
  for (size_t b = 0; b < ring_.blocks.size(); b++) {
    for (const RingTile& k : ring_.blocks[b]) {
      const cuda::PLayer& L = layers[(size_t)k.layer];
      const TaskType t = (TaskType)k.type;
      const cuda::QMat& m = t == TaskType::Qkv ? L.qkv : t == TaskType::O ? L.o : t == TaskType::GateUp ? L.gate_up
                          : t == TaskType::Down ? L.down : w.lm_head;
      const RingMatrix r = ring_matrix(m);
      cuda::PTileCopy c;
      c.w = static_cast<const uint8_t*>(m.q) + (size_t)k.row0 * r.row_bytes;
      c.scales = r.scale_row_bytes ? static_cast<const uint8_t*>(m.scales) + (size_t)k.row0 * r.scale_row_bytes
                                   : nullptr;
      c.bytes = (uint32_t)k.bytes;
      c.scale_bytes = (uint32_t)k.scale_bytes;
      copies.push_back(c);
    }
    begin.push_back((int)copies.size());
    // per task: the rows of its first tile (build_ring_plan: every tile of a task but the last holds as many)
    const auto& list = ring_.blocks[b];
    size_t j = 0;
    for (size_t i = 0; i < sched_.blocks[b].size(); i++) {
      tile_rows.push_back(ring_.task_tiles[b][i] > 0 ? list[j].rows : 0);
      j += (size_t)ring_.task_tiles[b][i];
    }
  }
  cuda::PTileCopy* d_copies = arena.alloc_n<cuda::PTileCopy>(std::max<size_t>(copies.size(), 1), Kind::Scratch);
  int* d_begin = arena.alloc_n<int>(begin.size(), Kind::Scratch);
  int* d_rows = arena.alloc_n<int>(std::max<size_t>(tile_rows.size(), 1), Kind::Scratch);
  if (!copies.empty())
    TI_CUDA_CHECK(cudaMemcpy(d_copies, copies.data(), copies.size() * sizeof(copies[0]), cudaMemcpyHostToDevice));
  TI_CUDA_CHECK(cudaMemcpy(d_begin, begin.data(), begin.size() * sizeof(int), cudaMemcpyHostToDevice));
  if (!tile_rows.empty())
    TI_CUDA_CHECK(cudaMemcpy(d_rows, tile_rows.data(), tile_rows.size() * sizeof(int), cudaMemcpyHostToDevice));
  p_.ring_copies = d_copies;
  p_.ring_begin = d_begin;
  p_.task_tile_rows = d_rows;
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

  // Shared memory: the tasks' areas (with the attention's key / value tiles where they fit beside the ring),
  // then the ring. The grid follows from it (the occupancy API).
  const size_t max_block = cuda::persistent_max_block_smem();
  p.kv_stage = o.kv_stage && c.head_dim % 8 == 0;
  const std::string ring_why = o.ring ? ring_unsupported(w) : "ring off";
  if (ring_why.empty()) {
    p.ring_slots = o.ring_slots;
    p.ring_slot_bytes = o.ring_slot_kib << 10;
  }
  auto layout = [&] {
    p.ring_offset = (uint32_t)cuda::persistent_ring_offset(p);
    return cuda::persistent_total_smem(p);
  };
  if (layout() > max_block && p.kv_stage) {  // the key / value tiles give way to the ring
    p.kv_stage = false;
    layout();
  }
  // The co-resident grid: at most o.blocks_per_sm per SM (default 2; more blocks, more participants in every
  // hand-off, fewer rows each; with the ring's shared memory usually 1 fits).
  const size_t smem = layout();
  if (p.ring_slots > 0 && smem > max_block)  // (before the occupancy query, which would refuse it less clearly)
    fail(ErrorKind::Device, "persistent ring plan rejected: " +
                                ring_smem_problem(p.ring_slots, p.ring_slot_bytes, smem, max_block));
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
  if (p.ring_slots > 0) {
    RingPlanShape rs;
    rs.slots = p.ring_slots;
    rs.slot_bytes = p.ring_slot_bytes;
    const DeviceLayer& L0 = w.layers[0];
    rs.mats[(int)TaskType::Qkv] = ring_matrix(L0.qkv);
    rs.mats[(int)TaskType::O] = ring_matrix(L0.o);
    rs.mats[(int)TaskType::GateUp] = ring_matrix(L0.gate_up);
    rs.mats[(int)TaskType::Down] = ring_matrix(L0.down);
    rs.mats[(int)TaskType::LmHead] = ring_matrix(w.lm_head);
    ring_ = build_ring_plan(sched_, rs);
    check_ring_plan(ring_, sched_, rs, p.ring_offset, max_block);
  }

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
  if (p.ring_slots > 0) upload_ring(w, layers, arena);
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

static_assert(PersistentDecode::kTraceColumns == 5 + cuda::kTaskStamps, "read_trace's row: 5 values, then the stamps");

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
  if (err[1] == 0xFFFFFFFFu)  // (cuda/persistent.cu, kRingErrorIndex)
    fail(ErrorKind::Device, "persistent decode step: a weight-ring copy timed out (tile " + std::to_string(err[2]) +
                                " of a block's plan); this step's tokens are invalid");
  fail(ErrorKind::Device, "persistent decode step: a wait on counter " + std::to_string(err[1]) +
                              " timed out at value " + std::to_string(err[2]) +
                              " (a broken schedule or blocks not co-resident); this step's tokens are invalid");
}

}  // namespace ti
