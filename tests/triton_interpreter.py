"""Triton's CPU interpreter as the tests run kernels under it: in a process of their own, since
TRITON_INTERPRET=1 must be set before Triton is first imported."""

import json
import os
import subprocess
import sys


def results_of(script: str) -> dict:
    """What the test module ``script``, run as a program under the interpreter, prints as JSON on
    its last line (the repository first on its path)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


def accept_numpy_scalars() -> None:
    """numpy >= 2.3 refuses int() of a one-element array, which the interpreter does for a loop
    bound or a branch computed in the kernel: index such tensors by their one element."""
    import numpy
    import triton.runtime.interpreter as interpreter

    if tuple(map(int, numpy.__version__.split(".")[:2])) < (2, 3):
        return
    patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor


def round_bfloat16_to_nearest() -> None:
    """The interpreter rounds float32 to bfloat16 toward zero; the GPU, and torch, to nearest even."""
    import numpy
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if dst_type.scalar != tl.bfloat16 or src.dtype.scalar != tl.float32:
            return cast(self, src, dst_type)
        data = torch.from_numpy(numpy.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
        return interpreter.TensorHandle(data.view(numpy.uint16), dst_type.scalar)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def exact_fp8_dot_operands() -> None:
    """The interpreter's tl.dot widens FP8 operands to float16 through its own conversion, which
    loses E5M2's subnormals (2^-16 and 2^-15 become 0, 3 * 2^-16 becomes 2^-15); the tensor cores
    read them exactly: widen them to float32 as torch does (exact for every FP8 code)."""
    import numpy
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    dot = interpreter.InterpreterBuilder.create_dot
    fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}

    def widened(handle):
        codes = torch.from_numpy(numpy.ascontiguousarray(handle.data)).view(fp8[handle.dtype.scalar])
        return interpreter.TensorHandle(codes.float().numpy(), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar in fp8 or b.dtype.scalar in fp8:
            a, b = (widened(x) if x.dtype.scalar in fp8 else x for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def round_fp8_to_nearest_even() -> None:
    """The interpreter's float32 -> FP8 casts carry no rounding into the exponent and break ties
    away from zero; the GPU's (cvt.rn.satfinite) round to nearest even, as the reference cast
    (graphquant.formats.fp8.cast_to_fp8) does: the interpreter's become the reference's. Its FP8
    -> float32 casts decode E4M3's NaN (0x7F) as 480: they become torch's."""
    import numpy
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    from graphquant.formats import fp8
    from graphquant.formats.fp8 import cast_to_fp8

    formats = {tl.float8e4nv: "e4m3", tl.float8e5: "e5m2"}
    convert = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar in formats and dst_type.scalar == tl.float32:
            codes = torch.from_numpy(numpy.ascontiguousarray(src.data)).view(fp8.FP8_DTYPES[formats[src.dtype.scalar]])
            return interpreter.TensorHandle(codes.float().numpy(), tl.float32)
        if dst_type.scalar not in formats or src.dtype.scalar != tl.float32:
            return convert(self, src, dst_type, rounding_mode)
        data = cast_to_fp8(torch.from_numpy(numpy.ascontiguousarray(src.data)), formats[dst_type.scalar]).view(torch.uint8).numpy()
        return interpreter.TensorHandle(data, dst_type.scalar)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def as_on_the_gpu() -> None:
    """Every patch above: the interpreter's scalars, casts and FP8 dot operands as the GPU's."""
    accept_numpy_scalars()
    round_fp8_to_nearest_even()
    exact_fp8_dot_operands()
    round_bfloat16_to_nearest()
