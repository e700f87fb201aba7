"""Builds graphquant._C, the CUDA kernels and their pybind11 bindings, where CUDA can build them.

That takes a CUDA build of torch, an nvcc of the same CUDA major version and the CUDA headers the
sources include. Elsewhere graphquant installs as pure Python and runs the reference numerics
(graphquant.kernels finds no _C), and the build prints why.

A C++ extension loads only into the torch release it was compiled against, so the build uses the
torch installed for the interpreter graphquant is being installed into, never a second copy
fetched for the build: torch is not a build requirement, and under pip's build isolation (which
hides that interpreter's site-packages) the build looks for it there.
"""

import glob
import os
import re
import site
import subprocess
import sys

from setuptools import setup


def installed_torch():
    """torch as installed for this interpreter, also where build isolation hides it from sys.path."""
    try:
        import torch
    except ImportError:
        holders = [d for d in (*site.getsitepackages(), site.getusersitepackages()) if os.path.isdir(os.path.join(d, "torch"))]
        if not holders:
            sys.exit(
                f"graphquant builds against the torch it will run with, and {sys.executable} has none: "
                "install torch >= 2.11 first (README.md, 'Set up')"
            )
        sys.path.append(holders[0])
        import torch
    return torch


torch = installed_torch()
from torch.utils import cpp_extension  # noqa: E402  (needs the torch found above)

# What csrc/cuda includes, directly and through ATen/cuda/CUDAContext.h.
CUDA_HEADERS = ("cuda_runtime.h", "cuda_fp8.h", "cublasLt.h", "cublas_v2.h", "cusparse.h", "cusolverDn.h")


def nvcc_release() -> tuple[int, int] | None:
    """The CUDA release of the nvcc that torch's build would call, or None where there is none."""
    if cpp_extension.CUDA_HOME is None:
        return None
    try:
        out = subprocess.run([os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2])) if found else None


def why_no_cuda(nvcc: tuple[int, int] | None) -> str | None:
    """Why the CUDA kernels cannot build here, or None when they can."""
    if os.environ.get("GRAPHQUANT_NO_CUDA") == "1":
        return "GRAPHQUANT_NO_CUDA=1"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if nvcc is None:
        return f"no nvcc found (CUDA_HOME={cpp_extension.CUDA_HOME}; set CUDA_HOME to a CUDA {torch.version.cuda} toolkit)"
    if str(nvcc[0]) != torch.version.cuda.split(".")[0]:
        return f"nvcc in {cpp_extension.CUDA_HOME} is CUDA {nvcc[0]}.{nvcc[1]} and torch {torch.__version__} was built with CUDA {torch.version.cuda}"
    include_dirs = cpp_extension.include_paths(device_type="cuda", torch_include_dirs=False)
    missing = [h for h in CUDA_HEADERS if not any(os.path.isfile(os.path.join(d, h)) for d in include_dirs)]
    if missing:
        return f"{', '.join(missing)} not found in {', '.join(include_dirs)}"
    return None


def cuda_archs(nvcc: tuple[int, int]) -> list[int]:
    """The compute capabilities (major * 10 + minor) the kernels are built for: sm_90a for
    Hopper's own instructions, and sm_100a where this nvcc knows it. An arch-specific target runs
    on its own capability alone, so the extension says which (graphquant._C.cuda_archs) and runs
    nowhere else."""
    return [90, 100] if nvcc >= (12, 8) else [90]


def cuda_arch_flags(archs: list[int]) -> list[str]:
    return [f"-gencode=arch=compute_{arch}a,code=sm_{arch}a" for arch in archs]


# The process already runs the shared libstdc++ (torch links it); some toolchains ship only
# libstdc++.a, and a second, static copy inside the extension crashed when an error message
# formatted a number (seen on the H200 machine's /opt/gcc). Link the shared one by name.
LINK_ARGS = ["-Wl,--push-state,--no-as-needed", "-l:libstdc++.so.6", "-Wl,--pop-state"] if sys.platform == "linux" else []


def extensions():
    """graphquant._C where CUDA can build it, else none."""
    nvcc = nvcc_release()
    reason = why_no_cuda(nvcc)
    if reason is not None:
        print(f"graphquant: no CUDA kernels (pure Python, reference numerics): {reason}", flush=True)
        return []
    print(f"graphquant: building the CUDA kernels with nvcc {nvcc[0]}.{nvcc[1]} for torch {torch.__version__}", flush=True)
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
    archs = cuda_archs(nvcc)
    kernels = cpp_extension.CUDAExtension(
        "graphquant._C",
        sources,
        extra_compile_args={
            # for bindings.cpp (graphquant._C.cuda_archs); not nvcc's, which would split the list at its commas
            "cxx": ["-O3", f"-DGRAPHQUANT_CUDA_ARCHS={','.join(map(str, archs))}"],
            # The kernels are bit-identical to graphquant/formats only with IEEE division, fp32
            # subnormals kept and no a*b+c contracted into one FMA rounding.
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-prec-div=true", "-ftz=false", "-fmad=false", *cuda_arch_flags(archs)],
        },
        extra_link_args=LINK_ARGS,
    )
    return [kernels]


setup(ext_modules=extensions(), cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)})
