#!/usr/bin/env bash
# Everything a GPU session measures, split into device calls that fit the device tool's limits
# (10 minutes a command, a bare machine unless the last call ended < 30 s before, at most 8 files back
# from $OUT per call). Logs and JSON results go to OUT_DIR.
#
#   bash benchmarks/gpu_session.sh OUT_DIR solo                         (a 15-minute device budget, one call: see below)
#   bash benchmarks/gpu_session.sh OUT_DIR quick1|quick2                (a 15-minute device budget: see below)
#   bash benchmarks/gpu_session.sh OUT_DIR call1|call2|call3|call4     (a 30-minute budget: one device call each)
#   bash benchmarks/gpu_session.sh OUT_DIR PHASE ...                  (phases by name)
#   GAPMON_GPU_DRY_RUN=1 bash benchmarks/gpu_session.sh OUT_DIR ...   (no GPU: prints what each phase
#                                                                      runs; tests/apps/test_gpu_session.py)
#
# A session is lent 15 minutes of device time now, the machine's start included (~30 s on 2026-11-26): one full call
# and perhaps a short second one. quick1 is the call to make first, everything in one command, most needed first.
# Before it, here (no device time): build the ncu phase's kernel_bench with this machine's nvcc (13.0, ~25 s) into
# .gpu-build/gapmon_kernel_bench and carry .gpu-build (its nvcc build there ran past 45 s):
#   mkdir -p .gpu-build && /usr/local/cuda/bin/nvcc -O3 -std=c++20 --expt-relaxed-constexpr -arch=sm_90 -lineinfo \
#     -I csrc benchmarks/cuda/kernel_bench.cu csrc/cuda/{stats,numerics,block}_cuda.cu -o .gpu-build/gapmon_kernel_bench
# A machine stays warm 30 s after a call: the next call made at once skips the start, and the extension built in
# gapmon/ is still there (run its phases without "reuse"). Give it back (give_back) when no call follows at once.
#   solo    build tests ncu quickmonitor quickpersample quicksuite   one call of 560 s at most (a deadline: each phase's
#                                   limit is cut to what is left, the phases before the suite leave it 280 s): the
#                                   extension, the CUDA tests, ncu, the step costs and the whole suite, last (14
#                                   workers, one thread each: 12 workers of 16 threads each on 16 cores reached 56% in
#                                   370 s on the H200). Files back: session.log build.log suite.log persample-gpt2.json provenance.json
#                                   profile.json monitor.json ncu.txt (no .so: no call follows that could reuse it).
#                                   Measured on an H200 (2026-11-28): 461 s in all (the suite 217 s, every test
#                                   passed), ~35 s of start; 404 s of device time were left, enough for a short call
#                                   (build 60 s + the tests it needs) on a fresh machine.
#   quick1  build tests suspects quicknumerics quickstats ncu   limits 120 + 90 + 60 + 75 + 45 + 90 = 480 s (and
#                                   90 s more where kernel_bench must be built there; ncu took 37 s on the H200): the extension
#                                   (ptxas registers in the log; no separate register check), the CUDA tests (every
#                                   kernel's first run on hardware: the fused one-read passes of #36 included), the
#                                   numerics and per-block formats against the statistics pass at 2^24 and 2^28, the
#                                   statistics ops at 2^20-2^28, and ncu's DRAM bytes and durations of the fused pass
#                                   (one read? the block formats cast from the reader's registers against the
#                                   kernel_bench "reread" cases, which read each chunk again: built unmeasured, 2026-11-27).
#                                   Returns _C*.so.gz: copy it to .gpu-build/ and carry .gpu-build in quick2.
#                                   Measured on an H100 (2026-11-26): machine facts 14 s, build 42 s, CUDA tests
#                                   30 s, quickstats 16 s; quicknumerics at 2^28 and nvcc's kernel_bench build ran
#                                   past their limits (now 2^24 only, and a kernel_bench built here may travel in
#                                   .gpu-build/, see the ncu phase).
#                                   Measured on an H200 (2026-11-27): the start ~30 s, quick1 215 s in all (build 53 s,
#                                   the carried kernel_bench ran there), then "quickpersample quickmonitor" on the warm
#                                   machine (no reuse needed) 74 s.
#   quick2  reuse quickmonitor quickpersample          limits 150 + 150 + 30 = 330 s plus the reuse (if >= 6 minutes
#                                   are left): GAPMonitor's and the per-sample norms' step costs on GPT-2 small (T=128),
#                                   the batch tracking's cost per op and the norms' host time per covered layer.
#                                   Measured on an H100 (2026-11-26): quickmonitor 22 s (one round; now two), quickpersample 30 s; then
#                                   a profile of one norms step against a plain one (benchmarks/profile_persample.py:
#                                   each phase's host time beside its time with the GPU drained, then the profiler).
#   quick3  reuse suspects quicksuite                 limits 120 + 420 s: the tests that failed on the first H100, alone
#                                   with their tracebacks, then the whole suite on 8 workers (pytest-xdist; on the first
#                                   H100 240 s reached 47% of it; on an H200, 12 workers, 370 s reached 56%)
# Expected times: build ~30 s and the whole suite ~6 min were measured on an H100 by an earlier session;
# the others are not measured yet (their limits are generous), so replace these figures once they are.
# With 30 minutes (the budget sessions had before):
#   call1  build tests demo        limits 180 + 60 + 180 + 120 = 540 s (build, its register check, the
#                                   CUDA tests, the demo). Returns gapmon/_C*.so in OUT_DIR: copy it to
#                                   .gpu-build/ (git-ignored) here and name .gpu-build in every later
#                                   call's carry; their "reuse" phase installs it (no rebuild).
#   call2  reuse stats ncu         limits 300 + 90 + 180 = 570 s   (#11's kernel targets; ncu per case,
#                                   #36's fused pass with an MX format: its DRAM bytes read should equal the
#                                   plain statistics-and-numerics pass's, one read;
#                                   the statistics-and-numerics kernel of #23 included)
#   call3  reuse monitor persample numerics  limits 150 + 150 + 100 + 30 + 20 + 120 = 570 s  (#12's step targets;
#                                   #23's numerics kernel against the statistics pass, x.sum and the reference;
#                                   #36's per-block formats; #38's Gram against the norms)
#   call4  reuse suite             limit 560 s: the whole test suite (~6 min), a call of its own
#   then, if device time is left:  variants (limit 240 s)
# Files back per call (at most 8): call1 session.log build.log _C*.so; call2 session.log stats.json
# ncu.txt; call3 session.log monitor.json persample-gpt2.json persample.json provenance.json gram.json numerics.json;
# call4 session.log; quick1 session.log build.log _C*.so.gz numerics.json stats.json ncu.txt; quick2 session.log
# monitor.json persample-gpt2.json provenance.json profile.json; quick3 session.log suite.log.
# Afterwards copy each X.json to benchmarks/results/X-<gpu>.json (stats-h100.json, monitor-h100.json, ...) and commit.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_session.sh OUT_DIR solo|quick1|quick2|quick3|call1|call2|call3|call4|PHASE ...}
shift
quick=0  # the calls of a 15-minute budget: shorter limits, fewer sizes
deadline=""  # seconds since the epoch by which the call must end (solo): every phase's limit is cut to fit it
reserve=0  # seconds before the deadline that the phases before the suite leave to it
case "${1:-}" in
  solo) phases="build tests ncu quickmonitor quickpersample quicksuite" ; quick=1 ; solo=1
        deadline=$(( $(date +%s) + ${GAPMON_CALL_LIMIT:-560} )) ; reserve=${GAPMON_SUITE_RESERVE:-280} ;;
  call1) phases="build tests demo" ;;
  call2) phases="reuse stats ncu" ;;
  call3) phases="reuse monitor persample numerics" ;;
  call4) phases="reuse suite" ;;
  quick1) phases="build tests suspects quicknumerics quickstats ncu" ; quick=1 ;;
  quick2) phases="reuse quickmonitor quickpersample" ; quick=1 ;;
  quick3) phases="reuse suspects quicksuite" ; quick=1 ;;
  "") echo "name a call (solo, quick1..quick3, call1..call4) or phases: build reuse tests demo stats quickstats ncu monitor" \
        "quickmonitor persample quickpersample numerics quicknumerics suite suspects quicksuite variants" >&2
      exit 2 ;;
  *) phases="$*" ;;
