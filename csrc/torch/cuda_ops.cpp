// CUDA implementations of the gapmon ops: torch glue around the launchers in csrc/cuda.
// Plans the chunks on the host and launches on the current stream, with no host synchronisation.
// Up to cuda::kInlineViews views travel in the kernel parameters; a longer table is copied to
// the device from pinned memory, or through kernel parameters while the stream is being
// captured into a CUDA graph (a captured copy would read the pinned buffer again at every
// replay, after the caching host allocator may have reused it).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "../core/numerics.h"
#include "../cuda/block_cuda.h"
#include "../cuda/numerics_cuda.h"
#include "../cuda/stats_cuda.h"
#include "../cuda/update_cuda.h"
#include "message.h"
#include "tensor_views.h"

namespace gapmon {
namespace {

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, message("gapmon.", op, ": CUDA launch failed: ", cudaGetErrorString(err)));
}

// A device copy of `bytes` bytes of host data (whole 8-byte words) on `stream`; `storage` keeps it alive
// until the kernels that read it have been queued (the caching allocator orders reuse on the stream).
const void* device_copy(const void* data, int64_t bytes, const at::Device& device, cudaStream_t stream,
                        at::Tensor& storage, const char* op) {
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    storage = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    check_launch(cuda::launch_upload(data, bytes, storage.data_ptr(), stream), op);
  } else {
    // The pinned staging buffer is kept alive by the caching host allocator until the copy is done.
    at::Tensor host = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr(), data, bytes);
    storage = host.to(device, /*non_blocking=*/true);
  }
  return storage.data_ptr();
}

// The kernels' view table: inline in the kernel parameters, or a device copy of a long one.
cuda::ViewTable view_table(const std::vector<core::StridedView>& views, const at::Device& device,
                           cudaStream_t stream, at::Tensor& storage, const char* op) {
  cuda::ViewTable table;
  table.num = static_cast<int64_t>(views.size());
  if (views.size() <= static_cast<size_t>(cuda::kInlineViews)) {
    std::copy(views.begin(), views.end(), table.inline_views);
    return table;
  }
  static_assert(sizeof(core::StridedView) % sizeof(uint64_t) == 0, "views are uploaded as 8-byte words");
  const int64_t bytes = static_cast<int64_t>(views.size() * sizeof(core::StridedView));
  table.device = static_cast<const core::StridedView*>(device_copy(views.data(), bytes, device, stream, storage, op));
  return table;
}

// `n` zeroed kernel counters on `stream`, without a launch: every launch leaves the counters it used
// at zero (the group that counts an item's last piece resets it), so one buffer per (device, stream),
// zeroed when it is allocated or grown, serves every later call on that stream in order. While the
// stream is captured into a CUDA graph the graph gets counters of its own, zeroed by a recorded
// memset (`keep` holds them until the launch is queued), so replays never share counters with eager
// calls or with another graph.
//
// The per-stream buffers come from cudaMalloc, outside torch's caching allocator: a buffer first made
// while torch.compile's cudagraph trees route allocations into a private pool (their warm-up runs)
// would be handed to other tensors when that pool is rewound. They are keyed by cudaStreamGetId, which
// is unique for the life of the process: a stream created after another was destroyed may get the
// same handle, and must not share a buffer that the destroyed stream's last kernels may still use.
unsigned* zeroed_counters(int64_t n, const at::Device& device, cudaStream_t stream, at::Tensor& keep, const char* op) {
  const int64_t bytes = n * int64_t(sizeof(unsigned));
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    keep = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    check_launch(cudaMemsetAsync(keep.data_ptr(), 0, bytes, stream), op);
    return static_cast<unsigned*>(keep.data_ptr());
  }
  struct Buffer {
    void* data;
    int64_t bytes;
  };
  static std::mutex mutex;
  // Never freed, also when outgrown (another host thread may still be about to launch on an old
  // one): they must outlive every kernel queued before the process exits. Sizes double, so the
  // outgrown ones add up to less than the current one.
  static auto* buffers = new std::map<std::pair<int, unsigned long long>, std::vector<Buffer>>();
  unsigned long long stream_id = 0;
  check_launch(cudaStreamGetId(stream, &stream_id), op);
  const std::lock_guard<std::mutex> lock(mutex);
  std::vector<Buffer>& held = (*buffers)[{device.index(), stream_id}];
  if (held.empty() || held.back().bytes < bytes) {
    int64_t size = 4096;
    while (size < bytes) size *= 2;
    void* data = nullptr;
    check_launch(cudaMalloc(&data, size), op);
    check_launch(cudaMemsetAsync(data, 0, size, stream), op);  // ordered before this call's launch
    held.push_back({data, size});
  }
  return static_cast<unsigned*>(held.back().data);
}

