"""Which build flags make a C++ refusal that formats an integer crash (SIGSEGV) on the GPU machines' image: four tiny
torch extensions built with load_inline, each function called in a process of its own; then cuda-gdb on gapmon's
first refusal case (the loaded libstdc++). Run there from the repository root, with gapmon/_C*.so in place; its
output of 2026-11-27 (H200) is probe.txt beside it."""
import os
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

SRC = r'''
#include <torch/extension.h>
#include <sstream>
int64_t fmt_long(int64_t v) { TORCH_CHECK_VALUE(false, "value ", v); return 0; }
int64_t fmt_string(int64_t v) { TORCH_CHECK_VALUE(false, "value ", std::to_string(v)); return 0; }
int64_t fmt_chars(int64_t v) { TORCH_CHECK_VALUE(false, "value ", "chars"); return 0; }
std::string oss_long(int64_t v) { std::ostringstream s; s << v; return s.str(); }
'''
VARIANTS = {
    "c++20 hidden openmp (gapmon's)": ["-O3", "-std=c++20", "-ffp-contract=fast", "-fvisibility=hidden", "-fopenmp"],
    "c++17 hidden openmp": ["-O3", "-std=c++17", "-ffp-contract=fast", "-fvisibility=hidden", "-fopenmp"],
    "c++20 default visibility": ["-O3", "-std=c++20", "-fopenmp"],
    "c++20 hidden, no openmp": ["-O3", "-std=c++20", "-fvisibility=hidden"],
}
CHILD = textwrap.dedent('''
    import sys, torch
    from torch.utils.cpp_extension import load_inline
    name, flags, fn = sys.argv[1], sys.argv[2].split(), sys.argv[3]
    m = load_inline(name, open(sys.argv[4]).read(), functions=["fmt_long", "fmt_string", "fmt_chars", "oss_long"],
                    extra_cflags=flags, extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
                    build_directory=sys.argv[5], verbose=False)
    if fn == "build":
        print("built"); sys.exit(0)
    try:
        r = getattr(m, fn)(7)
        print(fn, "returned", r)
    except ValueError as e:
        print(fn, "raised ValueError:", str(e).splitlines()[0])
''')
os.makedirs("/tmp/probe", exist_ok=True)
open("/tmp/probe/src.cpp", "w").write(SRC)
open("/tmp/probe/child.py", "w").write(CHILD)
def build(item):
    i, (label, flags) = item
    d = f"/tmp/probe/b{i}"
    os.makedirs(d, exist_ok=True)
    t = time.time()
    p = subprocess.run([sys.executable, "/tmp/probe/child.py", f"probe{i}", " ".join(flags), "build", "/tmp/probe/src.cpp", d],
                       capture_output=True, text=True, timeout=240)
    return label, p.returncode, time.time() - t, p.stderr[-600:]
with ThreadPoolExecutor(4) as ex:
    built = list(ex.map(build, enumerate(VARIANTS.items())))
for (label, rc, s, err), (i, flags) in zip(built, enumerate(VARIANTS.values())):
    print(f"== {label}: build rc {rc} ({s:.0f} s)" + ("" if rc == 0 else " " + err))
    if rc:
        continue
    for fn in ("oss_long", "fmt_chars", "fmt_string", "fmt_long"):
        p = subprocess.run([sys.executable, "/tmp/probe/child.py", f"probe{i}", " ".join(flags), fn, "/tmp/probe/src.cpp",
                            f"/tmp/probe/b{i}"], capture_output=True, text=True, timeout=120)
        print(f"   {fn}: exit {p.returncode} {p.stdout.strip()[:120]}")
print("gdb on gapmon's case:")
if not shutil.which("cuda-gdb"):
    sys.exit(0)
r = subprocess.run(["cuda-gdb", "-batch", "-ex", "run", "-ex", "bt 4", "-ex", "info sharedlibrary",
                    "--args", sys.executable, "tests/stats/native_error_cases.py", "cpu"], capture_output=True, text=True, timeout=120)
lines = r.stdout.splitlines()
print("\n".join(line for line in lines if line.startswith("#") or "stdc++" in line or "gcc_s" in line or "SIG" in line)[:4000])
