"""The emulated tokens x experts grouped GEMM of MXFP8 and NVFP4 operands decoded in registers
(triton_decode.experts_gemm): each token's row is its expert's product of the
emulation's values within fp32 accumulation's bound, with the factors the values leave out
(NVFP4's global decode, per group or per row) applied once; ragged and empty groups, a stack
padded past the output's columns, K not a whole number of tiles, and a decode step's few tokens.
The other path's values of the routed experts alone, and which operands and sizes take which.

On the CPU the kernels run under Triton's interpreter in a process of its own, and on the GPU
(tests/test_freeze_experts.py runs compiled expert layers of every family there too).
"""

import json

import pytest
import torch
import triton_interpreter

from graphquant.formats import fp8, groups
from graphquant.quantizers import ROWWISE, MXFP8Quantizer, NVFP4Quantizer, QuantizeContext

# (the tokens' quantizer, the experts'): the formats and variants whose rowwise operands it decodes.
FORMATS = {
    "mxfp8": (MXFP8Quantizer(), MXFP8Quantizer()),
    "nvfp4": (NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True)),
    "nvfp4 row scaled": (NVFP4Quantizer(row_scaled_nvfp4=True), NVFP4Quantizer(row_scaled_nvfp4=True)),
}
SPARSE = (1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0)
# (tokens of each group, K): ragged groups with an empty one; a decode step's few tokens, K ending
# in a partial 128-wide tile; a decode step's tokens among four times as many experts (one token a
# program), K ending in a partial step, and split across programs; K a whole 512-column chunk and
# 160 columns more, so that a tile program runs its steps inside K unmasked, then the rest masked,
# and one token a program runs a K split of each kind. Each in the layout training pads groups to
# (128 rows), and the first and a few-token one also in an inference graph's (16 rows).
FEW = groups.FEW_TOKEN_ROWS
SHAPES = [
    ((40, 0, 57, 27), 256, groups.GROUP_ROWS), ((1, 0, 2, 0), 160, groups.GROUP_ROWS), (SPARSE, 160, groups.GROUP_ROWS),
    (SPARSE, 2048, groups.GROUP_ROWS), ((3, 0, 5, 1), 672, groups.GROUP_ROWS), (SPARSE, 672, groups.GROUP_ROWS),
    ((40, 0, 57, 27), 256, FEW), ((3, 0, 5, 1), 672, FEW), (SPARSE, 672, FEW),
]
STACK_ROWS, N = 128, 112  # each expert's stacked rows, of which the output keeps N


def _operands(name: str, sizes: tuple, k: int, device: str, token_rows: int = groups.GROUP_ROWS):
    """(A's padded layout, its groups starting at multiples of ``token_rows``, A and the expert
    stack B quantized rowwise, each padded row's group, each stack row's)."""
    qa, qb = FORMATS[name]
    generator = torch.Generator().manual_seed(len(sizes) * k)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).to(device)
    tokens, experts = sum(sizes), len(sizes)
    layout = groups.padding(offs, tokens, token_rows, groups.padded_bound(tokens, experts, token_rows))
    x = (torch.randn(tokens, k, generator=generator) * torch.logspace(-3, 3, k)).to(device)
    w = (torch.randn(experts * STACK_ROWS, k, generator=generator) * torch.logspace(2, -2, experts * STACK_ROWS)[:, None]).to(device)
    stack = groups.uniform_padding(experts, STACK_ROWS, groups.GROUP_ROWS, torch.device(device))
    a = qa.quantize_groups(layout.pad(x), layout.row_group, experts, ROWWISE, QuantizeContext())
    b = qb.quantize_groups(w, stack.row_group, experts, ROWWISE, QuantizeContext())
    return layout, a, b, stack.row_group


def _factor(rep, row_group, rows: int) -> torch.Tensor:
    """Each GEMM row's factor of the values (rows, 1), ones where the values carry it all."""
    factor = rep.quantizer.grouped_factor(rep, row_group)
    return torch.ones(rows, 1, device=row_group.device) if factor is None else factor.float()


