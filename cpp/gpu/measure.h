// measure.h — GPU timing on one stream (CUDA events around enqueued work) and graph capture.
#pragma once
#include <cuda_runtime.h>

#include <functional>

namespace ti {

// Captures what `record` launches on `s` into an instantiated graph. A throw from `record` ends the capture
// (discarding it) and propagates; a CUDA failure is returned, leaving no sticky error behind.
cudaError_t capture_graph(cudaStream_t s, const std::function<void()>& record, cudaGraphExec_t* out);

class StreamClock {
 public:
  // graphs: replay_ms times from a captured graph (else from the stream).
  StreamClock(cudaStream_t s, bool graphs);
  ~StreamClock();
  StreamClock(const StreamClock&) = delete;
  StreamClock& operator=(const StreamClock&) = delete;
  cudaStream_t stream() const { return stream_; }
  // GPU milliseconds of the work `enqueue` puts on the stream (waits for it).
  float gpu_ms(const std::function<void()>& enqueue);
  // GPU time of what `enqueue` launches, replayed from a CUDA graph where graphs are on (as the decode step
  // runs: stream launches from the host take ~3 us each, longer than a small GEMV, and would time the host
  // instead); timed from the stream where capture is off or fails. One warm-up run first.
  float replay_ms(const std::function<void()>& enqueue);

 private:
  cudaStream_t stream_;
  bool graphs_;
  cudaEvent_t ev0_ = nullptr, ev1_ = nullptr;
};

}  // namespace ti
