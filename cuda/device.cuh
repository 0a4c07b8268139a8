// device.cuh — what the CUDA runtime says about the GPUs here, without throwing: the package must import and
// the CPU engine must run on a machine with no GPU and no driver.
#pragma once
#include <string>

namespace ti::cuda {

struct DeviceStatus {
  bool usable = false;
  int count = 0;
  std::string name;     // of device 0
  int cc_major = 0, cc_minor = 0;
  size_t total_mem = 0;
  std::string reason;   // why not usable
};

DeviceStatus device_status();

}  // namespace ti::cuda
