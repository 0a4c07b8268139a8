#include <cuda_runtime.h>

#include "device.cuh"

namespace ti::cuda {

DeviceStatus device_status() {
  DeviceStatus s;
  cudaError_t err = cudaGetDeviceCount(&s.count);
  if (err != cudaSuccess) {
    s.reason = std::string("CUDA runtime: ") + cudaGetErrorString(err);
    if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice)
      s.reason += " (no NVIDIA driver or GPU found, or the driver is older than this build's CUDA)";
    cudaGetLastError();  // clear the sticky error
    s.count = 0;
    return s;
  }
  if (s.count == 0) {
    s.reason = "no CUDA device found";
    return s;
  }
  cudaDeviceProp p{};
  err = cudaGetDeviceProperties(&p, 0);
  if (err != cudaSuccess) {
    s.reason = std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(err);
    return s;
  }
  s.name = p.name;
  s.cc_major = p.major;
  s.cc_minor = p.minor;
  s.total_mem = p.totalGlobalMem;
  if (p.major < 7 || (p.major == 7 && p.minor < 5)) {
    s.reason = "compute capability " + std::to_string(p.major) + "." + std::to_string(p.minor) +
               " is below the supported sm_75";
    return s;
  }
  s.usable = true;
  return s;
}

}  // namespace ti::cuda
