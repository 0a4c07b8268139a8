// gemm.cuh — the prefill's matrix products through cuBLASLt, with a per-shape tactic autotuner (see gemm.cu).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

struct cublasLtContext;  // cublasLtHandle_t, without including cublasLt.h in every user of this header

namespace ti::cuda {

enum class GemmOut { F32, AddF32, F16 };  // fp32; fp32 accumulated into D (the residual: beta = 1); fp16

// Y[n][m] = sum_k W[m][k] X[n][k]  (+ Y[n][m] for AddF32) — every row of X times every row of W, i.e.
// torch: Y = X @ W.T (+ Y). W: (M, ldw) fp16 row-major (a weight matrix: M output features of K inputs);
// X: (N, ldx) fp16 row-major (N tokens); Y: (N, ldy) fp32 or fp16. fp32 accumulation. Leading dimensions are
// multiples of 8 (16-byte rows); columns K.. of W and X are never read.
// k_slices > 1 (F32 only): K is cut into k_slices equal slices (K % (8 k_slices) == 0) and slice s's product goes
// to Y + s * slice_stride floats — one strided-batched launch, the partial sums left to the caller to add (a
// split-K whose reduce is the caller's kernel, which can do more on the way: batch_step.cu's down product).
struct GemmArgs {
  const __half* W = nullptr;
  const __half* X = nullptr;
  void* Y = nullptr;
  int M = 0, N = 0, K = 0;
  int ldw = 0, ldx = 0, ldy = 0;
  GemmOut out = GemmOut::F32;
  int k_slices = 1;
  int64_t slice_stride = 0;  // elements of Y between two slices' outputs (>= N ldy, a multiple of 4; a stride
                             // other than the tuned one is checked against the tuned algorithm before use)
};

// One tuned shape: what the autotuner timed and chose (`tinyinfer bench` prints these).
struct GemmTuning {
  int M = 0, N = 0, K = 0;   // N: the token bucket it was timed at
  GemmOut out = GemmOut::F32;
  int k_slices = 1;          // GemmArgs::k_slices (not saved by save(): such shapes are tuned in each process)
  int offered = 0;           // algorithms the heuristic offered
  int candidates = 0;        // algorithms timed: the heuristic's plus split-K variants of its first four
  double default_us = 0;     // cuBLASLt's first heuristic choice
  double tuned_us = 0;       // the fastest candidate
  int chosen = 0;            // its index among the candidates (0: the default was already the fastest;
                             // >= offered: a split-K variant)
  std::string algo;          // its description: algo id, tile, stages, split-K, ...
  bool from_file = false;    // restored by load() rather than timed in this process
};

// Owns a cuBLASLt handle, its workspace and the tuned algorithms of one engine (not a global: two engines on
// two models tune independently). Not thread-safe; the engine serialises its calls.
class Gemm {
 public:
  explicit Gemm(size_t workspace_bytes = 32u << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // Runs the product on `stream`. The first call for a (M, bucket(N), K, out) times the heuristic's candidates
  // on scratch outputs (never the real Y) and keeps the fastest; later calls reuse it. Inside a stream capture
  // it never times: it uses the tuned choice if there is one, else the heuristic's default.
  void run(const GemmArgs& a, cudaStream_t stream);
  // Tune (if not yet) without running: warm-up for benchmarks.
  const GemmTuning& tune(const GemmArgs& a, cudaStream_t stream);
  std::vector<GemmTuning> table() const;
  int tuned_count() const;

  // Tactics across runs. save(): one line per tuned shape (the algorithm as the hex of cuBLASLt's opaque
  // struct, which may be stored and reused with the same cuBLASLt version). load(): entries whose algorithm
  // cublasLtMatmulAlgoCheck still accepts (W, X, Y are not needed: layouts only); returns how many. Each line
  // carries a checksum: a damaged line is skipped (never handed to cuBLASLt).
  // fingerprint(): what a saved file is valid for — cuBLASLt version and GPU; the caller keys files by it.
  std::string save() const;
  int load(const std::string& text);
  static std::string fingerprint();

  bool autotune = true;      // false: always cuBLASLt's default choice (for the benchmark's comparison)
  bool tune_cold = true;     // each timed run with W out of the L2 (gemm.cu); false: back to back (A/B only)
  int max_candidates = 32;   // heuristic results asked for
  int timing_reps = 5;

  // tokens -> the N a shape is tuned at: 16, 32, 64, 128, then 192, 256, 384, 512, 768, ... (half octaves)
  static int bucket(int n);

 private:
  struct Entry;
  using Key = std::tuple<int, int, int, int, int>;  // M, bucket(N), K, out, k_slices
  Entry& lookup(const GemmArgs& a, cudaStream_t stream);

  cublasLtContext* handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<Key, Entry*> cache_;
};

}  // namespace ti::cuda
