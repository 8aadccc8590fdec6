// A small host emulator of the CUDA execution model, so that ctest runs the real kernel source
// (csrc/cuda/stats_cuda.cu compiled as C++ with GAPMON_CUDA_EMULATION) without a GPU.
//
// The threads of a block are cooperative fibers on one OS thread, switched at every barrier (on x86-64 by a
// six-register stack switch: ucontext's swapcontext makes two system calls per switch, which took 85% of the
// emulated tests' time; elsewhere by ucontext). Blocks run in order on one OS thread by default; with a schedule seed
// (gapmon_emu::set_schedule(seed)) they run in a shuffled order, several at once on worker OS
// threads (so blocks really interleave), and the fibers of each block are resumed in a shuffled
// order at every barrier round: a result that depends on which block or thread runs first shows
// up as a difference between schedules. Shared memory is per OS thread, hence per running block.
// It emulates what the kernels use: threadIdx/blockIdx/blockDim/gridDim, __syncthreads,
// __syncthreads_or, per-warp __shfl_down_sync, __shfl_xor_sync (over the whole warp, or over the lanes a mask
// names while the others are elsewhere), __any_sync and __syncwarp, __ldg/__ldcg, __threadfence, atomicAdd
// on counters, static __shared__ arrays and kernel launches. Device memory is host memory. It
// checks the kernels' logic (indexing, chunking, barriers, merge order, independence of the
// schedule), not their speed; it counts the bytes read through __ldg (global_bytes_read), so that a
// test can check how often a kernel reads its input.
//
// Force-included (-include) before the kernel source, so that its definitions of __shared__ and
// friends win over CUDA's host_defines.h.
#pragma once

#define __shared__ static thread_local  // one instance per OS thread: per running block
#define __global__
#define __device__
#define __host__
#define __grid_constant__
#define __launch_bounds__(...)
#define __noinline__ __attribute__((noinline))

// Before the index macros below: CUDA's headers use these names for parameters.
#include <cuda_runtime.h>  // cudaError_t, cudaStream_t, dim3, uint4 (declarations only: no runtime needed)

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__x86_64__)
// gapmon_emu_switch(&from_sp, to_sp): saves the callee-saved registers on the current stack, stores its pointer in
// *from_sp, loads to_sp and restores what was saved there (a new fiber's stack holds its entry as the return
// address). Weak, in a COMDAT group: every translation unit that includes this header emits the same one.
asm(R"(
  .pushsection .text.gapmon_emu_switch,"axG",@progbits,gapmon_emu_switch,comdat
  .weak gapmon_emu_switch
  .hidden gapmon_emu_switch
  .type gapmon_emu_switch,@function
gapmon_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size gapmon_emu_switch, .-gapmon_emu_switch
  .popsection
)");
extern "C" void gapmon_emu_switch(void** from_sp, void* to_sp);
#endif

namespace gapmon_emu {

// Where a fiber (or the scheduler) stopped, and how to switch between two such places.
#if defined(__x86_64__)
struct Context {
  void* sp = nullptr;
};

inline void switch_context(Context& from, Context& to) { gapmon_emu_switch(&from.sp, to.sp); }

// A fiber that starts entry() on `stack`: the six registers' slots, then entry as the return address, then a slot
// for entry's own (never used) return address, so that entry starts with the stack aligned as after a call.
inline void make_context(Context& c, std::vector<char>& stack, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack.data() + stack.size()) & ~uintptr_t{15};
  auto* slots = reinterpret_cast<void**>(top) - 8;
  for (int i = 0; i < 6; ++i) slots[i] = nullptr;
  slots[6] = reinterpret_cast<void*>(entry);
  slots[7] = nullptr;
  c.sp = slots;
}
#else
struct Context {
  ucontext_t uc;
};

inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }

inline void make_context(Context& c, std::vector<char>& stack, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack.data();
  c.uc.uc_stack.ss_size = stack.size();
  c.uc.uc_link = nullptr;  // entry never returns: it switches to the scheduler
  makecontext(&c.uc, entry, 0);
}
#endif

inline dim3 grid_dim, block_dim;                   // set before a launch's blocks start
inline thread_local dim3 block_idx, thread_idx;    // of the block and fiber running on this OS thread
inline std::atomic<long long> global_bytes_read{0};  // bytes read through __ldg, by every launch

// 0: blocks in order on the calling thread, fibers in order. Otherwise the seed of a shuffled,
// interleaved schedule (see the header comment); each launch draws a new permutation from it.
inline unsigned schedule_seed = 0;
inline unsigned schedule_launches = 0;
constexpr int kScheduleWorkers = 4;

inline void set_schedule(unsigned seed) {
  schedule_seed = seed;
  schedule_launches = 0;
}

