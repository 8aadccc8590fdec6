// Schemas of the gapmon ops (TORCH_LIBRARY) and the Python module gapmon._C that loads them.
// Kernels: csrc/cpu/stats_cpu.cpp and csrc/cpu/numerics_cpu.cpp (CPU), csrc/torch/cuda_ops.cpp (CUDA);
// fake kernels for tracing live in gapmon/_backend.py.
#include <Python.h>
#include <torch/library.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "../core/numerics.h"
#include "../core/stats_state.h"
#include "../cpu/stats_kernels.h"

namespace gapmon {
namespace {

// Reports (and, given a name, selects) the CPU instruction set of the kernels; for tests and
// benchmarks that compare the AVX-512, AVX2 and generic code paths.
std::string cpu_isa(std::string request) {
  if (!request.empty()) {
    try {
      cpu::select_isa(request);
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK_VALUE(false, e.what());
    }
  }
  return cpu::active_isa();
}

std::string joined(const char* const* names, int count) {
  std::string out;
  for (int i = 0; i < count; ++i) out += (i ? "," : "") + std::string(names[i]);
  return out;
}

// Names of a numerics row's columns: zero, subnormal, e-125 .. e128, inf, nan, tiny, huge, then the moments.
std::string numerics_names() {
  std::string out = "zero,subnormal";
  for (int e = core::kExpMin; e <= core::kExpMax; ++e) out += ",e" + std::to_string(e);
  return out + "," + joined(core::kTrailingBinNames, 4) + "," + joined(core::kMomentNames, 5);
}

// The column layouts of statistics rows, partial states, activation accumulators and numerics rows,
// each as comma-separated names in column order (csrc/core is their one definition).
std::vector<std::string> layout() {
  return {joined(core::kStatNames, core::kNumStats), joined(core::kStateNames, core::kNumStateColumns),
          joined(core::kAccNames, core::kNumAccColumns), numerics_names()};
}

}  // namespace

TORCH_LIBRARY(gapmon, m) {
  // Statistics rows have 7 float64 columns (counts exact up to 2^53): count, mean, var, max_abs, norm,
  // nonfinite, zeros.
  m.def("tensor_stats(Tensor x, int correction=1) -> Tensor");
  m.def("instance_stats(Tensor x, int correction=1) -> Tensor");
  m.def("multi_tensor_stats(Tensor[] xs, int correction=1) -> Tensor");
  // Mergeable partial states have 7 float64 columns: count, mean, m2, max_abs, sumsq, nonfinite, zeros.
  m.def("multi_tensor_states(Tensor[] xs) -> Tensor");
  m.def("merge_states(Tensor states) -> Tensor");
  m.def("finalize_states(Tensor states, int correction=1) -> Tensor");
  // Per-instance statistics of x (dim 0 = instances) folded into row `row` of a float64
  // [modules, 6] accumulator (columns: instances, sum mean, sum var, sum norm, nonfinite, max).
  m.def("accumulate_instance_stats(Tensor x, Tensor(a!) acc, int row, int correction=1) -> ()");
  // Numerics rows (csrc/core/numerics.h): exponent-histogram bins of |x| (exact integer counts), then
  // count, mean and the central moments M2, M3, M4, all float64; mergeable across pieces of a tensor.
  m.def("numerics_states(Tensor[] xs) -> Tensor");
  m.def("merge_numerics_states(Tensor states) -> Tensor");
  // Both of the above in one pass over memory: (multi_tensor_states(xs), numerics_states(xs)).
  m.def("multi_tensor_states_and_numerics(Tensor[] xs) -> (Tensor, Tensor)");
  // What an optimizer step did per parameter: [N, 5] float64 rows (|after - before|^2, |before|^2,
  // |grad|^2, <after - before, grad>, count), one read of each tensor (csrc/core/update_stats.h).
  m.def("update_sums(Tensor[] before, Tensor[] after, Tensor[] grads) -> Tensor");
  // Per-block low-precision formats (csrc/core/block_formats.h): [N, F, 12] float64 rows of xs cast to the
  // formats coded in `formats`; `amaxes` (float64 [N], each tensor's largest finite |x|) for the formats
  // scaled per tensor (NVFP4, current scaling). One read of each element.
  m.def("block_numerics(Tensor[] xs, int[] formats, Tensor amaxes) -> Tensor");
  // (multi_tensor_states(xs), numerics_states(xs) if `numerics` else [N, 0], block_numerics(xs, formats, amaxes)) in
  // one pass over memory: each chunk's numerics and block groups are taken while it is in cache (on CUDA, with
  // numerics, one launch: each chunk re-read from L2 by the block that has just read it).
  m.def("states_numerics_blocks(Tensor[] xs, bool numerics, int[] formats, Tensor amaxes) -> (Tensor, Tensor, Tensor)");
  // accumulate_instance_stats, and x's numerics row merged into row `numerics_row` of a float64
  // [rows, C] table in place (after what the row holds), in one pass over x (GAPMonitor's activation
  // hooks with numerics on).
  m.def(
      "accumulate_instance_stats_and_numerics(Tensor x, Tensor(a!) acc, int row, int correction, Tensor(b!) numerics, "
      "int numerics_row) -> ()");
  // accumulate_instance_stats (and, with `numerics_on`, accumulate_instance_stats_and_numerics), and x's per-block
  // format rows (block_numerics; `amax`: float64 [1], x's largest finite |x| for the formats scaled per tensor,
  // measured by the op when None) merged into row `blocks_row` of a float64 [rows, F, 12] table in place:
  // GAPMonitor's activation hooks with block formats on, one pass over x (after the amax's read when a format needs
  // it; CUDA: one fused launch, except 1-D, non-contiguous or many-short-instance activations: two reads).
  m.def(
      "accumulate_instance_stats_numerics_blocks(Tensor x, Tensor(a!) acc, int row, int correction, bool numerics_on, "
      "Tensor(b!) numerics, int numerics_row, int[] formats, Tensor? amax, Tensor(c!) blocks, int blocks_row) -> ()");
  m.def("_cpu_isa(str request) -> str", &cpu_isa);
  m.def("_layout() -> str[]", &layout);
}

// Statistics are not differentiable: the Autograd keys fall through to the backend kernels, so an
// input that requires grad needs no detach() (one less Python call per tensor of a list) and the
// rows never require grad.
TORCH_LIBRARY_IMPL(gapmon, Autograd, m) {
  for (const char* op : {"tensor_stats", "instance_stats", "multi_tensor_stats", "multi_tensor_states", "merge_states",
                         "finalize_states", "accumulate_instance_stats", "numerics_states",
                         "merge_numerics_states", "multi_tensor_states_and_numerics",
                         "accumulate_instance_stats_and_numerics", "update_sums", "block_numerics",
                         "states_numerics_blocks", "accumulate_instance_stats_numerics_blocks"}) {
    m.impl(op, torch::CppFunction::makeFallthrough());
  }
}

}  // namespace gapmon

// Importing gapmon._C runs the static registrations above; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
