#!/usr/bin/env bash
# Everything a GPU session measures, in one command (the device tool allows few, long calls):
# builds the CUDA extension in place, runs the CUDA tests, then the GPU benchmarks. Logs and
# JSON results go to OUT_DIR (default $OUT, else /tmp/gapmon-gpu): at most 8 files.
#
#   bash benchmarks/gpu_session.sh [OUT_DIR]
#
# Then copy OUT_DIR/stats.json to benchmarks/results/<gpu>.json (and monitor/persample likewise).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gapmon-gpu}}
mkdir -p "$out"
log="$out/session.log"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
section() { echo "=== $* ($(date +%T))" | tee -a "$log"; }

section "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" 2>&1 | tee -a "$log"

section "build"
arch=$($py -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
if ! TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch} GAPMON_CUDA=1 $py setup.py build_ext --inplace >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  exit 1
fi
grep -E "registers|spill" "$out/build.log" | tail -20 | tee -a "$log"
$py -c "import gapmon; b = gapmon.backend(); print('backend', b); assert b == 'cuda', b" 2>&1 | tee -a "$log" || exit 1

section "CUDA tests"
$py -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee -a "$log"
tests_rc=${PIPESTATUS[0]}

section "demo on one GPU"
timeout 120 $py -m gapmon demo --device cuda --out /tmp/gapmon-demo-gpu 2>&1 | tail -25 | tee -a "$log"

section "statistics benchmark"
timeout 300 $py benchmarks/bench_stats.py --device cuda --out "$out/stats.json" 2>&1 | tee -a "$log"

section "monitor benchmark"
timeout 150 $py benchmarks/bench_monitor.py --device cuda --gpt2 --steps 6 --rounds 2 --out "$out/monitor.json" 2>&1 | tee -a "$log"

section "per-sample benchmark"
timeout 120 $py benchmarks/bench_persample.py --device cuda --d-model 768 --out "$out/persample.json" 2>&1 | tee -a "$log"

section "done (CUDA tests exit code $tests_rc)"
exit "$tests_rc"