// Runs the statistics kernel over `views`: float64 statistics rows, or float64 states if `as_states`.
// With `acc_row`, the rows are also folded into that accumulator row in the same launch. Items of
// several chunks need chunk states (one allocation, no memset) and counters (zeroed_counters); an
// item of one chunk needs neither. One launch per way of reading that the views need (a list that
// mixes many short rows with other tensors: two; any single tensor: one).
at::Tensor run(std::vector<core::StridedView>& views, int64_t rows, const at::Device& device, int64_t correction,
               bool as_states, const char* op, double* acc_row = nullptr) {
  const c10::cuda::CUDAGuard guard(device);
  const auto opts = at::TensorOptions().device(device);
  at::Tensor out = at::empty({rows, int64_t(as_states ? int(core::kNumStateColumns) : int(core::kNumStats))},
                             opts.dtype(at::kDouble));
  if (rows == 0) return out;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cuda::LaunchPlan plan = cuda::plan_launch(views.data(), static_cast<int64_t>(views.size()));
  at::Tensor table_storage;
  const cuda::ViewTable table = view_table(views, device, stream, table_storage, op);
  cuda::StatsTargets targets;
  (as_states ? targets.out_states : targets.out_stats) = out.data_ptr<double>();
  targets.correction = correction;
  targets.acc_row = acc_row;
  at::Tensor chunk_states, captured_counters;
  if (cuda::needs_chunk_states(plan.max_chunks_per_item)) {
    chunk_states = at::empty({plan.total_chunks * int64_t(core::kNumStateColumns)}, opts.dtype(at::kDouble));
    targets.chunk_states = chunk_states.data_ptr<double>();
  }
  if (cuda::needs_counters(plan.max_chunks_per_item, acc_row != nullptr)) {
    targets.counters = zeroed_counters(rows + 1, device, stream, captured_counters, op);
  }
  check_launch(cuda::launch_stats(table, plan, rows, targets, stream), op);
  return out;
}

at::Tensor tensor_stats_cuda(const at::Tensor& x, int64_t correction) {
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 0, "tensor_stats", keep_alive)};
  return run(views, 1, x.device(), correction, false, "tensor_stats").squeeze(0);
}

at::Tensor instance_stats_cuda(const at::Tensor& x, int64_t correction) {
  check_batch_dim(x, "instance_stats");
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 1, "instance_stats", keep_alive)};
  return run(views, x.size(0), x.device(), correction, false, "instance_stats");
}

// An empty list carries no device: nothing to launch (the dispatcher does not route one here,
// but a direct call must not read xs[0]).
at::Tensor empty_rows() {
  return at::empty({0, core::kNumStats}, at::TensorOptions().dtype(at::kDouble));
}

at::Tensor multi_tensor_stats_cuda(at::TensorList xs, int64_t correction) {
  if (xs.empty()) return empty_rows();
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, "multi_tensor_stats", keep_alive);
  return run(views, static_cast<int64_t>(xs.size()), xs[0].device(), correction, false, "multi_tensor_stats");
}

