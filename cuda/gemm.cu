// gemm.cu — the prefill's matrix products: cuBLASLt, fp16 inputs, fp32 accumulation, with a tactic autotuner.
//
// Layout. Our weights are row-major (M, ldw) and activations row-major (N tokens, ldx), so Y = X W^T. In
// cuBLAS's column-major terms W is a K x M matrix (op = T), X a K x N matrix (op = N) and Y an M x N matrix with
// leading dimension ldy: the classic "TN" GEMM, which every cuBLASLt kernel family supports.
//
// Output variants: F32 (qkv, logits), AddF32 (the O and down projections add into the fp32 residual stream:
// C = D = Y with beta = 1, so the residual add costs nothing extra), F16 (gate/up, read once by SwiGLU).
//
// Why tune. cuBLASLt's heuristic picks an algorithm (kernel, tile, stages, split-K, swizzle) from a model of the
// GPU; for skinny or unusual shapes it can be several times off. Like TensorRT's tactics, the first time a shape
// is seen we ask the heuristic for up to `max_candidates` algorithms, time each on scratch buffers (median of
// `timing_reps` runs after a warm-up) and keep the fastest. Prompt lengths are bucketed to powers of two, and
// past 128 rows to half octaves too (192, 384, 768, 1536, ...): a shape is tuned once per bucket (at the bucket's
// N) and its algorithm reused for every N in the bucket after cublasLtMatmulAlgoCheck says it applies (else the
// heuristic's default for that exact N). Why the half octaves: the tile grid of an algorithm tuned at 1,024
// rows leaves a quarter of the SMs idle at 768 (H200: o and down at 500 TFLOP/s there against 690 at 2,048),
// and a server's passes take any number of rows.
//
// Timed from DRAM. A timed run follows a read over twice the L2's size (tune_cold), so the weights come from
// DRAM as in a model's pass (each matrix read once per step, the model far larger than the L2). Timed back to
// back instead, every matrix up to ~40 MB (all of TinyLlama's but gate/up) ran from the L2 after the warm-up and
// the tuner picked for a cache the real step never has. (A read, not a write: dirty lines left in the L2 would
// be written back during the timed run, traffic a real step does not have.)
#include <cublasLt.h>

#include <algorithm>
#include <cstdio>

#include "common.cuh"
#include "gemm.cuh"

namespace ti::cuda {

#define TI_CUBLAS_CHECK(expr)                                                                              \
  do {                                                                                                     \
    cublasStatus_t st_ = (expr);                                                                           \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                                      \
      ::ti::fail(::ti::ErrorKind::Device, std::string("cuBLASLt error ") + std::to_string((int)st_) + " in " + \
                                              #expr + " at " + __FILE__ + ":" + std::to_string(__LINE__)); \
  } while (0)

struct Gemm::Entry {
  GemmTuning info;
  cublasLtMatmulAlgo_t algo{};
  bool tuned = false;
  int64_t slice_stride = 0;  // k_slices > 1: the output stride it was timed at (another one is checked first)
};

namespace {

// The descriptors of one product (RAII: cuBLASLt descriptors are small host objects).
struct Desc {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  float beta = 0.0f;
  explicit Desc(const GemmArgs& g, int n) {
    TI_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
    TI_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
    TI_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt)));
    const int k = g.K / g.k_slices;  // (k_slices 1: all of K)
    TI_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16F, k, g.M, g.ldw));
    TI_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16F, k, n, g.ldx));
    const cudaDataType_t yt = g.out == GemmOut::F16 ? CUDA_R_16F : CUDA_R_32F;
    TI_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, yt, g.M, n, g.ldy));
    if (g.k_slices > 1) {  // slice s: W's and X's columns s k.., Y + s slice_stride
      const int32_t count = g.k_slices;
      const int64_t along_k = k, along_y = g.slice_stride;
      for (cublasLtMatrixLayout_t l : {a, b, c})
        TI_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      TI_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(a, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &along_k,
                                                       sizeof(along_k)));
      TI_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(b, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &along_k,
                                                       sizeof(along_k)));
      TI_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(c, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &along_y,
                                                       sizeof(along_y)));
    }
    beta = g.out == GemmOut::AddF32 ? 1.0f : 0.0f;
  }
  ~Desc() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
};

cublasLtHandle_t as_handle(cublasLtContext* h) { return h; }

