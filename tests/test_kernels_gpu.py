"""Native quantize kernels (csrc/cuda) against the reference numerics, bit for bit.

Every test takes the ``backend`` fixture: here the CUDA build on a GPU (marked ``gpu``);
tests/test_kernels_emulated.py runs the same tests on the CPU build of the same kernels. Inputs
are fresh random tensors of several shapes (partial tiles and blocks included) and dtypes, with
zeros, subnormals, huge values, infinities and NaNs mixed in.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from graphquant.formats import fp8, groups
from graphquant.formats.groups import GROUP_ROWS
from graphquant.kernels import native
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    Float8RowwiseQuantizer,
    HybridQuantizer,
    KernelEncoding,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeContext,
    Quantizer,
    STREAMS_PER_STEP,
    quantizer_classes,
)
from test_kernel_encoding import comparable, old_config
from test_user_format import Float8Block64

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SHAPES = ((256, 384), (200, 136), (96, 160), (48, 80), (130, 33), (1, 16))
VALUES = ("normal", "special", "special_finite")

# Factories, so that every test (and every hybrid) gets fresh quantizer instances.
QUANTIZERS = {
    "fp8_current_e4m3": lambda: Float8CurrentScalingQuantizer(),
    "fp8_current_e5m2_pow2_eps": lambda: Float8CurrentScalingQuantizer(fp8_dtype="e5m2", force_pow_2_scales=True, amax_epsilon=1e-3),
    "fp8_block_1d": lambda: Float8BlockQuantizer(block_scaling_dim=1),
    "fp8_block_2d_e5m2": lambda: Float8BlockQuantizer(fp8_dtype="e5m2", block_scaling_dim=2, force_pow_2_scales=False),
    "fp8_rowwise": lambda: Float8RowwiseQuantizer(),
    "fp8_rowwise_nopow2": lambda: Float8RowwiseQuantizer(fp8_dtype="e5m2", force_pow_2_scales=False),
    "mxfp8_e4m3": lambda: MXFP8Quantizer(),
    "mxfp8_e5m2": lambda: MXFP8Quantizer(fp8_dtype="e5m2"),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
    "nvfp4_sr": lambda: NVFP4Quantizer(stochastic_rounding=True),
    "nvfp4_rht_sr": lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True),
    "nvfp4_rht_nosign": lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, with_random_sign_mask=False),
    "nvfp4_rowscaled": lambda: NVFP4Quantizer(row_scaled_nvfp4=True),
    "nvfp4_rht_sr_rowscaled": lambda: NVFP4Quantizer(
        with_rht=True, with_post_rht_amax=True, stochastic_rounding=True, row_scaled_nvfp4=True
    ),
    "nvfp4_rht_nosign_2d_sr": lambda: NVFP4Quantizer(
        with_rht=True, with_post_rht_amax=True, with_random_sign_mask=False, with_2d_quantization=True, stochastic_rounding=True
    ),
    # A user's format (tests/test_user_format.py), run from its KernelEncoding: 1x64 / 64x1 float32
    # block scales, its columnwise data in x's layout.
    "user_fp8_block64": lambda: Float8Block64(),
}
# One of each format for the hybrid pairs.
HYBRID_CHILDREN = ("fp8_current_e4m3", "fp8_block_1d", "fp8_block_2d_e5m2", "fp8_rowwise", "mxfp8_e4m3", "nvfp4_rht_sr_rowscaled", "nvfp4_2d")


# The references, kept before forbid_reference replaces kernels' fallbacks.
REFERENCE = native.reference_quantize
REFERENCE_GROUPED = native.reference_grouped_quantize


def forbid_reference(monkeypatch):
    """Make kernels' fallback to the reference an error, so every test here runs a native kernel."""

    def fallback(*args, **kwargs):
        raise AssertionError("kernels fell back to the reference numerics: no native kernel ran")

    monkeypatch.setattr(native, "reference_quantize", fallback)
    for cls in (Quantizer, *quantizer_classes()):  # the grouped quantize's vectorised fallback
        for method in ("quantize_groups", "grouped_columnwise_amax"):
            if method in vars(cls):
                monkeypatch.setattr(cls, method, fallback)


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request, monkeypatch):
    """The device whose tensors the native kernels take."""
    assert native.extension() is not None, "graphquant._C was built without its CUDA kernels"
    forbid_reference(monkeypatch)
    return request.param


