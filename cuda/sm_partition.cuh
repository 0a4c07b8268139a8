// sm_partition.cuh — run this process's CUDA work on a subset of the GPU's SMs (a green context), for the
// benchmarks: an H100 held to 88 of its 132 SMs asks each SM for about the bytes per second an H200's 132 SMs
// must each stream (4.6 against 3.1 TB/s), so kernels bound by their per-SM issue rate show the H200's
// efficiency there (docs/perf/persistent.md §49). Never used by the engine itself.
#pragma once

namespace ti::cuda {

struct SmPartition {
  int sms = 0;                 // SMs in the partition
  int device_sms = 0;          // SMs of the whole device
  int min_partition = 0;       // the driver's granularity (cuDeviceGetDevResource)
  int alignment = 0;
};

// Makes a green context of at least `sms` SMs (rounded up to the driver's granularity) of device 0 current on the
// calling thread, so that every later runtime call of that thread (allocations, streams, launches, graphs) runs
// on those SMs only, and sets sm_count() (grid sizing) to the partition's size. Call it before anything else
// touches CUDA in the process (sm_count() is read once). Throws ti::Error(Device) where the driver has no green
// contexts (CUDA 12.4+) or the partition cannot be made.
SmPartition restrict_to_sms(int sms);

}  // namespace ti::cuda
