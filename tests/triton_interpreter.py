"""Triton's CPU interpreter (TRITON_INTERPRET=1, set before Triton is first imported) as the tests
run kernels under it."""

import numpy
import triton.runtime.interpreter as interpreter


def accept_numpy_scalars() -> None:
    """numpy >= 2.3 refuses int() of a one-element array, which the interpreter does for a loop
    bound or a branch computed in the kernel: index such tensors by their one element."""
    if tuple(map(int, numpy.__version__.split(".")[:2])) < (2, 3):
        return
    patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor
