// plan_cache.h — the GEMV plan across runs: its text form and the key it is valid for.
//
// A tuned GemvPlan (every role's pick and timings, the long-context graph decision, the decode step's shared-memory
// carveout and trigger points) is saved as text, so that a later load on the same GPU, driver, build and model
// shape takes it instead of tuning again (the Python Engine keeps the file: $TINYINFER_CACHE/plans/). The text
// names its format version and key and ends with a checksum of everything above it, so that a damaged file is never
// half-read and a file for another GPU, build or shape is never used: either is refused as a whole
// (PlanRead.problem says why) and the engine tunes instead.
//
//   tinyinfer-gemv-plan 4
//   key <the key: one line>
//   shape <role> <rows> <K> <ld> <copies> <bytes> <chosen R> <chosen blocks/SM> <chosen act8> <GB/s> <n tried>
//         (<R> <bps> <act8> <us>)*                                       (one line per role; act8: 0 or 1)
//   ...
//   long <long_from> <R> <bps> <act8>
//   early <which kernels trigger their successor at their start: 0 none, 1 the GEMVs but qkv, 2 also the attention>
//   carveout <percent, or -1: the driver's choice>
//   checksum <FNV-1a 64 of the lines above, 16 hex digits>
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "gemv_plan.h"

namespace ti {

constexpr int kPlanFormatVersion = 4;

std::string gemv_plan_to_text(const GemvPlan& plan, const std::string& key);

struct PlanRead {
  std::optional<GemvPlan> plan;  // empty: refused (problem says why)
  std::string problem;           // "stale: ..." (another key or format version) | "corrupt: ..." (damaged)
};
// The plan in `text` if it is whole (checksum, every field in range, every role once) and made for `key`.
PlanRead gemv_plan_from_text(const std::string& text, const std::string& key);

uint64_t fnv1a64(const std::string& s);

// The parts of a plan's key that are not the model or the options: the GPU (name, compute capability, SMs), the
// driver and runtime versions (device 0; throws ti::Error(Device) without one), and this build (CUDA version,
// architectures, when this file was compiled).
std::string plan_device_id();
std::string plan_build_id();

}  // namespace ti
