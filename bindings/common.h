// common.h — helpers shared by the binding files (module.cpp, engines.cpp, ops.cpp): numpy arrays out,
// checked conversions in.
#pragma once
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <variant>
#include <vector>

#include "../cpp/core/errors.h"
#include "../cpp/core/quant.h"
#include "../cpp/core/weights.h"

namespace tinyinfer_bindings {

namespace nb = nanobind;

using F32Out = nb::ndarray<nb::numpy, float, nb::ndim<2>>;
using F32In2 = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32In1 = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
// A weight format from Python: the enum, or its name checked by ti::wformat_from_string (unknown: an error).
using FormatArg = std::variant<ti::WFormat, std::string>;
// A source dtype from Python: the enum, or its name checked by ti::dtype_from_string (unknown: an error).
using DTypeArg = std::variant<ti::DType, std::string>;

inline ti::WFormat to_format(const FormatArg& f) {
  if (const auto* s = std::get_if<std::string>(&f)) return ti::wformat_from_string(*s);
  return std::get<ti::WFormat>(f);
}

inline ti::DType to_dtype(const DTypeArg& d) {
  if (const auto* s = std::get_if<std::string>(&d)) return ti::dtype_from_string(*s);
  return std::get<ti::DType>(d);
}

inline F32Out new_f32_array(size_t rows, size_t cols, float** data) {
  float* buf = new float[rows * cols];
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  *data = buf;
  return F32Out(buf, {rows, cols}, owner);
}

// A new numpy array owning a copy of `v`, reshaped (rows, cols).
template <typename T>
inline nb::ndarray<nb::numpy, T, nb::ndim<2>> numpy_copy(const std::vector<T>& v, size_t rows, size_t cols) {
  T* buf = new T[v.size() ? v.size() : 1];
  std::copy(v.begin(), v.end(), buf);
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<2>>(buf, {rows, cols}, owner);
}

// A new 1-D numpy array owning a copy of the first n items of `v`.
template <typename T>
inline nb::ndarray<nb::numpy, T, nb::ndim<1>> numpy_copy(const std::vector<T>& v, size_t n) {
  T* buf = new T[n ? n : 1];
  std::copy(v.begin(), v.begin() + n, buf);
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(buf, {n}, owner);
}

// The packed matrix as numpy: q (rows, ld) uint8 and scales (rows, scale_halves) fp16 bits (cpp/core/quant.h).
inline nb::dict quant_dict(const std::vector<uint8_t>& q, const std::vector<uint16_t>& scales, int64_t rows,
                           int64_t ld, ti::WFormat f, int64_t K) {
  nb::dict d;
  d["q"] = numpy_copy(q, (size_t)rows, (size_t)ld);
  d["scales"] = numpy_copy(scales, (size_t)rows, (size_t)ti::scale_halves(f, K));
  return d;
}

inline std::vector<int32_t> to_ids(const std::vector<int64_t>& ids) {
  std::vector<int32_t> r(ids.size());
  for (size_t i = 0; i < ids.size(); i++) {
    if (ids[i] < INT32_MIN || ids[i] > INT32_MAX)
      ti::fail(ti::ErrorKind::Request, "token id " + std::to_string(ids[i]) + " is out of range");
    r[i] = (int32_t)ids[i];
  }
  return r;
}

// seq_sample's RNG counters from Python ints: none negative.
inline std::vector<uint64_t> to_steps(const std::vector<int64_t>& steps) {
  std::vector<uint64_t> r(steps.size());
  for (size_t i = 0; i < steps.size(); i++) {
    if (steps[i] < 0)
      ti::fail(ti::ErrorKind::Request, "step " + std::to_string(steps[i]) + " at index " + std::to_string(i) +
                                           " is negative");
    r[i] = (uint64_t)steps[i];
  }
  return r;
}

void bind_engines(nb::module_& m);  // engines.cpp
void bind_ops(nb::module_& m);      // ops.cpp
void bind_persistent_probe(nb::module_& ops);  // ops_probe.cpp (CUDA builds)

}  // namespace tinyinfer_bindings
