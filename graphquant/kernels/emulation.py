"""Exact emulation of a low-precision GEMM: dequantize, multiply in high precision, rescale.

Per-tensor and per-row factors (an FP8 tensor scale, NVFP4's global amax, per-row FP8 scales)
are taken out of the operands, multiplied together and applied to the product once, as the
hardware GEMM applies alpha.
What stays in the operands (FP8 codes, MXFP8 and power-of-two-scaled values, NVFP4 q * s) is then
exact in bfloat16, so on a GPU the product runs as a bf16 GEMM with fp32 accumulation and is
exact up to that accumulation; scalar factors then run as that GEMM's alpha, in cuBLASLt's
epilogue (graphquant._C.bf16_gemm). Anything not exact in bf16 is multiplied in fp32.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from graphquant.kernels import native
from graphquant.quantizers import ROWWISE, Representation, gemm_dims

try:
    from graphquant.kernels import triton_dequantize
except ImportError:  # no Triton: dequantize with the reference's torch ops
    triton_dequantize = None


def _mxfp8_values(rep: Representation, live) -> torch.Tensor:
    return triton_dequantize.mxfp8_values(rep.data, rep.scale, rowwise=rep.direction == ROWWISE, live=live)


def _nvfp4_values(rep: Representation, live) -> torch.Tensor:
    return triton_dequantize.nvfp4_block_values(rep.data, rep.scale, live)


# The layout families (GemmInput.family) whose emulated values are a new copy, codes times scales
# of small blocks along the GEMM rows or the reduction: a Triton kernel makes them on a GPU, and a
# large operand is multiplied a slice of its rows at a time (each slice a representation of its own).
_BLOCK_VALUES = {"mxfp8": _mxfp8_values, "nvfp4": _nvfp4_values, "nvfp4_row_scaled": _nvfp4_values}


def _family(rep: Representation) -> Optional[str]:
    gemm_input = rep.quantizer.gemm_input(rep.direction)
    return None if gemm_input is None else gemm_input.family


def factored(rep: Representation) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(values, factor) with values * factor = the dequantized stored-orientation values, as the
    format splits them (Quantizer.emulated_values, emulated_factor).

    factor is None, a scalar, or a (rows, 1) column over the stored rows.
    """
    return values(rep), rep.quantizer.emulated_factor(rep)


def _values_kernel(rep: Representation):
    """The Triton kernel that makes rep's values on its device, or None."""
    if triton_dequantize is None or not triton_dequantize.runs_on(rep.data.device):
        return None
    return _BLOCK_VALUES.get(_family(rep))


def values(rep: Representation, live=None) -> torch.Tensor:
    """factored's values, from a Triton kernel where one makes them; there, with ``live``
    (triton_dequantize.LiveGroups of an expert stack's stored rows), of those rows alone."""
    fast = _values_kernel(rep)
    return rep.quantizer.emulated_values(rep) if fast is None else fast(rep, live)


def logical_values(rep: Representation, live=None) -> torch.Tensor:
    """``values(rep, live)`` in the logical (rows, cols) orientation."""
    stored = values(rep, live)
    return stored.t() if rep.transposed else stored


def gathers_rows(rep: Representation) -> bool:
    """Whether ``values_of_rows`` reads a gather of rep's stored rows in its values kernel where
    it runs (MXFP8's rowwise values: each row's scales are its own), not after as a copy."""
    return _family(rep) == "mxfp8" and rep.direction == ROWWISE


def values_of_rows(rep: Representation, rows: torch.Tensor) -> torch.Tensor:
    """``values(rep)``'s stored ``rows`` (int64 indices), in that order."""
    if gathers_rows(rep) and _values_kernel(rep) is _mxfp8_values:
        return triton_dequantize.mxfp8_values(rep.data, rep.scale, rowwise=True, rows=rows)
    return values(rep).index_select(0, rows)


