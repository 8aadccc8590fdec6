// How the kernels in csrc/cuda are launched: GAPMON_LAUNCH(kernel, grid, block, stream)(args...),
// a triple-chevron launch under nvcc, or a call on the host emulator (tests/cpp/cuda_emulator.h,
// force-included before the kernel source, defines it there).
#pragma once

#if defined(GAPMON_CUDA_EMULATION)
// tests/cpp/cuda_emulator.h runs the kernels on the host for ctest.
#elif !defined(__CUDACC_VER_MAJOR__) || __CUDACC_VER_MAJOR__ < 12
#error "gapmon's CUDA kernels need CUDA 12 or newer (__grid_constant__ kernel parameters)"
#else
#define GAPMON_LAUNCH(kernel, grid, block, stream) kernel<<<grid, block, 0, stream>>>
#endif
