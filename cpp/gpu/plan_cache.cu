// plan_cache.cu — see plan_cache.h. (snprintf / strtod rather than iostreams, as in cuda/gemm.cu: an
// ostringstream crashed the process on the H200 machine's build.)
#include "plan_cache.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../../cuda/common.cuh"
#include "../core/errors.h"

namespace ti {

uint64_t fnv1a64(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

static const char* kMagic = "tinyinfer-gemv-plan";
static const MatrixRole kRoles[] = {MatrixRole::Qkv, MatrixRole::O, MatrixRole::GateUp, MatrixRole::Down,
                                    MatrixRole::LmHead};

std::string gemv_plan_to_text(const GemvPlan& plan, const std::string& key) {
  char buf[256];
  std::string body = std::string(kMagic) + " " + std::to_string(kPlanFormatVersion) + "\nkey " + key + "\n";
  for (const GemvShapePlan& g : plan.shapes) {
    std::snprintf(buf, sizeof(buf), "shape %s %d %d %d %d %.0f %d %d %d %.3f %zu", role_name(g.role), g.rows, g.K,
                  g.ld, g.copies, g.bytes, g.chosen.rows_per_warp, g.chosen.blocks_per_sm, (int)g.chosen.act8,
                  g.gb_per_s, g.tried.size());
    body += buf;
    for (const GemvTrial& t : g.tried) {
      std::snprintf(buf, sizeof(buf), " %d %d %d %.4f", t.variant.rows_per_warp, t.variant.blocks_per_sm,
                    (int)t.variant.act8, t.us);
      body += buf;
    }
    body += "\n";
  }
  std::snprintf(buf, sizeof(buf), "long %lld %d %d %d\n", (long long)plan.long_from, plan.qkv_long.rows_per_warp,
                plan.qkv_long.blocks_per_sm, (int)plan.qkv_long.act8);
  body += buf;
  body += "early " + std::to_string(plan.early_trigger) + "\n";
  body += "carveout " + std::to_string(plan.carveout) + "\n";
  std::snprintf(buf, sizeof(buf), "checksum %016llx\n", (unsigned long long)fnv1a64(body));
  return body + buf;
}

namespace {

std::vector<std::string> split_words(const std::string& line) {
  std::vector<std::string> w;
  size_t at = 0;
  while (at < line.size()) {
    const size_t sp = line.find(' ', at);
    const size_t end = sp == std::string::npos ? line.size() : sp;
    if (end > at) w.push_back(line.substr(at, end - at));
    at = end + 1;
  }
  return w;
}

// Whole-word numbers only: "12x" or "" is a parse error, not 12 or 0.
bool to_ll(const std::string& s, long long& v) {
  if (s.empty()) return false;
  char* end = nullptr;
  v = std::strtoll(s.c_str(), &end, 10);
  return *end == '\0';
}
bool to_int(const std::string& s, int& v) {
  long long x = 0;
  if (!to_ll(s, x) || x < -(1LL << 31) || x >= (1LL << 31)) return false;
  v = (int)x;
  return true;
}
bool to_double(const std::string& s, double& v) {
  if (s.empty()) return false;
  char* end = nullptr;
  v = std::strtod(s.c_str(), &end);
  return *end == '\0' && v >= 0 && v < 1e30;
}

bool to_flag(const std::string& s, bool& v) {
  if (s != "0" && s != "1") return false;
  v = s == "1";
  return true;
}
bool variant_ok(const GemvVariant& v, MatrixRole r) {
  return v.blocks_per_sm >= 0 && v.blocks_per_sm <= 2 && plan_variant_ok(v.rows_per_warp, r) &&
         (v.rows_per_warp != kGemvMmaOneRow || (v.blocks_per_sm == 0 && !v.act8));
}

// One "shape ..." line (words w) into g; false: malformed or out of range.
bool parse_shape(const std::vector<std::string>& w, GemvShapePlan& g) {
  if (w.size() < 12) return false;
  bool found = false;
  for (MatrixRole r : kRoles)
    if (w[1] == role_name(r)) g.role = r, found = true;
  int n = 0;
  if (!found || !to_int(w[2], g.rows) || !to_int(w[3], g.K) || !to_int(w[4], g.ld) || !to_int(w[5], g.copies) ||
      !to_double(w[6], g.bytes) || !to_int(w[7], g.chosen.rows_per_warp) || !to_int(w[8], g.chosen.blocks_per_sm) ||
      !to_flag(w[9], g.chosen.act8) || !to_double(w[10], g.gb_per_s) || !to_int(w[11], n))
    return false;
  if (g.rows < 1 || g.K < 1 || g.ld < g.K || g.copies < 1 || n < 0 || w.size() != 12 + 4 * (size_t)n ||
      !variant_ok(g.chosen, g.role))
    return false;
  for (int i = 0; i < n; i++) {
    GemvTrial t;
    const size_t at = 12 + 4 * (size_t)i;
    if (!to_int(w[at], t.variant.rows_per_warp) || !to_int(w[at + 1], t.variant.blocks_per_sm) ||
        !to_flag(w[at + 2], t.variant.act8) || !to_double(w[at + 3], t.us) || !variant_ok(t.variant, g.role))
      return false;
    g.tried.push_back(t);
  }
  return true;
}

// The checked lines (no "checksum") into a plan; "" or what is wrong.
std::string parse_body(const std::vector<std::string>& lines, GemvPlan& plan) {
  bool has_long = false, has_carveout = false, has_early = false;
  for (size_t i = 2; i < lines.size(); i++) {
    const std::vector<std::string> w = split_words(lines[i]);
    if (!w.empty() && w[0] == "shape") {
      GemvShapePlan g;
      if (!parse_shape(w, g)) return "line " + std::to_string(i + 1) + " is malformed";
      if (plan.find(g.role)) return std::string("role ") + role_name(g.role) + " appears twice";
      plan.shapes.push_back(g);
    } else if (w.size() == 5 && w[0] == "long" && !has_long) {
      long long from = 0;
      if (!to_ll(w[1], from) || !to_int(w[2], plan.qkv_long.rows_per_warp) ||
          !to_int(w[3], plan.qkv_long.blocks_per_sm) || !to_flag(w[4], plan.qkv_long.act8) || (from < 1 && from != -1) ||
          (from > 0 && !variant_ok(plan.qkv_long, MatrixRole::Qkv)))
        return "line " + std::to_string(i + 1) + " is malformed";
      plan.long_from = from;
      has_long = true;
    } else if (w.size() == 2 && w[0] == "early" && !has_early) {
      if (!to_int(w[1], plan.early_trigger) || plan.early_trigger < 0 || plan.early_trigger > 2)
        return "line " + std::to_string(i + 1) + " is malformed";
      has_early = true;
    } else if (w.size() == 2 && w[0] == "carveout" && !has_carveout) {
      if (!to_int(w[1], plan.carveout) || plan.carveout < -1 || plan.carveout > 100)
        return "line " + std::to_string(i + 1) + " is malformed";
      has_carveout = true;
    } else {
      return "line " + std::to_string(i + 1) + " is not a plan line";
    }
  }
  if (!has_long) return "no long-context line";
  if (!has_carveout) return "no carveout line";
  if (!has_early) return "no early-trigger line";
  if (plan.shapes.size() != sizeof(kRoles) / sizeof(kRoles[0])) return "not every role has a shape line";
  return "";
}

}  // namespace

PlanRead gemv_plan_from_text(const std::string& text, const std::string& key) {
  PlanRead r;
  // The checksum covers every byte before its own line, so a truncated or edited file is caught here.
  const size_t cut = text.rfind("checksum ");
  if (cut == std::string::npos || (cut > 0 && text[cut - 1] != '\n')) {
    r.problem = "corrupt: no checksum line";
    return r;
  }
  const std::string body = text.substr(0, cut);
  char want[32];
  std::snprintf(want, sizeof(want), "checksum %016llx", (unsigned long long)fnv1a64(body));
  std::string tail = text.substr(cut);
  while (!tail.empty() && (tail.back() == '\n' || tail.back() == '\r')) tail.pop_back();
  if (tail != want) {
    r.problem = "corrupt: the checksum does not match";
    return r;
  }
  std::vector<std::string> lines;
  for (size_t at = 0; at < body.size();) {
    size_t nl = body.find('\n', at);
    if (nl == std::string::npos) nl = body.size();
    lines.push_back(body.substr(at, nl - at));
    at = nl + 1;
  }
  const std::string head = std::string(kMagic) + " ";
  if (lines.size() < 2 || lines[0].compare(0, head.size(), head) != 0 || lines[1].compare(0, 4, "key ") != 0) {
    r.problem = "corrupt: not a tinyinfer GEMV plan";
    return r;
  }
  if (lines[0] != head + std::to_string(kPlanFormatVersion)) {
    r.problem = "stale: format " + lines[0].substr(head.size()) + ", this build reads " +
                std::to_string(kPlanFormatVersion);
    return r;
  }
  if (lines[1].substr(4) != key) {
    r.problem = "stale: made for " + lines[1].substr(4);
    return r;
  }
  GemvPlan plan;
  const std::string bad = parse_body(lines, plan);
  if (!bad.empty()) {
    r.problem = "corrupt: " + bad;
    return r;
  }
  r.plan = std::move(plan);
  return r;
}

#define TI_STR2(...) #__VA_ARGS__
#define TI_STR(...) TI_STR2(__VA_ARGS__)

std::string plan_device_id() {
  int dev = 0, driver = 0, runtime = 0;
  cudaDeviceProp prop{};
  TI_CUDA_CHECK(cudaGetDevice(&dev));
  TI_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  TI_CUDA_CHECK(cudaDriverGetVersion(&driver));
  TI_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  return std::string(prop.name) + " sm_" + std::to_string(prop.major * 10 + prop.minor) + " " +
         std::to_string(prop.multiProcessorCount) + " SMs, driver " + std::to_string(driver) + " runtime " +
         std::to_string(runtime);
}

std::string plan_build_id() {
#ifdef __CUDA_ARCH_LIST__
  const char* archs = TI_STR(__CUDA_ARCH_LIST__);
#else
  const char* archs = "?";
#endif
  // The compile time stands for the kernels' code: a rebuilt module may time differently. (The Python Engine
  // also names the file after its _core module's size and time, which covers rebuilds of other files.)
  return std::string("cuda ") + std::to_string(CUDART_VERSION) + " archs " + archs + " built " + __DATE__ + " " +
         __TIME__;
}

}  // namespace ti
