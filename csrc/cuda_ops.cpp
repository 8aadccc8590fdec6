// CUDA implementations of the gapmon ops: torch glue around the launchers in csrc/cuda.
// Builds the chunk table on the host, copies it to the device with one asynchronous copy from
// pinned memory, and launches on the current stream (no host synchronisation).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "cuda/stats_cuda.h"
#include "tensor_views.h"

namespace gapmon {
namespace {

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "gapmon.", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

// Copies the planned views to the device; the pinned staging buffer is kept alive by the caching
// host allocator until the copy has completed.
at::Tensor device_table(std::vector<core::StridedView>& views, const at::Device& device) {
  const int64_t bytes = static_cast<int64_t>(views.size() * sizeof(core::StridedView));
  at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), views.data(), bytes);
  return host.to(device, /*non_blocking=*/true);
}

// Runs the statistics kernels over `views`: float32 stats rows, or float64 states if `as_states`.
at::Tensor run(std::vector<core::StridedView>& views, int64_t rows, const at::Device& device, int64_t correction,
               bool as_states, const char* op) {
  const c10::cuda::CUDAGuard guard(device);
  const auto opts = at::TensorOptions().device(device);
  at::Tensor out = at::empty({rows, int64_t(as_states ? int(core::kNumStateColumns) : int(core::kNumStats))},
                             opts.dtype(as_states ? at::kDouble : at::kFloat));
  if (rows == 0) return out;
  const int64_t total_chunks = core::plan_chunks(views.data(), static_cast<int64_t>(views.size()));
  at::Tensor table = device_table(views, device);
  at::Tensor scratch = at::empty({total_chunks, core::kNumStateColumns}, opts.dtype(at::kDouble));
  check_launch(cuda::launch_stats(reinterpret_cast<const core::StridedView*>(table.data_ptr()),
                                  static_cast<int64_t>(views.size()), total_chunks, rows, scratch.data_ptr<double>(),
                                  as_states ? nullptr : out.data_ptr<float>(),
                                  as_states ? out.data_ptr<double>() : nullptr, correction,
                                  c10::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

at::Tensor tensor_stats_cuda(const at::Tensor& x, int64_t correction) {
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 0, "tensor_stats", keep_alive)};
  return run(views, 1, x.device(), correction, false, "tensor_stats").squeeze(0);
}

at::Tensor instance_stats_cuda(const at::Tensor& x, int64_t correction) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "gapmon.instance_stats: expected a tensor with a batch dimension (ndim >= 1)");
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 1, "instance_stats", keep_alive)};
  return run(views, x.size(0), x.device(), correction, false, "instance_stats");
}

at::Tensor multi_tensor_stats_cuda(at::TensorList xs, int64_t correction) {
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, "multi_tensor_stats", keep_alive);
  return run(views, static_cast<int64_t>(xs.size()), xs[0].device(), correction, false, "multi_tensor_stats");
}

at::Tensor multi_tensor_states_cuda(at::TensorList xs) {
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, "multi_tensor_states", keep_alive);
  return run(views, static_cast<int64_t>(xs.size()), xs[0].device(), 0, true, "multi_tensor_states");
}

at::Tensor merge_states_cuda(const at::Tensor& states) {
  TORCH_CHECK_VALUE(states.dim() == 3 && states.scalar_type() == at::kDouble && states.size(2) == core::kNumStateColumns,
                    "gapmon.merge_states: expected float64 [parts, tensors, 7] states, got ", states.scalar_type(), " ",
                    states.sizes());
  const c10::cuda::CUDAGuard guard(states.device());
  const at::Tensor s = states.contiguous();
  at::Tensor out = at::empty({s.size(1), core::kNumStateColumns}, s.options());
  check_launch(cuda::launch_merge_states(s.data_ptr<double>(), s.size(0), s.size(1), out.data_ptr<double>(),
                                         c10::cuda::getCurrentCUDAStream()),
               "merge_states");
  return out;
}

at::Tensor finalize_states_cuda(const at::Tensor& states, int64_t correction) {
  TORCH_CHECK_VALUE(states.dim() == 2 && states.scalar_type() == at::kDouble && states.size(1) == core::kNumStateColumns,
                    "gapmon.finalize_states: expected float64 [tensors, 7] states, got ", states.scalar_type(), " ",
                    states.sizes());
  const c10::cuda::CUDAGuard guard(states.device());
  const at::Tensor s = states.contiguous();
  at::Tensor out = at::empty({s.size(0), core::kNumStats}, s.options().dtype(at::kFloat));
  check_launch(cuda::launch_finalize_states(s.data_ptr<double>(), s.size(0), correction, out.data_ptr<float>(),
                                            c10::cuda::getCurrentCUDAStream()),
               "finalize_states");
  return out;
}

void accumulate_instance_stats_cuda(const at::Tensor& x, at::Tensor& acc, int64_t row, int64_t correction) {
  check_accumulator(x, acc, row);
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 1, "accumulate_instance_stats", keep_alive)};
  const at::Tensor stats = run(views, x.size(0), x.device(), correction, false, "accumulate_instance_stats");
  check_launch(cuda::launch_accumulate_instances(stats.data_ptr<float>(), x.size(0),
                                                 acc.data_ptr<double>() + row * core::kNumAccColumns,
                                                 c10::cuda::getCurrentCUDAStream()),
               "accumulate_instance_stats");
}

}  // namespace

TORCH_LIBRARY_IMPL(gapmon, CUDA, m) {
  m.impl("accumulate_instance_stats", &accumulate_instance_stats_cuda);
  m.impl("tensor_stats", &tensor_stats_cuda);
  m.impl("instance_stats", &instance_stats_cuda);
  m.impl("multi_tensor_stats", &multi_tensor_stats_cuda);
  m.impl("multi_tensor_states", &multi_tensor_states_cuda);
  m.impl("merge_states", &merge_states_cuda);
  m.impl("finalize_states", &finalize_states_cuda);
}

}  // namespace gapmon
