"""Builds graphquant._C: the pybind11 binding module, with the CUDA kernels where CUDA exists.

The CUDA part is compiled only when a CUDA toolkit and a CUDA build of torch are both present;
otherwise the module carries the host-side code alone and graphquant runs the reference numerics.
"""

import glob
import os
import sys

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def cuda_arch_flags() -> list[str]:
    """sm_90a for Hopper's own instructions, and sm_100a where this nvcc knows it."""
    flags = ["-gencode=arch=compute_90a,code=sm_90a"]
    if int(torch.version.cuda.split(".")[0]) >= 13 or torch.version.cuda >= "12.8":
        flags.append("-gencode=arch=compute_100a,code=sm_100a")
    return flags


# The process already runs the shared libstdc++ (torch links it); some toolchains ship only
# libstdc++.a, and a second, static copy inside the extension crashed when an error message
# formatted a number (seen on the H200 machine's /opt/gcc). Link the shared one by name.
LINK_ARGS = ["-Wl,--push-state,--no-as-needed", "-l:libstdc++.so.6", "-Wl,--pop-state"] if sys.platform == "linux" else []


def extension():
    host_sources = sorted(glob.glob("csrc/*.cpp"))
    with_cuda = torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("GRAPHQUANT_NO_CUDA") != "1"
    if not with_cuda:
        return CppExtension("graphquant._C", host_sources, extra_compile_args={"cxx": ["-O2"]}, extra_link_args=LINK_ARGS)
    return CUDAExtension(
        "graphquant._C",
        host_sources + sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu")),
        define_macros=[("GRAPHQUANT_WITH_CUDA", "1")],
        extra_compile_args={
            "cxx": ["-O3"],
            # The kernels are bit-identical to graphquant/formats only with IEEE division, fp32
            # subnormals kept and no a*b+c contracted into one FMA rounding.
            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-prec-div=true", "-ftz=false", "-fmad=false", *cuda_arch_flags()],
        },
        extra_link_args=LINK_ARGS,
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
