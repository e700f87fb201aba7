"""A small input's rowwise NVFP4 or MXFP8 in one launch (csrc/cuda/small_rowwise.cuh), bit for
bit against the reference and against the tile programs' launches it replaces.

A decode step quantizes activations of 1-16 rows. The extension's small rowwise program makes
their rowwise NVFP4 (the tensor's or each row's amax, 1x16 blocks rounded to nearest) in one
launch, where the tile programs take three (a zeroed amax buffer, the amax pre-pass, the encode),
and their MXFP8 in one launch sized to the input, where the tile program spends a 128-row tile
on each few rows: up to 512 KiB of x (NVFP4), 256 KiB (row-scaled NVFP4), 128 KiB (MXFP8). Each
test runs on the CPU build of the kernels (tests/emulation, slow: a C++ build) and on the GPU,
where the profiler counts the kernels.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from emulation import extension as emulated_extension
from graphquant.kernels import native
from graphquant.quantizers import ROWWISE, MXFP8Quantizer, NVFP4Quantizer, QuantizeContext
from test_kernels_gpu import CTX, DTYPES, REFERENCE, VALUES, assert_same_rep, forbid_reference, make_input, supported

SMALL_ROWS = 128  # row-scaled NVFP4: kSmallRows (csrc/cuda/params.h)
QUANTIZERS = {
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_rowscaled": lambda: NVFP4Quantizer(row_scaled_nvfp4=True),
    "mxfp8_e4m3": lambda: MXFP8Quantizer(),
    "mxfp8_e5m2": lambda: MXFP8Quantizer(fp8_dtype="e5m2"),
}


@pytest.fixture(params=[pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)])
def backend(request, monkeypatch):
    """The device whose tensors the native kernels take: the CPU build's, or the GPU's."""
    if request.param == "cpu":
        ext = emulated_extension()
        if ext is None:
            pytest.skip("no C++ compiler to build the emulated kernels")
        monkeypatch.setattr(native, "extension", lambda: ext)
    else:
        assert native.extension() is not None, "graphquant._C was built without its CUDA kernels"
    forbid_reference(monkeypatch)
    return request.param


@contextlib.contextmanager
def tile_programs():
    """Within: the tile programs' launches instead of the small rowwise program's."""
    before = native.extension().set_small_rowwise(False)
    try:
        yield
    finally:
        native.extension().set_small_rowwise(before)


def launches(backend, call) -> list[str]:
    """The kernels ``call()`` launches: on the GPU every kernel the profiler sees (a fill
    included), after a first call; on the CPU the emulated launchers it calls."""
    if backend == "cpu":
        native.extension().take_launches()
        call()
        return native.extension().take_launches()
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        call()
        torch.cuda.synchronize()
    return [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def small_bytes(quantizer) -> int:
    """The bytes of x up to which the small program takes ``quantizer`` (params.h: small_rowwise_bytes)."""
    if isinstance(quantizer, MXFP8Quantizer):
        return 128 * 1024
    return (256 if quantizer.row_scaled_nvfp4 else 512) * 1024


def assert_small(backend, quantizer, made: list[str], small: bool, what: str):
    """``made`` is the small program's one launch where ``small``, else the tile programs': for
    NVFP4 the amax pre-pass and the encode (on the GPU also the fill that zeroes the amax), for
    MXFP8 the encode."""
    nvfp4 = isinstance(quantizer, NVFP4Quantizer)
    if backend == "cpu":
        assert made == (["small_rowwise"] if small else ["tile"] * (2 if nvfp4 else 1)), f"{what}: {made}"
    elif small:
        assert len(made) == 1 and "small_rowwise" in made[0], f"{what}: {made}"
    else:
        assert len(made) == (3 if nvfp4 else 1) and not any("small_rowwise" in name for name in made), f"{what}: {made}"


def check(backend, quantizer, x, small: bool, what: str):
    """The rowwise representation of x: the reference's bits, the small program's launch where
    ``small``, and the tile programs' bits from their own launches."""
    got = native.quantize(quantizer, x, ROWWISE, CTX)
    assert_same_rep(got, REFERENCE(quantizer, x, ROWWISE, CTX), f"{what} against the reference")
    assert_small(backend, quantizer, launches(backend, lambda: native.quantize(quantizer, x, ROWWISE, CTX)), small, what)
    with tile_programs():
        assert_same_rep(got, native.quantize(quantizer, x, ROWWISE, CTX), f"{what} against the tile programs")
        made = launches(backend, lambda: native.quantize(quantizer, x, ROWWISE, CTX))
        assert_small(backend, quantizer, made, False, f"{what}, turned off")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", QUANTIZERS)
