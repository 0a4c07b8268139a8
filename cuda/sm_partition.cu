// sm_partition.cu — restrict_to_sms (sm_partition.cuh): the driver's green contexts, reached through the runtime's
// driver entry points (no link to libcuda).
#include <cuda.h>
#include <cuda_runtime.h>

#include <string>

#include "common.cuh"
#include "sm_partition.cuh"

namespace ti::cuda {

int g_sm_count_override = 0;  // read by sm_count() (common.cuh)

namespace {

template <typename F>
F entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  TI_CUDA_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12040, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || !fn)
    fail(ErrorKind::Device,
         std::string("restrict_to_sms: the driver has no ") + name + " (green contexts need CUDA 12.4+)");
  return reinterpret_cast<F>(fn);
}

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS)
    fail(ErrorKind::Device, std::string("restrict_to_sms: ") + what + " failed (CUresult " + std::to_string((int)r) + ")");
}

}  // namespace

SmPartition restrict_to_sms(int sms) {
  if (sms < 1) fail(ErrorKind::Request, "restrict_to_sms: sms must be >= 1, got " + std::to_string(sms));
  TI_CUDA_CHECK(cudaSetDevice(0));
  TI_CUDA_CHECK(cudaFree(nullptr));  // the primary context exists (the driver is initialised)
  auto get_dev = entry<CUresult (*)(CUdevice*, int)>("cuDeviceGet");
  auto get_res = entry<CUresult (*)(CUdevice, CUdevResource*, CUdevResourceType)>("cuDeviceGetDevResource");
  auto split = entry<CUresult (*)(CUdevResource*, unsigned*, const CUdevResource*, CUdevResource*, unsigned, unsigned)>(
      "cuDevSmResourceSplitByCount");
  auto gen = entry<CUresult (*)(CUdevResourceDesc*, CUdevResource*, unsigned)>("cuDevResourceGenerateDesc");
  auto create = entry<CUresult (*)(CUgreenCtx*, CUdevResourceDesc, CUdevice, unsigned)>("cuGreenCtxCreate");
  auto to_ctx = entry<CUresult (*)(CUcontext*, CUgreenCtx)>("cuCtxFromGreenCtx");
  auto set_cur = entry<CUresult (*)(CUcontext)>("cuCtxSetCurrent");

  CUdevice dev{};
  check(get_dev(&dev, 0), "cuDeviceGet");
  CUdevResource all{};
  check(get_res(dev, &all, CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource");
  SmPartition p;
  p.device_sms = (int)all.sm.smCount;
  p.min_partition = (int)all.sm.minSmPartitionSize;
  p.alignment = (int)all.sm.smCoscheduledAlignment;
  if (sms > p.device_sms)
    fail(ErrorKind::Request, "restrict_to_sms: " + std::to_string(sms) + " SMs asked, the device has " +
                                 std::to_string(p.device_sms));
  CUdevResource part{}, rest{};
  unsigned groups = 1;
  check(split(&part, &groups, &all, &rest, 0, (unsigned)sms), "cuDevSmResourceSplitByCount");
  if (groups < 1) fail(ErrorKind::Device, "restrict_to_sms: no partition of " + std::to_string(sms) + " SMs");
  CUdevResourceDesc desc{};
  check(gen(&desc, &part, 1), "cuDevResourceGenerateDesc");
  CUgreenCtx g{};
  check(create(&g, desc, dev, CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate");
  CUcontext ctx{};
  check(to_ctx(&ctx, g), "cuCtxFromGreenCtx");
  check(set_cur(ctx), "cuCtxSetCurrent");
  p.sms = (int)part.sm.smCount;
  g_sm_count_override = p.sms;
  return p;
}

}  // namespace ti::cuda
