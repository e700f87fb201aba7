"""Triton kernels compiled for Hopper on the CPU, and Triton's ptxas on them: the tests that hold a
kernel to its instructions, registers and spills share it."""

import inspect
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


def compiled_for(kernel, pointers: dict, runtime: dict, constants: dict, num_warps: int, num_stages: int, capability: int = 90):
    """``kernel`` (a JITFunction) compiled for sm_``capability`` (on any machine: Triton compiles
    without a GPU) with the given pointer types (others fp32), the runtime ints' values (Triton
    specializes ints divisible by 16, and 1; an int not given: neither) and constants (a constexpr
    parameter not given: its default). benchmarks/sass_per_value.py compiles through it too."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constants = constants | {name: 1 for name, value in runtime.items() if value == 1 and name not in kernel.do_not_specialize}
    constants = {p.name: p.default for p in kernel.params if p.is_constexpr and p.default is not inspect.Parameter.empty} | constants
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name], attrs[(i,)] = pointers.get(name, "*fp32"), [["tt.divisibility", 16]]
        else:  # an int: Triton specializes those divisible by 16 unless told not to
            signature[name] = "i32"
            if name not in kernel.do_not_specialize and name in runtime and runtime[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