esac
want() { [[ " $phases " == *" $1 "* ]]; }
dry=${GAPMON_GPU_DRY_RUN:-0}
mkdir -p "$out"
log="$out/session.log"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
section() { echo "=== $* ($(date +%T))" | tee -a "$log"; }
# run LIMIT CMD...: the command under a time limit, so that a hang cannot eat the call; in a dry run,
# the command is printed instead.
# Under a deadline the limit is cut to the seconds left less the reserve (a dry run spends each limit whole on a
# clock of its own, kept in a file: run is often a pipeline's subshell).
dry_clock=$(mktemp)
trap 'rm -f "$dry_clock"' EXIT
date +%s >"$dry_clock"
now() { if [ "$dry" = 1 ]; then cat "$dry_clock"; else date +%s; fi; }
run() {
  local limit=$1
  shift
  if [ -n "$deadline" ]; then
    local left=$(( deadline - $(now) - reserve ))
    (( left < limit )) && limit=$left
    (( limit < 1 )) && limit=1
  fi
  if [ "$dry" = 1 ]; then
    echo "+ timeout $limit $*" >>"$log"
    echo $(( $(now) + limit )) >"$dry_clock"
    return 0
  fi
  timeout ${timeout_options:-} "$limit" "$@"
}

section "machine (phases: $phases)"
if [ "$dry" = 1 ]; then
  arch=9.0
  nvcc_bin=nvcc
