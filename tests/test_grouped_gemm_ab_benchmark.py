"""benchmarks/grouped_gemm_ab.py's plumbing on the CPU (its kernels need an sm_90 GPU): each side's
product reaches that side's extension with the installed one's arguments, the installed one is
restored after, and outputs compare by their bits."""

import importlib

import torch
from benchmark_tables import BENCHMARKS

from graphquant.formats import groups
from graphquant.kernels import grouped_fp8
from graphquant.quantizers import COLUMNWISE, ROWWISE, Float8RowwiseQuantizer, QuantizeContext


class Recorder:
    """An extension whose kernels record their arguments and return a marked output."""

    def __init__(self, mark: float):
        self.mark, self.calls = mark, []

    def grouped_fp8_tokens_by_experts(self, *args):
        self.calls.append(("tokens x experts", args))
        return torch.full((args[4], args[3]), self.mark)

    def grouped_fp8_tokens_by_tokens(self, *args):
        self.calls.append(("tokens x tokens", args))
        return torch.full((args[3].shape[0], args[2], args[0].shape[0]), self.mark)


def test_each_side_runs_its_own_extension_and_the_installed_one_comes_back(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    ab = importlib.import_module("grouped_gemm_ab")
    quantizer, rows, k, n = Float8RowwiseQuantizer(), 200, 64, 32
    tokens = groups.padding(torch.tensor([150, 200], dtype=torch.int32), rows, groups.GROUP_ROWS, groups.padded_bound(rows, 2, groups.GROUP_ROWS))
    stack = groups.padding(torch.tensor([n, 2 * n], dtype=torch.int32), 2 * n, groups.GROUP_ROWS, 2 * n)
    a = quantizer.quantize_groups(tokens.pad(torch.randn(rows, k)), tokens.row_group, 2, ROWWISE, QuantizeContext())
    b = quantizer.quantize_groups(torch.randn(2 * n, k), stack.row_group, 2, ROWWISE, QuantizeContext())
    at = quantizer.quantize_groups(tokens.pad(torch.randn(rows, k)), tokens.row_group, 2, COLUMNWISE, QuantizeContext())
    installed, baseline = Recorder(1.0), Recorder(2.0)
    monkeypatch.setattr(grouped_fp8.native, "extension_for", lambda device: installed)
    out = ab.product(baseline, a, b, stack.row_group, tokens, n, torch.bfloat16)
    assert out.eq(2.0).all() and len(baseline.calls) == 1 and not installed.calls
    assert ab.product(None, a, b, stack.row_group, tokens, n, torch.bfloat16).eq(1.0).all()
    (kind, theirs), (_, ours) = baseline.calls[0], installed.calls[0]
    assert kind == "tokens x experts" and len(theirs) == len(ours)
    assert all(_equal(x, y) for x, y in zip(theirs, ours))
    assert ab.product(baseline, at, at, tokens.row_group, tokens, k, torch.float32).eq(2.0).all()
    assert baseline.calls[-1][0] == "tokens x tokens"
    assert grouped_fp8.native.extension_for(None) is installed  # restored


def _equal(x, y) -> bool:
    if not isinstance(x, torch.Tensor):
        return x == y
    return x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.element_size() == 1 else torch.equal(x, y)


def test_same_bits_tells_apart_values_that_compare_equal(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    ab = importlib.import_module("grouped_gemm_ab")
    zero, negative_zero = torch.zeros(4, dtype=torch.bfloat16), -torch.zeros(4, dtype=torch.bfloat16)
    assert torch.equal(zero, negative_zero) and not ab._same(zero, negative_zero)
    assert ab._same(torch.ones(3), torch.ones(3)) and not ab._same(torch.ones(3), torch.ones(2))
