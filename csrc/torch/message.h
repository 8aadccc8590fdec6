// Refusal messages made into one std::string before they reach TORCH_CHECK.
//
// Why: on the GPU machines' image (torch 2.11.0+cu130, g++ 13.3; H100 2026-11-26, H200 2026-11-27) a
// std::ostringstream made in any torch extension crashed the process (SIGSEGV) as soon as a number was written to it,
// whatever the flags (C++17 or 20, default or hidden visibility, with or without OpenMP); text written to it did not.
// c10::str makes such a stream for a TORCH_CHECK message of several parts, so a refusal that named a number killed the
// user's process instead of raising. Here numbers, shapes and devices become text first (std::to_string,
// Device::str, which build no stream), and TORCH_CHECK gets one std::string, which it passes on as it is.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <string_view>
#include <type_traits>

namespace gapmon {
namespace message_parts {

inline std::string text(const char* s) { return s; }
inline std::string text(const std::string& s) { return s; }
inline std::string text(std::string_view s) { return std::string(s); }
inline std::string text(const c10::Device& d) { return d.str(); }
inline std::string text(at::ScalarType t) { return c10::toString(t); }

inline std::string text(c10::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

inline std::string text(c10::Layout layout) {
  switch (layout) {
    case c10::kStrided: return "Strided";
    case c10::kSparse: return "Sparse";
    case c10::kSparseCsr: return "SparseCsr";
    case c10::kSparseCsc: return "SparseCsc";
    case c10::kSparseBsr: return "SparseBsr";
    case c10::kSparseBsc: return "SparseBsc";
    case c10::kMkldnn: return "Mkldnn";
    case c10::kJagged: return "Jagged";
    default: return "layout " + std::to_string(static_cast<int>(layout));
  }
}

// integers and the unscoped enum constants of csrc/core (column counts)
template <typename T, std::enable_if_t<(std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>) ||
                                           std::is_enum_v<T>,
                                       int> = 0>
std::string text(T v) {
  return std::to_string(static_cast<long long>(v));
}

}  // namespace message_parts

// The parts (text, integers, shapes, devices, dtypes, layouts) joined into one string.
template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string out;
  (out += ... += message_parts::text(parts));
  return out;
}

}  // namespace gapmon
