// The CUDA numerics kernel compiled as host C++ on the emulator, for numerics_emulated_tests.
#define GAPMON_CUDA_EMULATION
#include "cuda_emulator.h"
// The emulator's definitions come first.
#include "../../csrc/cuda/numerics_cuda.cu"

// For test_numerics_emulated.cpp, which does not see the emulator: picks the block schedule.
void gapmon_emu_set_numerics_schedule(unsigned seed) { gapmon_emu::set_schedule(seed); }

// Bytes the kernels have read through __ldg so far (the emulator's count), for test_block_emulated.cpp.
long long gapmon_emu_global_bytes_read() { return gapmon_emu::global_bytes_read.load(); }
