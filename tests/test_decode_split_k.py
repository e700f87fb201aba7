"""The decode GEMM's split K (triton_decode._write): each program of an output tile writes its
partial sums, and the last to arrive adds every split's in split order and finishes the tile, in
the same launch. The result is, bit for bit, each split's sums added in split order, times both
factors' product, plus the bias, rounded once; the arrival counters are left at zero, so that the
next call (a CUDA graph's next replay) starts clean.

On the CPU the kernels run under Triton's interpreter, in a process of its own; on the GPU at a
Llama-3-8B FFN's down projection, replayed from a CUDA graph and on two streams at once.
"""

import json

import pytest
import torch
import triton_interpreter
from reference import cuda_graph_replays

from graphquant.kernels import arrival_counters
from graphquant.quantizers import ROWWISE, Float8CurrentScalingQuantizer, Float8RowwiseQuantizer, MXFP8Quantizer

PAIRS = {"tensorwise": Float8CurrentScalingQuantizer("e4m3"), "rowwise": Float8RowwiseQuantizer()}
# (m, n, k): one row, a partial weight tile; three rows, the last split shorter than the others.
SHAPES = [(1, 80, 1536), (3, 80, 1280)]


def _sliced(rep, start: int, stop: int):
    """Columns start:stop of a per-tensor or per-row FP8 representation, its factors all one."""
    data = rep.data[:, start:stop].contiguous()
    return rep.quantizer.representation(ROWWISE, tuple(data.shape), torch.bfloat16, data, torch.ones_like(rep.scale))


def _split_in_order(a, b, out_dtype: torch.dtype, bias) -> torch.Tensor:
    """What the decode GEMM's K split gives, made from one decode GEMM per split (each on its K
    columns alone, unsplit, factors one: that split's partial sums): their sum in split order from
    zero, times A's factor times B's, plus the bias, rounded once."""
    import triton

    from graphquant.kernels import triton_decode

    m, k = a.data.shape
    n = b.data.shape[0]
    splits = triton_decode.split_k(n, k, a.data.device)
    columns = triton_decode.K_CHUNK * triton.cdiv(triton.cdiv(k, splits), triton_decode.K_CHUNK)
    assert triton.cdiv(k, columns) > 1, "the case does not split K"
    summed = torch.zeros((m, n))
    for start in range(0, k, columns):
        summed += triton_decode.gemm(_sliced(a, start, start + columns), _sliced(b, start, start + columns), torch.float32)
    factor = a.scale.reshape(-1, 1) * b.scale.reshape(1, -1)
    total = summed * factor
    if bias is not None:
        total = total + bias.float()
    return total.to(out_dtype)


def _interpreted_results() -> dict:
    from graphquant.kernels import triton_decode

    torch.manual_seed(0)
    results = {}
    for name, quantizer in PAIRS.items():
        for m, n, k in SHAPES:
            x = torch.randn(m, k).to(torch.bfloat16)
            w = (torch.randn(n, k) / 8).to(torch.bfloat16)
            bias = torch.randn(n).to(torch.bfloat16)
            a, b = quantizer(x, columnwise=False).get(ROWWISE), quantizer(w, columnwise=False).get(ROWWISE)
            for out_dtype, with_bias in ((torch.float32, None), (torch.bfloat16, bias)):
                fused = triton_decode.gemm(a, b, out_dtype, with_bias)
                again = triton_decode.gemm(a, b, out_dtype, with_bias)
                case = f"{name} | {m}x{n}x{k} {str(out_dtype).removeprefix('torch.')}"
                results[f"in split order | {case}"] = torch.equal(fused, _split_in_order(a, b, out_dtype, with_bias))
                results[f"again | {case}"] = torch.equal(fused, again)
    # one program a row of A (MXFP8 on the FMA units): three rows of output tiles, K split
    mx = MXFP8Quantizer()
    x, w = torch.randn(3, 1024).to(torch.bfloat16), torch.randn(40, 1024).to(torch.bfloat16)
    fma = triton_decode.DecodeConfig(16, 128, 1, fma=True)
    a, b = mx(x, columnwise=False).get(ROWWISE), mx(w, columnwise=False).get(ROWWISE)
    first, again = (triton_decode.gemm(a, b, torch.float32, config=fma) for _ in range(2))
    results["again | mxfp8 fma"] = torch.equal(first, again)
    counters = list(arrival_counters.COUNTERS.values())
    results["counters"] = len(counters) == 1 and all(int(c.count_nonzero()) == 0 for c in counters)
    # a launch needing more counters than there are gets a larger buffer; the old one is kept
    # (a CUDA graph may hold its address)
    old = counters[0]
    grown = arrival_counters.zeroed(torch.device("cpu"), old.numel() + 1)
    results["grown"] = grown.numel() > old.numel() and int(grown.count_nonzero()) == 0 and arrival_counters.RETIRED[-1] is old
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return triton_interpreter.results_of(__file__)


@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("name", PAIRS)
def test_split_k_adds_the_splits_in_order_and_finishes_once_interpreted(interpreted, name, shape, out_dtype):
    """bf16 out with a bias; fp32 out without."""
    assert interpreted[f"in split order | {name} | {shape} {out_dtype}"]
    assert interpreted[f"again | {name} | {shape} {out_dtype}"]


def test_split_k_leaves_its_arrival_counters_zero_interpreted(interpreted):
    """After every call above, the FMA units' (one program a row of A) among them; and grown on demand."""
    assert interpreted["again | mxfp8 fma"]
    assert interpreted["counters"]
    assert interpreted["grown"]


@pytest.mark.gpu
def test_split_k_replays_from_a_cuda_graph_and_runs_on_two_streams_at_once():
    """The down projection of a Llama-3-8B FFN at one and 16 rows (K split): replayed from a CUDA
    graph on new inputs, each replay gives the eager call's bits; two streams running their GEMMs
    at once count their arrivals apart and give each stream's eager bits."""
    from graphquant.kernels import triton_decode

    torch.manual_seed(0)
    quantizer = PAIRS["rowwise"]
    w = (torch.randn(4096, 14336, device="cuda") / 64).to(torch.bfloat16)
    b = quantizer(w, columnwise=False).get(ROWWISE)
    assert triton_decode.split_k(4096, 14336, w.device) > 1

    def product(x: torch.Tensor) -> torch.Tensor:
        return triton_decode.gemm(triton_decode.QuantizedOnLoad(x, triton_decode.amaxes(x, quantizer), quantizer), b, torch.bfloat16)

    for m in (1, 16):
        x = torch.randn(m, 14336, device="cuda").to(torch.bfloat16)
        for scale, replayed in cuda_graph_replays(product, x):
            assert torch.equal(replayed, product(x)), f"{m} rows, inputs times {scale}"
    xs = [torch.randn(16, 14336, device="cuda").to(torch.bfloat16) for _ in range(2)]
    a = [quantizer(x, columnwise=False).get(ROWWISE) for x in xs]
    expected = [triton_decode.gemm(rep, b, torch.bfloat16) for rep in a]
    streams = [torch.cuda.Stream() for _ in xs]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(20):
        for i, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                outs[i].append(triton_decode.gemm(a[i], b, torch.bfloat16))
    torch.cuda.synchronize()
    assert all(torch.equal(out, expected[i]) for i in range(2) for out in outs[i])
    assert all(int(c.count_nonzero()) == 0 for c in arrival_counters.COUNTERS.values())


if __name__ == "__main__":  # the interpreted cases, as the fixture ``interpreted`` runs them
    triton_interpreter.as_on_the_gpu()
    print(json.dumps(_interpreted_results()))
