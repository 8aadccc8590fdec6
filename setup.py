"""Builds gapmon._C: C++ CPU kernels always; CUDA kernels when torch has CUDA and nvcc is found.

GAPMON_CUDA=1 forces the CUDA build (and fails if it cannot be done), GAPMON_CUDA=0 skips it;
GAPMON_PTXAS_VERBOSE=1 makes ptxas print each kernel's registers and spills.
"""
import glob
import os
import sys

from setuptools import setup

# Commands that only package the sources (the sdist, metadata) need no torch: they compile nothing.
SOURCE_ONLY = {"sdist", "egg_info", "dist_info", "check"}
COMPILES = not (set(sys.argv[1:]) & SOURCE_ONLY) or {"build_ext", "bdist_wheel", "install", "develop"} & set(sys.argv[1:])

# The extension must be compiled against the torch it will run with, so the build uses the
# environment's torch (pip install --no-build-isolation). An isolated build has no torch: say so in
# one line, at once, rather than compile against another torch pulled into the build.
torch = cpp_extension = None
if COMPILES:
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        sys.exit("gapmon: torch is not importable in this build environment. Install torch first, then build "
                 "without isolation: pip install --no-build-isolation .")
    if "pip-build-env" in torch.__file__:
        sys.exit("gapmon: this is an isolated build (torch from a temporary build environment); build against your "
                 "own torch instead: pip install --no-build-isolation .")

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda() -> bool:
    flag = os.environ.get("GAPMON_CUDA")
    if flag == "0":
        return False
    home = cpp_extension.CUDA_HOME
    if torch.version.cuda is None:
        problem = f"torch {torch.__version__} has no CUDA"
    elif home is None:
        problem = "nvcc was not found (set CUDA_HOME to the CUDA toolkit's root)"
    elif not os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
        # torch guesses CUDA_HOME from nvcc's place; a wrapper script (/usr/local/bin/nvcc) misleads it.
        problem = (f"CUDA_HOME={home} has no include/cuda_runtime_api.h (is nvcc a wrapper script?); "
                   "set CUDA_HOME to the CUDA toolkit's root, e.g. CUDA_HOME=/usr/local/cuda")
    else:
        return True
    if flag == "1":
        raise RuntimeError(f"GAPMON_CUDA=1 but {problem}")
    if torch.version.cuda is not None:
        print(f"gapmon: building the CPU kernels only: {problem}", file=sys.stderr)
    return False


def rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def extension():
    # csrc/torch: the op registration and all torch glue; csrc/cpu: the torch-free CPU kernels.
    glue = [p for p in glob.glob(os.path.join(ROOT, "csrc", "torch", "*.cpp")) if not p.endswith("cuda_ops.cpp")]
    sources = rel(glue + glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    cxx = ["-O3", "-std=c++20", "-ffp-contract=fast", "-Wno-psabi", "-fvisibility=hidden"]
    link = []
    if sys.platform.startswith("linux"):
        # at::parallel_for is inlined from ATen headers: without OpenMP it runs on one thread.
        # The module then shares the libgomp.so.1 that torch itself loads.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    if not want_cuda():
        return cpp_extension.CppExtension(
            "gapmon._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=link
        )
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        # No GPU to ask: build for the data-centre GPUs the kernels are tuned for (A100, H100/H200).
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        print("gapmon: no GPU visible, building the CUDA kernels for TORCH_CUDA_ARCH_LIST=8.0;9.0", file=sys.stderr)
    sources += rel([os.path.join(ROOT, "csrc", "torch", "cuda_ops.cpp")] + glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
    if os.environ.get("GAPMON_PTXAS_VERBOSE") == "1":  # registers and spills per kernel in the build log
        nvcc.append("-Xptxas=-v")
    return cpp_extension.CUDAExtension(
        "gapmon._C",
        sources,
        extra_compile_args={"cxx": cxx + ["-DGAPMON_WITH_CUDA"], "nvcc": nvcc},
        extra_link_args=link,
    )


if COMPILES:
    setup(
        ext_modules=[extension()],
        cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    )
else:
    setup()
