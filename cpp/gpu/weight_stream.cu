// weight_stream.cu — see weight_stream.h.
#include "weight_stream.h"

#include <algorithm>
#include <cstring>

#include "../../cuda/common.cuh"
#include "../core/errors.h"

namespace ti {

namespace {
std::string shape_str(int64_t rows, int64_t K, bool vec) {
  return vec ? "(" + std::to_string(K) + ")" : "(" + std::to_string(rows) + ", " + std::to_string(K) + ")";
}
}  // namespace

int64_t WeightStream::scale_row_bytes(WFormat f, int64_t K) { return f == WFormat::F16 ? 0 : scale_halves(f, K) * 2; }

WeightStream::WeightStream(DeviceWeights& w, const ModelConfig& c, cudaStream_t stream)
    : w_(w), cfg_(c), stream_(stream) {
  using RM = cuda::RowMap;
  auto rm = [](int64_t offset, int64_t step, int64_t rows) { return RM{offset, step, 0, rows}; };
  for (int64_t l = 0; l < c.n_layers; l++) {
    DeviceLayer& D = w.layers[(size_t)l];
    auto name = [&](const char* leaf) { return WeightStore::layer_tensor(l, leaf); };
    add_matrix(D.qkv, {{name("self_attn.q_proj.weight"), rm(0, 1, c.q_dim)},
                       {name("self_attn.k_proj.weight"), rm(c.q_dim, 1, c.kv_dim)},
                       {name("self_attn.v_proj.weight"), rm(c.q_dim + c.kv_dim, 1, c.kv_dim)}});
    add_matrix(D.o, {{name("self_attn.o_proj.weight"), rm(0, 1, c.hidden)}});
    add_matrix(D.gate_up, {{name("mlp.gate_proj.weight"), rm(0, 2, c.intermediate)},
                           {name("mlp.up_proj.weight"), rm(1, 2, c.intermediate)}});
    add_matrix(D.down, {{name("mlp.down_proj.weight"), rm(0, 1, c.hidden)}});
    for (auto [leaf, vec] : {std::pair{"input_layernorm.weight", D.attn_norm},
                             std::pair{"post_attention_layernorm.weight", D.mlp_norm}}) {
      Target t{Target::Vector};
      t.rows = 1, t.K = c.hidden, t.vec = vec;
      targets_.emplace(name(leaf), t);
      order_.push_back(name(leaf));
    }
  }
  Target e{Target::Embedding};
  e.rows = c.vocab, e.K = c.hidden, e.map = rm(0, 1, c.vocab);
  targets_.emplace("model.embed_tokens.weight", e);
  order_.push_back("model.embed_tokens.weight");
  Target n{Target::Vector};
  n.rows = 1, n.K = c.hidden, n.vec = w.final_norm;
  targets_.emplace("model.norm.weight", n);
  order_.push_back("model.norm.weight");
  if (!c.tie_word_embeddings) {
    add_matrix(w.lm_head, {{"lm_head.weight", rm(0, 1, c.vocab)}});
  } else if (w.lm_head.q != w.embedding) {
    // A tied head in a quantized format is its own copy: quantized from the embedding, or (GGUF Q8_0 embedding)
    // imported as "lm_head.weight" from the embedding's blocks. Optional: finish() does not ask for it.
    add_matrix(w.lm_head, {{"lm_head.weight", rm(0, 1, c.vocab)}});
    order_.pop_back();
  }

  try {
    for (int s = 0; s < kSlots; s++) {
      TI_CUDA_CHECK(cudaMallocHost(&pinned_[s], kChunkBytes));
      TI_CUDA_CHECK(cudaMallocAsync(&device_[s], kChunkBytes, stream_));
      TI_CUDA_CHECK(cudaEventCreateWithFlags(&done_[s], cudaEventDisableTiming));
    }
  } catch (...) {  // a constructor that throws runs no destructor
    release();
    throw;
  }
}

WeightStream::~WeightStream() { release(); }

void WeightStream::release() noexcept {
  cudaStreamSynchronize(stream_);
  for (Matrix& M : matrices_) {
    if (M.stage) cudaFreeAsync(M.stage, stream_);
    M.stage = nullptr;
  }
  for (int s = 0; s < kSlots; s++) {
    if (pinned_[s]) cudaFreeHost(pinned_[s]);
    if (device_[s]) cudaFreeAsync(device_[s], stream_);
    if (done_[s]) cudaEventDestroy(done_[s]);
    pinned_[s] = device_[s] = nullptr;
    done_[s] = nullptr;
  }
  cudaStreamSynchronize(stream_);
  // The stream-ordered pool keeps freed memory for reuse; hand it back, so the engine's report and the next
  // allocation see the device as the load leaves it.
  cudaMemPool_t pool;
  int dev = 0;
  if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetDefaultMemPool(&pool, dev) == cudaSuccess)
    cudaMemPoolTrimTo(pool, 0);
  cudaGetLastError();
}