def make_input(shape, dtype, values, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 7, (shape[0], 1), generator=g).float())
    if values.startswith("special"):
        flat = x.view(-1)
        n = flat.numel()
        picks = torch.randperm(n, generator=g)
        tiny = torch.finfo(dtype).tiny
        big = torch.finfo(dtype).max
        specials = [0.0, -0.0, tiny / 4, -tiny / 8, tiny, big, -big / 3, float("inf"), float("-inf")]
        if values == "special":  # a NaN poisons per-tensor scales; "special_finite" keeps them usable
            specials += [float("nan"), -float("nan")]
        for k, v in enumerate(specials):
            flat[picks[k::64][: max(1, n // 200)]] = v
        if shape[0] > 2:
            x[1] = 0.0  # a whole zero row
            x[2] = tiny / 2  # a row of subnormals
    return x.to(dtype).to(device)


def supported(quantizer, shape, direction) -> bool:
    try:
        quantizer.check_shape(shape, direction)
    except ValueError:
        return False
    return True


def assert_same(got, reference, what=""):
    """Bit-identical tensors (NaN payloads aside), same shape and dtype; or both None."""
    if reference is None:
        assert got is None, what
        return
    assert got is not None, what
    assert got.shape == reference.shape and got.dtype == reference.dtype, (
        f"{what}: {got.shape} {got.dtype} vs {reference.shape} {reference.dtype}"
    )
    on_gpu = got.is_cuda
    got, reference = got.cpu(), reference.cpu()
    if got.dtype.is_floating_point and (got.dtype.itemsize > 1 or not on_gpu):
        # NaN payloads and signs are not part of the contract (a CPU propagates an operand's NaN
        # where a GPU makes a canonical one); FP8 NaNs must match exactly on the GPU.
        both_nan = torch.isnan(got.float()) & torch.isnan(reference.float())
    else:
        both_nan = torch.zeros(got.shape, dtype=torch.bool)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.dtype.itemsize]
    got, reference = got.view(ints).masked_fill(both_nan, 0), reference.view(ints).masked_fill(both_nan, 0)
    mismatch = (got != reference).nonzero()
    assert mismatch.numel() == 0, f"{what}: {mismatch.shape[0]} of {got.numel()} differ, first at {mismatch[:4].tolist()}"


def assert_same_rep(got, reference, what=""):
    for field in ("data", "scale", "amax"):
        assert_same(getattr(got, field), getattr(reference, field), f"{what} {field}")
    for field in ("direction", "shape", "transposed", "dtype", "hadamard", "quantizer"):
        assert getattr(got, field) == getattr(reference, field), f"{what} {field}"


CTX = QuantizeContext(seed=1234, offset=(7 << 32) + 99)


@pytest.mark.parametrize("values", VALUES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("direction", (ROWWISE, COLUMNWISE))
@pytest.mark.parametrize("name", QUANTIZERS)
def test_quantize_matches_reference(backend, name, direction, dtype, values):
    quantizer = QUANTIZERS[name]()
    for n, shape in enumerate(SHAPES):
        if not supported(quantizer, shape, direction):
            continue
        x = make_input(shape, dtype, values, backend, seed=n)
        got = native.quantize(quantizer, x, direction, CTX)
        assert_same_rep(got, REFERENCE(quantizer, x, direction, CTX), f"{name} {shape}")


# Both directions: whole 128x128 tiles (on the GPU, 2-byte inputs take the register tile program
# there, but for NVFP4's transform and per-row amaxes) and partial ones (the generic tile program).
BOTH_SHAPES = ((256, 384), (640, 1152), (200, 136))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_both_directions_in_one_pass(backend, name, dtype):
    quantizer = QUANTIZERS[name]()
    for n, shape in enumerate(BOTH_SHAPES):
        if not (supported(quantizer, shape, ROWWISE) and supported(quantizer, shape, COLUMNWISE)):
            continue
        x = make_input(shape, dtype, "special" if n != 1 else "normal", backend, seed=n)
        rowwise, columnwise = native.quantize_hybrid(quantizer, x, CTX)
        assert_same_rep(rowwise, REFERENCE(quantizer, x, ROWWISE, CTX), f"rowwise {shape}")
        assert_same_rep(columnwise, REFERENCE(quantizer, x, COLUMNWISE, CTX), f"columnwise {shape}")


def test_register_tile_program_turned_off_gives_the_same_bits(backend, tmp_path):
    """GRAPHQUANT_REGISTER_TILE=0 (read once per process, so in a fresh one) sends the whole-tile
    launches that the register program takes to the generic tile program: the same bits as this
    process's, for every format and pair it takes, one direction or both, from either columnwise
    source, special values included."""
    if backend == "cpu":
        pytest.skip("the CPU build has the generic tile program only")
    names = ("fp8_current_e4m3", "fp8_current_e5m2_pow2_eps", "fp8_block_1d", "fp8_block_2d_e5m2", "mxfp8_e4m3", "mxfp8_e5m2",
             "nvfp4", "nvfp4_2d", "nvfp4_sr", "nvfp4_rht_sr", "nvfp4_rht_nosign", "nvfp4_rowscaled", "nvfp4_rht_sr_rowscaled")
    program = f"""
import sys, torch
sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r})
from test_kernels_gpu import CTX, QUANTIZERS, make_input
from graphquant.kernels import native
from graphquant.quantizers import HybridQuantizer
out = {{}}
for n, (row, col) in enumerate((r, c) for r in {names!r} for c in {names!r}):
    for dtype in (torch.bfloat16, torch.float16):
        x = make_input((384, 256), dtype, ("special", "special_finite", "normal")[n % 3], "cuda", seed=n)
        for source in ("original", "rowwise_dequantized"):
            hybrid = HybridQuantizer(QUANTIZERS[row](), QUANTIZERS[col](), source)
            reps = [*native.quantize_hybrid(hybrid, x, CTX), *(native.quantize(hybrid, x, d, CTX) for d in ("rowwise", "columnwise"))]
            out[row, col, str(dtype), source] = [t.cpu() for rep in reps for t in (rep.data, rep.scale, rep.amax) if t is not None]
torch.save(out, sys.argv[1])
"""
    results = []
    for value in ("1", "0"):
        path = tmp_path / f"tile{value}.pt"
        env = {**os.environ, "GRAPHQUANT_REGISTER_TILE": value}
        result = subprocess.run([sys.executable, "-c", program, str(path)], env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        results.append(torch.load(path))
    register, generic = results
    assert register.keys() == generic.keys()
    for key in register:
        for a, b in zip(register[key], generic[key]):
            assert_same(a, b, str(key))


@dataclasses.dataclass(frozen=True)
class Block64StoredTransposed(Float8Block64):
    """Says its columnwise data is stored transposed, while its kernel encoding keeps x's layout."""

    tag = "test_fp8_block64_stored_transposed"

    def transposed(self, direction):
        return direction == COLUMNWISE


def test_the_extension_reads_each_encoding_by_name(backend):
    """The extension's Encoding, made from a KernelEncoding's fields by keyword, holds the numbers
    of the positional config it replaces; a missing or unknown field, an unknown name, or an
    encoding whose layout is not the quantizer's, is an error that says what is accepted."""
    ext = native.extension()
    for name, make in QUANTIZERS.items():
        quantizer = make()
        for direction in (ROWWISE, COLUMNWISE):
            encoding = quantizer.kernel_encoding(direction)
            built = native._encoding(ext, quantizer, direction).native
            read = [built.format, built.fp8, built.epsilon, int(built.pow2), built.two_d, int(built.rht), int(built.sign_mask),
                    int(built.sr), int(built.row_scaled)]
            if name != "user_fp8_block64":
                assert read == pytest.approx(comparable(old_config(quantizer, direction))), f"{name} {direction}"
            assert built.transposed == encoding.transposed and built.delayed == encoding.delayed_scaling
            assert (built.block_rows, built.block_cols) == encoding.block
    user = native._encoding(ext, Float8Block64(), COLUMNWISE).native
    assert (user.format, user.block_chunks, user.two_d, user.transposed) == (2, 4, 0, False)
    with pytest.raises(ValueError, match=r"kernel_encoding\('columnwise'\) says transposed=False, but its representations say"):
        native.quantize(Block64StoredTransposed(), make_input((128, 128), torch.float32, "normal", backend), COLUMNWISE, CTX)

    fields = {f.name: getattr(MXFP8Quantizer().kernel_encoding(ROWWISE), f.name) for f in dataclasses.fields(KernelEncoding)}
    assert ext.Encoding(**fields).format == 4
    with pytest.raises(TypeError):
        ext.Encoding(**fields, block_len=32)
    with pytest.raises(TypeError):
        ext.Encoding(**{k: v for k, v in fields.items() if k != "element"})
    with pytest.raises(TypeError):
        ext.Encoding(*fields.values())  # by name only
    with pytest.raises(RuntimeError, match="scaling must be one of 'tensor', 'row', 'block', 'mxfp8', 'nvfp4', got 'tile'"):
        ext.Encoding(**{**fields, "scaling": "tile"})
    with pytest.raises(RuntimeError, match="no block blocks of 1x48"):
        ext.Encoding(**{**fields, "scaling": "block", "block": (1, 48)})


@pytest.mark.parametrize("source", ("original", "rowwise_dequantized"))
@pytest.mark.parametrize("row_name, col_name", (("user_fp8_block64", "fp8_block_1d"), ("fp8_block_2d_e5m2", "user_fp8_block64")))
def test_a_user_format_fuses_with_a_built_in_one(backend, row_name, col_name, source):
    """A user's 1x64 blocks beside the built-in 128-long ones in one pass, whole tiles and partial."""
    for n, shape in enumerate(((256, 384), (200, 136))):
        quantizer = HybridQuantizer(QUANTIZERS[row_name](), QUANTIZERS[col_name](), source)
        x = make_input(shape, torch.bfloat16, "special", backend, seed=n)
        rowwise, columnwise = native.quantize_hybrid(quantizer, x, CTX)
        assert_same_rep(rowwise, quantizer.quantize_rowwise(x, CTX), f"rowwise {shape}")
        assert_same_rep(columnwise, quantizer.quantize_columnwise(x, CTX), f"columnwise {shape}")


@pytest.mark.parametrize("name, direction", (("fp8_block_1d", ROWWISE), ("fp8_block_1d", COLUMNWISE), ("mxfp8_e4m3", ROWWISE)))
def test_1d_block_scales_across_the_reduction_lie_outer_dim_major(backend, name, direction):
    """1x128 (128x1) block scales and MXFP8's 1x32 ones lie outer-dim-major, as the spec stores
    1x128's and the reference both: a tile's scales are contiguous runs, and they cross an op
    boundary without a copy."""
    quantizer = QUANTIZERS[name]()
    assert quantizer.scale_outer_major(direction)
    x = make_input((256, 384), torch.bfloat16, "normal", backend)
    got = native.quantize(quantizer, x, direction, CTX)
    reference = REFERENCE(quantizer, x, direction, CTX)
    assert got.scale.stride() == reference.scale.stride() == (1, got.scale.shape[0])
    stored = got.tensors()[1]
    assert stored.is_contiguous() and stored.data_ptr() == got.scale.data_ptr()
    assert_same_rep(quantizer.stored_representation(direction, got.shape, got.dtype, got.tensors()), reference, direction)


@pytest.mark.parametrize("name", QUANTIZERS)
def test_persistent_ctas_take_several_tiles(backend, name):
    """Rowwise-only launches run as many CTAs as fit, each taking every grid-th tile through its
    two tile buffers: with a thousand tiles (a few hundred CTAs fit on an H200) each CTA takes
    several, aligned rows and not (K = 4100 is fetched element by element)."""
    if backend == "cpu":
        pytest.skip("the emulation runs every shape on three persistent CTAs already")
    quantizer = QUANTIZERS[name]()
    for n, shape in enumerate(((4096, 4096), (2048, 4100))):
        if not supported(quantizer, shape, ROWWISE):
            continue
        x = make_input(shape, torch.bfloat16, "special", backend, seed=n)
        got = native.quantize(quantizer, x, ROWWISE, CTX)
        assert_same_rep(got, REFERENCE(quantizer, x, ROWWISE, CTX), f"{name} {shape}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", ("e4m3", "e5m2"))
def test_delayed_scaling(backend, fp8_dtype, dtype):
    quantizer = Float8DelayedScalingQuantizer(fp8_dtype=fp8_dtype)
    for n, shape in enumerate(SHAPES):
        x = make_input(shape, dtype, "special", backend, seed=n)
        ctx = QuantizeContext(scale=torch.tensor([3.0 / (n + 1)], device=backend))
        for direction in (ROWWISE, COLUMNWISE):
            got = native.quantize(quantizer, x, direction, ctx)
            assert_same_rep(got, REFERENCE(quantizer, x, direction, ctx), f"{shape} {direction}")
        rowwise, columnwise = native.quantize_hybrid(quantizer, x, ctx)
        assert_same_rep(columnwise, REFERENCE(quantizer, x, COLUMNWISE, ctx), f"{shape} both")


@pytest.mark.parametrize("source", ("original", "rowwise_dequantized"))
@pytest.mark.parametrize("row_name, col_name", list(itertools.product(HYBRID_CHILDREN, HYBRID_CHILDREN)))
def test_hybrid_matches_unfused(backend, row_name, col_name, source):
    """One fused pass equals the two children run separately, from either columnwise source."""
    shape = (256, 384)
    dtypes = DTYPES if (row_name, col_name) == ("mxfp8_e4m3", "nvfp4_2d") else (torch.bfloat16,)
    for n, dtype in enumerate(dtypes):
        quantizer = HybridQuantizer(QUANTIZERS[row_name](), QUANTIZERS[col_name](), source)
        x = make_input(shape, dtype, "special" if n == 0 else "normal", backend, seed=n)
        rowwise, columnwise = native.quantize_hybrid(quantizer, x, CTX)
        assert_same_rep(rowwise, quantizer.quantize_rowwise(x, CTX), "rowwise")
        assert_same_rep(columnwise, quantizer.quantize_columnwise(x, CTX), "columnwise")
        assert_same_rep(native.quantize(quantizer, x, COLUMNWISE, CTX), columnwise, "columnwise alone")


@pytest.mark.parametrize("shape", ((256, 384), (200, 136), (130, 33)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ("fp8_current_e4m3", "fp8_block_1d", "fp8_rowwise", "mxfp8_e5m2", "nvfp4_rht_sr_rowscaled"))
def test_quantize_dbias(backend, name, dtype, shape):
    quantizer = HybridQuantizer(QUANTIZERS[name](), QUANTIZERS["fp8_block_2d_e5m2"]())
    directions = [d for d in (ROWWISE, COLUMNWISE) if supported(quantizer, shape, d)]
    x = make_input(shape, dtype, "normal", backend)
    wanted = dict(rowwise=ROWWISE in directions, columnwise=COLUMNWISE in directions)
    rowwise, columnwise, dbias = native.quantize_pass(quantizer, x, CTX, dbias=True, **wanted)
    for direction, rep in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)):
        if direction in directions:
            assert_same_rep(rep, REFERENCE(quantizer, x, direction, CTX), direction)
    assert dbias.dtype == dtype and dbias.shape == (shape[1],)
    exact = x.double().sum(0).cpu()
    # fp32 sums of M terms (fp8.accumulation_bound's, as x's product with ones), then one rounding
    # to the output dtype.
    ones = torch.ones(1, shape[0], dtype=torch.float64)
    bound = fp8.accumulation_bound(ones, x.double().cpu(), fp8.FP32)[0] + exact.abs() * torch.finfo(dtype).eps
    assert ((dbias.double().cpu() - exact).abs() <= bound).all()
    assert torch.equal(native.quantize_pass(quantizer, x, CTX, dbias=True, **wanted)[2], dbias), "dbias is deterministic"


GROUPED = (
    "fp8_current_e4m3", "fp8_block_1d", "fp8_block_2d_e5m2", "fp8_rowwise", "mxfp8_e4m3", "nvfp4", "nvfp4_rht_sr_rowscaled", "nvfp4_2d",
)


GROUPED_HYBRID = "hybrid mxfp8 / nvfp4 rht sr"
# Columns of grouped inputs: partial tiles (the generic tile program), and whole ones (where the
# register tile program takes 2-byte inputs of per-tensor and row-scaled FP8).
GROUPED_COLUMNS = (160, 256)


def grouped_quantizer(name):
    """GROUPED's quantizer of that name, or GROUPED_HYBRID: each child its direction, from x."""
    if name == GROUPED_HYBRID:
        return HybridQuantizer(MXFP8Quantizer(), NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True), "original")
    return QUANTIZERS[name]()


def grouped_rows(sizes: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the groups' bounds, each row's group) of consecutive row groups of ``sizes`` rows."""
    bounds = torch.tensor([0, *itertools.accumulate(sizes)], device=device)
    return bounds, torch.arange(len(sizes), device=device).repeat_interleave(torch.tensor(sizes, device=device), output_size=sum(sizes))


@pytest.mark.parametrize("direction", (ROWWISE, COLUMNWISE))
@pytest.mark.parametrize("name", GROUPED)
def test_grouped_quantize(backend, name, direction):
    quantizer = QUANTIZERS[name]()
    # Empty groups only where the per-group reference can quantize an empty slice.
    allows_empty = name.startswith(("fp8_current", "fp8_block", "mxfp8")) or (name == "fp8_rowwise" and direction == ROWWISE)
    sizes = [256, 0, 128, 384] if allows_empty else [256, 128, 384]
    bounds, row_group = grouped_rows(sizes, backend)
    for n, (dtype, cols) in enumerate(itertools.product(DTYPES, GROUPED_COLUMNS)):
        x = make_input((sum(sizes), cols), dtype, "special", backend, seed=n)
        got = native.grouped_quantize(quantizer, x, row_group, bounds, direction, CTX)
        reference = REFERENCE_GROUPED(quantizer, x, bounds, direction, CTX)
        assert_same_rep(got, reference, str(dtype))


@pytest.mark.parametrize("fp8_dtype", ("e4m3", "e5m2"))
def test_grouped_delayed_scaling(backend, fp8_dtype):
    """Delayed scaling keeps a slot a group (an expert): each group quantized with its own scale,
    each reporting its own amax, as the reference quantizes each group alone; an empty group too."""
    quantizer = Float8DelayedScalingQuantizer(fp8_dtype=fp8_dtype)
    sizes = [256, 0, 128, 384]
    bounds, row_group = grouped_rows(sizes, backend)
    ctx = QuantizeContext(scale=torch.tensor([3.0, 0.5, 1 / 7, 40.0], device=backend))
    for n, (dtype, cols) in enumerate(itertools.product(DTYPES, GROUPED_COLUMNS)):
        x = make_input((sum(sizes), cols), dtype, "special", backend, seed=n)
        both = native.grouped_quantize_pass(quantizer, x, row_group, bounds, ctx, rowwise=True, columnwise=True)
        for direction in (ROWWISE, COLUMNWISE):
            reference = REFERENCE_GROUPED(quantizer, x, bounds, direction, ctx)
            assert_same_rep(native.grouped_quantize(quantizer, x, row_group, bounds, direction, ctx), reference, f"{dtype} {direction}")
            assert_same_rep(getattr(both, direction), reference, f"{dtype} {direction} of both")


@pytest.mark.parametrize("name", [*GROUPED, GROUPED_HYBRID])
def test_grouped_quantize_of_both_directions_equals_each_alone(backend, name):
    """Both directions from one read of x (native.grouped_quantize_pass, as a grouped site's
    operands take them) are what each direction's own call makes, bit for bit, random draws
    included; a hybrid's too (each child its direction, from x)."""
    quantizer = grouped_quantizer(name)
    sizes = [256, 128, 384]
    bounds, row_group = grouped_rows(sizes, backend)
    x = make_input((sum(sizes), 160), torch.bfloat16, "special", backend)
    both = native.grouped_quantize_pass(quantizer, x, row_group, bounds, CTX, rowwise=True, columnwise=True)
    for direction, rep in ((ROWWISE, both.rowwise), (COLUMNWISE, both.columnwise)):
        alone = native.grouped_quantize(quantizer.child(direction), x, row_group, bounds, direction, CTX)
        assert_same_rep(rep, alone, direction)


@pytest.mark.parametrize("name", [*GROUPED, GROUPED_HYBRID])
def test_grouped_quantize_through_a_gather(backend, name):
    """A MoE site's rows quantized into the padded layout as the kernel reads them through the
    layout's gather (groups.padding's source: pad rows, and an empty group, read nothing) are what
    the quantize of the padded copy makes, bit for bit, each direction alone and both at once; rows
    of 16-byte pieces and rows read element by element; whole tiles (the register tile program);
    and rows read one by one through a gather of the model's own (a shuffled source, no runs)."""
    quantizer = grouped_quantizer(name)
    rows = 700
    offs = torch.tensor([200, 200, 333, rows], dtype=torch.int32, device=backend)  # an empty group
    layout = groups.padding(offs, rows, GROUP_ROWS, groups.padded_bound(rows, 4, GROUP_ROWS))
    bounds = layout.bounds
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0)).to(backend)
    for cols, dtype in ((160, torch.bfloat16), (160, torch.float32), (131, torch.float16), (256, torch.bfloat16)):
        directions = [d for d in (ROWWISE, COLUMNWISE) if supported(quantizer, (layout.padded_rows, cols), d)]
        if not directions:
            continue
        x = make_input((rows, cols), dtype, "special", backend)
        for wanted in [directions] + [[d] for d in directions] * (len(directions) == 2):
            both = dict(rowwise=ROWWISE in wanted, columnwise=COLUMNWISE in wanted)
            got = native.grouped_quantize_pass(quantizer, x, layout.row_group, bounds, CTX, source=layout.source, runs=layout.runs, **both)
            want = native.grouped_quantize_pass(quantizer, layout.pad(x), layout.row_group, bounds, CTX, **both)
            # A gather of the model's own in front (tokens sorted by expert): each row read through it.
            shuffled = torch.where(layout.source >= 0, order[layout.source.clamp_min(0)], -1)
            through = native.grouped_quantize_pass(quantizer, x, layout.row_group, bounds, CTX, source=shuffled, **both)
            want_through = native.grouped_quantize_pass(quantizer, groups.gather_rows(x, shuffled), layout.row_group, bounds, CTX, **both)
            for direction in wanted:
                what = f"{direction} of {wanted}, {cols} {dtype}"
                assert_same_rep(getattr(got, direction), getattr(want, direction), what)
                assert_same_rep(getattr(through, direction), getattr(want_through, direction), f"{what}, through a gather")


