// Views and values shared by the emulated kernel tests: a StridedView over host data of any dtype,
// and the values of one of its items in logical order (the references' input).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <vector>

#include "../../csrc/core/strided_view.h"

namespace emulated {

using gapmon::core::DType;
using gapmon::core::StridedView;

template <typename T> DType dtype_of();
template <> inline DType dtype_of<float>() { return DType::kFloat32; }
template <> inline DType dtype_of<double>() { return DType::kFloat64; }
template <> inline DType dtype_of<__half>() { return DType::kFloat16; }
template <> inline DType dtype_of<__nv_bfloat16>() { return DType::kBFloat16; }

inline double to_double(float x) { return x; }
inline double to_double(double x) { return x; }
inline double to_double(__half x) { return __half2float(x); }
inline double to_double(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> T from_float(float x) { return static_cast<T>(x); }
template <> inline __half from_float<__half>(float x) { return __float2half(x); }
template <> inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// A view of `items` items of shape `sizes` / `strides` (elements), item b at data + b * item_stride.
template <typename T>
StridedView view(const T* data, std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t items = 1,
                 int64_t item_stride = 0, int64_t repeat = 1) {
  StridedView v;
  v.data = data;
  v.dtype = dtype_of<T>();
  v.ndim = static_cast<int32_t>(sizes.size());
  v.item_numel = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    v.sizes[d] = sizes[d];
    v.strides[d] = strides[d];
    v.item_numel *= sizes[d];
  }
  v.items = items;
  v.item_stride = item_stride;
  v.repeat = repeat;
  if (v.item_numel == 0) v.ndim = 0;  // as tensor_views.h describes empty items
  return v;
}

// The values of item `item` of `v`, in logical order, each `repeat` times.
template <typename T>
std::vector<double> values_of(const StridedView& v, int64_t item) {
  std::vector<double> out;
  const T* base = static_cast<const T*>(v.data) + item * v.item_stride;
  std::vector<int64_t> index(v.ndim, 0);
  for (int64_t n = 0; n < v.item_numel; ++n) {
    int64_t offset = 0;
    for (int d = 0; d < v.ndim; ++d) offset += index[d] * v.strides[d];
    for (int64_t r = 0; r < v.repeat; ++r) out.push_back(to_double(base[offset]));
    for (int d = v.ndim - 1; d >= 0 && ++index[d] == v.sizes[d]; --d) index[d] = 0;
  }
  return out;
}

}  // namespace emulated