void WeightStream::add_matrix(const cuda::QMat& m, const std::vector<std::pair<std::string, cuda::RowMap>>& parts) {
  Matrix M;
  M.m = m;
  M.parts = (int)parts.size();
  matrices_.push_back(M);
  for (const auto& [name, map] : parts) {
    Target t{Target::MatrixPart};
    t.matrix = (int)matrices_.size() - 1;
    t.map = map;
    t.rows = map.rows;
    t.K = m.K;
    targets_.emplace(name, t);
    order_.push_back(name);
  }
}

WeightStream::Target& WeightStream::target(const std::string& name, int64_t total_rows, int64_t K) {
  auto it = targets_.find(name);
  if (it == targets_.end())
    fail(ErrorKind::Unsupported, "unexpected tensor '" + name + "' (not a weight of a " +
                                     std::to_string(cfg_.n_layers) + "-layer Llama model)");
  Target& t = it->second;
  const bool vec = t.kind == Target::Vector;
  if (total_rows != t.rows || K != t.K)
    fail(ErrorKind::ModelFormat, "tensor '" + name + "' has shape " + shape_str(total_rows, K, vec) +
                                     ", expected " + shape_str(t.rows, t.K, vec));
  return t;
}

// n_rows rows of row_bytes each from host `src` through the pinned ring; launch(device_rows, first, count) is
// enqueued per chunk, after its upload. A slot is refilled only once its previous chunk's kernel is done.
template <typename Launch>
void WeightStream::stream_bytes(const uint8_t* src, int64_t n_rows, int64_t row_bytes, const Launch& launch) {
  if (row_bytes > (int64_t)kChunkBytes) fail(ErrorKind::Unsupported, "a tensor row is larger than the load's chunk");
  const int64_t per_chunk = (int64_t)kChunkBytes / row_bytes;
  for (int64_t r0 = 0; r0 < n_rows; r0 += per_chunk) {
    const int64_t nr = std::min(per_chunk, n_rows - r0);
    const size_t bytes = (size_t)(nr * row_bytes);
    const int s = next_slot_;
    next_slot_ = (next_slot_ + 1) % kSlots;
    TI_CUDA_CHECK(cudaEventSynchronize(done_[s]));
    std::memcpy(pinned_[s], src + (size_t)(r0 * row_bytes), bytes);
    TI_CUDA_CHECK(cudaMemcpyAsync(device_[s], pinned_[s], bytes, cudaMemcpyHostToDevice, stream_));
    launch(device_[s], r0, nr);
    TI_CUDA_CHECK(cudaEventRecord(done_[s], stream_));
    bytes_in_ += bytes;
  }
}

