"""GEMMs that read one A in one launch of the decode GEMM (triton_decode.gemms_sharing_a; in a
graph passes/gemms_sharing_x.py): a SwiGLU's gate and up projections. Each output is, bit for
bit, that GEMM's own call: each is tiled and K-split as alone, its partial sums and arrival
counters apart from the other's.

On the CPU the kernels run under Triton's interpreter, in a process of their own; on the GPU at a
Llama-3-8B FFN's shapes, eagerly and replayed from a CUDA graph.
"""

import json
import os
import tempfile

import pytest
import torch
import triton_interpreter
from models import SwiGLU
from reference import cuda_graph_replays, fresh_dynamo, hopper_on_cpu  # noqa: F401  (fixtures: fresh_dynamo autouse)

import graphquant
from graphquant import zoo
from graphquant.kernels import backends
from graphquant.quantizers import ROWWISE, Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8RowwiseQuantizer

# (A's quantizer, the weights'): each FP8 family the decode GEMM runs two of in one launch.
PAIRS = {
    "tensorwise": (Float8CurrentScalingQuantizer("e4m3"), Float8CurrentScalingQuantizer("e4m3")),
    "rowwise": (Float8RowwiseQuantizer(), Float8RowwiseQuantizer()),
    "block 1x128 x 128x128": (Float8BlockQuantizer(block_scaling_dim=1), Float8BlockQuantizer(block_scaling_dim=2)),
}
# (m, n, n2, k): one row, both K split (the interpreter's 4 SMs); 16 rows, the first split and
# the second not (its tiles fill the SMs); three rows, partial tiles, neither split.
SHAPES = [(1, 80, 40, 1536), (16, 64, 512, 1280), (3, 48, 24, 256)]
RECIPES = {"tensorwise": zoo.recipe("tensorwise"), "rowwise": zoo.recipe("rowwise"), "deepseek_blockwise": zoo.recipe("deepseek_blockwise")}


def _separate_and_shared(name: str, x: torch.Tensor, ws: list, biases: list, out_dtype: torch.dtype, on_load: bool) -> tuple[list, list]:
    """(each weight's own decode GEMM, the two in one launch) of x, quantized by the reference
    first or by the kernels (QuantizedOnLoad)."""
    from graphquant.kernels import triton_decode

    qa, qb = PAIRS[name]
    bs = [qb(w, columnwise=False).get(ROWWISE) for w in ws]
    a = triton_decode.QuantizedOnLoad(x, triton_decode.amaxes(x, qa), qa) if on_load else qa(x, columnwise=False).get(ROWWISE)
    separate = [triton_decode.gemm(a, b, out_dtype, bias) for b, bias in zip(bs, biases)]
    return separate, triton_decode.gemms_sharing_a(a, bs, out_dtype, biases)


def _frozen(recipe, x: torch.Tensor, merged: bool, dump_dir=None) -> tuple[torch.Tensor, list]:
    """A frozen SwiGLU FFN's output for x (aot_eager, a static graph) with its gate and up
    projections merged or not (the pass made a no-op), and its plans."""
    torch.manual_seed(0)
    return _compiled_frozen(SwiGLU(128, 256).to(x.device, torch.bfloat16), recipe, x, merged, dump_dir=dump_dir)


def _compiled_frozen(model, recipe, x: torch.Tensor, merged: bool, backend="aot_eager", dump_dir=None) -> tuple[torch.Tensor, list]:
    """``model`` compiled for inference (a static graph), frozen, with the linears that read one
    x merged or not (the pass made a no-op): its output for x and its plans."""
    from graphquant import compiler

    merge = compiler.merge_gemms_sharing_x
    if not merged:
        compiler.merge_gemms_sharing_x = lambda gm: None
    try:
        compiled = graphquant.compile(model, recipe, mode="inference", backend=backend, dynamic=False, dump_dir=dump_dir)
        graphquant.freeze(compiled)
        with torch.no_grad():
            return compiled(x), compiled.graphquant.plans
    finally:
        compiler.merge_gemms_sharing_x = merge


