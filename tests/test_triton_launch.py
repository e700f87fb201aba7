"""graphquant.kernels.triton_launch: a kernel launched again by its remembered launcher writes what
Triton's own launch writes, to the call's tensors and TMA descriptors (not the first call's), with
its own compile for a tensor of another alignment, and an autotuner's chosen config and grid. GPU
only: Triton's interpreter (the CPU) takes Triton's own path."""

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.gpu

import triton.language as tl  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402

from graphquant.kernels import triton_launch  # noqa: E402


@triton.jit
def _scaled_copy(src, dst, n, factor, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(src + at, mask=at < n) * factor
    if NEGATE:
        value = -value
    tl.store(dst + at, value, mask=at < n)


@gluon.jit
def _filled_block(dst, value):
    """Block (0, 0, 0) of ``dst`` (a TMA descriptor of fp32, 4 warps) filled with ``value``."""
    block = gl.allocate_shared_memory(gl.float32, dst.block_type.shape, dst.layout)
    layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 4, 8], [1, 4, 1], [2, 1, 0])
    block.store(gl.full(dst.block_type.shape, value, gl.float32, layout))
    fence_async_shared()
    tma.async_copy_shared_to_global(dst, [0, 0, 0], block)
    tma.store_wait(0)


_autotuned_copy = triton.autotune(
    configs=[triton.Config({"BLOCK": 64}, num_warps=2), triton.Config({"BLOCK": 256}, num_warps=4)], key=["n"]
)(_scaled_copy)


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def test_every_call_writes_its_own_tensors():
    for call in range(4):
        src = torch.randn(1000, device="cuda")
        dst = torch.empty_like(src)
        triton_launch.launch(_scaled_copy, (triton.cdiv(1000, 128),), src, dst, 1000, 2.0, BLOCK=128, NEGATE=call % 2 == 1)
        torch.testing.assert_close(dst, src * (-2.0 if call % 2 else 2.0), rtol=0, atol=0)


def test_every_call_writes_through_its_own_descriptor():
    for call in range(3):
        dst = torch.zeros(2, 64, 32, device="cuda")  # (rows 64 to 127 of the first block fall outside: the second block's untouched)
        layout = gl.NVMMASharedLayout.get_default_for([1, 128, 32], gl.float32)
        triton_launch.launch(_filled_block, (1,), TensorDescriptor.from_tensor(dst, [1, 128, 32], layout), float(call + 1))
        expected = torch.zeros_like(dst)
        expected[0] = call + 1
        torch.testing.assert_close(dst, expected, rtol=0, atol=0)


def test_a_misaligned_tensor_gets_its_own_compile():
    base = torch.randn(1001, device="cuda")
    for offset in (0, 1, 0, 1):  # 4-byte offsets: the second and fourth calls are not 16-byte aligned
        src, dst = base[offset:offset + 1000], torch.empty(1001, device="cuda")[offset:offset + 1000]
        triton_launch.launch(_scaled_copy, (triton.cdiv(1000, 128),), src, dst, 1000, 1.0, BLOCK=128)
        torch.testing.assert_close(dst, src, rtol=0, atol=0)


def test_an_autotuner_launches_its_chosen_config_with_its_grid():
    for _ in range(3):
        src = torch.randn(3000, device="cuda")
        dst = torch.zeros_like(src)
        triton_launch.launch(_autotuned_copy, lambda meta: (triton.cdiv(3000, meta["BLOCK"]),), src, dst, 3000, 3.0)
        torch.testing.assert_close(dst, src * 3.0, rtol=0, atol=0)


def test_a_captured_launch_replays_on_the_captured_tensors():
    src, dst = torch.randn(500, device="cuda"), torch.zeros(500, device="cuda")
    triton_launch.launch(_scaled_copy, (4,), src, dst, 500, 5.0, BLOCK=128)  # remembered before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_launch.launch(_scaled_copy, (4,), src, dst, 500, 5.0, BLOCK=128)
    src.copy_(torch.randn(500, device="cuda"))
    graph.replay()
    torch.testing.assert_close(dst, src * 5.0, rtol=0, atol=0)


def test_only_the_first_call_of_a_signature_goes_through_triton(monkeypatch):
    runs = []
    run = _scaled_copy.run
    monkeypatch.setattr(_scaled_copy, "run", lambda *args, **kwargs: runs.append(1) or run(*args, **kwargs))
    for _ in range(3):
        src = torch.randn(700, device="cuda")
        dst = torch.empty_like(src)
        triton_launch.launch(_scaled_copy, (triton.cdiv(700, 32),), src, dst, 700, 7.0, BLOCK=32)
        torch.testing.assert_close(dst, src * 7.0, rtol=0, atol=0)
    assert len(runs) == 1