def test_decode_activations_in_one_launch(backend, name, dtype):
    """1, 3 and 16 rows of 16 (NVFP4), 32, 4096 + 16 (NVFP4), 4096 + 32 and 14336 columns, with
    zeros, subnormals, huge values, infinities and NaNs among them (the larger ones past the
    format's bytes: the tile programs')."""
    quantizer = QUANTIZERS[name]()
    shapes = [(r, c) for r in (1, 3, 16) for c in (16, 32, 4096 + 16, 4096 + 32, 14336) if supported(quantizer, (r, c), ROWWISE)]
    for n, (rows, cols) in enumerate(shapes):
        x = make_input((rows, cols), dtype, VALUES[n % len(VALUES)], backend, seed=n)
        check(backend, quantizer, x, x.nbytes <= small_bytes(quantizer), f"{name} {rows}x{cols} {dtype}")


def test_what_the_small_program_takes(backend):
    """Up to the format's bytes whatever the element size, at most 128 rows when each row has its
    amax, and x 16-byte aligned; past those, the tile programs, with the same bits."""
    nvfp4, row_scaled, mxfp8 = NVFP4Quantizer(), NVFP4Quantizer(row_scaled_nvfp4=True), MXFP8Quantizer()
    for quantizer, shape, dtype, small in (
        (nvfp4, (16, 16384), torch.bfloat16, True),
        (nvfp4, (16, 16384 + 16), torch.bfloat16, False),
        (nvfp4, (16, 8192), torch.float32, True),
        (nvfp4, (4096, 16), torch.float16, True),
        (row_scaled, (8, 16384), torch.bfloat16, True),
        (row_scaled, (8, 16384 + 16), torch.bfloat16, False),
        (row_scaled, (SMALL_ROWS, 16), torch.bfloat16, True),
        (row_scaled, (SMALL_ROWS + 1, 16), torch.bfloat16, False),
        (mxfp8, (16, 4096), torch.bfloat16, True),
        (mxfp8, (16, 4096 + 32), torch.bfloat16, False),
        (mxfp8, (1024, 32), torch.float32, True),
        (mxfp8, (2048, 32), torch.float32, False),
    ):
        x = make_input(shape, dtype, "special_finite", backend)
        check(backend, quantizer, x, small, f"{quantizer} {shape} {dtype}")
    for quantizer in (nvfp4, mxfp8):
        unaligned = make_input((1, 4096 + 1), torch.bfloat16, "normal", backend)[:, 1:]  # 2 bytes past 16-byte alignment
        check(backend, quantizer, unaligned, False, f"{quantizer}, an unaligned x")


@pytest.mark.gpu
@pytest.mark.parametrize("name", QUANTIZERS)
def test_under_a_cuda_graph(name):
    """A decode step replays its quantizes from a CUDA graph: the launch (NVFP4's a cluster),
    captured, encodes whatever x holds at each replay."""
    quantizer = QUANTIZERS[name]()
    x = make_input((16, 4096), torch.bfloat16, "normal", "cuda")
    native.quantize(quantizer, x, ROWWISE, CTX)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        made = native.quantize(quantizer, x, ROWWISE, QuantizeContext())
    for seed in range(3):
        x.copy_(make_input(x.shape, x.dtype, "special_finite", "cuda", seed=seed))
        graph.replay()
        assert_same_rep(made, REFERENCE(quantizer, x, ROWWISE, CTX), f"replay {seed}")
