"""graphquant::mixed_input_operand: x's values for the mixed-input GEMM made from x in one op, on
CUDA by one kernel (graphquant.kernels.triton_mixed_operand): bit for bit the reference's
(mixed_input.operand of x quantized by graphquant.formats), for MXFP8 and NVFP4, x in bf16, fp16
and fp32, rows no multiple of the kernel's, blocks of zeros, of tiny and of huge values, infinities
and NaNs, and NVFP4 from a global amax larger than x's own. Which quantizers the op takes.

On the CPU the kernel runs under Triton's interpreter in a process of its own, and on the GPU.
"""

import json
import re

import ptxas
import pytest
import torch
import triton_interpreter

from graphquant.formats import nvfp4
from graphquant.kernels import mixed_input
from graphquant.quantizers import ROWWISE, HybridQuantizer, MXFP8Quantizer, NVFP4Quantizer, QuantizeContext

QUANTIZERS = {"mxfp8": MXFP8Quantizer(), "nvfp4": NVFP4Quantizer()}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CASES = ["random", "special", "larger amax"]


def _x(case: str, dtype: torch.dtype, device: str) -> torch.Tensor:
    """33 rows of 640 columns (five 128-column programs, three 16-row ones, the last partial): rows
    of random magnitudes, or with blocks of zeros, of values near the format's and dtype's ends,
    infinities and NaNs."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(33, 640, generator=generator) * torch.exp2(torch.randint(-12, 12, (33, 1), generator=generator).float())
    if case == "special":
        x[0, :32] = 0.0
        x[1, :16] = -0.0
        x[2, 32:48] = 1e-30 * torch.randn(16, generator=generator)
        x[3, 64:96] = torch.finfo(dtype).max * torch.rand(32, generator=generator)
        x[4, 100] = float("inf")
        x[5, 200] = float("-inf")
        x[6, 300] = float("nan")
        x[7, :] = torch.finfo(dtype).tiny * torch.randn(640, generator=generator)
    return x.to(dtype).to(device)


def _amax(x: torch.Tensor, name: str, case: str):
    amax = mixed_input.x_amax(x, QUANTIZERS[name])
    return amax * 4 if case == "larger amax" and amax is not None else amax


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bf16 bit patterns, NaN where the other is NaN (of any payload)."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


def _kernel_is_the_reference(name: str, dtype: str, case: str, device: str) -> bool:
    from graphquant.kernels import triton_mixed_operand

    x = _x(case, DTYPES[dtype], device)
    amax = _amax(x, name, case)
    got = triton_mixed_operand.values(x, amax, QUANTIZERS[name])
    want = mixed_input.operand_of_x(x.cpu(), None if amax is None else amax.cpu(), QUANTIZERS[name])
    return got.dtype == torch.bfloat16 and got.shape == x.shape and _same_bits(got.cpu(), want)


PARAMS = [(name, dtype, case) for name in QUANTIZERS for dtype in DTYPES for case in CASES if not (name == "mxfp8" and case == "larger amax")]


def _interpreted_results() -> dict:
    return {" | ".join(p): _kernel_is_the_reference(*p, "cpu") for p in PARAMS}


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return triton_interpreter.results_of(__file__)


@pytest.mark.parametrize("name, dtype, case", PARAMS)
def test_values_are_the_references_bit_for_bit_interpreted(interpreted, name, dtype, case):
    assert interpreted[f"{name} | {dtype} | {case}"]


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype, case", PARAMS)
def test_values_are_the_references_bit_for_bit_on_gpu(name, dtype, case):
    assert _kernel_is_the_reference(name, dtype, case, "cuda")


@pytest.mark.parametrize("name", QUANTIZERS)
def test_as_a_dependent_launch_the_kernel_waits_before_it_reads_x_and_lets_the_gemm_start_after(name):
    """Compiled for Hopper as a dependent launch (on any machine with Triton), each program waits
    for the kernel before it (griddepcontrol.wait) before any load or store, then lets the
    mixed-input GEMM after it start (launch_dependents): nothing is read before x is written."""
    pytest.importorskip("triton")
    from graphquant.kernels import triton_mixed_operand

    sizes, order = mixed_input.DIGITS[name]
    kernel = ptxas.compiled_for(
        triton_mixed_operand._values_kernel, {"x_ptr": "*bf16", "amax_ptr": "*fp32", "out_ptr": "*bf16"}, {"M": 16, "K": 4096, "stride": 4096},
        dict(FORMAT=mixed_input.FORMATS[name], SIZES=sizes, ORDER=order, BLOCK_M=triton_mixed_operand._BLOCK_M, ATOMS=triton_mixed_operand._ATOMS,
             ATOM=mixed_input.ATOM, DEPENDENT=True),
        num_warps=4, num_stages=1,
    )
    ptx = kernel.asm["ptx"]
    wait, launch = ptx.index("griddepcontrol.wait"), ptx.index("griddepcontrol.launch_dependents")
    memory = re.search(r"\b(ld\.global|st\.global|atom\.|red\.)", ptx[:wait])
    assert memory is None and wait < launch, ptx[:wait][-400:]


def test_the_op_is_the_values_of_x_quantized_in_the_kernels_order():
    """The op's reference: mixed_input.operand of x's representation, NVFP4's from the amax given."""
    for name, q in QUANTIZERS.items():
        x = _x("random", torch.bfloat16, "cpu")
        amax = mixed_input.x_amax(x, q)
        got = torch.ops.graphquant.mixed_input_operand(x, amax, q.spec)
        assert torch.equal(got, mixed_input.operand(q.quantize_rowwise(x, QuantizeContext())))
    larger = nvfp4.global_amax(x) * 4
    rep = NVFP4Quantizer().quantize_from_amax(x, larger, ROWWISE)
    assert torch.equal(rep.amax, larger) and torch.equal(torch.ops.graphquant.mixed_input_operand(x, larger, NVFP4Quantizer().spec), mixed_input.operand(rep))


@pytest.mark.parametrize("case", ["random", "special", "special without its NaN"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_amax_it_takes_is_the_formats_global_amax(dtype, case):
    x = _x(case.split(" without")[0], DTYPES[dtype], "cpu")
    x = torch.where(x.isnan(), 0.0, x) if "without" in case else x
    got, want = mixed_input.x_amax(x, NVFP4Quantizer()), nvfp4.global_amax(x)
    assert got.dtype == torch.float32 and (torch.equal(got, want) or (case == "special" and got.isnan() and want.isnan()))


def test_it_takes_mxfp8_e4m3_and_one_amax_nvfp4_rowwise():
    assert all(mixed_input.values_from_x(q) for q in QUANTIZERS.values())
    assert mixed_input.values_from_x(HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer()).child(ROWWISE))
    for q in (
        MXFP8Quantizer("e5m2"), NVFP4Quantizer(row_scaled_nvfp4=True), NVFP4Quantizer(with_2d_quantization=True),
        NVFP4Quantizer(stochastic_rounding=True), NVFP4Quantizer(with_amax_reduction=True),
    ):
        assert not mixed_input.values_from_x(q), q


if __name__ == "__main__":  # the interpreted cases, as the fixture ``interpreted`` runs them
    triton_interpreter.as_on_the_gpu()
    print(json.dumps(_interpreted_results()))
