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


def round_fp8_to_nearest_even() -> None:
    """The interpreter's float32 -> FP8 casts carry no rounding into the exponent and break ties
    away from zero; the GPU's (cvt.rn.satfinite) round to nearest even, as the reference cast
    (graphquant.formats.fp8.cast_to_fp8) does: the interpreter's become the reference's."""
    import numpy
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    from graphquant.formats.fp8 import cast_to_fp8

    formats = {tl.float8e4nv: "e4m3", tl.float8e5: "e5m2"}
    convert = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar not in formats or src.dtype.scalar != tl.float32:
            return convert(self, src, dst_type, rounding_mode)
        data = cast_to_fp8(torch.from_numpy(numpy.ascontiguousarray(src.data)), formats[dst_type.scalar]).view(torch.uint8).numpy()
        return interpreter.TensorHandle(data, dst_type.scalar)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
