// module.cpp — tinyinfer._core: nanobind bindings only. Type conversion and argument checks, no math.
//   module.cpp    the module, error translation, ModelConfig, SamplingConfig
//   engines.cpp   the enums and option structs, WeightStore, CpuEngine, CudaEngine
//   ops.cpp       single operations / kernels on numpy arrays, for tests and benchmarks
//   kernel_tests  host drivers running one kernel on host arrays (CUDA builds)
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "../cpp/core/config.h"
#include "../cpp/core/errors.h"
#include "../cpp/core/sampling.h"
#include "common.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// The Python exception types of tinyinfer.errors, one per ti::ErrorKind (references kept for the process).
struct ErrorTypes {
  PyObject* model_format;
  PyObject* unsupported;
  PyObject* request;
  PyObject* device;
};

void bind_errors(nb::module_& m) {
  static ErrorTypes types{PyExc_RuntimeError, PyExc_RuntimeError, PyExc_RuntimeError, PyExc_RuntimeError};
  // tinyinfer/__init__.py imports tinyinfer.errors before this module. Imported on its own instead (only
  // nanobind's stubgen does that, at build time) it must not import the package — that would load an installed
  // tinyinfer._core next to this one — so every kind stays a plain RuntimeError there.
  nb::dict modules = nb::borrow<nb::dict>(nb::module_::import_("sys").attr("modules"));
  if (modules.contains("tinyinfer.errors")) {
    nb::handle errors = modules["tinyinfer.errors"];
    types = ErrorTypes{errors.attr("ModelFormatError").inc_ref().ptr(),
                       errors.attr("UnsupportedModelError").inc_ref().ptr(),
                       errors.attr("InvalidRequestError").inc_ref().ptr(),
                       errors.attr("DeviceError").inc_ref().ptr()};
  }
  nb::register_exception_translator(
      [](const std::exception_ptr& p, void* payload) {
        auto* t = static_cast<ErrorTypes*>(payload);
        try {
          std::rethrow_exception(p);
        } catch (const ti::Error& e) {
          PyObject* type = t->request;
          switch (e.kind()) {
            case ti::ErrorKind::ModelFormat: type = t->model_format; break;
            case ti::ErrorKind::Unsupported: type = t->unsupported; break;
            case ti::ErrorKind::Request: type = t->request; break;
            case ti::ErrorKind::Device: type = t->device; break;
          }
          PyErr_SetString(type, e.what());
        }
      },
      &types);
  (void)m;
}

