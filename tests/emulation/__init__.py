"""Builds the CPU emulation of graphquant's CUDA kernels (see emulate.cpp), once per session."""

from __future__ import annotations

import functools
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=None)
def extension():
    """The emulated graphquant._C, or None where there is no C++ compiler (a build error raises)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return None
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name="graphquant_emulated",
        sources=[os.path.join(REPO, "csrc/cuda/register.cpp"), os.path.join(REPO, "tests/emulation/emulate.cpp")],
        extra_include_paths=[os.path.join(REPO, "csrc/cuda")],
        # IEEE fp32 as on the GPU: no a*b+c contraction (the kernels build with -fmad=false).
        extra_cflags=["-O2", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-unknown-pragmas", "-DGRAPHQUANT_EMULATE"],
        # The shared libstdc++, as setup.py links it (a toolchain with only libstdc++.a crashes on messages with numbers).
        extra_ldflags=["-Wl,--push-state,--no-as-needed", "-l:libstdc++.so.6", "-Wl,--pop-state"] if sys.platform == "linux" else [],
    )