def _within_bound(name: str, sizes: tuple, k: int, token_rows: int, device: str) -> bool:
    """The fp32 product against float64's exact one of the same values times the same factor."""
    from graphquant.kernels import triton_decode

    layout, a, b, b_group = _operands(name, sizes, k, device, token_rows)
    got = triton_decode.experts_gemm(a, b, layout, N, torch.float32)
    va = a.quantizer.emulated_values(a).double()[layout.position]
    vb = b.quantizer.emulated_values(b).double().reshape(len(sizes), STACK_ROWS, k)[:, :N]
    group = layout.row_group[layout.position]
    fa = _factor(a, layout.row_group, len(layout.row_group))[layout.position]
    fb = _factor(b, b_group, len(b_group)).reshape(len(sizes), STACK_ROWS)[:, :N][group]
    alpha = (fa * fb).double()
    exact = torch.einsum("tk,tnk->tn", va, vb[group])
    bound = fp8.accumulation_bound(va[:, None, :], vb[group].transpose(1, 2), fp8.FP32)[:, 0, :]
    error = (got.double() - exact * alpha).abs()
    return got.shape == (sum(sizes), N) and bool((error <= alpha * bound + 2.0**-22 * (exact * alpha).abs()).all())


def _live_values_are_the_references(name: str, device: str) -> bool:
    """An expert stack's values written for the experts some token was routed to alone (the
    emulated product's other path) are, on those experts' rows, the reference's."""
    from graphquant.kernels import triton_dequantize

    sizes = (40, 0, 57, 0)
    layout, _, b, _ = _operands(name, sizes, 256, device)
    live = triton_dequantize.LiveGroups(layout.ends, STACK_ROWS)
    if name == "mxfp8":
        got = triton_dequantize.mxfp8_values(b.data, b.scale, rowwise=True, live=live)
    else:
        got = triton_dequantize.nvfp4_block_values(b.data, b.scale, live)
    want = b.quantizer.emulated_values(b)
    rows = [g * STACK_ROWS + r for g, size in enumerate(sizes) if size for r in range(STACK_ROWS)]
    return torch.equal(got[rows].float(), want[rows].float())


def _one_token_a_program_runs_where_tokens_are_few(device: str) -> bool:
    """The one-row program takes a decode step's tokens among four times as many experts
    (SPARSE), and the tile program more than two tokens an expert."""
    from graphquant.kernels import triton_decode

    ran, launch = [], triton_decode.launch
    triton_decode.launch = lambda kernel, *args, **kwargs: ran.append(kernel) or launch(kernel, *args, **kwargs)
    try:
        for sizes in (SPARSE, (6, 0, 3, 0)):
            layout, a, b, _ = _operands("nvfp4", sizes, 256, device)
            triton_decode.experts_gemm(a, b, layout, N, torch.float32)
    finally:
        triton_decode.launch = launch
    return ran == [triton_decode._expert_rows_kernel, triton_decode._expert_tiles_kernel]


def _interpreted_results() -> dict:
    results = {
        f"{name} | {sizes} | {k} | {rows}": _within_bound(name, sizes, k, rows, "cpu") for name in FORMATS for sizes, k, rows in SHAPES
    }
    results["one token a program"] = _one_token_a_program_runs_where_tokens_are_few("cpu")
    return results | {f"{name} | live values": _live_values_are_the_references(name, "cpu") for name in FORMATS}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return triton_interpreter.results_of(__file__)


@pytest.mark.parametrize("shape", [f"{sizes} | {k} | {rows}" for sizes, k, rows in SHAPES])
@pytest.mark.parametrize("name", FORMATS)
def test_decoded_experts_product_is_the_emulations_within_fp32_accumulation_interpreted(interpreted, name, shape):
    assert interpreted[f"{name} | {shape}"]