else
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv 2>&1 | tee -a "$log"
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" 2>&1 | tee -a "$log"
  arch=$($py -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  nvcc_bin=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  # torch guesses CUDA_HOME from nvcc's place; where nvcc is a wrapper script (/usr/local/bin/nvcc),
  # point it at a directory that has the toolkit's headers.
  if [ -z "${CUDA_HOME:-}" ] || [ ! -f "$CUDA_HOME/include/cuda_runtime_api.h" ]; then
    for home in "$(dirname "$(dirname "$(readlink -f "$nvcc_bin")")")" /usr/local/cuda /usr/local/cuda-*; do
      if [ -f "$home/include/cuda_runtime_api.h" ]; then export CUDA_HOME=$home; break; fi
    done
  fi
  echo "CUDA_HOME=${CUDA_HOME:-not found}" | tee -a "$log"
fi
sm=sm_${arch/./}
tests_rc=0

if want build; then
  section "build"
  if ! GAPMON_PTXAS_VERBOSE=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$arch} GAPMON_CUDA=1 \
      run $([ "$quick" = 1 ] && echo 120 || echo 180) $py setup.py build_ext --inplace >"$out/build.log" 2>&1; then
    tail -40 "$out/build.log"
    exit 1
  fi
  grep -E "registers|spill" "$out/build.log" | tail -20 | tee -a "$log"  # ptxas -v: registers and spills per kernel
  # back to this machine, gzipped (the .so is ~24 MB, over the 16 MB a file back may weigh): carry it in later calls
  [ "$dry" = 1 ] || [ "${solo:-0}" = 1 ] || for so in gapmon/_C*.so; do gzip -c "$so" >"$out/$(basename "$so").gz"; done
  [ "$quick" = 1 ] || run 60 $py tests/cpp/check_kernels.py "$nvcc_bin" . 2>&1 | tee -a "$log"
fi

if want reuse; then
  section "reuse the extension built by call1"
  so=$(ls .gpu-build/_C*.so .gpu-build/_C*.so.gz 2>/dev/null | head -n 1)
  if [ "$dry" != 1 ]; then
    [ -n "$so" ] || { echo "no .gpu-build/_C*.so(.gz): run call1, copy its _C*.so.gz to .gpu-build/, carry .gpu-build" | tee -a "$log"; exit 1; }
    case "$so" in
      *.gz) gunzip -c "$so" >"gapmon/$(basename "$so" .gz)" ;;
      *) cp "$so" gapmon/ ;;
    esac
  fi
  echo "reusing ${so:-.gpu-build/_C*.so}" | tee -a "$log"
fi

if { want build || want reuse; } && [ "$dry" != 1 ]; then
  $py -c "import gapmon; b = gapmon.backend(); print('backend', b); assert b == 'cuda', b" 2>&1 | tee -a "$log" || exit 1
fi