struct Block {
  static constexpr size_t kStackBytes = 64 * 1024;
  int threads = 0;
  std::vector<Context> contexts;
  std::vector<std::vector<char>> stacks;
  std::vector<char> finished;
  Context scheduler;
  int current = 0;
  // Barriers: arrivals and generation, for the block and for each warp.
  int block_arrived = 0;
  int64_t block_generation = 0;
  std::vector<int> warp_arrived;
  std::vector<int64_t> warp_generation;
  // Barriers of some lanes of a warp (a shuffle's mask): arrivals and generation per (warp, mask).
  std::map<std::pair<int, unsigned>, std::pair<int, int64_t>> lanes_barriers;
  std::vector<double> exchange;  // one slot per thread, for shuffles and votes
  int64_t progress = 0;          // barrier arrivals and finished threads: no change in a round = deadlock
  std::function<void()> body;
};

inline thread_local Block* running = nullptr;

inline void yield() { switch_context(running->contexts[running->current], running->scheduler); }

inline int thread_id() { return running->current; }

inline void block_barrier() {
  Block& b = *running;
  const int64_t generation = b.block_generation;
  ++b.progress;
  if (++b.block_arrived == b.threads) {
    b.block_arrived = 0;
    ++b.block_generation;
  }
  while (b.block_generation == generation) yield();
}

inline void warp_barrier() {
  Block& b = *running;
  const int warp = thread_id() / 32;
  const int width = b.threads - warp * 32 < 32 ? b.threads - warp * 32 : 32;
  const int64_t generation = b.warp_generation[warp];
  ++b.progress;
  if (++b.warp_arrived[warp] == width) {
    b.warp_arrived[warp] = 0;
    ++b.warp_generation[warp];
  }
  while (b.warp_generation[warp] == generation) yield();
}

// A barrier of the lanes of the calling thread's warp that `mask` names (the calling lane among them).
inline void lanes_barrier(unsigned mask) {
  Block& b = *running;
  const int warp = thread_id() / 32;
  if ((mask >> (thread_id() % 32) & 1u) == 0) throw std::logic_error("a lane calls a shuffle whose mask leaves it out");
  auto& [arrived, generation] = b.lanes_barriers[{warp, mask}];
  const int64_t mine = generation;
  ++b.progress;
  if (++arrived == __builtin_popcount(mask)) {
    arrived = 0;
    ++generation;
  }
  while (b.lanes_barriers[{warp, mask}].second == mine) yield();
}

// Resumes thread t until it waits at a barrier or returns. Not inlined: under ucontext, swapcontext returns like
// setjmp, so the caller's loop variables stay out of the function that calls it.
[[gnu::noinline]] inline void resume(Block& b, int t) {
  b.current = t;
  thread_idx = dim3(t, 0, 0);
  switch_context(b.scheduler, b.contexts[t]);
}

// A fiber's whole life: the kernel body, then back to the scheduler for good (a finished fiber is never resumed).
[[noreturn]] inline void fiber_entry() {
  running->body();
  running->finished[running->current] = 1;
  ++running->progress;
  switch_context(running->contexts[running->current], running->scheduler);
  std::terminate();
}

// Sets thread t up to start the kernel body on its own stack.
[[gnu::noinline]] inline void prepare(Block& b, int t) { make_context(b.contexts[t], b.stacks[t], fiber_entry); }

// Runs block `bx` of the current launch on `b`'s fibers; `rng` (if any) shuffles the order in
// which waiting fibers are resumed in every round.
inline void run_block(Block& b, unsigned bx, std::mt19937* rng) {
  block_idx = dim3(bx, 0, 0);
  b.finished.assign(b.threads, 0);
  for (int t = 0; t < b.threads; ++t) prepare(b, t);
  std::vector<int> order(b.threads);
  std::iota(order.begin(), order.end(), 0);
  for (int left = b.threads; left > 0;) {  // rounds until every thread has returned
    left = 0;
    const int64_t progress = b.progress;
    if (rng != nullptr) std::shuffle(order.begin(), order.end(), *rng);
    for (int t : order) {
      if (b.finished[t]) continue;
      resume(b, t);
      left += !b.finished[t];
    }
    if (left > 0 && b.progress == progress) throw std::logic_error("deadlock: threads wait at barriers others never reach");
  }
  if (b.block_arrived != 0) throw std::logic_error("a thread returned while others waited at __syncthreads");
}

// Runs kernel(args...) on a grid of blocks, each block's threads as fibers; blocks in order, or
// shuffled over kScheduleWorkers OS threads when a schedule seed is set.
template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args) {
  if (block.y != 1 || block.z != 1 || grid.y != 1 || grid.z != 1) throw std::invalid_argument("1-D launches only");
  grid_dim = grid;
  block_dim = block;
  std::vector<unsigned> blocks(grid.x);
  std::iota(blocks.begin(), blocks.end(), 0u);
  const unsigned seed = schedule_seed == 0 ? 0 : schedule_seed * 7919u + schedule_launches++;
  if (seed != 0) {
    std::mt19937 shuffle(seed);
    std::shuffle(blocks.begin(), blocks.end(), shuffle);
  }
  const int workers = seed == 0 ? 1 : static_cast<int>(std::min<unsigned>(kScheduleWorkers, grid.x));
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_lock;
  auto work = [&](int worker) {
    try {
      Block b;
      b.threads = static_cast<int>(block.x);
      b.contexts.resize(b.threads);
      b.stacks.assign(b.threads, std::vector<char>(Block::kStackBytes));
      b.warp_arrived.assign((b.threads + 31) / 32, 0);
      b.warp_generation.assign((b.threads + 31) / 32, 0);
      b.exchange.assign(b.threads, 0.0);
      b.body = [&] { kernel(args...); };
      std::mt19937 rng(seed + 104729u * worker);
      Block* outer = running;
      running = &b;
      for (size_t i; (i = next++) < blocks.size();) run_block(b, blocks[i], seed == 0 ? nullptr : &rng);
      running = outer;
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_lock);
      if (!error) error = std::current_exception();
    }
  };
  if (workers == 1) {
    work(0);
  } else {
    std::vector<std::thread> pool;
    for (int w = 0; w < workers; ++w) pool.emplace_back(work, w);
    for (auto& t : pool) t.join();
  }
  if (error) std::rethrow_exception(error);
}