void WeightStream::load_rows(const std::string& name, DType type, const void* data, int64_t row0, int64_t n,
                             int64_t total_rows, int64_t K, int rope_heads) {
  Target& t = target(name, total_rows, K);
  if (row0 < 0 || n < 0 || row0 + n > t.rows)
    fail(ErrorKind::Request, "tensor '" + name + "': rows " + std::to_string(row0) + ".." + std::to_string(row0 + n) +
                                 " out of range (" + std::to_string(t.rows) + " rows)");
  if (t.imported || t.rows_done + n > t.rows) fail(ErrorKind::ModelFormat, "tensor '" + name + "' given twice");
  if (t.kind == Target::Vector) {  // a norm: tiny, converted here and copied as fp32
    std::vector<float> v((size_t)K);
    for (int64_t k = 0; k < K; k++) {
      const uint8_t* p = static_cast<const uint8_t*>(data) + k * dtype_size(type);
      uint16_t h;
      if (type != DType::F32) std::memcpy(&h, p, 2);
      if (type == DType::F32) std::memcpy(&v[(size_t)k], p, 4);
      else v[(size_t)k] = type == DType::F16 ? half_to_float(h) : bf16_to_float(h);
    }
    TI_CUDA_CHECK(cudaMemcpyAsync(t.vec, v.data(), v.size() * 4, cudaMemcpyHostToDevice, stream_));
    TI_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `v` dies here
    t.rows_done = 1;
    bytes_in_ += (size_t)K * dtype_size(type);
    return;
  }
  if (rope_heads > 0 && t.rows % (2 * rope_heads))
    fail(ErrorKind::ModelFormat, "tensor '" + name + "': cannot un-permute " + std::to_string(t.rows) +
                                     " rows for " + std::to_string(rope_heads) + " heads");
  cuda::RowMap map = t.map;
  map.rope_heads = rope_heads;
  __half* dst = w_.embedding;
  int ld = w_.ld_h;
  if (t.kind == Target::MatrixPart) {
    Matrix& M = matrices_[(size_t)t.matrix];
    ld = (int)cuda::pad8(K);
    if (M.m.fmt == WFormat::F16) {
      dst = static_cast<__half*>(const_cast<void*>(M.m.q));
    } else {
      if (!M.stage)
        TI_CUDA_CHECK(cudaMallocAsync(&M.stage, (size_t)M.m.rows * ld * sizeof(__half), stream_));
      dst = M.stage;
    }
  }
  const int64_t row_bytes = K * (int64_t)dtype_size(type);
  stream_bytes(static_cast<const uint8_t*>(data), n, row_bytes, [&](const uint8_t* rows, int64_t r0, int64_t nr) {
    cuda::convert_rows(rows, type, nr, (int)K, row0 + r0, dst, ld, map, stream_);
  });
  t.rows_done += n;
  if (t.rows_done == t.rows) part_done(t);
}

// The checks every imported (already quantized) matrix passes; returns its destination.
WeightStream::Matrix& WeightStream::import_target(Target& t, const std::string& name, WFormat f, int rope_heads) {
  if (t.kind != Target::MatrixPart)
    fail(ErrorKind::Request, "tensor '" + name + "': only layer matrices and an untied LM head import quantized rows");
  Matrix& M = matrices_[(size_t)t.matrix];
  if (M.m.fmt != f)
    fail(ErrorKind::Request, "tensor '" + name + "': " + to_string(f) + " rows for a " + to_string(M.m.fmt) +
                                 " matrix");
  if (t.imported || t.rows_done > 0) fail(ErrorKind::ModelFormat, "tensor '" + name + "' given twice");
  if (rope_heads > 0 && t.rows % (2 * rope_heads))
    fail(ErrorKind::ModelFormat, "tensor '" + name + "': cannot un-permute " + std::to_string(t.rows) +
                                     " rows for " + std::to_string(rope_heads) + " heads");
  return M;
}

void WeightStream::load_quantized(const std::string& name, WFormat f, const uint8_t* q, int64_t q_row_bytes,
                                  const uint8_t* scales, int64_t scale_row_bytes_in, int64_t rows, int64_t K,
                                  int rope_heads) {
  Target& t = target(name, rows, K);
  Matrix& M = import_target(t, name, f, rope_heads);
  if (q_row_bytes != M.m.ld || scale_row_bytes_in != scale_row_bytes(f, K))
    fail(ErrorKind::ModelFormat, "tensor '" + name + "': " + to_string(f) + " rows of " + std::to_string(q_row_bytes) +
                                     " + " + std::to_string(scale_row_bytes_in) + " bytes, expected " +
                                     std::to_string(M.m.ld) + " + " + std::to_string(scale_row_bytes(f, K)));
  cuda::RowMap map = t.map;
  map.rope_heads = rope_heads;
  uint8_t* dq = static_cast<uint8_t*>(const_cast<void*>(M.m.q));
  uint8_t* ds = static_cast<uint8_t*>(const_cast<void*>(M.m.scales));
  stream_bytes(q, rows, q_row_bytes, [&](const uint8_t* src, int64_t r0, int64_t nr) {
    cuda::scatter_rows(src, nr, (int)q_row_bytes, r0, dq, map, stream_);
  });
  stream_bytes(scales, rows, scale_row_bytes_in, [&](const uint8_t* src, int64_t r0, int64_t nr) {
    cuda::scatter_rows(src, nr, (int)scale_row_bytes_in, r0, ds, map, stream_);
  });
  t.imported = true;
  t.rows_done = t.rows;
  M.any_imported = true;
  part_done(t);
}

