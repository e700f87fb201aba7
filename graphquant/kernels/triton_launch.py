"""Launching graphquant's Triton kernels again without Triton's per-call Python.

Triton's ``kernel[grid](...)`` binds every argument, takes each one's specialization (an int's
value where it is 1 or a multiple of 16, a tensor's dtype and 16-byte alignment) and looks the
compiled kernel up again at every call, behind the autotuner's own key; for a decode GEMM's
forty-odd arguments that is far more host time than the kernel's few microseconds of GPU time,
and without CUDA graphs it set the pace of a decode step. ``launch`` does that work once per
call signature (every argument that is not a tensor or a TMA descriptor, by value; each tensor's
dtype and alignment; each descriptor's dtype, block and layout), remembers the compiled kernel,
its grid and its arguments in order, and afterwards hands the call's tensors and descriptors
straight to the compiled kernel's launcher. Triton's interpreter, and
launch hooks (a profiler's), get Triton's own path. ``dependent_launch`` says where a kernel is
launched dependent on the kernel before it (Hopper's programmatic dependent launch).
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Union

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.runtime.autotuner import Autotuner
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from graphquant.kernels import devices

try:  # Gluon's TMA descriptors (Triton 3.6): handed over per call like tensors
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:
    TensorDescriptor = torch.Tensor

Grid = Union[tuple[int, ...], Callable[[dict[str, Any]], tuple[int, ...]]]
PER_CALL = (torch.Tensor, TensorDescriptor)  # arguments handed over at every call, not kept by value


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, for grids and sizes on the host: triton.cdiv is a constexpr function, about
    a hundred times slower to call from Python than this."""
    return -(-a // b)


class _Launch(NamedTuple):
    """One call signature's compiled kernel (its launcher, function and metadata) and grid, the
    arguments in the kernel's order with None where the call's tensors and descriptors go, and
    where those come from (a position in the call's arguments, or a keyword)."""

    launcher: Callable[..., None]
    function: Any
    metadata: Any
    grid: tuple[int, int, int]
    values: tuple
    tensors: tuple[tuple[int, Union[int, str]], ...]


_LAUNCHES: dict[tuple, _Launch] = {}


def _signature(values: Any) -> tuple:
    """What Triton's specialization may read of each argument: a tensor's dtype and whether it is
    16-byte aligned, a TMA descriptor's dtype, block and layout, any other argument itself."""
    return tuple(_specialized(v) for v in values)


def _specialized(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.dtype, v.data_ptr() % 16 == 0
    if isinstance(v, TensorDescriptor):  # its base, shape and strides travel at every call
        return v.base.dtype, tuple(v.block_shape), v.layout
    return v


def _hooked(hook: Any) -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps a chain of them (empty: none), earlier ones
    a callable or None."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel: Any, grid: Grid, *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)`` for a triton.jit kernel or an autotuner over one; a grid
    given as a function must be one of the arguments and the chosen config's alone, as Triton's
    grids are (it is evaluated once per call signature)."""
    hooked = _hooked(triton.knobs.runtime.launch_enter_hook) or _hooked(triton.knobs.runtime.launch_exit_hook)
    if triton.knobs.runtime.interpret or hooked:
        kernel[grid](*args, **kwargs)
        return
    device = driver.active.get_current_device()
    key = (kernel, device, None if callable(grid) else grid, _signature(args), tuple(kwargs), _signature(kwargs.values()))
    known = _LAUNCHES.get(key)
    if known is None:
        known = _LAUNCHES[key] = _first(kernel, grid, args, kwargs)
    else:
        values = list(known.values)
        for position, source in known.tensors:
            values[position] = args[source] if isinstance(source, int) else kwargs[source]
        stream = driver.active.get_current_stream(device)
        known.launcher(*known.grid, stream, known.function, known.metadata, None, None, None, *values)


def _first(kernel: Any, grid: Grid, args: tuple, kwargs: dict) -> _Launch:
    """Launch through Triton (which compiles, or autotunes, as it needs) and keep what it did."""
    compiled = kernel[grid](*args, **kwargs)
    jit, chosen = (kernel.fn, kernel.best_config.kwargs) if isinstance(kernel, Autotuner) else (kernel, {})
    if not isinstance(jit, JITFunction):
        raise TypeError(f"launch takes a triton.jit kernel or an autotuner over one, not {kernel}")
    params = {name: value for name, value in {**kwargs, **chosen}.items() if name in jit.arg_names}
    bound = jit.signature.bind(*args, **params)
    bound.apply_defaults()
    named = dict(bound.arguments)  # every parameter in the kernel's order: the positional ones first
    shape = tuple(grid(named) if callable(grid) else grid)
    tensors = tuple(
        (position, position if position < len(args) else name)
        for position, (name, value) in enumerate(named.items())
        if isinstance(value, PER_CALL)
    )
    values = tuple(None if isinstance(value, PER_CALL) else value for value in named.values())
    return _Launch(compiled.run, compiled.function, compiled.packed_metadata, (*shape, 1, 1)[:3], values, tensors)


# GRAPHQUANT_DEPENDENT_LAUNCH=0 (read once a process, as the CUDA extension's launches read it)
# makes every launch wait for the kernel before it: to measure what the dependent launches gain.
DEPENDENT_LAUNCH = os.environ.get("GRAPHQUANT_DEPENDENT_LAUNCH") != "0"


def dependent_launch(device: torch.device) -> dict:
    """A kernel's DEPENDENT and its launch's launch_pdl for a launch on ``device``: a programmatic
    dependent launch (it starts while the kernel before it finishes, and waits for it:
    ``wait_for_the_kernel_before``) where asked (DEPENDENT_LAUNCH) on a GPU that has them
    (griddepcontrol, which PTX has from sm_90 on: for an sm_89 GPU, which the decode GEMM also
    serves, the kernels would not assemble with it); not in Triton's interpreter, which runs no PTX
    and each launch after the last."""
    dependent = DEPENDENT_LAUNCH and not triton.knobs.runtime.interpret and (devices.capability(device) or (0, 0)) >= (9, 0)
    return {"DEPENDENT": dependent, "launch_pdl": dependent}


@triton.jit
def wait_for_the_kernel_before(DEPENDENT: tl.constexpr):
    """The prologue of a dependent launch, before a program's first load or store."""
    if DEPENDENT:
        gdc_wait()