@pytest.mark.parametrize("name", [*GROUPED, GROUPED_HYBRID])
def test_grouped_columnwise_takes_the_amaxes_the_rowwise_call_took(backend, name):
    """The amaxes a columnwise side scales from, taken in the same read of x as the rowwise
    (take_columnwise_amax: an expert stack's weights in forward), are the per-group reference's;
    the columnwise made later from them (columnwise_amax: in backward) is the one made alone, bit
    for bit; and the kernel does take them rather than reading x for them again."""
    quantizer = grouped_quantizer(name)
    column = quantizer.child(COLUMNWISE)
    sizes = [256, 128, 384]
    bounds, row_group = grouped_rows(sizes, backend)
    for values in ("special", "normal"):
        x = make_input((sum(sizes), 160), torch.bfloat16, values, backend)
        first = native.grouped_quantize_pass(quantizer, x, row_group, bounds, CTX, rowwise=True, columnwise=False, take_columnwise_amax=True)
        rowwise = native.grouped_quantize(quantizer.child(ROWWISE), x, row_group, bounds, ROWWISE, CTX)
        assert_same_rep(first.rowwise, rowwise, f"{values} rowwise")
        scaling = column.kernel_encoding(COLUMNWISE).scaling
        if scaling == "row":  # per group and column
            want = groups.group_amax(x, row_group, len(sizes), per_column=True).reshape(-1)
        elif scaling in ("tensor", "nvfp4"):  # per group
            want = REFERENCE_GROUPED(column, x, bounds, COLUMNWISE, CTX).amax.float().reshape(-1)
        else:  # scales from blocks alone
            want = x.new_empty(0, dtype=torch.float32)
        assert_same(first.columnwise_amax, want, f"{values} amaxes")

        def columnwise(amax):
            made = native.grouped_quantize_pass(quantizer, x, row_group, bounds, CTX, rowwise=False, columnwise=True, columnwise_amax=amax)
            return made.columnwise

        alone = native.grouped_quantize(column, x, row_group, bounds, COLUMNWISE, CTX)
        assert_same_rep(columnwise(first.columnwise_amax), alone, f"{values} columnwise")
        if want.numel() and torch.isfinite(want).all():
            assert not torch.equal(columnwise(first.columnwise_amax * 4).scale, alone.scale), "the given amaxes were not taken"