// kernel<<<grid, block, 0, stream>>>(args...) becomes launcher(kernel, grid, block)(args...).
template <typename Kernel>
struct Launcher {
  Kernel kernel;
  dim3 grid, block;
  template <typename... Args>
  void operator()(Args... args) const {
    launch(kernel, grid, block, args...);
  }
};

template <typename Kernel>
Launcher<Kernel> launcher(Kernel kernel, dim3 grid, dim3 block) {
  return {kernel, grid, block};
}

}  // namespace gapmon_emu

// The per-thread view of the emulated launch.
#define threadIdx (::gapmon_emu::thread_idx)
#define blockIdx (::gapmon_emu::block_idx)
#define blockDim (::gapmon_emu::block_dim)
#define gridDim (::gapmon_emu::grid_dim)

inline void __syncthreads() { gapmon_emu::block_barrier(); }

inline int __syncthreads_or(int predicate) {
  auto& b = *gapmon_emu::running;
  b.exchange[gapmon_emu::thread_id()] = predicate != 0;
  gapmon_emu::block_barrier();
  int any = 0;
  for (int t = 0; t < b.threads; ++t) any |= b.exchange[t] != 0;
  gapmon_emu::block_barrier();
  return any;
}

inline int __any_sync(unsigned, int predicate) {
  auto& b = *gapmon_emu::running;
  const int tid = gapmon_emu::thread_id(), first = tid / 32 * 32;
  b.exchange[tid] = predicate != 0;
  gapmon_emu::warp_barrier();
  int any = 0;
  for (int t = first; t < first + 32 && t < b.threads; ++t) any |= b.exchange[t] != 0;
  gapmon_emu::warp_barrier();
  return any;
}

// A barrier (and memory fence) of the calling thread's warp.
inline void __syncwarp(unsigned = 0xffffffffu) { gapmon_emu::warp_barrier(); }

inline double __shfl_down_sync(unsigned, double value, unsigned delta) {
  auto& b = *gapmon_emu::running;
  const int tid = gapmon_emu::thread_id(), lane = tid % 32;
  b.exchange[tid] = value;
  gapmon_emu::warp_barrier();
  const double got = lane + static_cast<int>(delta) < 32 && tid + static_cast<int>(delta) < b.threads
                         ? b.exchange[tid + delta]
                         : value;  // lanes past the end keep their own value, as the hardware does
  gapmon_emu::warp_barrier();
  return got;
}

// A butterfly exchange within the warp (lane ^ lane_mask), for 32-bit unsigned values (exact in the exchange's
// doubles). With a mask other than the whole warp, only the lanes it names take part (the others may be
// elsewhere); the partner must be one of them.
inline unsigned __shfl_xor_sync(unsigned mask, unsigned value, int lane_mask) {
  auto& b = *gapmon_emu::running;
  const int tid = gapmon_emu::thread_id(), partner = tid ^ lane_mask;
  const bool whole = mask == 0xffffffffu;
  if (!whole && (mask >> (partner % 32) & 1u) == 0) throw std::logic_error("a shuffle's partner is not in its mask");
  b.exchange[tid] = value;
  whole ? gapmon_emu::warp_barrier() : gapmon_emu::lanes_barrier(mask);
  const unsigned got = partner < b.threads ? static_cast<unsigned>(b.exchange[partner]) : value;
  whole ? gapmon_emu::warp_barrier() : gapmon_emu::lanes_barrier(mask);
  return got;
}

template <typename T>
inline T __ldg(const T* p) {
  gapmon_emu::global_bytes_read.fetch_add(sizeof(T), std::memory_order_relaxed);
  return *p;
}

// Blocks really run concurrently on worker OS threads: the counters are host atomics and the fence
// a host fence, which order the plain stores and loads around them as the CUDA pattern needs.
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline unsigned atomicAdd(unsigned* address, unsigned value) {
  return std::atomic_ref<unsigned>(*address).fetch_add(value, std::memory_order_relaxed);
}

template <typename T>
inline T __ldcg(const T* p) {
  return *p;
}

#define GAPMON_LAUNCH(kernel, grid, block, stream) \
  (static_cast<void>(stream), ::gapmon_emu::launcher(kernel, dim3(grid), dim3(block)))
