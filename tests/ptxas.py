"""Triton's ptxas on a kernel compiled for Hopper on the CPU: the tests that hold a kernel to its
registers and spills share it."""

import subprocess
import tempfile


def report(ptx: str) -> str:
    """What ptxas (Triton's, for sm_90a) says of a kernel's registers and spills."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        with open(f"{folder}/kernel.ptx", "w") as file:
            file.write(ptx)
        done = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f"{folder}/kernel.ptx", "-o", f"{folder}/kernel.cubin"],
            capture_output=True, text=True, check=True,
        )
    return done.stderr