at::Tensor multi_tensor_states_cuda(at::TensorList xs) {
  if (xs.empty()) return empty_rows();
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, "multi_tensor_states", keep_alive);
  return run(views, static_cast<int64_t>(xs.size()), xs[0].device(), 0, true, "multi_tensor_states");
}

// The optimizer-update rows (csrc/core/update_stats.h): the operand table copied to the device, one
// launch for the chunks and one for the rows.
at::Tensor update_sums_cuda(at::TensorList before, at::TensorList after, at::TensorList grads) {
  std::vector<at::Tensor> keep_alive;
  std::vector<core::UpdateOperands> ops = update_operands(before, after, grads, keep_alive);
  const int64_t n = static_cast<int64_t>(ops.size());
  if (n == 0) return at::zeros({0, core::kUpdateColumns}, at::TensorOptions().dtype(at::kDouble));
  const at::Device device = before[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t total = core::plan_update_chunks(ops.data(), n);
  static_assert(sizeof(core::UpdateOperands) % sizeof(uint64_t) == 0, "operands are uploaded as 8-byte words");
  at::Tensor table;
  const auto* ops_device = static_cast<const core::UpdateOperands*>(
      device_copy(ops.data(), n * int64_t(sizeof(core::UpdateOperands)), device, stream, table, "update_sums"));
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor chunk_sums = at::empty({total, core::kUpdateSums}, options);
  at::Tensor out = at::empty({n, core::kUpdateColumns}, options);
  check_launch(cuda::launch_update_sums(ops_device, n, total, chunk_sums.data_ptr<double>(), out.data_ptr<double>(),
                                        stream),
               "update_sums");
  return out;
}

// The per-block format rows [N, F, kNumBlockColumns] of prepared operands (csrc/core/block_formats.h; amax: the
// operands' tensor amaxes on the device, or null when no format needs one): the operand table copied to the
// device, one launch for the chunks and one for the rows.
at::Tensor block_rows_of_cuda(std::vector<core::BlockOperand>& ops, const std::vector<core::BlockFormat>& formats,
                              const double* amax, const at::Device device, const char* op) {
  const int64_t n = static_cast<int64_t>(ops.size());
  if (n == 0) return at::empty({0, static_cast<int64_t>(formats.size()), core::kNumBlockColumns}, at::kDouble);
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cuda::BlockFormatList list;
  list.num = static_cast<int>(formats.size());
  for (int f = 0; f < list.num; ++f) list.codes[f] = formats[f];
  const int64_t total = core::plan_block_chunks(ops.data(), n);
  static_assert(sizeof(core::BlockOperand) % sizeof(uint64_t) == 0, "operands are uploaded as 8-byte words");
  at::Tensor table;
  const auto* ops_device = static_cast<const core::BlockOperand*>(
      device_copy(ops.data(), n * int64_t(sizeof(core::BlockOperand)), device, stream, table, op));
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor chunk_rows = at::empty({total, list.num, core::kNumBlockColumns}, options);
  at::Tensor out = at::empty({n, list.num, core::kNumBlockColumns}, options);
  check_launch(cuda::launch_block_numerics(ops_device, n, total, list, amax, chunk_rows.data_ptr<double>(),
                                           out.data_ptr<double>(), stream),
               op);
  return out;
}

at::Tensor block_numerics_cuda(at::TensorList xs, at::IntArrayRef format_codes, const at::Tensor& amaxes) {
  const std::vector<core::BlockFormat> formats = block_formats_of(format_codes);
  std::vector<at::Tensor> keep_alive;
  std::vector<core::BlockOperand> ops = block_operands(xs, formats, amaxes, keep_alive);
  if (ops.empty()) return block_rows_of_cuda(ops, formats, nullptr, at::Device(at::kCPU), "block_numerics");
  const double* amax = any_needs_amax(formats) ? amaxes.data_ptr<double>() : nullptr;
  return block_rows_of_cuda(ops, formats, amax, xs[0].device(), "block_numerics");
}

at::Tensor merge_states_cuda(const at::Tensor& states) {
  check_states(states, 3, "merge_states");
  const c10::cuda::CUDAGuard guard(states.device());
  const at::Tensor s = states.contiguous();
  at::Tensor out = at::empty({s.size(1), core::kNumStateColumns}, s.options());
  check_launch(cuda::launch_merge_states(s.data_ptr<double>(), s.size(0), s.size(1), out.data_ptr<double>(),
                                         c10::cuda::getCurrentCUDAStream()),
               "merge_states");
  return out;
}

at::Tensor finalize_states_cuda(const at::Tensor& states, int64_t correction) {
  check_states(states, 2, "finalize_states");
  const c10::cuda::CUDAGuard guard(states.device());
  const at::Tensor s = states.contiguous();
  at::Tensor out = at::empty({s.size(0), core::kNumStats}, s.options());
  check_launch(cuda::launch_finalize_states(s.data_ptr<double>(), s.size(0), correction, out.data_ptr<double>(),
                                            c10::cuda::getCurrentCUDAStream()),
               "finalize_states");
  return out;
}

// Runs the statistics-and-numerics kernel over `views`, planned by cuda::plan_launch with no view
// read by warps (tensors always; instances unless they are many short rows): numerics rows into
// numerics.out, statistics where `stats` says. Adds the scratch the plan and the targets need: chunk
// states and chunk numerics rows (one allocation each, no memset) and counters.
void launch_with_numerics(std::vector<core::StridedView>& views, const cuda::LaunchPlan& plan, int64_t rows,
                          const at::Device& device, cuda::StatsTargets stats, cuda::NumericsTargets numerics,
                          const char* op, const cuda::FusedBlocks& fused = cuda::FusedBlocks()) {
  const auto opts = at::TensorOptions().device(device).dtype(at::kDouble);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor table_storage;
  const cuda::ViewTable table = view_table(views, device, stream, table_storage, op);
  const bool several = cuda::needs_chunk_states(plan.max_chunks_per_item);
  at::Tensor chunk_states, chunk_rows, captured_counters;
  if (several) {
    chunk_states = at::empty({plan.total_chunks * int64_t(core::kNumStateColumns)}, opts);
    stats.chunk_states = chunk_states.data_ptr<double>();
  }
  if (several || numerics.merge_items) {
    chunk_rows = at::empty({plan.total_chunks, int64_t(core::kNumNumericsColumns)}, opts);
    numerics.chunk_rows = chunk_rows.data_ptr<double>();
  }
  if (several || numerics.merge_items || stats.acc_row != nullptr) {
    stats.counters = zeroed_counters(rows + 1, device, stream, captured_counters, op);
  }
  check_launch(cuda::launch_stats_and_numerics(table, plan, rows, stats, numerics, stream, fused), op);
}

// Numerics rows (csrc/core/numerics.h) of every tensor and, if `with_states`, their statistics states,
// read in one pass (one launch): {states or an undefined tensor, numerics rows}.
std::pair<at::Tensor, at::Tensor> run_with_numerics(at::TensorList xs, bool with_states, const char* op) {
  const auto columns = int64_t(core::kNumNumericsColumns);
  const auto host = at::TensorOptions().dtype(at::kDouble);
  if (xs.empty()) {
    return {with_states ? at::empty({0, int64_t(core::kNumStateColumns)}, host) : at::Tensor(), at::empty({0, columns}, host)};
  }
  std::vector<at::Tensor> keep_alive;
  auto views = views_of(xs, op, keep_alive);
  const at::Device device = xs[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const auto opts = at::TensorOptions().device(device).dtype(at::kDouble);
  const int64_t rows = static_cast<int64_t>(xs.size());
  at::Tensor out = at::empty({rows, columns}, opts);
  at::Tensor states = with_states ? at::empty({rows, int64_t(core::kNumStateColumns)}, opts) : at::Tensor();
  cuda::StatsTargets stats;
  if (with_states) stats.out_states = states.data_ptr<double>();
  cuda::NumericsTargets numerics;
  numerics.out = out.data_ptr<double>();
  const cuda::LaunchPlan plan = cuda::plan_launch(views.data(), rows);  // single items: by blocks, in order
  launch_with_numerics(views, plan, rows, device, stats, numerics, op);
  return {states, out};
}

at::Tensor numerics_states_cuda(at::TensorList xs) { return run_with_numerics(xs, false, "numerics_states").second; }

std::tuple<at::Tensor, at::Tensor> multi_tensor_states_and_numerics_cuda(at::TensorList xs) {
  auto [states, numerics] = run_with_numerics(xs, true, "multi_tensor_states_and_numerics");
  return {states, numerics};
}

at::Tensor merge_numerics_states_cuda(const at::Tensor& states) {
  check_numerics_states(states);
  const c10::cuda::CUDAGuard guard(states.device());
  const at::Tensor s = states.contiguous();
  at::Tensor out = at::empty({s.size(1), core::kNumNumericsColumns}, s.options());
  check_launch(cuda::launch_merge_numerics(s.data_ptr<double>(), s.size(0), s.size(1), out.data_ptr<double>(),
                                           c10::cuda::getCurrentCUDAStream()),
               "merge_numerics_states");
  return out;
}

void accumulate_instance_stats_cuda(const at::Tensor& x, at::Tensor& acc, int64_t row, int64_t correction) {
  check_accumulator(x, acc, row);
  const c10::cuda::CUDAGuard guard(x.device());  // the fold below runs on x's device too, not the current one
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> views{make_view(x, 1, "accumulate_instance_stats", keep_alive)};
  run(views, x.size(0), x.device(), correction, false, "accumulate_instance_stats",
      acc.data_ptr<double>() + row * core::kNumAccColumns);
}

// The instance fold of accumulate_instance_stats (the same bits) and x's numerics merged into the table
// row, in the kernel. Instances read by blocks: one launch, one read of x (the numerics of every chunk
// of every instance are merged by the block that writes the last row). Many short instances, which the
// statistics kernel reads by warps: the fold launch, then the numerics kernel over x as one tensor
// (two reads of x).
void accumulate_instance_stats_and_numerics_cuda(const at::Tensor& x, at::Tensor& acc, int64_t row, int64_t correction,
                                                 at::Tensor& numerics_table, int64_t numerics_row) {
  const char* op = "accumulate_instance_stats_and_numerics";
  check_accumulator(x, acc, row, op);
  check_numerics_table(x, numerics_table, numerics_row);
  const c10::cuda::CUDAGuard guard(x.device());
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> instances{make_view(x, 1, op, keep_alive)};
  const int64_t items = x.size(0);
  double* acc_row = acc.data_ptr<double>() + row * core::kNumAccColumns;
  cuda::NumericsTargets numerics;
  numerics.out = numerics_table.data_ptr<double>() + numerics_row * core::kNumNumericsColumns;
  numerics.accumulate = true;
  const cuda::LaunchPlan plan = cuda::plan_launch(instances.data(), 1);
  if (plan.warp_chunks == 0) {
    at::Tensor rows = at::empty({items, int64_t(core::kNumStats)}, acc.options());
    cuda::StatsTargets stats;
    stats.out_stats = rows.data_ptr<double>();
    stats.correction = correction;
    stats.acc_row = acc_row;
    numerics.merge_items = true;
    launch_with_numerics(instances, plan, items, x.device(), stats, numerics, op);
    return;
  }
  run(instances, items, x.device(), correction, false, op, acc_row);
  std::vector<core::StridedView> whole{make_view(x, 0, op, keep_alive)};
  launch_with_numerics(whole, cuda::plan_launch(whole.data(), 1), 1, x.device(), cuda::StatsTargets(), numerics, op);
}

// The statistics states, the numerics rows and the per-block format rows of xs in one launch that reads each
// tensor from DRAM once (launch_stats_and_numerics with FusedBlocks: each chunk is read again from L2 by the
// block that has just read it for the statistics), then the merge of each tensor's chunk rows. A tensor that
// is not contiguous is cast by the block kernel from its contiguous copy. Without `numerics`: the statistics
// launch and the block kernel.
std::tuple<at::Tensor, at::Tensor, at::Tensor> states_numerics_blocks_cuda(at::TensorList xs, bool with_numerics,
                                                                           at::IntArrayRef format_codes,
                                                                           const at::Tensor& amaxes) {
  const char* op = "states_numerics_blocks";
  const std::vector<core::BlockFormat> formats = block_formats_of(format_codes, op);
  const int64_t n = static_cast<int64_t>(xs.size()), num_formats = static_cast<int64_t>(formats.size());
  const int64_t numerics_width = with_numerics ? core::kNumNumericsColumns : 0;
  if (n == 0) {
    const auto host = at::TensorOptions().dtype(at::kDouble);
    return {at::empty({0, int64_t(core::kNumStateColumns)}, host), at::empty({0, numerics_width}, host),
            at::empty({0, num_formats, int64_t(core::kNumBlockColumns)}, host)};
  }
  const at::Device device = xs[0].device();
  const c10::cuda::CUDAGuard guard(device);
  const auto opts = at::TensorOptions().device(device).dtype(at::kDouble);
  if (!with_numerics) {
    return {multi_tensor_states_cuda(xs), at::empty({n, 0}, opts), block_numerics_cuda(xs, format_codes, amaxes)};
  }
  std::vector<at::Tensor> keep_alive;
  std::vector<core::BlockOperand> ops = block_operands(xs, formats, amaxes, keep_alive, op);
  auto views = views_of(xs, op, keep_alive);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cuda::LaunchPlan plan = cuda::plan_launch(views.data(), n);  // single items: by blocks, in order
  std::vector<int64_t> rest;
  std::vector<core::BlockOperand> rest_ops;  // cast after the pass from these operands (their copies made above)
  for (int64_t i = 0; i < n; ++i) {
    if (!(xs[i].is_contiguous() && ops[i].cols > 0)) {
      rest_ops.push_back(ops[i]);
      ops[i].data = nullptr, ops[i].rows = 0, ops[i].cols = 0;  // empty rows in the pass; cast below
      rest.push_back(i);
    }
    ops[i].first_chunk = views[i].first_chunk;
  }
  static_assert(sizeof(core::BlockOperand) % sizeof(uint64_t) == 0, "operands are uploaded as 8-byte words");
  at::Tensor ops_storage;
  const auto* ops_device = static_cast<const core::BlockOperand*>(
      device_copy(ops.data(), n * int64_t(sizeof(core::BlockOperand)), device, stream, ops_storage, op));
  cuda::FusedBlocks fused;
  fused.ops = ops_device;
  fused.formats.num = static_cast<int>(num_formats);
  for (int64_t f = 0; f < num_formats; ++f) fused.formats.codes[f] = formats[f];
  const bool need_amax = any_needs_amax(formats);
  fused.amaxes = need_amax ? amaxes.data_ptr<double>() : nullptr;
  at::Tensor chunk_rows = at::empty({plan.total_chunks, num_formats, int64_t(core::kNumBlockColumns)}, opts);
  fused.chunk_rows = chunk_rows.data_ptr<double>();
  at::Tensor states = at::empty({n, int64_t(core::kNumStateColumns)}, opts);
  at::Tensor numerics_rows = at::empty({n, numerics_width}, opts);
  at::Tensor blocks = at::empty({n, num_formats, int64_t(core::kNumBlockColumns)}, opts);
  cuda::StatsTargets stats;
  stats.out_states = states.data_ptr<double>();
  cuda::NumericsTargets numerics;
  numerics.out = numerics_rows.data_ptr<double>();
  launch_with_numerics(views, plan, n, device, stats, numerics, op, fused);
  check_launch(cuda::launch_merge_fused_block_rows(ops_device, n, static_cast<int>(num_formats),
                                                   chunk_rows.data_ptr<double>(), blocks.data_ptr<double>(), stream),
               op);
  if (!rest.empty()) {
    const at::Tensor index = at::tensor(rest, at::kLong).to(device);
    const at::Tensor their_amaxes = need_amax ? amaxes.index_select(0, index).contiguous() : at::Tensor();
    blocks.index_copy_(0, index, block_rows_of_cuda(rest_ops, formats, need_amax ? their_amaxes.data_ptr<double>() : nullptr,
                                                    device, op));
  }
  return {states, numerics_rows, blocks};
}

// BlockRow::merge of device rows [F, kNumBlockColumns], in place into `held`: counts and sums add, the smallest
// non-zero magnitude the smaller, the largest block ratio the larger.
void merge_block_rows_into(at::Tensor held, const at::Tensor& fresh) {
  at::Tensor merged = held + fresh;
  for (const auto& [column, smaller] : {std::pair<int64_t, bool>{core::bMinNonzero, true}, {core::bMaxBlockRatio, false}}) {
    const at::Tensor h = held.select(1, column), f = fresh.select(1, column);
    merged.select(1, column).copy_(at::where(smaller ? f.lt(h) : f.gt(h), f, h));
  }
  held.copy_(merged);
}

// accumulate_instance_stats (with `with_numerics`, _and_numerics) and x's per-block format rows merged into
// blocks[blocks_row], reading x once: one launch of the statistics pass with merge_items and FusedBlocks (each chunk
// read again from L2 by the block that has just read it; the instances are whole rows of x's last dim, in order),
// then a one-block merge of the chunks' block rows into the table row. Without numerics the pass computes a numerics
// row into scratch and drops it: that pass is the one that casts in the same read. Two reads (the instance op, then
// the block kernel) where the pass cannot take x: not contiguous, fewer than two dims (no instance of whole rows),
// empty, or many short instances (read by warps). A format scaled per tensor without a given amax: x's amax by ATen
// ops first, a read of its own (the scale depends on the whole tensor), as on the CPU.
void accumulate_instance_stats_numerics_blocks_cuda(const at::Tensor& x, at::Tensor& acc, int64_t row, int64_t correction,
                                                    bool with_numerics, at::Tensor& numerics, int64_t numerics_row,
                                                    at::IntArrayRef format_codes, const std::optional<at::Tensor>& amax,
                                                    at::Tensor& blocks, int64_t blocks_row) {
  const char* op = "accumulate_instance_stats_numerics_blocks";
  const std::vector<core::BlockFormat> formats = block_formats_of(format_codes, op);
  const int64_t num_formats = static_cast<int64_t>(formats.size());
  check_block_table(x, blocks, blocks_row, num_formats, op);
  check_accumulator(x, acc, row, op);
  if (with_numerics) check_numerics_table(x, numerics, numerics_row);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto opts = x.options().dtype(at::kDouble);
  const bool need_amax = any_needs_amax(formats);
  const at::Tensor tensor_amax =
      !need_amax || x.numel() == 0 ? at::zeros({1}, opts)
      : amax.has_value()          ? *amax
                                  : at::where(at::isfinite(x), x.abs(), at::zeros({}, x.options())).amax().to(at::kDouble).reshape({1});
  double* block_dst = blocks.data_ptr<double>() + blocks_row * num_formats * core::kNumBlockColumns;
  std::vector<at::Tensor> keep_alive;
  std::vector<core::StridedView> instances{make_view(x, 1, op, keep_alive)};
  const cuda::LaunchPlan plan = cuda::plan_launch(instances.data(), 1);
  if (!(x.is_contiguous() && x.dim() >= 2 && x.numel() > 0 && plan.warp_chunks == 0)) {
    if (with_numerics) {
      accumulate_instance_stats_and_numerics_cuda(x, acc, row, correction, numerics, numerics_row);
    } else {
      accumulate_instance_stats_cuda(x, acc, row, correction);
    }
    merge_block_rows_into(blocks.select(0, blocks_row), block_numerics_cuda({x}, format_codes, tensor_amax).select(0, 0));
    return;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  std::vector<core::BlockOperand> ops = block_operands({x}, formats, tensor_amax, keep_alive, op);
  ops[0].first_chunk = 0;
  at::Tensor ops_storage;
  cuda::FusedBlocks fused;
  fused.ops = static_cast<const core::BlockOperand*>(
      device_copy(ops.data(), int64_t(sizeof(core::BlockOperand)), x.device(), stream, ops_storage, op));
  fused.formats.num = static_cast<int>(num_formats);
  for (int64_t f = 0; f < num_formats; ++f) fused.formats.codes[f] = formats[f];
  fused.amaxes = need_amax ? tensor_amax.data_ptr<double>() : nullptr;
  at::Tensor chunk_rows = at::empty({plan.total_chunks, num_formats, int64_t(core::kNumBlockColumns)}, opts);
  fused.chunk_rows = chunk_rows.data_ptr<double>();
  const int64_t items = x.size(0);
  at::Tensor rows = at::empty({items, int64_t(core::kNumStats)}, opts);
  cuda::StatsTargets stats;
  stats.out_stats = rows.data_ptr<double>();
  stats.correction = correction;
  stats.acc_row = acc.data_ptr<double>() + row * core::kNumAccColumns;
  at::Tensor dropped = with_numerics ? at::Tensor() : at::zeros({1, int64_t(core::kNumNumericsColumns)}, opts);
  cuda::NumericsTargets targets;
  targets.out = with_numerics ? numerics.data_ptr<double>() + numerics_row * core::kNumNumericsColumns
                              : dropped.data_ptr<double>();
  targets.accumulate = true;
  targets.merge_items = true;
  launch_with_numerics(instances, plan, items, x.device(), stats, targets, op, fused);
  check_launch(cuda::launch_accumulate_fused_block_rows(chunk_rows.data_ptr<double>(), plan.total_chunks,
                                                        static_cast<int>(num_formats), block_dst, stream),
               op);
}

}  // namespace

TORCH_LIBRARY_IMPL(gapmon, CUDA, m) {
  m.impl("states_numerics_blocks", &states_numerics_blocks_cuda);
  m.impl("accumulate_instance_stats", &accumulate_instance_stats_cuda);
  m.impl("update_sums", &update_sums_cuda);
  m.impl("block_numerics", &block_numerics_cuda);
  m.impl("tensor_stats", &tensor_stats_cuda);
  m.impl("instance_stats", &instance_stats_cuda);
  m.impl("multi_tensor_stats", &multi_tensor_stats_cuda);
  m.impl("multi_tensor_states", &multi_tensor_states_cuda);
  m.impl("merge_states", &merge_states_cuda);
  m.impl("finalize_states", &finalize_states_cuda);
  m.impl("numerics_states", &numerics_states_cuda);
  m.impl("merge_numerics_states", &merge_numerics_states_cuda);
  m.impl("multi_tensor_states_and_numerics", &multi_tensor_states_and_numerics_cuda);
  m.impl("accumulate_instance_stats_and_numerics", &accumulate_instance_stats_and_numerics_cuda);
  m.impl("accumulate_instance_stats_numerics_blocks", &accumulate_instance_stats_numerics_blocks_cuda);
}

}  // namespace gapmon
