"""Compiles every CUDA kernel source and checks the kernels' register budget, without a GPU (run by ctest).

Compiles every csrc/cuda/*.cu with ``nvcc -Xptxas -v`` for sm_80 and sm_90, warnings as errors (the build's only
compile of them: CMake does not compile them again), and checks that:

- the statistics kernels use at most 64 registers, so 4 blocks of 256 threads are resident per SM,
  the statistics-and-numerics kernel (plain, and fused with the block formats) at most 128 (2 blocks),
  and the block-format kernel fits its launch bounds;
- spill traffic stays within a small budget per function: the kernel keeps its loop state across
  the out-of-line per-chunk call (read_chunk), and that call saves the registers it uses, once per
  chunk (at least 256 elements per thread), which ptxas reports as spills (the fused pass, which casts
  the block formats in the reader's loop, has a larger budget: see FUSED);
- where a SASS disassembler is found (cuobjdump from the CUDA toolkit or Triton's copy), no loop
  that issues 128-bit global loads touches local memory: the element loops themselves never spill
  (the fused pass's: at most one local access per 200 instructions).

Usage: check_kernels.py NVCC SOURCE_ROOT
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

# (source, kernel name, instantiations, register budget): each kernel's __launch_bounds__.
KERNELS = (
    ("stats_cuda.cu", "stats_kernel", 2, 64),
    ("numerics_cuda.cu", "stats_numerics_kernel", 2, 128),  # <false>: the pass; <true>: with block formats
    ("block_cuda.cu", "block_chunk_kernel", 1, 255),
)
# Per function, stores or loads: the per-chunk call saves (a few hundred bytes per thread per chunk of
# at least 256 elements per thread, from L1), not element-loop spills (checked on the SASS).
MAX_SPILL_BYTES = 512
# The fused pass (statistics, numerics and the block formats cast from the reader's vectors, 128 registers)
# keeps far more in its element loops: ptxas reloads a few loop-invariant values per batch of vectors there
# (2-14 local loads in loops of 900-7,600 instructions on sm_80/sm_90) and saves more per chunk. Its budget:
# per function, and local memory accesses per element-loop instruction.
FUSED = r"stats_numerics_kernelILb1|FusedObserver"
MAX_FUSED_SPILL_BYTES = 1024
MAX_FUSED_LOCAL_PER_INSTRUCTION = 1 / 200


def compile_verbose(nvcc: str, source: str, arch: str, out: str) -> str:
    cmd = [nvcc, "-std=c++20", "--expt-relaxed-constexpr", "-O3", "-Werror=all-warnings", f"-arch={arch}", "-Xptxas",
           "-v", "-cubin", "-o", out, source]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"nvcc failed for {arch}:\n{done.stderr}")
    return done.stderr


def function_properties(ptxas_log: str) -> dict[str, dict[str, int]]:
    """{mangled name: {registers, spill_stores, spill_loads}} from ptxas -v output."""
    props: dict[str, dict[str, int]] = {}
    name = None
    for line in ptxas_log.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            name = m.group(1)
            props[name] = {"registers": 0, "spill_stores": 0, "spill_loads": 0}
        elif name and (m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            props[name]["spill_stores"], props[name]["spill_loads"] = int(m.group(1)), int(m.group(2))
        elif name and (m := re.search(r"Used (\d+) registers", line)):
            props[name]["registers"] = int(m.group(1))
    return props


def readable(mangled: str) -> str:
    """The function's name and template arguments out of its mangled name (enough to tell them apart)."""
    m = re.search(r"\d(stats_kernel|read_chunk|accumulate_chunk_in_double|fused_block_chunk|[a-z_]+_kernel)(?:I(\w+?)EE|E)",
                  mangled)
    if m:
        return f"{m.group(1)}<{m.group(2)}>" if m.group(2) else m.group(1)
    return re.sub(r"^_ZN.*?\d+(?=[a-z])", "", mangled)[-40:]


def find_cuobjdump(nvcc: str) -> str | None:
    here = os.path.join(os.path.dirname(nvcc), "cuobjdump")
    if os.path.exists(here):
        return here
    if found := shutil.which("cuobjdump"):
        return found
    # NVIDIA's wheels (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm): cuobjdump needs
    # nvdisasm from the same directory, which it finds through NVDISASM_PATH.
    for site in sys.path:
        for binary in glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "cuobjdump")):
            if os.path.exists(os.path.join(os.path.dirname(binary), "nvdisasm")):
                os.environ.setdefault("NVDISASM_PATH", os.path.dirname(binary))
                return binary
    try:
        import triton  # ships the CUDA binary utilities

        triton_copies = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))
        return triton_copies[0] if triton_copies else None
    except Exception:  # no triton, or one that fails to import: the SASS check is skipped
        return None


def element_loops_with_local_memory(cuobjdump: str, cubin: str) -> list[str]:
    """Loops (backward branches) that issue 128-bit global loads and also touch local memory."""
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    bad = []
    for function in re.split(r"\n\s*Function : ", sass)[1:]:
        name = function.split("\n", 1)[0].strip()
        code = []
        for line in function.splitlines():
            if m := re.search(r"/\*([0-9a-f]{4,})\*/\s*(.*?);", line):
                code.append((int(m.group(1), 16), m.group(2).strip()))
        index = {address: i for i, (address, _) in enumerate(code)}
        for i, (address, text) in enumerate(code):
            m = re.search(r"BRA (?:!?P\d, )?0x([0-9a-f]+)", text)
            if not m or int(m.group(1), 16) >= address or int(m.group(1), 16) not in index:
                continue
            body = [t for _, t in code[index[int(m.group(1), 16)]: i + 1]]
            vector_loads = sum("LDG.E.128" in t for t in body)
            local = sum(bool(re.search(r"\b(LDL|STL)\b", t)) for t in body)
            # An element loop: all its global loads are the kVecUnroll vectors of one batch (outer
            # loops over runs contain several element loops and may keep cursors in local memory).
            allowed = len(body) * MAX_FUSED_LOCAL_PER_INSTRUCTION if re.search(FUSED, name) else 0
            if 0 < vector_loads <= 4 and local > allowed:
                bad.append(f"{readable(name)}: element loop of {len(body)} instructions, {local} local memory accesses")
    return bad


ARCHS = ("sm_80", "sm_90")


def check_source(source: str, kernel: str, instantiations: int, max_registers: int, cuobjdump: str | None,
                 compiled: dict[str, tuple[str, str]]) -> list[str]:
    """The budgets of one source's kernels, from its compiled {arch: (ptxas log, cubin)}."""
    failures = []
    for arch in ARCHS:
        log, cubin = compiled[arch]
        props = function_properties(log)
        kernels = {n: p for n, p in props.items() if re.search(rf"\d{kernel}[IE]", n)}
        if len(kernels) != instantiations:
            failures.append(f"{arch}: expected {instantiations} {kernel} instantiation(s), found {list(kernels)}")
        for name, p in props.items():
            short = readable(name)
            if name in kernels and p["registers"] > max_registers:
                failures.append(f"{arch} {short}: {p['registers']} registers > {max_registers}")
            if max(p["spill_stores"], p["spill_loads"]) > (MAX_FUSED_SPILL_BYTES if re.search(FUSED, name) else MAX_SPILL_BYTES):
                failures.append(f"{arch} {short}: spills {p['spill_stores']} B stored, {p['spill_loads']} B loaded")
            if name in kernels:
                print(f"{arch} {short}: {p['registers']} registers, spills {p['spill_stores']}/{p['spill_loads']} B")
        if cuobjdump:
            failures += [f"{arch} {b}" for b in element_loops_with_local_memory(cuobjdump, cubin)]
    return failures


def main() -> None:
    nvcc, root = sys.argv[1], sys.argv[2]
    failures = []
    cuobjdump = find_cuobjdump(nvcc)
    with tempfile.TemporaryDirectory() as tmp:
        # Every (source, arch) compiled at once, as many at a time as there are cores (each takes ~20 s).
        sources = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")))
        missing = {source for source, *_ in KERNELS} - set(sources)
        if missing:
            sys.exit(f"kernel sources not found: {sorted(missing)}")
        jobs = {(source, arch): (os.path.join(root, "csrc", "cuda", source), os.path.join(tmp, f"{source}.{arch}.cubin"))
                for source in sources for arch in ARCHS}
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            logs = {key: pool.submit(compile_verbose, nvcc, path, key[1], cubin) for key, (path, cubin) in jobs.items()}
        for key in jobs:
            logs[key].result()  # every source compiles (nvcc's errors name the line)
        print(f"compiled {', '.join(sources)} for {' and '.join(ARCHS)}, warnings as errors")
        for source, kernel, instantiations, max_registers in KERNELS:
            compiled = {arch: (logs[source, arch].result(), jobs[source, arch][1]) for arch in ARCHS}
            failures += check_source(source, kernel, instantiations, max_registers, cuobjdump, compiled)
    if cuobjdump:
        print(f"element loops checked for local memory with {cuobjdump}")
    else:
        print("no cuobjdump found: the element-loop local memory check is skipped")
    if failures:
        print("\n".join(failures))
        sys.exit(1)
    print("kernel register budget: ok")


if __name__ == "__main__":
    main()