if want tests; then
  section "CUDA tests"
  run $([ "$quick" = 1 ] && echo 90 || echo 180) $py -m pytest -q -p no:cacheprovider tests/stats/test_cuda.py \
    tests/stats/test_native_errors.py 2>&1 | tee -a "$log"
  tests_rc=${PIPESTATUS[0]}
  # The first H100 session saw C++ refusals kill the process (SIGSEGV) instead of raising: where one still does, the
  # native backtrace of the first case that crashes (cuda-gdb debugs host code too; there is no gdb there), and what
  # the extension links against.
  if [ "$dry" != 1 ] && ! $py tests/stats/native_error_cases.py cpu >/dev/null 2>&1; then
    section "a C++ refusal crashed: native backtrace"
    { g++ --version | head -1; ldd gapmon/_C*.so | grep -E "stdc|gcc_s|c10|torch_cpu"; } 2>&1 | tee -a "$log"
    run 60 cuda-gdb -batch -ex run -ex bt --args $py tests/stats/native_error_cases.py cpu 2>&1 | tail -40 | tee -a "$log"
  fi
fi

if want suspects; then
  section "the tests that failed on the GPU machines (H100 2026-11-26, H200 2026-11-27), one process, their tracebacks"
  # On 8-12 workers their tracebacks were lost when the limit cut the run; here they come first and alone: the C++
  # refusals (SIGSEGV there until their messages were built as one string), the noise scale under FSDP2/HSDP (torch
  # 2.11's single parameter group) and per-sample norms under torch.compile (2.11's Dynamo traced the tracking).
  run $([ "$quick" = 1 ] && echo 60 || echo 120) $py -m pytest -q -p no:cacheprovider --tb=short \
    tests/stats/test_native_errors.py tests/monitor/test_noise_scale.py tests/per_sample/test_per_sample.py \
    -k "fsdp2 or hsdp or native or refusals or compile or untraced or one_string" 2>&1 | tail -60 | tee -a "$log"
  tests_rc=$(( tests_rc || PIPESTATUS[0] ))
fi

if want demo; then
  section "demo on one GPU"
  rm -rf /tmp/gapmon-demo-gpu
  run 120 $py -m gapmon demo --device cuda --out /tmp/gapmon-demo-gpu 2>&1 | tail -25 | tee -a "$log"
fi

if want stats; then
  section "statistics benchmark"
  run 300 $py benchmarks/bench_stats.py --device cuda --cases stats,host,multi,instance --out "$out/stats.json" 2>&1 | tee -a "$log"
fi

if want quickstats; then
  section "statistics benchmark, 2^20-2^28 (quick)"
  run 45 $py benchmarks/bench_stats.py --device cuda --cases stats --sizes 20,24,28 --skip-llama --out "$out/stats.json" 2>&1 | tee -a "$log"
fi

if want quicknumerics; then
  # 2^24 only: the per-block formats at 2^28 (5-9 ms a call on an H100) ran past 75 s
  section "numerics and per-block formats against the statistics pass, 2^24 (quick)"
  run 75 $py benchmarks/bench_stats.py --device cuda --cases numerics,blocks --numerics-sizes 24 \
    --out "$out/numerics.json" 2>&1 | tee -a "$log"
fi

if want numerics; then
  section "numerics benchmark (exponent histogram + moments, and the per-block formats, vs the statistics pass)"
  run 120 $py benchmarks/bench_stats.py --device cuda --cases numerics,blocks --numerics-sizes 20,24,28 \
    --out "$out/numerics.json" 2>&1 | tee -a "$log"
fi

if want ncu; then
  section "ncu: one launch of every kernel_bench case a target names (clocks left as they are)"
  # quick: the fused statistics-numerics(-blocks) kernel alone, fewer sections
  kernels="stats_kernel|stats_numerics_kernel"
  sections="--section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis"
  if [ "$quick" = 1 ]; then kernels="stats_numerics_kernel"; sections="--section SpeedOfLight"; fi
  # nvcc took over 45 s there (an H100 machine, 2026-11-26): a kernel_bench built here for the same arch and
  # nvcc (13.0) can travel in .gpu-build/ instead
  bench_bin=/tmp/gapmon_kernel_bench
  if [ -x .gpu-build/gapmon_kernel_bench ]; then
    bench_bin=.gpu-build/gapmon_kernel_bench
    echo "kernel_bench: the one in .gpu-build" | tee -a "$log"
  else
    run 90 "$nvcc_bin" -O3 -std=c++20 --expt-relaxed-constexpr -arch="$sm" -lineinfo \
      -I csrc benchmarks/cuda/kernel_bench.cu csrc/cuda/stats_cuda.cu csrc/cuda/numerics_cuda.cu csrc/cuda/block_cuda.cu \
      -o "$bench_bin"
  fi &&
    run $([ "$quick" = 1 ] && echo 90 || echo 180) ncu --clock-control none $sections \
      --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum \
      --kernel-name regex:"$kernels" "$bench_bin" --once > "$out/ncu.txt" 2>&1
  tail -80 "$out/ncu.txt" | tee -a "$log"
