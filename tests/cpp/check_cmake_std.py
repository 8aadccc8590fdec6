"""The C++ standard nvcc really compiles the CUDA check target (the kernel benchmark) with: the last -std= of its
generated flags must be c++20 (CMake once appended nvcc's default -std=c++17 after ours)."""
import re
import sys
from pathlib import Path

build = Path(sys.argv[1])
bad = []
for target in ("gapmon_kernel_bench_check",):
    flags = (build / "CMakeFiles" / f"{target}.dir" / "flags.make").read_text()
    line = next(x for x in flags.splitlines() if x.startswith("CUDA_FLAGS"))
    standards = re.findall(r"-std=(\S+)", line)
    if not standards or standards[-1] != "c++20":
        bad.append(f"{target}: {standards}")
if bad:
    sys.exit("nvcc does not compile as C++20: " + "; ".join(bad))
print("nvcc compiles the CUDA check targets as C++20")
