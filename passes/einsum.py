"""Two-operand einsums that are one (batched) matrix product, as y[b] = x[b] @ w[b]^T.

find_gemms works the layout out once, when it annotates the site; the rewritten graph passes it
to graphquant.ops.functional.quantized_einsum, which applies it.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional


class EinsumLayout(NamedTuple):
    """How ``einsum(equation, a, b)`` becomes a batched TN product and back.

    x = a.permute(a_perm).reshape(x_shape); w = b.permute(b_perm).reshape(w_shape);
    result = (x @ w^T).reshape(y_shape).permute(out_perm).
    A NamedTuple, so that a graph carries it as an argument (FX writes it out as a call).
    """

    equation: str
    a_perm: tuple[int, ...]
    b_perm: tuple[int, ...]
    x_shape: tuple[int, int, int]
    w_shape: tuple[int, int, int]
    y_shape: tuple[int, ...]
    out_perm: tuple[int, ...]


def einsum_layout(equation: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...]) -> Optional[EinsumLayout]:
    """The layout, or None when the equation is not a plain batched product (ellipsis, traces,
    a letter summed out of one operand alone, repeated letters, symbolic sizes)."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    inputs, out = equation.split("->")
    if inputs.count(",") != 1:
        return None
    a, b = inputs.split(",")
    if any(len(set(s)) != len(s) for s in (a, b, out)) or len(a) != len(a_shape) or len(b) != len(b_shape):
        return None
    if not all(isinstance(s, int) for s in (*a_shape, *b_shape)):
        return None
    batch = [c for c in out if c in a and c in b]
    m = [c for c in out if c in a and c not in b]
    n = [c for c in out if c in b and c not in a]
    k = [c for c in a if c in b and c not in out]
    if set(a) != set(batch + m + k) or set(b) != set(batch + n + k) or set(out) != set(batch + m + n):
        return None
    size = {c: a_shape[a.index(c)] for c in a} | {c: b_shape[b.index(c)] for c in b}
    if any(a_shape[a.index(c)] != b_shape[b.index(c)] for c in batch + k):
        return None

    def prod(letters: list[str]) -> int:
        return math.prod(size[c] for c in letters)

    y_letters = batch + m + n
    return EinsumLayout(
        equation=equation,
        a_perm=tuple(a.index(c) for c in batch + m + k),
        b_perm=tuple(b.index(c) for c in batch + n + k),
        x_shape=(prod(batch), prod(m), prod(k)),
        w_shape=(prod(batch), prod(n), prod(k)),
        y_shape=tuple(size[c] for c in y_letters),
        out_perm=tuple(y_letters.index(c) for c in out),
    )