std::string describe(const cublasLtMatmulAlgo_t& algo) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) {
    uint32_t v = 0;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written);
    return (long)v;
  };
  char buf[160];
  std::snprintf(buf, sizeof(buf), "algo %ld tile %ld stages %ld splitK %ld reduction %ld swizzle %ld",
                get(CUBLASLT_ALGO_CONFIG_ID), get(CUBLASLT_ALGO_CONFIG_TILE_ID), get(CUBLASLT_ALGO_CONFIG_STAGES_ID),
                get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM), get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                get(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING));
  return buf;
}

bool capturing(cudaStream_t s) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  TI_CUDA_CHECK(cudaStreamIsCapturing(s, &st));
  return st != cudaStreamCaptureStatusNone;
}

// More tactics than the heuristic offers: its first few algorithms again with the K dimension split 2..16 ways
// (partial sums reduced in the workspace). Skinny products (a short prompt: N = 16) have too few output tiles
// to fill the GPU, and the heuristic rarely proposes a split. Kept only where cublasLtMatmulAlgoCheck accepts
// them within our workspace, and only where each split still covers >= 64 of K (a tile's depth is 32-64: a
// thinner split cannot be faster, and degenerate ones — K = 8 split 16 ways — are the suspects of a tuned
// 8x3x8 GEMM that once came out wrong in the tests, not reproduced). Shapes with K >= 1,024 keep every split;
// SmolLM2's K = 576 / 960 lose only the 16-way ones.
void add_split_k(cublasLtHandle_t h, const Desc& d, int K, size_t workspace, std::vector<cublasLtMatmulAlgo_t>& cands) {
  const size_t base = std::min<size_t>(cands.size(), 4);
  for (size_t i = 0; i < base; i++) {
    uint32_t support = 0, schemes = 0;
    size_t written = 0;
    cublasLtMatmulAlgoCapGetAttribute(&cands[i], CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, &support, sizeof(support), &written);
    cublasLtMatmulAlgoCapGetAttribute(&cands[i], CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes),
                                      &written);
    if (!support) continue;
    const uint32_t scheme = (schemes & CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE) ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                            : (schemes & CUBLASLT_REDUCTION_SCHEME_INPLACE)    ? CUBLASLT_REDUCTION_SCHEME_INPLACE
                                                                               : CUBLASLT_REDUCTION_SCHEME_NONE;
    for (uint32_t k : {2u, 4u, 8u, 16u}) {
      if ((uint32_t)K < 64u * k) break;
      cublasLtMatmulAlgo_t a = cands[i];
      uint32_t cur = 0;
      cublasLtMatmulAlgoConfigGetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &cur, sizeof(cur), &written);
      if (cur == k) continue;  // the heuristic's own choice is already a candidate
      if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &k, sizeof(k)) != CUBLAS_STATUS_SUCCESS ||
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme)) !=
              CUBLAS_STATUS_SUCCESS)
        continue;
      cublasLtMatmulHeuristicResult_t r{};
      if (cublasLtMatmulAlgoCheck(h, d.op, d.a, d.b, d.c, d.c, &a, &r) == CUBLAS_STATUS_SUCCESS &&
          r.workspaceSize <= workspace)
        cands.push_back(a);
    }
  }
}

}  // namespace

int Gemm::bucket(int n) {
  int b = 16;
  while (b < n) {
    if (b >= 128 && b + b / 2 >= n) return b + b / 2;  // (past 128 rows also 192, 384, 768, 1536, ...)
    b *= 2;
  }
  return b;
}

Gemm::Gemm(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  cublasLtHandle_t h = nullptr;
  TI_CUBLAS_CHECK(cublasLtCreate(&h));
  handle_ = h;
  if (cudaMalloc(&workspace_, workspace_bytes_) != cudaSuccess) {
    cudaGetLastError();
    cublasLtDestroy(h);
    fail(ErrorKind::Device, "out of GPU memory: the cuBLASLt workspace (" + std::to_string(workspace_bytes_ >> 20) +
                                " MiB)");
  }
}

Gemm::~Gemm() {
  for (auto& kv : cache_) delete kv.second;
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(as_handle(handle_));
}

std::vector<GemmTuning> Gemm::table() const {
  std::vector<GemmTuning> out;
  for (const auto& kv : cache_)
    if (kv.second->tuned) out.push_back(kv.second->info);
  return out;
}

int Gemm::tuned_count() const {
  int n = 0;
  for (const auto& kv : cache_) n += kv.second->tuned ? 1 : 0;
  return n;
}

std::string Gemm::fingerprint() {
  int dev = 0;
  cudaDeviceProp prop{};
  TI_CUDA_CHECK(cudaGetDevice(&dev));
  TI_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  // ("timed from DRAM": tactics timed with a warm L2, before, are not taken for these)
  return "cublasLt " + std::to_string(cublasLtGetVersion()) + " | " + prop.name + " | sm_" +
         std::to_string(prop.major * 10 + prop.minor) + " | " + std::to_string(prop.multiProcessorCount) +
         " SMs | timed from DRAM";
}

// Reads n bytes (a multiple of 16) so that the L2 holds only clean lines of them afterwards; the one store is
// never taken (the sum of zeros), it only keeps the loads from being dropped.
__global__ void l2_evict_kernel(const uint4* p, size_t n16, unsigned* never) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n16; i += (size_t)gridDim.x * blockDim.x) {
    const uint4 v = p[i];
    acc |= v.x | v.y | v.z | v.w;
  }
  if (acc == 0xFFFFFFFFu) *never = acc;
}

static void evict_l2(void* buf, size_t bytes, cudaStream_t s) {
  l2_evict_kernel<<<1024, 256, 0, s>>>(static_cast<const uint4*>(buf), bytes / 16, static_cast<unsigned*>(buf));
  TI_CUDA_CHECK(cudaGetLastError());
}

// FNV-1a over a saved line: cuBLASLt's algorithm struct is opaque, and handing it a damaged one is undefined
// behaviour (it can crash), so a line whose checksum does not match is never parsed into one.
static uint64_t line_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

// (No iostreams in this file: an ostringstream here crashed the process on the H200 machine's build; plain
// snprintf / sscanf do the same job.)
std::string Gemm::save() const {
  std::string out = "# tinyinfer GEMM tactics (" + fingerprint() +
                    "): M N K out offered candidates chosen default_us tuned_us algo-hex checksum\n";
  for (const auto& kv : cache_) {
    const Entry& e = *kv.second;
    if (!e.tuned || e.info.k_slices > 1) continue;
    const GemmTuning& t = e.info;
    char buf[160];
    std::snprintf(buf, sizeof(buf), "%d %d %d %d %d %d %d %.3f %.3f ", t.M, t.N, t.K, (int)t.out, t.offered,
                  t.candidates, t.chosen, t.default_us, t.tuned_us);
    std::string line = buf;
    const unsigned char* b = reinterpret_cast<const unsigned char*>(&e.algo);
    for (size_t i = 0; i < sizeof(e.algo); i++) {
      std::snprintf(buf, sizeof(buf), "%02x", (unsigned)b[i]);
      line += buf;
    }
    std::snprintf(buf, sizeof(buf), " %016llx\n", (unsigned long long)line_hash(line));
    out += line + buf;
  }
  return out;
}

int Gemm::load(const std::string& text) {
  int loaded = 0;
  size_t at = 0;
  while (at < text.size()) {
    size_t nl = text.find('\n', at);
    if (nl == std::string::npos) nl = text.size();
    const std::string line = text.substr(at, nl - at);
    at = nl + 1;
    if (line.empty() || line[0] == '#') continue;
    const size_t cut = line.find_last_of(' ');
    if (cut == std::string::npos) continue;
    unsigned long long sum = 0;
    if (std::sscanf(line.c_str() + cut + 1, "%16llx", &sum) != 1 || sum != line_hash(line.substr(0, cut))) continue;
    GemmTuning t;
    int out = 0, used = 0;
    if (std::sscanf(line.c_str(), "%d %d %d %d %d %d %d %lf %lf %n", &t.M, &t.N, &t.K, &out, &t.offered,
                    &t.candidates, &t.chosen, &t.default_us, &t.tuned_us, &used) != 9)
      continue;  // a damaged line: that shape is simply tuned again
    const std::string hex = line.substr((size_t)used, cut - (size_t)used);
    cublasLtMatmulAlgo_t algo{};
    if (out < 0 || out > 2 || hex.size() != 2 * sizeof(algo) || t.M < 1 || t.N < 1 || t.K < 1) continue;
    unsigned char* b = reinterpret_cast<unsigned char*>(&algo);
    bool ok = true;
    for (size_t i = 0; i < sizeof(algo) && ok; i++) {
      unsigned v = 0;
      ok = std::sscanf(hex.c_str() + 2 * i, "%2x", &v) == 1;
      b[i] = (unsigned char)v;
    }
    t.out = (GemmOut)out;
    GemmArgs a;
    a.M = t.M;
    a.N = t.N;
    a.K = t.K;
    a.ldw = a.ldx = (int)pad8(t.K);
    a.ldy = (int)pad8(t.M);
    a.out = t.out;
    Desc d(a, t.N);
    cublasLtMatmulHeuristicResult_t check{};
    if (!ok || cublasLtMatmulAlgoCheck(as_handle(handle_), d.op, d.a, d.b, d.c, d.c, &algo, &check) !=
                   CUBLAS_STATUS_SUCCESS || check.workspaceSize > workspace_bytes_)
      continue;
    Entry*& e = cache_[Key{t.M, t.N, t.K, out, 1}];
    if (!e) e = new Entry();
    t.algo = describe(algo);
    t.from_file = true;
    e->info = t;
    e->algo = algo;
    e->tuned = true;
    loaded++;
  }
  return loaded;
}

