"""Two-operand einsums that are one (batched) matrix product, as y[b] = x[b] @ w[b]^T.

find_gemms works the layout out once, when it annotates the site; the rewritten graph passes it
to graphquant.ops.functional.quantized_einsum, which applies it.
"""

from __future__ import annotations

import math
import string
from typing import NamedTuple, Optional, Sequence


class EinsumLayout(NamedTuple):
    """How ``einsum(equation, a, b)`` becomes a batched TN product and back.

    x = a.permute(a_perm), its dims taken as (batch, m, k) groups of batch_dims, m_dims and the
    rest; w = b.permute(b_perm), as (batch, n, k) groups of batch_dims, n_dims and the rest;
    result = (x @ w^T) with its dims back (batch, m, n), permuted by out_perm. Dim counts, not
    sizes: ``shapes`` takes the sizes from the operands, so a symbolic size (dynamic shapes) needs
    no constant. A NamedTuple, so that a graph carries it as an argument (FX writes it out as a call).
    """

    equation: str
    a_perm: tuple[int, ...]
    b_perm: tuple[int, ...]
    batch_dims: int
    m_dims: int
    n_dims: int
    out_perm: tuple[int, ...]

    def shapes(self, a_shape: Sequence, b_shape: Sequence) -> tuple[tuple, tuple, tuple]:
        """(x sizes (batch, m, k), w sizes (batch, n, k), the product's dims before out_perm) for
        operands of these shapes."""
        a = [a_shape[i] for i in self.a_perm]
        b = [b_shape[i] for i in self.b_perm]
        mid, nid = self.batch_dims + self.m_dims, self.batch_dims + self.n_dims
        batch = math.prod(a[: self.batch_dims])
        x_sizes = (batch, math.prod(a[self.batch_dims : mid]), math.prod(a[mid:]))
        w_sizes = (batch, math.prod(b[self.batch_dims : nid]), math.prod(b[nid:]))
        return x_sizes, w_sizes, (*a[:mid], *b[self.batch_dims : nid])


def einsum_layout(equation: str, a_shape: tuple, b_shape: tuple) -> Optional[EinsumLayout]:
    """The layout, or None when the equation is not a plain batched product (traces, a letter
    summed out of one operand alone, repeated letters). A symbolic size is compared as a symbol:
    the test becomes a guard of the compiled graph."""
    equation = equation.replace(" ", "")
    inputs, _, out = equation.partition("->")
    if inputs.count(",") != 1:
        return None
    a, b = inputs.split(",")
    if "->" not in equation:  # torch's implicit output: the letters that occur once, in alphabetical order
        once = sorted(c for c in set(a + b) if c != "." and (a + b).count(c) == 1)
        out = ("..." if "..." in inputs else "") + "".join(once)
    spelled = _without_ellipsis(a, b, out, len(a_shape), len(b_shape))
    if spelled is None:
        return None
    a, b, out = spelled
    if any(len(set(s)) != len(s) for s in (a, b, out)) or len(a) != len(a_shape) or len(b) != len(b_shape):
        return None
    batch = [c for c in out if c in a and c in b]
    m = [c for c in out if c in a and c not in b]
    n = [c for c in out if c in b and c not in a]
    k = [c for c in a if c in b and c not in out]
    if set(a) != set(batch + m + k) or set(b) != set(batch + n + k) or set(out) != set(batch + m + n):
        return None
    if any(a_shape[a.index(c)] != b_shape[b.index(c)] for c in batch + k):
        return None
    y_letters = batch + m + n
    return EinsumLayout(
        equation=equation,
        a_perm=tuple(a.index(c) for c in batch + m + k),
        b_perm=tuple(b.index(c) for c in batch + n + k),
        batch_dims=len(batch),
        m_dims=len(m),
        n_dims=len(n),
        out_perm=tuple(y_letters.index(c) for c in out),
    )


def _without_ellipsis(a: str, b: str, out: str, a_dims: int, b_dims: int) -> Optional[tuple[str, str, str]]:
    """(a, b, out) with each ``...`` spelled as letters of its own, its dims aligned from the
    right across the operands as torch broadcasts them; None where an ellipsis is malformed or the
    output drops one (which sums its dims)."""
    terms = (a, b, out)
    if any(t.replace("...", "").count(".") or t.count("...") > 1 for t in terms) or ("..." in out) != ("..." in a + b):
        return None
    spans = [dims - (len(t) - 3) if "..." in t else 0 for t, dims in ((a, a_dims), (b, b_dims))]
    if min(spans) < 0:
        return None
    width = max(spans)
    free = [c for c in string.ascii_letters if c not in a + b + out][:width]
    return tuple(t.replace("...", "".join(free[width - span :])) for t, span in zip(terms, (*spans, width)))
