// The CUDA kernel source compiled as host C++ on the emulator, for cuda_emulated_tests.
#define GAPMON_CUDA_EMULATION
#include "cuda_emulator.h"
// The emulator's definitions come first.
#include "../../csrc/cuda/stats_cuda.cu"
