"""graphquant.kernels.triton_exp2 against float64: the FMA-pipe 2^x over every float32 exponent of
its domain (Horner's steps unfused under Triton's interpreter, fused by the GPU), and the tile
whose columns alternate between it and tl.math.exp2."""

import json
import math

import pytest
import torch

import triton_interpreter

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from graphquant.kernels.triton_exp2 import exp2_fma, exp2_halves  # noqa: E402

BLOCK = 4096


@triton.jit
def _fma_kernel(X, Y, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, exp2_fma(tl.load(X + offs)))


@triton.jit
def _tile_kernel(X, HALVES, MUFU, ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.program_id(0) * ROWS * COLS + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(X + offs)
    tl.store(HALVES + offs, exp2_halves(x))
    tl.store(MUFU + offs, tl.math.exp2(x))


def _inputs() -> torch.Tensor:
    """Float32 x < 128: random mantissas at every exponent from 2^-149 to 2^6 of both signs, every
    integer and half-integer of [-130, 128), the edges of the rounding to an integer, the flush
    range and what lies beyond it, -inf."""
    g = torch.Generator().manual_seed(0)
    mantissas = 1 + torch.rand(256, generator=g, dtype=torch.float64)
    magnitudes = (mantissas[None, :] * torch.exp2(torch.arange(-149, 7, dtype=torch.float64))[:, None]).flatten()
    halves = torch.arange(-260, 256, dtype=torch.float64) / 2
    edges = torch.tensor([0.5, -0.5, -126.0, -127.0, -128.0, -1000.0, -3e38, 127.99]).double()
    x = torch.cat((magnitudes, -magnitudes, -magnitudes - 120, halves, edges, torch.tensor([-math.inf]).double())).float()
    near = torch.cat((torch.nextafter(halves.float(), torch.tensor(math.inf)), torch.nextafter(halves.float(), torch.tensor(-math.inf))))
    x = torch.cat((x, near))
    x = x[x < 128]
    return torch.cat((x, x.new_full((-x.numel() % BLOCK,), -math.inf)))


def check_exp2(device: str) -> dict:
    """The largest relative error of ``exp2_fma`` where 2^x is a normal float32 (log2 of it), its
    largest absolute error below (log2), whether x <= -127 gives 0 exactly, whether every result
    is finite, and whether ``exp2_halves`` gives tl.math.exp2's bits in its even columns and
    ``exp2_fma``'s in its odd ones."""
    x = _inputs().to(device)
    y = torch.empty_like(x)
    _fma_kernel[(x.numel() // BLOCK,)](x, y, BLOCK)
    halves, mufu = torch.empty_like(x), torch.empty_like(x)
    _tile_kernel[(x.numel() // BLOCK,)](x, halves, mufu, 64, BLOCK // 64)
    exact = torch.exp2(x.double())
    normal = x >= -126
    relative = ((y.double() - exact).abs() / exact)[normal].max().item()
    absolute = (y.double() - exact).abs()[~normal].max().item()
    columns = lambda t: t.view(-1, BLOCK // 64)  # noqa: E731
    return {
        "log2 relative": math.log2(relative),
        "log2 absolute below": math.log2(absolute),
        "zero from -127 down": bool((y[x <= -127] == 0).all()),
        "finite": bool(y.isfinite().all()),
        "halves": torch.equal(columns(halves)[:, 0::2], columns(mufu)[:, 0::2]) and torch.equal(columns(halves)[:, 1::2], columns(y)[:, 1::2]),
    }


def _assert_within_the_bound(results: dict) -> None:
    assert results["log2 relative"] <= -23, results  # ex2.approx.f32: about 2^-22
    assert results["log2 absolute below"] <= -126, results
    assert results["zero from -127 down"] and results["finite"] and results["halves"], results


def test_exp2_under_the_interpreter():
    _assert_within_the_bound(triton_interpreter.results_of(__file__))


@pytest.mark.gpu
def test_exp2_on_the_gpu():
    _assert_within_the_bound(check_exp2("cuda"))


if __name__ == "__main__":  # the interpreted check, as test_exp2_under_the_interpreter runs it
    print(json.dumps(check_exp2("cpu")))
