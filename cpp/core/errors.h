// errors.h — the core's exception types. The bindings map each kind onto the matching Python
// tinyinfer.TinyInferError subclass, so a message written here reaches the user unchanged.
#pragma once
#include <stdexcept>
#include <string>

namespace ti {

enum class ErrorKind {
  ModelFormat,   // a model file is corrupt, truncated, or holds a tensor of the wrong shape
  Unsupported,   // valid model, but something this engine cannot run
  Request,       // bad arguments to a call (token ids out of range, context too long, ...)
  Device,        // GPU missing, out of memory, a CUDA error
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg) : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

[[noreturn]] inline void fail(ErrorKind kind, const std::string& msg) { throw Error(kind, msg); }

}  // namespace ti