void bind_config(nb::module_& m) {
  nb::class_<ti::ModelConfig>(m, "ModelConfig", "The shape of a Llama-family model (see cpp/core/config.h).")
      .def(nb::init<>())
      .def_rw("hidden", &ti::ModelConfig::hidden)
      .def_rw("intermediate", &ti::ModelConfig::intermediate)
      .def_rw("n_layers", &ti::ModelConfig::n_layers)
      .def_rw("n_heads", &ti::ModelConfig::n_heads)
      .def_rw("n_kv_heads", &ti::ModelConfig::n_kv_heads)
      .def_rw("head_dim", &ti::ModelConfig::head_dim)
      .def_rw("vocab", &ti::ModelConfig::vocab)
      .def_rw("rms_eps", &ti::ModelConfig::rms_eps)
      .def_rw("rope_theta", &ti::ModelConfig::rope_theta)
      .def_prop_rw(
          "rope_scaling", [](const ti::ModelConfig& c) { return std::string(ti::rope_scaling_name(c.rope_scaling)); },
          [](ti::ModelConfig& c, const std::string& s) {
            if (s == "none") c.rope_scaling = ti::RopeScaling::None;
            else if (s == "linear") c.rope_scaling = ti::RopeScaling::Linear;
            else if (s == "llama3") c.rope_scaling = ti::RopeScaling::Llama3;
            else ti::fail(ti::ErrorKind::Unsupported, "rope scaling '" + s + "' (supported: none, linear, llama3)");
          },
          "'none' | 'linear' | 'llama3'")
      .def_rw("rope_factor", &ti::ModelConfig::rope_factor)
      .def_rw("rope_low_freq_factor", &ti::ModelConfig::rope_low_freq_factor)
      .def_rw("rope_high_freq_factor", &ti::ModelConfig::rope_high_freq_factor)
      .def_rw("rope_original_max_pos", &ti::ModelConfig::rope_original_max_pos)
      .def_rw("tie_word_embeddings", &ti::ModelConfig::tie_word_embeddings)
      .def_rw("max_position_embeddings", &ti::ModelConfig::max_position_embeddings)
      .def_rw("bos_token_id", &ti::ModelConfig::bos_token_id)
      .def_rw("eos_token_ids", &ti::ModelConfig::eos_token_ids)
      .def_ro("q_dim", &ti::ModelConfig::q_dim)
      .def_ro("kv_dim", &ti::ModelConfig::kv_dim)
      .def_ro("group", &ti::ModelConfig::group)
      .def("validate", &ti::ModelConfig::validate, "Check every field and compute q_dim, kv_dim, group.")
      .def("__repr__", &ti::ModelConfig::to_string);

  nb::class_<ti::SamplingConfig>(m, "SamplingConfig")
      .def(nb::init<>())
      .def_rw("temperature", &ti::SamplingConfig::temperature)
      .def_rw("top_k", &ti::SamplingConfig::top_k)
      .def_rw("top_p", &ti::SamplingConfig::top_p)
      .def_rw("min_p", &ti::SamplingConfig::min_p)
      .def_rw("repetition_penalty", &ti::SamplingConfig::repetition_penalty)
      .def_rw("seed", &ti::SamplingConfig::seed)
      .def_rw("presence_penalty", &ti::SamplingConfig::presence_penalty)
      .def_rw("frequency_penalty", &ti::SamplingConfig::frequency_penalty)
      // (read as copies: assign a whole list, as cfg.bias_ids.append(t) changes nothing)
      .def_rw("bias_ids", &ti::SamplingConfig::bias_ids, "logit bias: the token ids (distinct; assign a list)")
      .def_rw("bias_values", &ti::SamplingConfig::bias_values, "logit bias: added to those logits (-inf: banned)")
      // (a numpy array both ways: a step's mask is copied in one memcpy, not converted word by word)
      .def_prop_rw(
          "allowed",
          [](const ti::SamplingConfig& s) { return tinyinfer_bindings::numpy_copy(s.allowed, s.allowed.size()); },
          [](ti::SamplingConfig& s, nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> a) {
            s.allowed.assign(a.data(), a.data() + a.shape(0));
          },
          nb::for_getter(nb::rv_policy::move),
          "structured outputs: the allowed tokens, one bit a token (uint32 words, bit t % 32 of word t / 32; an "
          "empty array: every token)")
      .def("validate", [](const ti::SamplingConfig& s) { ti::validate(s); })
      .def("validate", [](const ti::SamplingConfig& s, int64_t vocab) { ti::validate(s, vocab); }, "vocab"_a);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "tinyinfer's C++/CUDA core (private: use the tinyinfer package)";
  bind_errors(m);
  bind_config(m);
  tinyinfer_bindings::bind_engines(m);
  tinyinfer_bindings::bind_ops(m);
  nb::dict info;
  info["cuda"] = nb::bool_(
#ifdef TINYINFER_WITH_CUDA
      true
#else
      false
#endif
  );
  info["cuda_architectures"] = TINYINFER_CUDA_ARCHS;
  // Why there is no CUDA backend, as fields (CMakeLists.txt): "" in a CUDA build, else no-nvcc | no-cublaslt |
  // cuda-off; the nvcc version found ("" when none); the source tree built (for the reinstall command).
  info["no_cuda_reason"] = TINYINFER_NO_CUDA_REASON;
  info["nvcc_version"] = TINYINFER_NVCC_VERSION;
  info["source_dir"] = TINYINFER_SOURCE_DIR;
  info["openmp"] = nb::bool_(
#ifdef _OPENMP
      true
#else
      false
#endif
  );
  info["version"] = TINYINFER_VERSION;
  m.attr("build_info") = info;
  m.attr("MAX_LOGIT_BIAS") = ti::kMaxLogitBias;  // a SamplingConfig's logit-bias entries (min_tokens' bans included)
}
