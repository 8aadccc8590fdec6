// The CUDA kernel source compiled as host C++ on the emulator, for cuda_emulated_tests.
#define GAPMON_CUDA_EMULATION
#include "cuda_emulator.h"
// The emulator's definitions come first.
#include "../../csrc/cuda/stats_cuda.cu"

// For test_cuda_emulated.cpp, which does not see the emulator: picks the block schedule.
void gapmon_emu_set_schedule(unsigned seed) { gapmon_emu::set_schedule(seed); }