def scaled_values(rep: Representation, factor: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``values(rep)`` in the logical (rows, cols) orientation times ``factor`` (fp32, broadcast
    over them; None: no factor), rounded to fp32 and then to ``dtype`` as torch's ops round.
    NVFP4's Triton kernel takes a rowwise operand's per-row factor before its one store, in place
    of three passes of torch ops (an fp32 copy, the product, the cast) over an expert stack."""
    per_stored_row = factor is not None and rep.direction == ROWWISE and not rep.transposed and factor.shape[1:] == (1,)
    if per_stored_row and _values_kernel(rep) is _nvfp4_values:
        return triton_dequantize.nvfp4_block_values(rep.data, rep.scale, row_factor=factor, dtype=dtype)
    logical = logical_values(rep)
    return logical.to(dtype) if factor is None else (logical.float() * factor).to(dtype)


def _grouped(values: torch.Tensor, rep: Representation, batch: int) -> torch.Tensor:
    """(batch, rows, K) of the operand with its reduction dim last (see backends.gemm)."""
    if not rep.stored_k_last:
        values = values.t()
    rows, k = values.shape
    if rep.direction == ROWWISE:
        return values.reshape(batch, rows // batch, k)
    return values.reshape(rows, batch, k // batch).permute(1, 0, 2)


def _grouped_factor(factor: Optional[torch.Tensor], rep: Representation, batch: int) -> Optional[torch.Tensor]:
    """The factor shaped to broadcast over (batch, rows, 1) of the grouped operand."""
    if factor is None or factor.dim() == 0:
        return factor
    if not rep.stored_k_last:
        raise ValueError(f"{rep.quantizer}: a per-row factor must lie along the operand's rows")
    return factor.reshape(batch, -1, 1) if rep.direction == ROWWISE else factor.reshape(1, -1, 1)


def _scalar_alpha(fa: Optional[torch.Tensor], fb: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The product's one factor, on the device, where each factor is a scalar or absent (not both)."""
    factors = [f for f in (fa, fb) if f is not None]
    if not factors or any(f.dim() for f in factors):
        return None
    return (factors[0] * factors[1] if len(factors) == 2 else factors[0]).float()


def _joint_factor(fa, fb, a: Representation, b: Representation, batch: int) -> Optional[torch.Tensor]:
    """A's and B's factors multiplied together (fp32), to broadcast over the (batch, m, n) product:
    one factor applied once, as a GPU GEMM's alpha (fa * fb) is, so that no intermediate overflows
    where the result does not (a scale near 1e33 times a product of codes would)."""
    fa, fb = _grouped_factor(fa, a, batch), _grouped_factor(fb, b, batch)
    if fb is not None and fb.dim():
        fb = fb.transpose(1, 2)
    if fa is None or fb is None:
        return fb if fa is None else fa
    return fa * fb


def _aligned(t: torch.Tensor) -> bool:
    """Whether cuBLASLt's 16-byte-aligned kernels take t as it lies: each matrix row- or column-major,
    its address and its other strides multiples of 16 bytes (of bf16)."""
    strides = t.stride()
    return t.data_ptr() % 16 == 0 and 1 in strides[1:] and all(s % 8 == 0 for s in strides if s != 1)


def _epilogue_gemm(
    left: torch.Tensor,
    right: torch.Tensor,
    alpha: Optional[torch.Tensor],
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    out: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """alpha * left @ right^T (+ bias) with alpha and the bias applied by cuBLASLt's epilogue (no
    pass over an fp32 product, one rounding), written into ``out`` where cuBLASLt can write it
    (out_dtype, rows of 16-byte-aligned elements), or None where the extension or its aligned
    kernels do not take it."""
    ext = native.extension_for(left.device)
    if ext is None or alpha is None or left.dtype != torch.bfloat16:
        return None
    if right.shape[1] % 8 or not (_aligned(left) and _aligned(right)):
        return None
    if bias is not None and not (bias.dtype in (torch.bfloat16, out_dtype) and bias.is_contiguous() and bias.data_ptr() % 16 == 0):
        return None
    if out is not None and not (out.dtype == out_dtype != torch.float16 and _aligned(out) and out.stride(-1) == 1):
        out = None
    return ext.bf16_gemm(left, right, alpha, out_dtype, bias, out)


# The most elements of an MXFP8 or NVFP4 operand dequantized at once (64 MiB of bf16): a larger
# one is multiplied in slices of its rows. Whole, a SwiGLU's hidden activation dequantized for a
# wgrad (448 MiB at 16384x14336) sat at a decoder layer's memory peak; smaller slices mean more
# launches (two per slice), which can leave a short step waiting on the host.
SLICE_ELEMENTS = 32 << 20


def rows_of(rep: Representation, start: int, stop: int) -> Representation:
    """GEMM rows [start, stop) of an MXFP8 or NVFP4 operand. Its data, scales (one row or column
    of scales per row or column of data) and per-row amax are cut along the same stored dim:
    stored rows where the GEMM reads rows of the stored data, stored columns where it reads them
    transposed (MXFP8's columnwise side keeps x's layout)."""
    def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None or t.dim() == 0:
            return t
        return t[start:stop] if rep.stored_k_last or t.dim() == 1 else t[:, start:stop]

    rows, cols = rep.shape
    shape = (stop - start, cols) if rep.direction == ROWWISE else (rows, stop - start)
    return dataclasses.replace(rep, data=cut(rep.data), scale=cut(rep.scale), amax=cut(rep.amax), shape=shape)


def gemm(
    a: Representation,
    b: Representation,
    batch: int,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    slice_elements: int = SLICE_ELEMENTS,
) -> torch.Tensor:
    """(batch, m, n) = A @ B^T (+ bias) per group, exact up to fp32 accumulation; the bias is added
    to the fp32 product before its one rounding to out_dtype. The larger of two one-group MXFP8 or
    NVFP4 operands, if over ``slice_elements``, is dequantized and multiplied a slice of its rows
    at a time against the other, dequantized once (each output element is still one product)."""
    bf16 = a.data.is_cuda and a.quantizer.values_exact_in_bf16(a) and b.quantizer.values_exact_in_bf16(b)
    dtype = torch.bfloat16 if bf16 else torch.float32
    m, n, k = gemm_dims(a, b, batch)
    sliceable = [(rows, rep) for rows, rep in ((m, a), (n, b)) if batch == 1 and _family(rep) in _BLOCK_VALUES]
    rows, big = max(sliceable, key=lambda candidate: candidate[0], default=(0, None))
    if rows * k <= slice_elements:
        return _product(_operand(a, batch, dtype), _operand(b, batch, dtype), a, b, batch, out_dtype, bias)
    step = max(128, slice_elements // k // 128 * 128)
    other = _operand(b if big is a else a, 1, dtype)
    # The big operand's factor once for all slices; scalar factors as one alpha, multiplied once.
    factor = big.quantizer.emulated_factor(big)
    alpha = _scalar_alpha(factor, other[1])
    if alpha is not None:
        other, factor = (other[0], None), alpha
    out = torch.empty((1, m, n), dtype=out_dtype, device=a.data.device)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        piece = rows_of(big, start, stop)
        part = (_grouped(values(piece), piece, 1).to(dtype), factor if factor is None or factor.dim() == 0 else factor[start:stop])
        if big is a:
            _product(part, other, a, b, 1, out_dtype, bias, out=out[:, start:stop])
        else:
            _product(other, part, a, b, 1, out_dtype, None if bias is None else bias[start:stop], out=out[:, :, start:stop])
        del part  # before the next slice is dequantized, so that two are never alive at once
    return out


def _operand(rep: Representation, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(values as (batch, rows, K) in ``dtype``, factor) of one GEMM operand."""
    values, factor = factored(rep)
    return _grouped(values, rep, batch).to(dtype), factor


def _product(
    left_operand: tuple[torch.Tensor, Optional[torch.Tensor]],
    right_operand: tuple[torch.Tensor, Optional[torch.Tensor]],
    a: Representation,
    b: Representation,
    batch: int,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """left @ right^T times their factors (+ bias), rounded once to out_dtype; into ``out`` if given."""
    (left, fa), (right, fb) = left_operand, right_operand
    result = None
    if fa is None and fb is None and left.dtype == out_dtype:  # fp32 accumulation, one rounding to out_dtype
        if bias is None:
            return torch.bmm(left, right.mT, out=out)
        if bias.dtype == out_dtype:  # the bias in the same GEMM's epilogue (batch is 1 with a bias)
            result = torch.addmm(bias, left[0], right[0].t()).unsqueeze(0)
    if result is None:
        result = _epilogue_gemm(left, right, _scalar_alpha(fa, fb), out_dtype, bias, out)
    if result is None:
        result = _factored_product(left, fa, right, fb, a, b, batch, out_dtype, bias)
    return result if out is None or result is out else out.copy_(result)


def _factored_product(left, fa, right, fb, a: Representation, b: Representation, batch: int, out_dtype, bias) -> torch.Tensor:
    """The product in fp32, then the factors and the bias, rounded once to out_dtype."""
    product = torch.bmm(left, right.mT, out_dtype=torch.float32) if left.dtype != torch.float32 else torch.bmm(left, right.mT)
    if fa is None and fb is None and bias is None:
        return product.to(out_dtype)
    product = product.float()
    factor = _joint_factor(fa, fb, a, b, batch)
    if factor is not None:
        product = product * factor
    if bias is not None:
        product = product + bias.float()
    return product.to(out_dtype)