@pytest.mark.gpu
@pytest.mark.parametrize("cols", (4096, 1408, 384, 4608))  # 16 words a lane (the long rows' kernel); 5-6 and 1-2 of the short rows' 8; too long
@pytest.mark.parametrize("take_columnwise_amax", (False, True))
def test_row_scaled_fp8_rowwise_program(take_columnwise_amax, cols):
    """Row-scaled FP8's rowwise side, alone or with the amaxes its columnwise scales from, runs as
    the row strip program's one launch (beside the zeroed amaxes), with no pre-pass or main pass,
    where a warp's registers hold a row (up to row_strip.h's kMaxColumns, 4096 2-byte elements),
    and on the tile programs' pre-pass and main pass past that; the reference's bits either way."""
    assert native.extension() is not None
    bounds, row_group = grouped_rows([256, 384], "cuda")
    x = make_input((640, cols), torch.bfloat16, "special", "cuda")
    quantizer = QUANTIZERS["fp8_rowwise"]()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        made = native.grouped_quantize_pass(
            quantizer, x, row_group, bounds, CTX, rowwise=True, columnwise=False, take_columnwise_amax=take_columnwise_amax
        )
        torch.cuda.synchronize()
    kernels = [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    tile_passes = [name for name in kernels if "tile" in name or "finalize" in name]
    strips = sum("row_strip_kernel" in name for name in kernels)
    assert (strips, len(tile_passes) > 0) == ((1, False) if cols <= 4096 else (0, True)), kernels
    assert_same_rep(made.rowwise, REFERENCE_GROUPED(quantizer, x, bounds, ROWWISE, CTX))
    if take_columnwise_amax:
        assert_same(made.columnwise_amax, groups.group_amax(x, row_group, 2, per_column=True).reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("direction", (ROWWISE, COLUMNWISE))
@pytest.mark.parametrize("name", QUANTIZERS)
def test_dequantize_matches_reference(backend, name, direction, dtype):
    quantizer = QUANTIZERS[name]()
    for n, shape in enumerate(SHAPES):
        if not supported(quantizer, shape, direction):
            continue
        x = make_input(shape, dtype, "special", backend, seed=n)
        rep = REFERENCE(quantizer, x, direction, CTX)
        assert native._native_dequantize(rep, dtype, True) is not None, "no native dequantize"
        assert_same(native.dequantize(rep), rep.dequantize(), f"{shape}")
        assert_same(native.dequantize_for_gemm(rep, torch.float32), rep.dequantize(torch.float32), f"{shape} fp32")
        if isinstance(quantizer, NVFP4Quantizer):
            from graphquant.formats import nvfp4

            codes = nvfp4.e2m1_values(nvfp4.unpack(rep.data))
            unscaled = codes * rep.scale.float().repeat_interleave(16, dim=1)
            assert_same(native.dequantize_for_gemm(rep, with_global=False), unscaled.to(torch.bfloat16), "q * s")


def test_stochastic_rounding_reproducible_and_unbiased(backend):
    quantizer = NVFP4Quantizer(stochastic_rounding=True)
    g = torch.Generator().manual_seed(3)
    x = (torch.rand(256, 256, generator=g) * 4 - 2).to(backend)
    ctx = QuantizeContext(seed=11, offset=5)
    first = native.quantize(quantizer, x, ROWWISE, ctx)
    assert torch.equal(first.data, native.quantize(quantizer, x, ROWWISE, ctx).data), "same seed, same bits"
    other = native.quantize(quantizer, x, ROWWISE, QuantizeContext(seed=11, offset=6))
    assert not torch.equal(first.data, other.data), "another offset draws other bits"
    draws = 64
    mean = sum(
        native.quantize(quantizer, x, ROWWISE, QuantizeContext(seed=11, offset=k)).dequantize(torch.float64)
        for k in range(draws)
    ) / draws
    nearest = NVFP4Quantizer().quantize_rowwise(x, ctx).dequantize(torch.float64)
    error_sr, error_rn = (mean - x.double()).mean().abs().item(), (nearest - x.double()).abs().mean().item()
    assert error_sr < error_rn / 8, f"mean error {error_sr} vs round-to-nearest {error_rn}"


@pytest.mark.parametrize("name", ("nvfp4_sr", "nvfp4_rht_sr_rowscaled", "nvfp4_rht_nosign_2d_sr"))
def test_stochastic_rounding_key_made_on_the_device(backend, name):
    """A compiled model's [seed, step] stays on the device: the kernels make the key from it there,
    bit-identical to the host's key for seed and offset = step * STREAMS_PER_STEP + stream (a
    64-bit seed and a step past 2^16 use every word of the hash)."""
    quantizer = QUANTIZERS[name]()
    x = make_input((256, 384), torch.bfloat16, "normal", backend)
    seed, step, stream = -(5 << 40) - 3, 70001, 12
    rng = torch.tensor([seed, step], dtype=torch.int64, device=backend)
    on_device = native.quantize_hybrid(quantizer, x, QuantizeContext(rng=rng, offset=stream))
    host = QuantizeContext(seed=seed, offset=step * STREAMS_PER_STEP + stream)
    for direction, rep in zip((ROWWISE, COLUMNWISE), on_device):
        assert_same_rep(rep, REFERENCE(quantizer, x, direction, host), direction)


@pytest.mark.gpu
def test_no_host_synchronisation_and_current_stream():
    """The hot path never waits for the device, and runs on the caller's stream."""
    assert native.extension() is not None
    x = make_input((512, 640), torch.bfloat16, "normal", "cuda")
    hybrid = HybridQuantizer(NVFP4Quantizer(with_rht=True, with_post_rht_amax=True), Float8CurrentScalingQuantizer(), "rowwise_dequantized")
    expected = native.quantize_hybrid(hybrid, x, CTX)
    bounds, row_group = grouped_rows([256, 256], "cuda")
    stochastic, rng = QUANTIZERS["nvfp4_rht_sr_rowscaled"](), torch.tensor([5, 9], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            got = native.quantize_hybrid(hybrid, x, CTX)
            grouped = native.grouped_quantize(
                Float8CurrentScalingQuantizer(), x, row_group, bounds, COLUMNWISE, CTX
            )
            dbias = native.quantize_pass(MXFP8Quantizer(), x, CTX, dbias=True)[2]
            # as a compiled model calls it: stochastic rounding's [seed, step] stays on the device
            torch.ops.graphquant.quantize(x, stochastic.spec, True, True, None, rng, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for a, b in zip(got, expected):
        assert_same_rep(a, b)
    assert grouped.scale.shape == (2,) and dbias.shape == (640,)
