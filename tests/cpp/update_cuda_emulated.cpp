// The optimizer-update kernel source (csrc/cuda/update_cuda.cu) compiled as host C++ on the emulator,
// for update_emulated_tests.
#define GAPMON_CUDA_EMULATION
#include "cuda_emulator.h"
// The emulator's definitions come first.
#include "../../csrc/cuda/update_cuda.cu"

// For test_update_emulated.cpp, which does not see the emulator: picks the block schedule.
void gapmon_emu_set_update_schedule(unsigned seed) { gapmon_emu::set_schedule(seed); }