fi

if want monitor; then
  section "monitor benchmark"
  run 150 $py benchmarks/bench_monitor.py --device cuda --gpt2 --steps 6 --rounds 2 --out "$out/monitor.json" 2>&1 | tee -a "$log"
fi

if want persample; then
  section "per-sample benchmark"
  run 150 $py benchmarks/bench_persample.py --device cuda --gpt2 128 1024 --steps 6 --out "$out/persample-gpt2.json" 2>&1 | tee -a "$log"
  run 100 $py benchmarks/bench_persample.py --device cuda --d-model 768 --out "$out/persample.json" 2>&1 | tee -a "$log"
  # the batch-provenance mode's cost per op and GPT-2 small's op count (#34): its share of a GPU step
  run 30 $py benchmarks/bench_provenance.py --device cuda --out "$out/provenance.json" 2>&1 | tee -a "$log"
  # per-sample Gram matrices against the norms of the same Linear layer (#38)
  run 20 $py benchmarks/bench_gram.py --device cuda --out "$out/gram.json" 2>&1 | tee -a "$log"
fi

if want quickmonitor; then
  section "monitor benchmark, GPT-2 small (quick)"
  # two rounds: one (2026-11-26) left ~4 ms of noise (interval=10, which launches nothing, showed 3.8 ms)
  run 150 $py benchmarks/bench_monitor.py --device cuda --gpt2 --steps 4 --rounds 2 --out "$out/monitor.json" 2>&1 | tee -a "$log"
fi

if want quickpersample; then
  section "per-sample benchmark, GPT-2 small at T=128 (quick)"
  run 150 $py benchmarks/bench_persample.py --device cuda --gpt2 128 --steps 4 --out "$out/persample-gpt2.json" 2>&1 | tee -a "$log"
  # the batch tracking's cost per op and the per-sample norms' host time per step and per covered layer (#34)
  run 30 $py benchmarks/bench_provenance.py --device cuda --out "$out/provenance.json" 2>&1 | tee -a "$log"
  # why a norms step costs 3.85x a plain one on an H100 (2026-11-26) where the products alone make 1.30x: wall
  # against GPU busy time, launches, the host's waits for the GPU and which gapmon line makes each
  run 60 $py benchmarks/profile_persample.py --device cuda --out "$out/profile.json" 2>&1 | tee -a "$log"
fi


if want quicksuite; then
  workers=${GAPMON_SUITE_WORKERS:-$([ "${solo:-0}" = 1 ] && echo 14 || echo 8)}
  section "whole test suite, $workers workers of one thread each (quick)"
  # -v: each test's verdict is in suite.log as it ends, also when the limit cuts the run; the limit sends SIGINT
  # first, so that pytest prints the tracebacks of the failures so far. One thread per worker: torch's default (a
  # thread per core in every worker) oversubscribed the cores many times over.
  # GAPMON_SUITE_LIMIT / GAPMON_SUITE_WORKERS: to fit what device time is left (16 cores there)
  reserve=0
  timeout_options="-s INT -k 20" run "${GAPMON_SUITE_LIMIT:-420}" env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $py -m pytest -v -n "$workers" \
    -p no:cacheprovider --tb=short --durations=25 tests >"$out/suite.log" 2>&1
  tests_rc=$?
  grep -E "FAILED|ERROR" "$out/suite.log" | head -40 | tee -a "$log"
  tail -3 "$out/suite.log" | tee -a "$log"
fi

if want suite; then
  section "whole test suite"
  run 560 $py -m pytest -q -p no:cacheprovider tests 2>&1 | tail -30 | tee -a "$log"
  tests_rc=${PIPESTATUS[0]}
fi

if want variants; then
  section "kernel variants (benchmarks/cuda/tune.sh)"
  NVCC=$nvcc_bin CUDA_ARCH=$sm run 240 bash benchmarks/cuda/tune.sh "$out/variants.txt" 2>&1 | tee -a "$log"
fi

section "done (tests exit code $tests_rc)"
exit "$tests_rc"
