#!/usr/bin/env bash
# Everything a GPU session measures, in one command (the device tool allows few, long calls):
# builds the CUDA extension in place, runs the CUDA tests, then the GPU benchmarks. Logs and
# JSON results go to OUT_DIR (default $OUT, else /tmp/gapmon-gpu): at most 9 files (session.log,
# build.log, stats.json, monitor.json, persample-gpt2.json, persample.json, variants.txt, ncu.txt).
#
#   bash benchmarks/gpu_session.sh [OUT_DIR [PHASE ...]]
#
# PHASEs (default: all but suite, in this order): build tests demo stats variants ncu monitor persample;
# "suite" runs the whole test suite on the GPU machine (about 6 minutes: a call of its own).
# A device call is limited to 10 minutes: split them over two calls when needed, e.g.
# "build tests demo stats" then "build variants ncu monitor persample" (build is quick when done).
#
# Then copy OUT_DIR/stats.json to benchmarks/results/<gpu>.json (and monitor/persample likewise).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gapmon-gpu}}
shift || true
phases=${*:-build tests demo stats variants ncu monitor persample}
want() { [[ " $phases " == *" $1 "* ]]; }
mkdir -p "$out"
log="$out/session.log"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
section() { echo "=== $* ($(date +%T))" | tee -a "$log"; }

section "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" 2>&1 | tee -a "$log"

arch=$($py -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
tests_rc=0
if want build; then
section "build"
if ! TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch} GAPMON_CUDA=1 $py setup.py build_ext --inplace >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
grep -E "registers|spill" "$out/build.log" | tail -20 | tee -a "$log"
$py tests/cpp/check_kernels.py "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" . 2>&1 | tee -a "$log"
$py -c "import gapmon; b = gapmon.backend(); print('backend', b); assert b == 'cuda', b" 2>&1 | tee -a "$log" || exit 1
fi

if want tests; then
section "CUDA tests"
$py -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee -a "$log"
tests_rc=${PIPESTATUS[0]}
fi

if want suite; then
section "whole test suite"
timeout 560 $py -m pytest -q -p no:cacheprovider tests 2>&1 | tail -30 | tee -a "$log"
tests_rc=${PIPESTATUS[0]}
fi

if want demo; then
section "demo on one GPU"
rm -rf /tmp/gapmon-demo-gpu
timeout 120 $py -m gapmon demo --device cuda --out /tmp/gapmon-demo-gpu 2>&1 | tail -25 | tee -a "$log"
fi

if want stats; then
section "statistics benchmark"
timeout 300 $py benchmarks/bench_stats.py --device cuda --out "$out/stats.json" 2>&1 | tee -a "$log"
fi

if want variants; then
section "kernel variants (benchmarks/cuda/tune.sh)"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc) CUDA_ARCH=sm_${arch/./} timeout 240 \
  bash benchmarks/cuda/tune.sh "$out/variants.txt" 2>&1 | tee -a "$log"
fi

if want ncu; then
section "ncu: the statistics kernels on the default variant"
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -arch=sm_${arch/./} -lineinfo -I csrc benchmarks/cuda/kernel_bench.cu \
  csrc/cuda/stats_cuda.cu -o /tmp/gapmon_kernel_bench && \
  timeout 180 ncu --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis \
    --kernel-name regex:stats_kernel --launch-skip 3 --launch-count 3 /tmp/gapmon_kernel_bench > "$out/ncu.txt" 2>&1
tail -60 "$out/ncu.txt" | tee -a "$log"
fi

if want monitor; then
section "monitor benchmark"
timeout 150 $py benchmarks/bench_monitor.py --device cuda --gpt2 --steps 6 --rounds 2 --out "$out/monitor.json" 2>&1 | tee -a "$log"
fi

if want persample; then
section "per-sample benchmark"
timeout 150 $py benchmarks/bench_persample.py --device cuda --gpt2 128 1024 --steps 6 --out "$out/persample-gpt2.json" 2>&1 | tee -a "$log"
timeout 120 $py benchmarks/bench_persample.py --device cuda --d-model 768 --out "$out/persample.json" 2>&1 | tee -a "$log"
fi

section "done (CUDA tests exit code $tests_rc)"
exit "$tests_rc"
