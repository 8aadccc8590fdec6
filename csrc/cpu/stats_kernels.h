// Torch-free CPU kernels: the state of one chunk of a StridedView, vectorised for the
// best instruction set this CPU has (chosen once at load time, overridable for tests).
#pragma once

#include <cstdint>
#include <string>

#include "../core/strided_view.h"

namespace gapmon {
namespace cpu {

// State of logical elements [lo, hi) of item `item` of `view` (multiplicity not applied).
core::State<double> chunk_state(const core::StridedView& view, int64_t item, int64_t lo, int64_t hi);

// Name of the instruction set in use: "avx512", "avx2" or "generic".
std::string active_isa();

// Whether the instruction set in use has AVX2, FMA and F16C ("avx2" or "avx512"): the numerics kernels
// follow the same selection.
bool selected_isa_has_avx2();
// Whether it is "avx512" (AVX-512 F and BW with the above).
bool selected_isa_has_avx512();

// Selects an instruction set ("avx512", "avx2", "generic" or "auto" for the best supported).
// Throws std::invalid_argument if the name is unknown or this CPU does not support it.
void select_isa(const std::string& name);

}  // namespace cpu
}  // namespace gapmon
