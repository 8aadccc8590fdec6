// The per-block format kernel source (csrc/cuda/block_cuda.cu) compiled as host C++ on the emulator, for
// block_emulated_tests.
#define GAPMON_CUDA_EMULATION
#include "cuda_emulator.h"
// The emulator's definitions come first.
#include "../../csrc/cuda/block_cuda.cu"

// For test_block_emulated.cpp, which does not see the emulator: picks the block schedule.
void gapmon_emu_set_block_schedule(unsigned seed) { gapmon_emu::set_schedule(seed); }
