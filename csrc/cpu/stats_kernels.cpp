// The CPU statistics kernel's entry points: the baseline copy of the body (stats_kernels_body.h)
// and the choice, once at load time, of the best copy this CPU runs (AVX-512, AVX2 or baseline).
#include "stats_kernels.h"

#include <atomic>
#include <stdexcept>

#include "stats_kernels_body.h"
#include "stats_kernels_isa.h"

namespace gapmon {
namespace cpu {
namespace {

using ChunkFn = State<double> (*)(const StridedView&, int64_t, int64_t, int64_t);

State<double> chunk_state_generic(const StridedView& v, int64_t item, int64_t lo, int64_t hi) {
  return chunk_state_body<16>(v, item, lo, hi);
}

#ifdef GAPMON_HAS_X86_ISAS
bool cpu_supports(const std::string& isa) {
  __builtin_cpu_init();
  if (isa == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }
  return isa == "generic";
}
#else
bool cpu_supports(const std::string& isa) { return isa == "generic"; }
#endif

struct Selected {
  ChunkFn fn;
  const char* name;
};

Selected resolve(const std::string& name) {
#ifdef GAPMON_HAS_X86_ISAS
  if (name == "avx512" || (name == "auto" && cpu_supports("avx512"))) return {isa::chunk_state_avx512, "avx512"};
  if (name == "avx2" || (name == "auto" && cpu_supports("avx2"))) return {isa::chunk_state_avx2, "avx2"};
#endif
  return {chunk_state_generic, "generic"};
}

std::atomic<ChunkFn> g_chunk_fn{nullptr};
std::atomic<const char*> g_isa_name{nullptr};

void ensure_selected() {
  if (g_chunk_fn.load(std::memory_order_acquire) == nullptr) select_isa("auto");
}

}  // namespace

State<double> chunk_state(const StridedView& view, int64_t item, int64_t lo, int64_t hi) {
  ensure_selected();
  return g_chunk_fn.load(std::memory_order_relaxed)(view, item, lo, hi);
}

bool selected_isa_has_avx2() {
  ensure_selected();
  return g_chunk_fn.load(std::memory_order_relaxed) != chunk_state_generic;
}

bool selected_isa_has_avx512() {
  ensure_selected();
#ifdef GAPMON_HAS_X86_ISAS
  return g_chunk_fn.load(std::memory_order_relaxed) == isa::chunk_state_avx512;
#else
  return false;
#endif
}

std::string active_isa() {
  ensure_selected();
  return g_isa_name.load();
}

void select_isa(const std::string& name) {
  if (name != "auto" && name != "avx512" && name != "avx2" && name != "generic") {
    throw std::invalid_argument("unknown CPU instruction set '" + name +
                                "'; expected one of auto, avx512, avx2, generic");
  }
  if (name != "auto" && !cpu_supports(name)) {
    throw std::invalid_argument("this CPU does not support the '" + name + "' instruction set");
  }
  const Selected s = resolve(name);
  g_isa_name.store(s.name);
  g_chunk_fn.store(s.fn, std::memory_order_release);
}

}  // namespace cpu
}  // namespace gapmon