const GemmTuning& Gemm::tune(const GemmArgs& a, cudaStream_t s) { return lookup(a, s).info; }

// The cached entry of a's shape bucket, tuning it first if it is new (and we are not inside a capture).
Gemm::Entry& Gemm::lookup(const GemmArgs& a, cudaStream_t s) {
  const int nb = bucket(a.N);
  const Key key{a.M, nb, a.K, (int)a.out, a.k_slices};
  auto it = cache_.find(key);
  if (it != cache_.end() && (it->second->tuned || capturing(s))) return *it->second;
  Entry* e = it != cache_.end() ? it->second : (cache_[key] = new Entry());
  e->info = GemmTuning{a.M, nb, a.K, a.out, a.k_slices};

  GemmArgs t = a;  // time at the bucket's N on scratch X and Y (zeros): the caller's buffers stay untouched
  t.N = nb;
  if (a.k_slices > 1) t.slice_stride = (int64_t)nb * a.ldy;  // (the scratch Y's slices)
  e->slice_stride = t.slice_stride;
  Desc d(t, nb);
  cublasLtMatmulPreference_t pref = nullptr;
  TI_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  TI_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                       &workspace_bytes_, sizeof(workspace_bytes_)));
  std::vector<cublasLtMatmulHeuristicResult_t> res((size_t)std::max(1, max_candidates));
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(as_handle(handle_), d.op, d.a, d.b, d.c, d.c, pref,
                                                           (int)res.size(), res.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS || found == 0)
    fail(ErrorKind::Device, "cuBLASLt has no algorithm for the GEMM M=" + std::to_string(a.M) +
                                " N=" + std::to_string(nb) + " K=" + std::to_string(a.K));
  e->algo = res[0].algo;
  std::vector<cublasLtMatmulAlgo_t> cands;
  for (int i = 0; i < found; i++)
    if (res[(size_t)i].state == CUBLAS_STATUS_SUCCESS) cands.push_back(res[(size_t)i].algo);
  if (autotune && !capturing(s) && a.k_slices == 1) add_split_k(as_handle(handle_), d, a.K, workspace_bytes_, cands);
  if (capturing(s) || !autotune) {  // no timing inside a capture; or the default on purpose
    e->info.candidates = 1;
    e->info.offered = found;
    e->info.algo = describe(e->algo);
    e->tuned = !capturing(s);
    return *e;
  }

  const size_t y_elt = a.out == GemmOut::F16 ? 2 : 4;
  void *x = nullptr, *y = nullptr, *flush = nullptr;
  size_t flush_bytes = 0;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  auto cleanup = [&] {
    if (x) cudaFree(x);
    if (y) cudaFree(y);
    if (flush) cudaFree(flush);
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
  };
  try {
    TI_CUDA_CHECK(cudaMalloc(&x, (size_t)nb * a.ldx * 2));
    const size_t y_bytes = (size_t)a.k_slices * nb * a.ldy * y_elt;
    TI_CUDA_CHECK(cudaMalloc(&y, y_bytes));
    TI_CUDA_CHECK(cudaMemsetAsync(x, 0, (size_t)nb * a.ldx * 2, s));
    TI_CUDA_CHECK(cudaMemsetAsync(y, 0, y_bytes, s));
    TI_CUDA_CHECK(cudaEventCreate(&e0));
    TI_CUDA_CHECK(cudaEventCreate(&e1));
    if (tune_cold) {
      int dev = 0, l2 = 0;
      TI_CUDA_CHECK(cudaGetDevice(&dev));
      TI_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
      flush_bytes = 2 * (size_t)std::max(l2, 1 << 20);
      if (cudaMalloc(&flush, flush_bytes) != cudaSuccess) {  // no room: timed warm, as before, not a failure
        cudaGetLastError();
        flush = nullptr;
      } else {
        TI_CUDA_CHECK(cudaMemsetAsync(flush, 0, flush_bytes, s));
      }
    }
    const float alpha = 1.0f;
    auto launch_algo = [&](const cublasLtMatmulAlgo_t& algo) {
      return cublasLtMatmul(as_handle(handle_), d.op, &alpha, a.W, d.a, x, d.b, &d.beta, y, d.c, y, d.c, &algo,
                            workspace_, workspace_bytes_, s);
    };
    double best = 1e30;
    int ran = 0;
    for (int i = 0; i < (int)cands.size(); i++) {
      if (launch_algo(cands[(size_t)i]) != CUBLAS_STATUS_SUCCESS) continue;  // warm-up (and: does it run?)
      std::vector<float> ms;
      for (int r = 0; r < std::max(1, timing_reps); r++) {
        if (flush) evict_l2(flush, flush_bytes, s);  // the L2 holds none of W
        TI_CUDA_CHECK(cudaEventRecord(e0, s));
        launch_algo(cands[(size_t)i]);
        TI_CUDA_CHECK(cudaEventRecord(e1, s));
        TI_CUDA_CHECK(cudaEventSynchronize(e1));
        float t_ms = 0;
        TI_CUDA_CHECK(cudaEventElapsedTime(&t_ms, e0, e1));
        ms.push_back(t_ms);
      }
      std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
      const double us = ms[ms.size() / 2] * 1e3;
      ran++;
      if (i == 0) e->info.default_us = us;
      if (us < best) {
        best = us;
        e->algo = cands[(size_t)i];
        e->info.chosen = i;
      }
    }
    cudaGetLastError();
    if (ran == 0) fail(ErrorKind::Device, "cuBLASLt: no candidate algorithm ran for M=" + std::to_string(a.M));
    e->info.candidates = ran;
    e->info.offered = found;
    e->info.tuned_us = best;
    if (e->info.default_us == 0) e->info.default_us = best;  // the default itself failed to run
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  e->info.algo = describe(e->algo);
  e->tuned = true;
  return *e;
}