def test_codes_are_decoded_in_registers_for_few_tokens_an_expert_of_one_block_format():
    """Up to 32 tokens an expert on average; MXFP8 by NVFP4, E5M2 MXFP8 (whose words the decode
    GEMM's programs do not decode) or a columnwise operand takes the values' path."""
    pytest.importorskip("triton")
    from graphquant.kernels import triton_decode

    _, a, b, _ = _operands("mxfp8", (1, 0, 2, 0), 256, "cpu")
    _, a4, b4, _ = _operands("nvfp4", (1, 0, 2, 0), 256, "cpu")
    assert triton_decode.decodes_experts(a, b, 128, 4) and not triton_decode.decodes_experts(a, b, 129, 4)
    assert triton_decode.decodes_experts(a4, b4, 128, 4) and not triton_decode.decodes_experts(a4, b4, 129, 4)
    assert not triton_decode.decodes_experts(a, b4, 3, 4)
    e5m2 = MXFP8Quantizer(fp8_dtype="e5m2").quantize_rowwise(torch.randn(4 * STACK_ROWS, 256), QuantizeContext())
    assert not triton_decode.decodes_experts(a, e5m2, 3, 4)
    columnwise = MXFP8Quantizer().quantize_columnwise(torch.randn(4 * STACK_ROWS, 256), QuantizeContext())
    assert not triton_decode.decodes_experts(a, columnwise, 3, 4)


def test_a_decode_steps_few_tokens_run_one_token_a_program_interpreted(interpreted):
    assert interpreted["one token a program"]


@pytest.mark.parametrize("name", FORMATS)
def test_an_expert_stacks_values_of_its_routed_experts_alone_are_the_references_interpreted(interpreted, name):
    assert interpreted[f"{name} | live values"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
def test_an_expert_stacks_values_of_its_routed_experts_alone_are_the_references_on_gpu(name):
    assert _live_values_are_the_references(name, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("sizes, k, token_rows", SHAPES)
@pytest.mark.parametrize("name", FORMATS)
def test_decoded_experts_product_is_the_emulations_within_fp32_accumulation_on_gpu(name, sizes, k, token_rows):
    assert _within_bound(name, sizes, k, token_rows, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
def test_emulated_grouped_gemm_decodes_in_registers_on_gpu_and_rounds_its_fp32_sum_once(name, monkeypatch):
    """grouped.gemm takes the decoding kernel for these operands at a decode step's few tokens
    (the values path would fail here), and its bf16 output is its fp32 output rounded once."""
    from graphquant.kernels import backends, grouped, triton_decode

    layout, a, b, b_group = _operands(name, (1, 0, 2, 0), 256, "cuda")
    monkeypatch.setattr(grouped, "_emulated", lambda *args: pytest.fail("every expert's values were written out"))
    emulated = backends.GemmBackend(backends.EMULATION)
    out = grouped.gemm(a, b, b_group, layout, groups.GROUP_ROWS, N, torch.bfloat16, emulated, "moe#0 fprop")
    fp32 = triton_decode.experts_gemm(a, b, layout, N, torch.float32)
    assert torch.equal(out, fp32.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
def test_one_token_a_program_replays_in_a_cuda_graph_bit_for_bit(name):
    """A decode step's product, K split (its arrival counters left zero by each launch), captured
    in a CUDA graph: every replay gives the eager call's bits."""
    from graphquant.kernels import triton_decode

    layout, a, b, _ = _operands(name, SPARSE, 2048, "cuda")
    eager = triton_decode.experts_gemm(a, b, layout, N, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = triton_decode.experts_gemm(a, b, layout, N, torch.bfloat16)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, eager)


if __name__ == "__main__":  # the interpreted cases, as the fixture ``interpreted`` runs them
    triton_interpreter.as_on_the_gpu()
    print(json.dumps(_interpreted_results()))