def _interpreted_results() -> dict:
    from graphquant.kernels import triton_decode

    torch.manual_seed(0)
    results = {}
    for name in PAIRS:
        for m, n, n2, k in SHAPES:
            x = (torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]).to(torch.bfloat16)
            ws = [(torch.randn(rows, k) / 8).to(torch.bfloat16) for rows in (n, n2)]
            bias = torch.randn(n).to(torch.bfloat16)
            for on_load in (False, True):
                for out_dtype, biases in ((torch.float32, [None, None]), (torch.bfloat16, [bias, None])):
                    separate, shared = _separate_and_shared(name, x, ws, biases, out_dtype, on_load)
                    case = f"{name} | {m}x{n}+{n2}x{k} | {'on load' if on_load else 'first'} | {biases[0] is not None}"
                    results[case] = all(torch.equal(s, t) for s, t in zip(separate, shared, strict=True))
    splits = [[triton_decode.split_k(rows, k, torch.device("cpu")) > 1 for rows in (n, n2)] for m, n, n2, k in SHAPES]
    results["splits as described"] = splits == [[True, True], [True, False], [False, False]]
    results["counters"] = all(int(c.count_nonzero()) == 0 for c in triton_decode._ARRIVALS.values())
    backends.capability = lambda device: (9, 0)
    for name, recipe in RECIPES.items():
        backends.clear_caches()
        x = torch.randn(1, 128).to(torch.bfloat16)
        torch._dynamo.reset()
        merged, _ = _frozen(recipe, x, True)
        torch._dynamo.reset()
        separate, _ = _frozen(recipe, x, False)
        results[f"frozen ffn {name}"] = torch.equal(merged, separate)
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return triton_interpreter.results_of(__file__)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("a", ["first", "on load"])
@pytest.mark.parametrize("shape", [f"{m}x{n}+{n2}x{k}" for m, n, n2, k in SHAPES])
@pytest.mark.parametrize("name", PAIRS)
def test_two_gemms_in_one_launch_give_each_ones_own_bits_interpreted(interpreted, name, shape, a, bias):
    """A quantized first or by the kernel as it loads it (1x128 blocks: by its kernel first);
    bf16 out with a bias on the first GEMM, fp32 out without."""
    assert interpreted[f"{name} | {shape} | {a} | {bias}"]


def test_shared_launches_split_k_as_described_and_leave_the_counters_zero_interpreted(interpreted):
    assert interpreted["splits as described"]
    assert interpreted["counters"]


@pytest.mark.parametrize("name", RECIPES)
def test_a_frozen_ffn_gives_the_same_bits_with_its_gate_and_up_projections_in_one_launch_interpreted(interpreted, name):
    assert interpreted[f"frozen ffn {name}"]


@pytest.mark.parametrize("name", RECIPES)
def test_a_frozen_swiglu_runs_its_gate_and_up_projections_in_one_call(hopper_on_cpu, name):
    """Frozen, at one row: the rewritten graph (its dump) has one call for the gate and up
    projections naming both sites and their formats, and the down projection's own; the GEMMs run
    as one launch of two and one of one."""
    with tempfile.TemporaryDirectory() as dump_dir:
        _, plans = _frozen(RECIPES[name], torch.randn(1, 128).to(torch.bfloat16), True, dump_dir)
        rewritten = open(os.path.join(dump_dir, "graph_000_rewritten.py")).read()
    assert rewritten.count("quantized_frozen_linears_sharing_x(") == 1, rewritten
    assert rewritten.count("quantized_frozen_linear(") == 1, rewritten
    shared = next(line for line in rewritten.splitlines() if "quantized_frozen_linears_sharing_x(" in line)
    weight = plans[0].quantizer(next(r for r, _ in plans[0].slots if r.name == "gate_proj" and r.tensor_type == "weight"))
    assert "name='gate_proj'" in shared and "name='up_proj'" in shared and shared.count(f"weight={weight.spec!r}") == 2, shared
    assert hopper_on_cpu.launches == [2, 1]


def test_inductor_compiles_the_shared_call_of_a_stack_of_ffns(hopper_on_cpu):
    """Through Inductor (its Python wrapper names every GEMM of the shared call), a stack of frozen
    SwiGLUs (sites named "0.gate_proj#0 fprop") computes the bits it computes unmerged, one launch
    for each FFN's gate and up projections."""
    x = torch.randn(1, 128).to(torch.bfloat16)
    outputs = []
    for merged in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(SwiGLU(128, 256), SwiGLU(128, 256)).to(torch.bfloat16)
        outputs.append(_compiled_frozen(model, RECIPES["tensorwise"], x, merged, backend="inductor")[0])
    assert torch.equal(*outputs)
    assert hopper_on_cpu.launches == [2, 1, 2, 1, 1, 1, 1, 1, 1, 1]


def _up_tensorwise_else_rowwise(role):
    return RECIPES["tensorwise" if role.name == "up_proj" else "rowwise"].qfactory(role)


def test_linears_of_different_formats_stay_apart(hopper_on_cpu):
    """The gate and up projections in different formats (rowwise and tensorwise) each run their own GEMM."""
    recipe = graphquant.recipes.CustomRecipe(_up_tensorwise_else_rowwise)
    with tempfile.TemporaryDirectory() as dump_dir:
        _frozen(recipe, torch.randn(1, 128).to(torch.bfloat16), True, dump_dir)
        rewritten = open(os.path.join(dump_dir, "graph_000_rewritten.py")).read()
    assert "quantized_frozen_linears_sharing_x(" not in rewritten and rewritten.count("quantized_frozen_linear(") == 3, rewritten
    assert hopper_on_cpu.launches == [1, 1, 1]


