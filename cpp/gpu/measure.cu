// measure.cu — see measure.h; and the CudaEngine's measurement entry points (benchmarks, tracing).
#include "measure.h"

#include <algorithm>

#include "../../cuda/attention.cuh"
#include "../../cuda/common.cuh"
#include "../core/errors.h"
#include "cuda_engine.h"

namespace ti {

cudaError_t capture_graph(cudaStream_t s, const std::function<void()>& record, cudaGraphExec_t* out) {
  cudaGraph_t graph = nullptr;
  cudaError_t err = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return err;
  }
  try {
    record();
  } catch (...) {
    cudaStreamEndCapture(s, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    throw;
  }
  err = cudaStreamEndCapture(s, &graph);
  if (err == cudaSuccess) err = cudaGraphInstantiate(out, graph, 0);
  if (graph) cudaGraphDestroy(graph);
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

StreamClock::StreamClock(cudaStream_t s, bool graphs) : stream_(s), graphs_(graphs) {
  TI_CUDA_CHECK(cudaEventCreate(&ev0_));
  const cudaError_t err = cudaEventCreate(&ev1_);
  if (err != cudaSuccess) {
    cudaEventDestroy(ev0_);
    TI_CUDA_CHECK(err);
  }
}

StreamClock::~StreamClock() {
  cudaEventDestroy(ev0_);
  cudaEventDestroy(ev1_);
}

float StreamClock::gpu_ms(const std::function<void()>& enqueue) {
  TI_CUDA_CHECK(cudaEventRecord(ev0_, stream_));
  enqueue();
  TI_CUDA_CHECK(cudaEventRecord(ev1_, stream_));
  TI_CUDA_CHECK(cudaEventSynchronize(ev1_));
  float ms = 0;
  TI_CUDA_CHECK(cudaEventElapsedTime(&ms, ev0_, ev1_));
  return ms;
}

float StreamClock::replay_ms(const std::function<void()>& enqueue) {
  cudaGraphExec_t exec = nullptr;
  if (graphs_ && capture_graph(stream_, enqueue, &exec) == cudaSuccess) {
    TI_CUDA_CHECK(cudaGraphLaunch(exec, stream_));  // warm-up
    const float ms = gpu_ms([&] { TI_CUDA_CHECK(cudaGraphLaunch(exec, stream_)); });
    cudaGraphExecDestroy(exec);
    return ms;
  }
  enqueue();  // warm-up
  return gpu_ms(enqueue);
}

// ---- the engine's measurements ----

// GPU ms per decode step, `launch(pos)` enqueueing the step at pos, from `context` on (greedy sampling; 3 steps
// of warm-up). The cache is left holding benchmark tokens. Every measurement that writes the single sequence's
// cache resets it first: a throw on the way must not leave tokens_ describing a conversation whose cache holds
// benchmark data (the next generate would extend it: Engine._cached_prefix).
double CudaEngine::time_steps(int64_t context, int steps, const std::function<void(int64_t)>& launch) {
  if (context < 0 || context + std::max(steps, 3) > max_seq_)
    fail(ErrorKind::Request, "timing decode steps: context + max(steps, 3) must be <= max_seq_len");
  reset();
  kv_reserve(context + std::max(steps, 3));
  upload_sampling(SamplingConfig{});
  set_state(1, (int)context, 0);
  for (int i = 0; i < 3; i++) launch(context + i);
  set_state(1, (int)context, 0);
  const float ms = clock_->gpu_ms([&] {
    for (int i = 0; i < steps; i++) launch(context + i);
  });
  return ms / steps;
}

double CudaEngine::time_decode_step(int64_t context, int steps, DecodePath path) {
  if (context < 0 || context + steps >= max_seq_)
    fail(ErrorKind::Request, "time_decode_step: context + steps must be < max_seq_len");
  if (path == DecodePath::Persistent && !persistent_graph_)
    fail(ErrorKind::Request, "time_decode_step: this engine has no persistent decode step (CudaOptions.decode_path)");
  const double ms = time_steps(context, steps, [&](int64_t pos) { run_decode_step(pos, path); });
  if (persistent_) persistent_->check(stream_);
  reset();  // the cache now holds benchmark tokens
  return ms;
}

std::pair<std::vector<std::string>, std::vector<uint64_t>> CudaEngine::trace_step(int64_t context) {
  if (!dbuf_.trace) fail(ErrorKind::Request, "trace_step: build the engine with CudaOptions.trace = True");
  if (context < 0 || context + 3 > max_seq_) fail(ErrorKind::Request, "trace_step: context must be <= max_seq_len - 3");
  reset();
  kv_reserve(context + 3);  // (three warm-up steps from context on)
  upload_sampling(SamplingConfig{});
  set_state(1, (int)context, 0);
  // (the graph path's kernels, also where decode() replays the persistent step: persistent_trace_step traces that)
  for (int i = 0; i < 3; i++) run_decode_step(context + i, DecodePath::Graph);  // warm-up: the traced step follows others
  set_state(1, (int)context, 0);
  const size_t n = dbuf_.trace_words;
  TI_CUDA_CHECK(cudaMemsetAsync(dbuf_.trace, 0, n * 8, stream_));
  run_decode_step(context, DecodePath::Graph);
  run_decode_step(context + 1, DecodePath::Graph);  // the traced step: the second, so that the one before overlaps as usual
  std::vector<uint64_t> t(n);
  TI_CUDA_CHECK(cudaMemcpyAsync(t.data(), dbuf_.trace, n * 8, cudaMemcpyDeviceToHost, stream_));
  TI_CUDA_CHECK(cudaStreamSynchronize(stream_));
  reset();
  return {step_->trace_names(), t};
}

std::vector<int64_t> CudaEngine::persistent_trace_step(int64_t context) {
  if (!persistent_ || !persistent_->traced())
    fail(ErrorKind::Request, "persistent_trace_step: build the engine with CudaOptions.trace = True and "
                             "decode_path = persistent");
  if (context < 0 || context + 4 > max_seq_)
    fail(ErrorKind::Request, "persistent_trace_step: context must be <= max_seq_len - 4");
  reset();
  kv_reserve(context + 4);
  upload_sampling(SamplingConfig{});
  set_state(1, (int)context, 0);
  for (int i = 0; i < 3; i++) run_decode_step(context + i, DecodePath::Persistent);  // warm-up
  persistent_->clear_trace(stream_);
  run_decode_step(context + 3, DecodePath::Persistent);  // the traced step (its state: 3 steps on from context)
  std::vector<int64_t> rows = persistent_->read_trace(stream_);
  persistent_->check(stream_);
  reset();
  return rows;
}

double CudaEngine::time_attention(int64_t context, int reps) {
  if (context < 0 || context >= max_seq_) fail(ErrorKind::Request, "time_attention: context must be < max_seq_len");
  reset();
  kv_reserve(context + 1);
  set_state(1, (int)context, 0);
  auto run = [&] {
    for (int64_t l = 0; l < cfg_.n_layers; l++) {  // every layer's cache: L2-cold like the real step
      cuda::DecodeAttnParams a = step_->attn_params(l);
      a.early_trigger = false;  // (back to back, early triggers would overlap the layers: not one kernel's time)
      cuda::decode_attention(a, stream_, pdl_);
    }
  };
  const float ms = clock_->replay_ms([&] {
    for (int i = 0; i < reps; i++) run();
  });
  reset();
  return ms * 1e3 / (reps * cfg_.n_layers);
}

double CudaEngine::time_prefill(int64_t n_tokens, int reps) {
  if (!prefill_) fail(ErrorKind::Request, "time_prefill: this engine has no batched prefill");
  if (n_tokens < 1 || n_tokens > max_seq_)
    fail(ErrorKind::Request, "time_prefill: n_tokens must be in 1..max_seq_len=" + std::to_string(max_seq_));
  if (reps < 1) fail(ErrorKind::Request, "time_prefill: reps must be >= 1");
  std::vector<int32_t> toks((size_t)n_tokens);
  for (int64_t i = 0; i < n_tokens; i++) toks[(size_t)i] = (int32_t)((i * 7919 + 13) % cfg_.vocab);
  const int rows = prefill_->rows();
  auto run = [&] {
    for (int64_t c0 = 0; c0 < n_tokens; c0 += rows)
      prefill_->run_chunk(toks.data() + c0, (int)std::min<int64_t>(rows, n_tokens - c0), (int)c0, nullptr, 0);
  };
  reset();
  kv_reserve(n_tokens);
  run();  // warm-up: tunes this length's GEMM shapes
  const float ms = clock_->gpu_ms([&] {
    for (int i = 0; i < reps; i++) run();
  });
  reset();
  return ms / reps;
}

std::vector<std::pair<std::string, cuda::GemmTuning>> CudaEngine::gemm_table() const {
  if (!gemm_) return {};
  return named_gemm_table(*gemm_, cfg_);
}

}  // namespace ti