void Gemm::run(const GemmArgs& a, cudaStream_t s) {
  if (a.M < 1 || a.N < 1 || a.K < 1 || a.ldw < a.K || a.ldx < a.K || a.ldy < a.M || a.ldw % 8 || a.ldx % 8 ||
      a.ldy % 8)
    fail(ErrorKind::Request, "gemm: bad shape M=" + std::to_string(a.M) + " N=" + std::to_string(a.N) +
                                 " K=" + std::to_string(a.K));
  if (a.k_slices < 1 || (a.k_slices > 1 && (a.out != GemmOut::F32 || a.K % (8 * a.k_slices) != 0 ||
                                            a.slice_stride < (int64_t)a.N * a.ldy || a.slice_stride % 4 != 0)))
    fail(ErrorKind::Request, "gemm: k_slices " + std::to_string(a.k_slices) + " needs out f32, K % (8 k_slices) == 0 "
                             "and slice_stride >= N ldy, a multiple of 4 (K=" + std::to_string(a.K) + ")");
  Entry& e = lookup(a, s);
  Desc d(a, a.N);
  cublasLtMatmulHeuristicResult_t check{};
  const cublasLtMatmulAlgo_t* algo = &e.algo;
  if ((a.N != e.info.N || (a.k_slices > 1 && a.slice_stride != e.slice_stride)) &&
      cublasLtMatmulAlgoCheck(as_handle(handle_), d.op, d.a, d.b, d.c, d.c, &e.algo, &check) != CUBLAS_STATUS_SUCCESS) {
    algo = nullptr;  // the bucket's algorithm does not fit this N (or slices' stride): let cuBLASLt choose
  }
  const float alpha = 1.0f;
  TI_CUBLAS_CHECK(cublasLtMatmul(as_handle(handle_), d.op, &alpha, a.W, d.a, a.X, d.b, &d.beta, a.Y, d.c, a.Y, d.c,
                                 algo, workspace_, workspace_bytes_, s));
}

}  // namespace ti::cuda
