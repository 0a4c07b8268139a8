// engines.cpp — the engines and their options: WeightStore, CpuEngine, CudaOptions (+ GemvPin), CudaEngine,
// and the enums they take (WFormat, DType, MatrixRole); the sequence slots both engines share (sequences.h);
// the KV pages' bookkeeping (KvPagePool, KvSequence).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "../cpp/core/batch_sample.h"
#include "../cpp/core/config.h"
#include "../cpp/core/engine_checks.h"
#include "../cpp/core/quant.h"
#include "../cpp/core/sampling.h"
#include "../cpp/core/weights.h"
#include "../cpp/cpu/cpu_engine.h"
#include "../cpp/gpu/kv_pages.h"
#include "../cpp/gpu/persistent_ring_plan.h"
#include "../cpp/gpu/persistent_schedule.h"
#include "common.h"
#include "sequences.h"
#ifdef TINYINFER_WITH_CUDA
#include "../cpp/gpu/cuda_engine.h"
#include "../cpp/gpu/plan_cache.h"
#endif

namespace tinyinfer_bindings {

using namespace nb::literals;

namespace {

#ifdef TINYINFER_WITH_CUDA
// A GEMV plan as Python sees it: one dict per role (CudaEngine.gemv_table, CudaEngine.read_plan).
nb::list plan_table(const ti::GemvPlan& plan) {
  nb::list out;
  for (const ti::GemvShapePlan& g : plan.shapes) {
    std::vector<int> tried_R, tried_bps;
    std::vector<int> tried_act8;  // 0 or 1
    std::vector<double> us;
    for (const ti::GemvTrial& t : g.tried) {
      tried_R.push_back(t.variant.rows_per_warp);
      tried_bps.push_back(t.variant.blocks_per_sm);
      tried_act8.push_back(t.variant.act8);
      us.push_back(t.us);
    }
    nb::dict d;
    d["role"] = g.role;
    d["name"] = ti::role_name(g.role);
    d["rows"] = g.rows;
    d["K"] = g.K;
    d["copies"] = g.copies;
    d["R"] = g.chosen.rows_per_warp;
    d["blocks_per_sm"] = g.chosen.blocks_per_sm;
    d["act8"] = g.chosen.act8;
    d["tried_R"] = tried_R;
    d["tried_blocks_per_sm"] = tried_bps;
    d["tried_act8"] = tried_act8;
    d["us"] = us;
    d["gb_per_s"] = g.gb_per_s;
    out.append(d);
  }
  return out;
}
#endif

// forward / decode / state: the same Python surface for every engine class.
template <typename E, typename Cls>
void bind_engine_common(Cls& cls) {
  cls.def_prop_ro("config", &E::config)
      .def_prop_ro("max_seq_len", &E::max_seq_len)
      .def_prop_ro("position", &E::position)
      .def_prop_ro("tokens", [](const E& e) { return e.tokens(); })
      .def("reset", &E::reset)
      .def(
          "forward",
          [](E& e, const std::vector<int64_t>& tokens, bool all_logits) {
            std::vector<int32_t> ids = to_ids(tokens);
            if (ids.empty()) ti::fail(ti::ErrorKind::Request, "forward: no tokens given");
            const size_t rows = all_logits ? ids.size() : 1;
            float* out = nullptr;
            F32Out arr = new_f32_array(rows, (size_t)e.config().vocab, &out);
            {
              nb::gil_scoped_release release;
              e.forward(ids.data(), (int64_t)ids.size(), all_logits, out);
            }
            return arr;
          },
          "tokens"_a, "all_logits"_a = false,
          "Run tokens at the current position; logits (len(tokens) or 1, vocab) float32.")
      .def(
          "decode",
          [](E& e, int64_t max_steps, const ti::SamplingConfig& s, const std::vector<int64_t>& stop_ids,
             uint64_t step0) {
            std::vector<int32_t> stops = to_ids(stop_ids);
            nb::gil_scoped_release release;
            return e.decode(max_steps, s, stops, step0);
          },
          "max_steps"_a, "sampling"_a, "stop_ids"_a, "step0"_a = 0,
          "Sample and run up to max_steps tokens; stops after a stop id (included).")
      .def(
          "decode_draft",
          [](E& e, const std::vector<int64_t>& draft, const ti::SamplingConfig& s,
             const std::vector<int64_t>& stop_ids, uint64_t step0) {
            std::vector<int32_t> ids = to_ids(draft), stops = to_ids(stop_ids);
            nb::gil_scoped_release release;
            return e.decode_draft(ids.data(), (int64_t)ids.size(), s, stops, step0);
          },
          "draft"_a, "sampling"_a, "stop_ids"_a, "step0"_a = 0,
          "Speculative decoding: the pending token and the draft run in one pass, then tokens are drawn as decode() "
          "draws them while each equals the draft's next (1 to len(draft) + 1; after a stop id, none).")
      .def("rewind", &E::rewind, "n"_a,
           "Keep the first n tokens (all run) and forget the rest; the history restarts as them, as prompt; a "
           "forward() comes before the next decode. n == position: nothing changes.");
}

#ifdef TINYINFER_WITH_CUDA
// One item of CudaEngine.load's iterable: (kind, name, data, scales, dtype, rope_heads, row0, (rows, K)).
//   kind "rows": data holds rows row0 .. of the tensor, (n, K) or (K) for a vector, in `dtype` (bf16 as uint16);
//   kind "int4" / "int8": the whole matrix in that layout, data (rows, row bytes) and scales (rows, ...);
//   kind "q4_0" / "q4_1": the whole matrix as GGUF stores it, data (rows, row bytes), converted on the device.
// The GIL is held while reading the item and released for the copy.
void load_item(ti::WeightStream& s, nb::handle item) {
  using Array = nb::ndarray<nb::c_contig, nb::device::cpu, nb::ro>;
  nb::tuple t = nb::cast<nb::tuple>(item);
  if (t.size() < 8) ti::fail(ti::ErrorKind::Request, "CudaEngine.load: an item must have 8 fields");
  const std::string kind = nb::cast<std::string>(t[0]), name = nb::cast<std::string>(t[1]);
  Array a = nb::cast<Array>(t[2]);
  const int rope_heads = nb::cast<int>(t[5]);
  const int64_t row0 = nb::cast<int64_t>(t[6]);
  const auto [rows, K] = nb::cast<std::pair<int64_t, int64_t>>(t[7]);
  if (kind == "rows") {
    const ti::DType d = ti::dtype_from_string(nb::cast<std::string>(t[4]));
    if (a.itemsize() != ti::dtype_size(d) || a.ndim() < 1 || a.ndim() > 2 || (int64_t)a.shape(a.ndim() - 1) != K)
      ti::fail(ti::ErrorKind::ModelFormat, "tensor '" + name + "': rows of " + std::to_string(a.itemsize()) +
                                               "-byte items with last dimension " +
                                               std::to_string(a.ndim() ? a.shape(a.ndim() - 1) : 0) + " do not match " +
                                               ti::to_string(d) + " rows of " + std::to_string(K));
    const int64_t n = a.ndim() == 2 ? (int64_t)a.shape(0) : 1;
    nb::gil_scoped_release release;
    s.load_rows(name, d, a.data(), row0, n, rows, K, rope_heads);
  } else if (kind == "int4" || kind == "int8") {
    Array sc = nb::cast<Array>(t[3]);
    if (a.ndim() != 2 || sc.ndim() != 2 || (int64_t)a.shape(0) != rows || (int64_t)sc.shape(0) != rows)
      ti::fail(ti::ErrorKind::ModelFormat, "tensor '" + name + "': " + kind + " data and scales must be (" +
                                               std::to_string(rows) + ", ...) arrays");
    const int64_t qb = (int64_t)(a.shape(1) * a.itemsize()), sb = (int64_t)(sc.shape(1) * sc.itemsize());
    nb::gil_scoped_release release;
    s.load_quantized(name, ti::wformat_from_string(kind), static_cast<const uint8_t*>(a.data()), qb,
                     static_cast<const uint8_t*>(sc.data()), sb, rows, K, rope_heads);
  } else if (kind == "q4_0" || kind == "q4_1") {
    if (a.ndim() != 2 || a.itemsize() != 1 || (int64_t)a.shape(0) != rows)
      ti::fail(ti::ErrorKind::ModelFormat, "tensor '" + name + "': " + kind + " blocks must be a (" +
                                               std::to_string(rows) + ", bytes) uint8 array");
    nb::gil_scoped_release release;
    s.load_q4_blocks(name, kind == "q4_1", static_cast<const uint8_t*>(a.data()), (int64_t)a.shape(1), rows, K,
                     rope_heads);
  } else {
    ti::fail(ti::ErrorKind::Request, "CudaEngine.load: unknown item kind '" + kind + "'");
  }
}
#endif

}  // namespace

void bind_engines(nb::module_& m) {
  nb::enum_<ti::WFormat>(m, "WFormat", "A matrix format on the device (cpp/core/quant.h).")
      .value("fp16", ti::WFormat::F16)
      .value("int8", ti::WFormat::I8)
      .value("int4", ti::WFormat::I4);
  nb::enum_<ti::DType>(m, "DType", "A source tensor's element type (bf16 arrives as uint16 bits).")
      .value("fp32", ti::DType::F32)
      .value("fp16", ti::DType::F16)
      .value("bf16", ti::DType::BF16);

  nb::class_<ti::WeightStore>(m, "WeightStore", "Named host tensors in, checked weights out (as stored).")
      .def(nb::init<const ti::ModelConfig&>(), "config"_a)
      .def(
          "add",
          [](ti::WeightStore& w, const std::string& name, nb::ndarray<nb::c_contig, nb::device::cpu, nb::ro> a,
             const DTypeArg& dtype) {
            const ti::DType t = to_dtype(dtype);
            if (a.itemsize() != ti::dtype_size(t))
              ti::fail(ti::ErrorKind::Request, "tensor '" + name + "': array item size " +
                                                   std::to_string(a.itemsize()) + " does not match dtype " +
                                                   ti::to_string(t));
            std::vector<int64_t> shape(a.ndim());
            for (size_t i = 0; i < a.ndim(); i++) shape[i] = (int64_t)a.shape(i);
            nb::gil_scoped_release release;
            w.add(name, t, a.data(), shape);
          },
          "name"_a, "array"_a, "dtype"_a,
          "Copy one tensor in. dtype: DType or 'fp32' | 'fp16' | 'bf16' (bf16 passed as a uint16 array).")
      .def("finish", &ti::WeightStore::finish)
      .def(
          "quantize", [](ti::WeightStore& w, const FormatArg& f) { w.quantize(to_format(f)); },
          "format"_a, nb::call_guard<nb::gil_scoped_release>(),
          "The CPU engine's quantized model: every matrix re-encoded as quantize(fp16(w)) (blocks kept).")
      .def_prop_ro("format", &ti::WeightStore::format)
      .def_prop_ro("bytes", &ti::WeightStore::bytes, "Memory held by the tensors.")
      .def(
          "held", [](const ti::WeightStore& w, const std::string& n) { return ti::to_string(w.get(n).held); },
          "name"_a, "How a tensor is held: 'fp32' | 'fp16' | 'bf16' | 'int8' | 'int4'.")
      .def(
          "add_int4",
          [](ti::WeightStore& w, const std::string& name,
             nb::ndarray<const uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> q,
             nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> sm) {
            const int64_t rows = (int64_t)q.shape(0), K = (int64_t)q.shape(1) * 2;
            if ((int64_t)sm.shape(0) != rows || (int64_t)sm.shape(1) != K / ti::kI4Group * 2)
              ti::fail(ti::ErrorKind::Request, "add_int4 '" + name + "': sm must be (rows, K / 32 * 2)");
            w.add_int4(name, q.data(), sm.data(), rows, K);
          },
          "name"_a, "q"_a, "sm"_a,
          "An already-int4 matrix (cpp/core/quant.h layout; a GGUF Q4_0/Q4_1 tensor converted block for block).")
      .def(
          "add_int8",
          [](ti::WeightStore& w, const std::string& name,
             nb::ndarray<const int8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> q,
             nb::ndarray<const uint16_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> d) {
            const int64_t rows = (int64_t)q.shape(0), K = (int64_t)q.shape(1);
            if ((int64_t)d.shape(0) != rows || (int64_t)d.shape(1) != (K + ti::kI8Block - 1) / ti::kI8Block)
              ti::fail(ti::ErrorKind::Request, "add_int8 '" + name + "': d must be (rows, K / 32)");
            w.add_int8(name, q.data(), d.data(), rows, K);
          },
          "name"_a, "q"_a, "d"_a,
          "An already-int8 matrix: a GGUF Q8_0 tensor's q (rows, K) int8 and d (rows, K / 32) fp16 bits.")
      .def(
          "is_imported",
          [](const ti::WeightStore& w, const std::string& n, const FormatArg& f) {
            return w.imported(n, to_format(f)) != nullptr;
          },
          "name"_a, "format"_a = "int4", "Whether `name` was imported (add_int4 / add_int8) in that format.")
      .def(
          "tensor",
          [](const ti::WeightStore& w, const std::string& n) {
            const ti::HostTensor& t = w.get(n);
            return numpy_copy(t.widen(), (size_t)t.rows(), (size_t)t.cols());
          },
          "name"_a, "A copy of the fp32 values the CPU engine computes with: (rows, cols); a vector as (n, 1).")
      .def("expected_shape", &ti::WeightStore::expected_shape, "name"_a)
      .def("required_names", &ti::WeightStore::required_names)
      .def_prop_ro("config", &ti::WeightStore::config);

  auto cpu = nb::class_<ti::CpuEngine>(m, "CpuEngine",
                                       "The fp32 reference engine: one sequence and max_batch sequence slots.");
  cpu.def(nb::init<std::shared_ptr<const ti::WeightStore>, int64_t, int64_t, int64_t, int>(), "weights"_a,
          "max_seq_len"_a, "threads"_a = 0, "max_batch"_a = 64, "act8"_a = 0,
          "threads: 0 = the cores available, else 1..1024; max_batch: sequence slots, 1..1024; act8: the quantized "
          "products' inputs rounded as the GPU's int8 inputs (CudaOptions.act8's twin): 0 never, -1 int4 "
          "matrices, -2 int4 matrices but down, 2 every quantized matrix.")
      .def_prop_ro("threads", &ti::CpuEngine::threads)
      .def_prop_ro("act8", &ti::CpuEngine::act8)
      .def_prop_ro("weight_bytes", &ti::CpuEngine::weight_bytes, "Host memory of the weights, as held.");
  bind_engine_common<ti::CpuEngine>(cpu);
  bind_sequences<ti::CpuEngine>(cpu);
  cpu.def(
      "seq_logits",
      [](const ti::CpuEngine& e, int64_t slot) {
        const std::vector<float>& l = e.seq_logits(slot);
        return numpy_copy(l, l.size());
      },
      "slot"_a, "The slot's current logits, float32 (vocab) (empty before its first prefill): the reference's "
      "window for tests.");

  // The paged KV cache's host bookkeeping (cpp/gpu/kv_pages.h: plain C++, in every build), for its CPU tests.
  nb::class_<ti::KvPagePool>(m, "KvPagePool", "A pool of KV-cache page ids with a free list.")
      .def(nb::init<int64_t, int, uint64_t>(), "n_pages"_a, "page_size"_a, "shuffle_seed"_a = 0)
      .def_prop_ro("page_size", &ti::KvPagePool::page_size)
      .def_prop_ro("n_pages", &ti::KvPagePool::n_pages)
      .def_prop_ro("free_pages", &ti::KvPagePool::free_pages)
      .def("pages_for", &ti::KvPagePool::pages_for, "positions"_a)
      .def("refs", &ti::KvPagePool::refs, "page"_a, "How many sequences hold the page (0: free).");
  nb::class_<ti::KvSequence>(m, "KvSequence", "One sequence's page table over a KvPagePool.")
      .def(nb::init<const ti::KvPagePool&, int64_t>(), "pool"_a, "max_positions"_a)
      .def("grow", &ti::KvSequence::grow, "pool"_a, "positions"_a,
           "Cover positions [0, positions) with pages; returns the first table index that changed.")
      .def("release", &ti::KvSequence::release, "pool"_a)
      .def("shrink", &ti::KvSequence::shrink, "pool"_a, "positions"_a,
           "Keep the pages of positions [0, positions); the rest back to the pool.")
      .def("share", &ti::KvSequence::share, "pool"_a, "src"_a, "pages"_a,
           "Give its pages back, then hold src's first `pages` pages too (nothing copied).")
      .def("unshare", &ti::KvSequence::unshare, "pool"_a, "j"_a,
           "Entry j made its own page where others hold it too: the page it held (to copy from), or -1.")
      .def("owned_pages", &ti::KvSequence::owned_pages, "pool"_a, "start"_a = 0,
           "Of its pages from table entry `start` on, those no other sequence holds.")
      .def_prop_ro("table", &ti::KvSequence::table)
      .def_prop_ro("max_pages", &ti::KvSequence::max_pages);

  // The persistent decode step's schedule (cpp/gpu/persistent_schedule.h: plain C++, in every build): built and
  // checked on the host; bound so that its checker is tested without a GPU (a broken schedule must be refused).
  nb::enum_<ti::TaskType>(m, "TaskType", "A task type of the persistent decode step.")
      .value("Embed", ti::TaskType::Embed)
      .value("Qkv", ti::TaskType::Qkv)
      .value("AttnPartial", ti::TaskType::AttnPartial)
      .value("AttnMerge", ti::TaskType::AttnMerge)
      .value("O", ti::TaskType::O)
      .value("GateUp", ti::TaskType::GateUp)
      .value("Down", ti::TaskType::Down)
      .value("LmHead", ti::TaskType::LmHead);
  nb::class_<ti::PTask>(m, "PTask", "One task of a persistent-step block: its unit and the counters it waits on / signals.")
      .def(nb::init<>())
      .def_rw("type", &ti::PTask::type)
      .def_rw("layer", &ti::PTask::layer)
      .def_rw("a", &ti::PTask::a)
      .def_rw("b", &ti::PTask::b)
      .def_rw("wait", &ti::PTask::wait)
      .def_rw("wait_count", &ti::PTask::wait_count)
      .def_rw("signal", &ti::PTask::signal)
      .def("__repr__", [](const ti::PTask& t) {
        return std::string("PTask(") + ti::task_name(t.type) + ", layer " + std::to_string(t.layer) + ", [" +
               std::to_string(t.a) + ", " + std::to_string(t.b) + "), wait " + std::to_string(t.wait) + " x" +
               std::to_string(t.wait_count) + ", signal " + std::to_string(t.signal) + ")";
      });
  nb::class_<ti::ScheduleShape>(m, "ScheduleShape", "What a persistent-step schedule is built from.")
      .def(nb::init<>())
      .def_rw("hidden", &ti::ScheduleShape::hidden)
      .def_rw("q_dim", &ti::ScheduleShape::q_dim)
      .def_rw("kv_dim", &ti::ScheduleShape::kv_dim)
      .def_rw("intermediate", &ti::ScheduleShape::intermediate)
      .def_rw("n_layers", &ti::ScheduleShape::n_layers)
      .def_rw("n_heads", &ti::ScheduleShape::n_heads)
      .def_rw("n_kv_heads", &ti::ScheduleShape::n_kv_heads)
      .def_rw("vocab", &ti::ScheduleShape::vocab)
      .def_rw("max_chunks", &ti::ScheduleShape::max_chunks)
      .def_rw("grid", &ti::ScheduleShape::grid)
      .def_rw("fused_merge", &ti::ScheduleShape::fused_merge);
  nb::class_<ti::PersistentSchedule>(m, "PersistentSchedule", "Per block of the persistent kernel, its tasks in order.")
      .def_rw("grid", &ti::PersistentSchedule::grid)
      .def_rw("n_counters", &ti::PersistentSchedule::n_counters)
      .def_rw("blocks", &ti::PersistentSchedule::blocks, "A list (per block) of lists of PTask (copied both ways).")
      .def_ro("final_counter", &ti::PersistentSchedule::final_counter)
      .def_prop_ro("n_tasks", &ti::PersistentSchedule::n_tasks);
  m.def("build_persistent_schedule", &ti::build_persistent_schedule, "shape"_a);
  m.def("check_persistent_schedule", &ti::check_persistent_schedule, "schedule"_a, "max_coresident"_a,
        "Raises DeviceError naming the first problem unless the schedule completes on max_coresident blocks.");
  // Its weight ring's plan (cpp/gpu/persistent_ring_plan.h), likewise plain C++.
  nb::class_<ti::RingTile>(m, "RingTile", "One tile of a block's ring plan: rows of one matrix into one slot.")
      .def_ro("task", &ti::RingTile::task)
      .def_prop_ro("type", [](const ti::RingTile& k) { return (ti::TaskType)k.type; })
      .def_ro("layer", &ti::RingTile::layer)
      .def_ro("row0", &ti::RingTile::row0)
      .def_ro("rows", &ti::RingTile::rows)
      .def_ro("bytes", &ti::RingTile::bytes)
      .def_ro("scale_bytes", &ti::RingTile::scale_bytes);
  nb::class_<ti::RingPlanShape>(m, "RingPlanShape", "What a ring plan is built from: slots, slot bytes, matrices.")
      .def(nb::init<>())
      .def_rw("slots", &ti::RingPlanShape::slots)
      .def_rw("slot_bytes", &ti::RingPlanShape::slot_bytes)
      .def("set_matrix",
           [](ti::RingPlanShape& s, ti::TaskType t, int rows, int row_bytes, int scale_row_bytes, int scale_alloc) {
             s.mats[(int)t] = ti::RingMatrix{rows, row_bytes, scale_row_bytes, scale_alloc};
           },
           "type"_a, "rows"_a, "row_bytes"_a, "scale_row_bytes"_a = 0, "scale_alloc"_a = 0);
  nb::class_<ti::RingPlan>(m, "RingPlan", "Per block of the persistent kernel, the tiles its ring streams, in order.")
      .def_ro("slots", &ti::RingPlan::slots)
      .def_ro("slot_bytes", &ti::RingPlan::slot_bytes)
      .def_rw("blocks", &ti::RingPlan::blocks, "A list (per block) of lists of RingTile (copied).")
      .def_rw("task_tiles", &ti::RingPlan::task_tiles, "Per block, per task: the tiles it consumes.")
      .def_prop_ro("n_tiles", &ti::RingPlan::n_tiles);
  m.def("build_ring_plan", &ti::build_ring_plan, "schedule"_a, "shape"_a);
  m.def("check_ring_plan", &ti::check_ring_plan, "plan"_a, "schedule"_a, "shape"_a, "other_smem"_a, "max_smem"_a,
        "Raises DeviceError naming the first problem unless the plan is safe (see persistent_ring_plan.h).");
  m.def("ring_plan_smem", &ti::ring_plan_smem, "slots"_a, "slot_bytes"_a);

#ifdef TINYINFER_WITH_CUDA
  nb::enum_<ti::MatrixRole>(m, "MatrixRole", "A GEMV shape of the decode step (cpp/gpu/gemv_plan.h).")
      .value("Qkv", ti::MatrixRole::Qkv)
      .value("O", ti::MatrixRole::O)
      .value("GateUp", ti::MatrixRole::GateUp)
      .value("Down", ti::MatrixRole::Down)
      .value("LmHead", ti::MatrixRole::LmHead);
  nb::class_<ti::GemvPin>(m, "GemvPin", "A GEMV variant forced for one role after tuning (CudaOptions.gemv_pins).")
      .def(
          "__init__",
          [](ti::GemvPin* p, ti::MatrixRole role, int rows_per_warp, int blocks_per_sm) {
            const ti::GemvPin pin{role, rows_per_warp, blocks_per_sm};
            ti::check_pin(pin);
            new (p) ti::GemvPin(pin);
          },
          "role"_a, "rows_per_warp"_a, "blocks_per_sm"_a,
          "rows_per_warp: 1, 2, 4, 8 (split-K) or 16 (the tensor-core product on the one row, blocks_per_sm 0); "
          "blocks_per_sm: 0 (a block per tile), 1 or 2.")
      .def_rw("role", &ti::GemvPin::role)
      .def_rw("rows_per_warp", &ti::GemvPin::rows_per_warp)
      .def_rw("blocks_per_sm", &ti::GemvPin::blocks_per_sm)
      .def("__repr__", [](const ti::GemvPin& p) {
        return std::string("GemvPin(") + ti::role_name(p.role) + ", " + std::to_string(p.rows_per_warp) + ", " +
               std::to_string(p.blocks_per_sm) + ")";
      });
  nb::enum_<ti::DecodePath>(m, "DecodePath", "Which decode pass CudaEngine.decode replays (CudaOptions.decode_path).")
      .value("Graph", ti::DecodePath::Graph)
      .value("Persistent", ti::DecodePath::Persistent)
      .value("Auto", ti::DecodePath::Auto);
  nb::class_<ti::CudaOptions>(m, "CudaOptions", "The GPU engine's options (cpp/gpu/cuda_options.h).")
      .def(nb::init<>())
      // (Engine copies the caller's options before it sets weights / act8 on them: copy.copy works)
      .def("__copy__", [](const ti::CudaOptions& o) { return o; })
      .def("__deepcopy__", [](const ti::CudaOptions& o, nb::dict) { return o; }, nb::arg("memo"))
      .def_rw("pdl", &ti::CudaOptions::pdl)
      .def_rw("early_trigger", &ti::CudaOptions::early_trigger)
      .def_rw("trace", &ti::CudaOptions::trace)
      .def_rw("graphs", &ti::CudaOptions::graphs)
      .def_rw("attn_chunk", &ti::CudaOptions::attn_chunk)
      .def_rw("gemv_rows", &ti::CudaOptions::gemv_rows)
      .def_rw("gemv_grid", &ti::CudaOptions::gemv_grid)
      .def_rw("gemv_resident_margin", &ti::CudaOptions::gemv_resident_margin)
      .def_rw("gemv_small_tiles", &ti::CudaOptions::gemv_small_tiles)
      .def_rw("gemv_step_check", &ti::CudaOptions::gemv_step_check)
      .def_rw("gemv_mma", &ti::CudaOptions::gemv_mma)
      .def_rw("act8", &ti::CudaOptions::act8)
      .def_rw("gemv_pins", &ti::CudaOptions::gemv_pins, "A list of GemvPin (assign a new list; it is copied).")
      .def_rw("decode_long_from", &ti::CudaOptions::decode_long_from)
      .def_rw("smem_carveout", &ti::CudaOptions::smem_carveout)
      .def_rw("one_chunk_graph", &ti::CudaOptions::one_chunk_graph)
      .def_rw("attn_tensor_cores", &ti::CudaOptions::attn_tensor_cores)
      .def_rw("batched_prefill", &ti::CudaOptions::batched_prefill)
      .def_rw("prefill_chunk", &ti::CudaOptions::prefill_chunk)
      .def_rw("gemm_autotune", &ti::CudaOptions::gemm_autotune)
      .def_rw("gemm_tune_cold", &ti::CudaOptions::gemm_tune_cold)
      .def_rw("max_batch", &ti::CudaOptions::max_batch)
      .def_rw("batch_gemv_f16_max", &ti::CudaOptions::batch_gemv_f16_max)
      .def_rw("batch_gemv_quant_max", &ti::CudaOptions::batch_gemv_quant_max)
      .def_rw("batch_pdl", &ti::CudaOptions::batch_pdl)
      .def_rw("batch_mma_max", &ti::CudaOptions::batch_mma_max)
      .def_rw("batch_mma_f16_max", &ti::CudaOptions::batch_mma_f16_max)
      .def_rw("batch_mma_f16_qkvo_max", &ti::CudaOptions::batch_mma_f16_qkvo_max)
      .def_rw("batch_mma_f16_down_max", &ti::CudaOptions::batch_mma_f16_down_max)
      .def_rw("batch_mma_ring", &ti::CudaOptions::batch_mma_ring)
      .def_rw("batch_down_k_slices", &ti::CudaOptions::batch_down_k_slices)
      .def_rw("batch_one_row_plan", &ti::CudaOptions::batch_one_row_plan)
      .def_rw("batch_act8_fused", &ti::CudaOptions::batch_act8_fused)
      .def_rw("draft_pass", &ti::CudaOptions::draft_pass)
      .def_rw("batch_mma_m_tiles", &ti::CudaOptions::batch_mma_m_tiles)
      .def_rw("batch_attn_span", &ti::CudaOptions::batch_attn_span)
      .def_rw("batch_attn_heads", &ti::CudaOptions::batch_attn_heads)
      .def_rw("kv_page_size", &ti::CudaOptions::kv_page_size)
      .def_rw("kv_pool_pages", &ti::CudaOptions::kv_pool_pages)
      .def_rw("kv_page_shuffle", &ti::CudaOptions::kv_page_shuffle)
      .def_rw("decode_path", &ti::CudaOptions::decode_path)
      .def_rw("persistent_prefetch", &ti::CudaOptions::persistent_prefetch)
      .def_rw("persistent_fused_merge", &ti::CudaOptions::persistent_fused_merge)
      .def_rw("persistent_blocks_per_sm", &ti::CudaOptions::persistent_blocks_per_sm)
      .def_rw("persistent_timeout_ms", &ti::CudaOptions::persistent_timeout_ms)
      .def_rw("persistent_ring", &ti::CudaOptions::persistent_ring)
      .def_rw("persistent_ring_slots", &ti::CudaOptions::persistent_ring_slots)
      .def_rw("persistent_ring_slot_kib", &ti::CudaOptions::persistent_ring_slot_kib)
      .def_rw("persistent_kv_stage", &ti::CudaOptions::persistent_kv_stage)
      .def_rw("plan_text", &ti::CudaOptions::plan_text,
              "A saved GEMV plan (CudaEngine.plan_text) to take instead of tuning, if made for this key; '': tune.")
      .def_prop_rw(
          "weights", [](const ti::CudaOptions& o) { return o.weights; },
          [](ti::CudaOptions& o, const FormatArg& f) { o.weights = to_format(f); },
          "The matrices' format on the device: WFormat or 'fp16' | 'int8' | 'int4' (quantized at load).");
  auto gpu = nb::class_<ti::CudaEngine>(m, "CudaEngine", "The GPU engine: fp16 weights, graph-replayed decode.");
  gpu.def_static(
          "load",
          [](const ti::ModelConfig& c, int64_t max_seq_len, ti::CudaOptions opt, nb::iterable items) {
            nb::gil_scoped_release release;
            return new ti::CudaEngine(c, max_seq_len, opt, [&](ti::WeightStream& s) {
              nb::gil_scoped_acquire acquire;  // the iterable is Python code
              for (nb::handle item : items) load_item(s, item);
            });
          },
          "config"_a, "max_seq_len"_a, "options"_a, "items"_a, nb::rv_policy::take_ownership,
          "Load the weights streamed from `items` (load_item in bindings/engines.cpp; loaders/base.py "
          "StreamItem): each tensor in its stored form, straight to the device. An error leaves nothing "
          "behind.")
      .def_static(
          "random",
          [](const ti::ModelConfig& c, int64_t max_seq_len, uint64_t seed, ti::CudaOptions opt) {
            nb::gil_scoped_release release;
            return new ti::CudaEngine(c, max_seq_len, seed, opt);
          },
          "config"_a, "max_seq_len"_a, "seed"_a = 0, "options"_a = ti::CudaOptions(),
          nb::rv_policy::take_ownership, "Random fp16 weights at the config's shape, made on the GPU (benchmarks).")
      .def_prop_ro("last_decode_ms", &ti::CudaEngine::last_decode_ms)
      .def_prop_ro("weight_bytes", &ti::CudaEngine::weight_bytes)
      .def_prop_ro("kv_cache_bytes", &ti::CudaEngine::kv_cache_bytes)
      .def_prop_ro("scratch_bytes", &ti::CudaEngine::scratch_bytes)
      .def_prop_ro("kv_pages",
                   [](const ti::CudaEngine& e) {
                     const auto [size, pool, used] = e.kv_pages();
                     return nb::make_tuple(size, pool, used);
                   },
                   "The paged KV cache: (positions per page, pages in the pool, pages the sequence holds).")
      .def_prop_ro("uses_pdl", &ti::CudaEngine::uses_pdl)
      .def_prop_ro("uses_graphs", &ti::CudaEngine::uses_graphs)
      .def_prop_ro("decode_path", &ti::CudaEngine::decode_path, "The pass decode() replays: Graph or Persistent.")
      .def("debug_skew_persistent_epoch", &ti::CudaEngine::debug_skew_persistent_epoch, "by"_a,
           "Tests: the next persistent step's waits can never succeed (it must end with a DeviceError).")
      .def_prop_ro("persistent_problem", &ti::CudaEngine::persistent_problem,
                   "Why DecodePath.Auto fell back to the graph path ('': it did not).")
      .def_prop_ro("persistent_grid",
                   [](const ti::CudaEngine& e) {
                     const auto [grid, coresident] = e.persistent_grid();
                     return nb::make_tuple(grid, coresident);
                   },
                   "(blocks of the persistent kernel, co-resident blocks the occupancy API allows); (0, 0): none.")
      .def_prop_ro("decode_long",
                   [](const ti::CudaEngine& e) {
                     const ti::GemvPlan& p = e.gemv_plan();
                     return nb::make_tuple(p.long_from, p.qkv_long.rows_per_warp, p.qkv_long.blocks_per_sm);
                   },
                   "The long-context decode graph: (from context, qkv R, qkv blocks per SM); from = -1: none.")
      .def_prop_ro("early_trigger", [](const ti::CudaEngine& e) { return e.gemv_plan().early_trigger; },
                   "Which decode-step kernels let their successor launch at their start (PDL; timed at load): 0 none, "
                   "1 the GEMVs but qkv, 2 those and the attention.")
      .def_prop_ro("smem_carveout", [](const ti::CudaEngine& e) { return e.gemv_plan().carveout; },
                   "The shared-memory carveout (percent) the decode step's kernels ask for; -1: the driver's choice.")
      .def_prop_ro("device_name", &ti::CudaEngine::device_name)
      .def_prop_ro("load_times",
                   [](const ti::CudaEngine& e) {
                     const ti::CudaEngine::LoadTimes& t = e.load_times();
                     nb::dict d;
                     d["weights"] = t.weights_s;
                     d["tune"] = t.tune_s;
                     d["graphs"] = t.graphs_s;
                     return d;
                   },
                   "Wall seconds of the load: weights (read + upload + conversion), tune (GEMV plan), graphs.")
      .def(
          "matrix_bytes",
          [](const ti::CudaEngine& e, int64_t layer, ti::MatrixRole role) {
            auto [q, sc] = e.matrix_bytes(layer, role);
            return nb::make_tuple(nb::bytes(reinterpret_cast<const char*>(q.data()), q.size()),
                                  nb::bytes(reinterpret_cast<const char*>(sc.data()), sc.size()));
          },
          "layer"_a, "role"_a,
          "A weight matrix's device bytes as stored: (q, scales) (tests; scales empty for fp16). MatrixRole "
          "qkv / o / gate_up / down, or lm_head (layer ignored).")
      .def("gemv_table", [](const ti::CudaEngine& e) { return plan_table(e.gemv_plan()); },
           "The load-time GEMV plan, one dict per role: the chosen variant (R, blocks_per_sm, act8) and every one "
           "timed.")
      .def_static("plan_key", &ti::CudaEngine::plan_key, "config"_a, "max_seq_len"_a, "options"_a,
                  "What a saved GEMV plan must have been made for (GPU, driver, build, model shape, options).")
      .def_static(
          "read_plan",
          [](const std::string& text, const std::string& key) {
            const ti::PlanRead r = ti::gemv_plan_from_text(text, key);
            if (!r.plan) return nb::make_tuple(nb::none(), nb::none(), nb::none(), r.problem);
            const ti::GemvPlan& p = *r.plan;
            nb::dict step;
            step["carveout"] = p.carveout;
            step["early_trigger"] = p.early_trigger;
            return nb::make_tuple(plan_table(p), nb::make_tuple(p.long_from, p.qkv_long.rows_per_warp,
                                                                p.qkv_long.blocks_per_sm, p.qkv_long.act8),
                                  step, "");
          },
          "text"_a, "key"_a,
          "Check a saved plan as the constructor does (no GPU needed): (gemv_table, (from, qkv R, qkv blocks per SM, "
          "qkv act8), {'carveout': percent or -1, 'early_trigger': 0 / 1 / 2}, '') or (None, None, None, problem) with "
          "problem 'stale: ...' or 'corrupt: ...'.")
      .def_static(
          "plan_by_steps",
          [](const std::vector<std::tuple<int, int, bool, std::vector<std::tuple<int, int, bool, double>>>>& roles,
             nb::callable step_us, double gain) {
            ti::GemvPlan plan;
            for (const auto& [R, bps, a8, tried] : roles) {
              ti::GemvShapePlan g;
              g.role = (ti::MatrixRole)plan.shapes.size();
              g.chosen = ti::GemvVariant{R, bps, a8};
              g.bytes = 1e6;
              for (const auto& [tR, tb, ta, us] : tried) g.tried.push_back({ti::GemvVariant{tR, tb, ta}, us});
              plan.shapes.push_back(g);
            }
            auto picks = [](const ti::GemvPlan& p) {
              nb::list out;
              for (const ti::GemvShapePlan& g : p.shapes)
                out.append(nb::make_tuple(g.chosen.rows_per_warp, g.chosen.blocks_per_sm, g.chosen.act8));
              return out;
            };
            const int flipped = ti::tune_plan_by_steps(
                plan, [&](const ti::GemvPlan& p) { return nb::cast<double>(step_us(picks(p))); }, gain);
            return nb::make_tuple(picks(plan), flipped);
          },
          "roles"_a, "step_us"_a, "gain"_a = 0.01,
          "tune_plan_by_steps (gemv_plan.h) on a plan given as [(R, blocks_per_sm, act8, [(R, bps, act8, us) "
          "tried])] with step_us([(R, bps, act8)] chosen) -> µs: ([(R, bps, act8)] kept, roles flipped). For tests.")
      .def_prop_ro("plan_text", &ti::CudaEngine::plan_text,
                   "This engine's GEMV plan as text to save ('' where gemv_pins changed it).")
      .def_prop_ro("plan_from_cache", &ti::CudaEngine::plan_from_cache)
      .def_prop_ro("plan_problem", &ti::CudaEngine::plan_problem,
                   "Why CudaOptions.plan_text was refused ('stale: ...' / 'corrupt: ...'); '' if it was not.")
      .def_prop_ro("tune_seconds", &ti::CudaEngine::tune_seconds,
                   "Seconds of the load spent on the GEMV plan, the decode graphs and the long-context decision.")
      .def_prop_ro("tune_parts",
                   [](const ti::CudaEngine& e) {
                     const double* t = e.tune_parts();
                     nb::dict d;
                     d["plan"] = t[0];
                     d["graphs"] = t[1];
                     d["long_context"] = t[2];
                     return d;
                   },
                   "tune_seconds in parts (s): plan (tuned or read), graphs (captured), long_context (decided).")
      .def("gemm_table",
           [](const ti::CudaEngine& e) {
             nb::list out;
             for (const auto& [name, t] : e.gemm_table()) {
               nb::dict d;
               d["name"] = name;
               d["M"] = t.M;
               d["N"] = t.N;
               d["K"] = t.K;
               d["out"] = t.out == ti::cuda::GemmOut::F16 ? "f16" : t.out == ti::cuda::GemmOut::AddF32 ? "add_f32"
                          : t.k_slices > 1 ? "f32/" + std::to_string(t.k_slices) + "k" : "f32";
               d["candidates"] = t.candidates;
               d["default_us"] = t.default_us;
               d["tuned_us"] = t.tuned_us;
               d["chosen"] = t.chosen;
               d["algo"] = t.algo;
               d["offered"] = t.offered;
               d["from_file"] = t.from_file;
               out.append(d);
             }
             return out;
           },
           "Every GEMM shape tuned so far: cuBLASLt's default vs the fastest candidate (µs, at the bucket's N).")
      .def_prop_ro("batched_prefill", &ti::CudaEngine::batched_prefill)
      .def("save_tactics", &ti::CudaEngine::save_tactics, "The tuned GEMM tactics as text (see load_tactics).")
      .def("load_tactics", &ti::CudaEngine::load_tactics, "text"_a,
           "Restore tactics saved by save_tactics (entries cuBLASLt still accepts); returns how many.")
      .def_prop_ro("tuned_gemms", &ti::CudaEngine::tuned_gemms)
      .def_static("gemm_fingerprint", &ti::cuda::Gemm::fingerprint,
                  "What saved tactics are valid for: the cuBLASLt version and the GPU.")
      .def("time_prefill", &ti::CudaEngine::time_prefill, "n_tokens"_a, "reps"_a,
           nb::call_guard<nb::gil_scoped_release>(), "GPU ms of one prefill of n_tokens at position 0 (resets).")
      .def(
          "last_logits",
          [](ti::CudaEngine& e) {
            const std::vector<float> l = e.last_logits();
            return numpy_copy(l, l.size());
          },
          "The logits of the last pass (prefill's last row, prompt token or decode()'s last step), float32 (vocab).")
      .def("time_decode_step", &ti::CudaEngine::time_decode_step, "context"_a, "steps"_a,
           "path"_a = ti::DecodePath::Auto, nb::call_guard<nb::gil_scoped_release>(),
           "GPU ms per graph-replayed decode step at this context; path: Auto (decode()'s pass), Graph or Persistent.")
      .def(
          "trace_step",
          [](ti::CudaEngine& e, int64_t context) {
            auto [names, t] = e.trace_step(context);
            const size_t per = names.empty() ? 0 : t.size() / names.size();
            nb::list out;
            for (size_t k = 0; k < names.size(); k++)
              out.append(nb::make_tuple(names[k], std::vector<uint64_t>(t.begin() + k * per, t.begin() + (k + 1) * per)));
            return out;
          },
          "context"_a,
          "CudaOptions.trace engines: one decode step; per kernel (name, kTraceBlocks x 6: global-timer ns at the "
          "start, after the PDL wait, after the prologue, at the end (0 = block absent) and, GEMVs only, after the "
          "first tile's first dot products, then the block's SM).")
      .def(
          "persistent_trace_step",
          [](ti::CudaEngine& e, int64_t context) {
            const std::vector<int64_t> rows = e.persistent_trace_step(context);
            constexpr size_t cols = ti::PersistentDecode::kTraceColumns;
            return numpy_copy(rows, rows.size() / cols, cols);
          },
          "context"_a,
          "CudaOptions.trace engines with the persistent step: one step at `context` (after 3 warm-up steps); int64 "
          "(tasks, 9): block, task type (0 embed, 1 qkv, 2 attn_partial, 3 attn_merge, 4 o, 5 gate_up, 6 down, "
          "7 lm_head), layer, a, b, global-timer ns at the task's start, after its wait, at its end, after its input's "
          "staging (GEMV and attention tasks; else 0) (0: not reached; all 0 in a build without -DTINYINFER_TRACE=ON).")
      .def("time_attention", &ti::CudaEngine::time_attention, "context"_a, "reps"_a,
           nb::call_guard<nb::gil_scoped_release>(), "GPU µs of one layer's decode attention at this context.");
  bind_engine_common<ti::CudaEngine>(gpu);
  bind_sequences<ti::CudaEngine>(gpu);
  gpu.def(
      "seq_logits",
      [](const ti::CudaEngine& e, int64_t slot) {
        const std::vector<float> l = e.seq_logits(slot);
        return numpy_copy(l, l.size());
      },
      "slot"_a, "The slot's current logits, float32 (vocab) (empty before its first prefill), copied from the "
      "device: tests.");
#endif
}

}  // namespace tinyinfer_bindings