def test_the_shared_gemm_ops_pass_opcheck(hopper_on_cpu):
    triton_decode = backends.triton_decode
    quantizer = Float8RowwiseQuantizer()
    x = torch.randn(2, 128).to(torch.bfloat16)
    ws = [quantizer(torch.randn(rows, 128).to(torch.bfloat16), columnwise=False).get(ROWWISE) for rows in (64, 32)]
    b = [t for w in ws for t in w.tensors()]
    shared = (b, quantizer.spec, [64, 128, 32, 128], torch.bfloat16)
    sites = "fc1#0 fprop, fc3#0 fprop"
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    args = (x, triton_decode.amaxes(x, quantizer), quantizer.spec, *shared, triton_decode.QUANTIZING_BACKEND, sites, [None, torch.randn(32).to(torch.bfloat16)])
    torch.library.opcheck(torch.ops.graphquant.gemms_quantizing_a.default, args, test_utils=utils)
    xq = quantizer(x, columnwise=False).get(ROWWISE)
    args = (list(xq.tensors()), quantizer.spec, ROWWISE, [2, 128], *shared, triton_decode.BACKEND, sites, [None, None])
    torch.library.opcheck(torch.ops.graphquant.gemms_sharing_a.default, args, test_utils=utils)


@pytest.mark.gpu
@pytest.mark.parametrize("name", PAIRS)
def test_the_gate_and_up_projections_in_one_launch_are_each_ones_own_call_on_the_gpu(name):
    """A Llama-3-8B FFN's w1 and w3 (14336 x 4096) at 1 and 16 rows, with and without a bias,
    A quantized first and as loaded: eagerly, then replayed from a CUDA graph on new inputs,
    each output is its own GEMM's eager call's bits, and the arrival counters end at zero."""
    from graphquant.kernels import triton_decode

    torch.manual_seed(0)
    ws = [(torch.randn(14336, 4096, device="cuda") / 64).to(torch.bfloat16) for _ in range(2)]
    bias = torch.randn(14336, device="cuda").to(torch.bfloat16)
    for m in (1, 16):
        x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
        for on_load in (False, True):
            for biases in ([None, None], [bias, None]):
                separate, shared = _separate_and_shared(name, x, ws, biases, torch.bfloat16, on_load)
                assert all(torch.equal(s, t) for s, t in zip(separate, shared)), (m, on_load)
        qa, qb = PAIRS[name]
        bs = [qb(w, columnwise=False).get(ROWWISE) for w in ws]

        def quantizing(x: torch.Tensor):
            return triton_decode.QuantizedOnLoad(x, triton_decode.amaxes(x, qa), qa)

        def both(x: torch.Tensor) -> list:
            return triton_decode.gemms_sharing_a(quantizing(x), bs, torch.bfloat16, [bias, None])

        for scale, replayed in cuda_graph_replays(both, x):
            expected = [triton_decode.gemm(quantizing(x), b, torch.bfloat16, bias_) for b, bias_ in zip(bs, [bias, None])]
            assert all(torch.equal(r, e) for r, e in zip(replayed, expected)), f"{m} rows, inputs times {scale}"
    torch.cuda.synchronize()
    assert all(int(c.count_nonzero()) == 0 for c in triton_decode._ARRIVALS.values())


@pytest.mark.gpu
def test_a_frozen_ffn_on_the_gpu_gives_the_same_bits_with_one_launch_for_its_gate_and_up():
    """The frozen FFN (tensorwise) at one and 16 rows, merged and not, gives the same bits (every
    recipe's, interpreted above)."""
    for rows in (1, 16):
        x = torch.randn(rows, 128, device="cuda").to(torch.bfloat16)
        torch._dynamo.reset()
        merged, plans = _frozen(RECIPES["tensorwise"], x, True)
        torch._dynamo.reset()
        separate, _ = _frozen(RECIPES["tensorwise"], x, False)
        assert {g.backend.name for g in plans[0].gemms} == {backends.triton_decode.QUANTIZING_BACKEND}, str(plans[0])
        assert torch.equal(merged, separate)


if __name__ == "__main__":  # the interpreted cases, as the fixture ``interpreted`` runs them
    triton_interpreter.accept_numpy_scalars()
    triton_interpreter.round_fp8_to_nearest_even()
    triton_interpreter.exact_fp8_dot_operands()
    triton_interpreter.round_bfloat16_to_nearest()
    print(json.dumps(_interpreted_results()))