void WeightStream::load_q4_blocks(const std::string& name, bool q4_1, const uint8_t* blocks, int64_t row_bytes,
                                  int64_t rows, int64_t K, int rope_heads) {
  Target& t = target(name, rows, K);
  Matrix& M = import_target(t, name, WFormat::I4, rope_heads);
  if (K % kI4Group != 0 || row_bytes != K / 32 * (q4_1 ? 20 : 18))
    fail(ErrorKind::ModelFormat, "tensor '" + name + "': " + std::string(q4_1 ? "Q4_1" : "Q4_0") + " rows of " +
                                     std::to_string(row_bytes) + " bytes for " + std::to_string(K) + " weights");
  cuda::RowMap map = t.map;
  map.rope_heads = rope_heads;
  uint8_t* dq = static_cast<uint8_t*>(const_cast<void*>(M.m.q));
  __half2* dsm = static_cast<__half2*>(const_cast<void*>(M.m.scales));
  stream_bytes(blocks, rows, row_bytes, [&](const uint8_t* src, int64_t r0, int64_t nr) {
    cuda::q4_blocks_to_i4(src, q4_1, nr, (int)K, r0, dq, dsm, map, stream_);
  });
  t.imported = true;
  t.rows_done = t.rows;
  M.any_imported = true;
  part_done(t);
}

void WeightStream::part_done(Target& t) {
  if (t.kind == Target::Embedding) {
    // A tied head in a quantized format: its own copy, quantized from the embedding's fp16 rows.
    if (cfg_.tie_word_embeddings && w_.lm_head.q != w_.embedding && !targets_.at("lm_head.weight").imported)
      cuda::quantize_matrix(w_.embedding, w_.ld_h, w_.lm_head, stream_);
    return;
  }
  Matrix& M = matrices_[(size_t)t.matrix];
  if (!t.imported) M.float_parts.push_back(t.map);
  if (++M.parts_done == M.parts) finalize(M);
}

// Every part of a quantized-format matrix has arrived: quantize the float parts' fp16 rows. Rows are quantized
// independently, so a matrix mixing imported and float parts is quantized whole into a scratch copy whose float
// parts' rows are then copied over (the imported rows stay as they came).
void WeightStream::finalize(Matrix& M) {
  if (M.m.fmt == WFormat::F16 || !M.stage) return;
  const int ldh = (int)cuda::pad8(M.m.K);
  if (!M.any_imported) {
    cuda::quantize_matrix(M.stage, ldh, M.m, stream_);
  } else {
    const int64_t qb = M.m.ld, sb = scale_row_bytes(M.m.fmt, M.m.K);
    cuda::QMat tmp = M.m;
    void *tq = nullptr, *ts = nullptr;
    TI_CUDA_CHECK(cudaMallocAsync(&tq, (size_t)(M.m.rows * qb), stream_));
    TI_CUDA_CHECK(cudaMallocAsync(&ts, (size_t)(M.m.rows * sb), stream_));
    tmp.q = tq, tmp.scales = ts;
    cuda::quantize_matrix(M.stage, ldh, tmp, stream_);
    auto copy_rows = [&](const void* from, const void* to, int64_t row_bytes, const cuda::RowMap& p) {
      const size_t at = (size_t)(p.offset * row_bytes), pitch = (size_t)(p.step * row_bytes);
      TI_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<uint8_t*>(const_cast<void*>(to)) + at, pitch,
                                      static_cast<const uint8_t*>(from) + at, pitch, (size_t)row_bytes,
                                      (size_t)p.rows, cudaMemcpyDeviceToDevice, stream_));
    };
    for (const cuda::RowMap& p : M.float_parts) {
      copy_rows(tq, M.m.q, qb, p);
      copy_rows(ts, M.m.scales, sb, p);
    }
    TI_CUDA_CHECK(cudaFreeAsync(tq, stream_));
    TI_CUDA_CHECK(cudaFreeAsync(ts, stream_));
  }
  TI_CUDA_CHECK(cudaFreeAsync(M.stage, stream_));
  M.stage = nullptr;
}

void WeightStream::finish() {
  for (const std::string& name : order_) {
    const Target& t = targets_.at(name);
    const bool vec = t.kind == Target::Vector;
    if (t.rows_done == 0)
      fail(ErrorKind::ModelFormat,
           "missing tensor '" + name + "' (expected shape " + shape_str(t.rows, t.K, vec) + ")");
    if (t.rows_done != t.rows)
      fail(ErrorKind::ModelFormat, "tensor '" + name + "': " + std::to_string(t.rows_done) + " of " +
                                       std::to_string(t.rows) + " rows arrived");
  }
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace ti
