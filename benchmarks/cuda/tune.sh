#!/usr/bin/env bash
# Builds kernel_bench.cu for several compile-time variants of the CUDA kernels (group size, loads in
# flight per thread) in parallel, runs each, and prints their lines together: for a GPU session.
#
#   bash benchmarks/cuda/tune.sh [OUT_FILE]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/dev/stdout}
arch=${CUDA_ARCH:-sm_90}
nvcc=${NVCC:-nvcc}
work=$(mktemp -d)
variants=("32 4" "16 4" "64 4" "32 2" "32 8")
for v in "${variants[@]}"; do
  set -- $v
  $nvcc -O3 -std=c++20 --expt-relaxed-constexpr -arch="$arch" -I csrc -DGAPMON_CUDA_GROUP="$1" \
    -DGAPMON_CUDA_VEC_UNROLL="$2" benchmarks/cuda/kernel_bench.cu csrc/cuda/stats_cuda.cu csrc/cuda/numerics_cuda.cu -o "$work/bench_$1_$2" &
done
wait
for v in "${variants[@]}"; do
  set -- $v
  "$work/bench_$1_$2"
done | tee "$out"
rm -rf "$work"
