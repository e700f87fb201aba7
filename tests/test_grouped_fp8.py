"""graphquant's CUDA FP8 grouped GEMM (graphquant.kernels.grouped_fp8) on Hopper: which grouped
GEMMs the plan gives it; on the GPU, every product it takes within the float64 reference's bound
(test_triton_grouped_fp8.excess) and bit for bit the Triton kernel's: the same wgmmas, promotions
and factors in the same order."""

import pytest
import torch
from test_triton_grouped_fp8 import FORMATS, GPU_SHAPE, excess

from graphquant.formats import groups
from graphquant.kernels import backends, grouped_fp8
from graphquant.kernels import grouped as grouped_kernels
from graphquant.quantizers import COLUMNWISE, ROWWISE, Float8BlockQuantizer

CASES = [(name, gemm) for name in ("tensorwise", "rowwise", "blockwise") for gemm in ("fprop", "dgrad", "wgrad")]


class BesideTriton:
    """grouped_fp8's functions, each output checked bit for bit against the Triton kernel's on the
    same operands (test_triton_grouped_fp8.excess calls it as the Triton kernel's module)."""

    PROMOTE_EVERY = grouped_fp8.PROMOTE_EVERY

    def __init__(self):
        self.compared = 0

    def tokens_by_experts(self, *args):
        ours = grouped_fp8.tokens_by_experts(*args)
        assert torch.equal(ours, backends.triton_grouped_fp8.tokens_by_experts(*args)), "the Triton kernel's bits"
        self.compared += 1
        return ours

    def tokens_by_tokens(self, *args):
        ours = grouped_fp8.tokens_by_tokens(*args)
        theirs = backends.triton_grouped_fp8.tokens_by_tokens(*args)
        tile = backends.triton_grouped_fp8._tokens_by_tokens.best_config.kwargs["BLOCK_K"]
        assert tile == grouped_fp8.PROMOTE_EVERY, f"the Triton kernel took {tile}-long K tiles: hold it to 128 (k_tiles_of_128)"
        assert torch.equal(ours, theirs), "the Triton kernel's bits"
        self.compared += 1
        return ours


def selections(name: str, fast: bool, token_rows: int = groups.GROUP_ROWS) -> dict:
    """{GEMM: the plan's backend} of a grouped site of FORMATS[name] on sm90, every GEMM let
    accumulate fast (``fast``) or none, the extension pretended to run the CUDA kernel."""
    qx, qw, qg = FORMATS[name]
    pairs = {"fprop": (qx, ROWWISE, qw, ROWWISE), "dgrad": (qg, ROWWISE, qw, COLUMNWISE), "wgrad": (qg, COLUMNWISE, qx, COLUMNWISE)}
    chosen = {}
    for gemm, (qa, da, qb, db) in pairs.items():
        selection = backends.select_grouped(qa, da, qb, db, torch.device("cuda"), 4096, fast, False, token_rows)
        assert selection.bucket == backends.NATIVE, selection
        chosen[gemm] = selection.backend
    return chosen


@pytest.fixture
def hopper(monkeypatch):
    if not backends.TRITON_GROUPED_GEMMS:
        pytest.skip("needs Triton")
    monkeypatch.setattr(backends, "capability", lambda device: (9, 0))
    monkeypatch.setattr(grouped_fp8, "extension_runs", lambda device: True)


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "blockwise"])
def test_plan_gives_it_every_promoted_grouped_gemm_of_whole_tiles(hopper, name):
    assert selections(name, False) == dict.fromkeys(("fprop", "dgrad", "wgrad"), backends.GemmBackend(grouped_fp8.BACKEND))


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_plan_gives_it_the_sums_a_recipe_lets_accumulate_fast_too_promoted(hopper, name):
    """Its promoted products run faster than the Triton kernel's fast ones (benchmarks/NOTES.md,
    grouped_gemm.py), so the permission to accumulate fast buys nothing there."""
    assert selections(name, True) == dict.fromkeys(("fprop", "dgrad", "wgrad"), backends.GemmBackend(grouped_fp8.BACKEND))


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_plan_leaves_fast_sums_to_the_triton_kernel_where_the_extension_has_no_cuda_kernel(hopper, monkeypatch, name):
    monkeypatch.setattr(grouped_fp8, "extension_runs", lambda device: False)
    chosen = selections(name, True)
    assert chosen == dict.fromkeys(("fprop", "dgrad", "wgrad"), backends.GemmBackend(backends.triton_grouped_fp8.BACKEND, fast_accumulation=True))


@pytest.fixture
def one_by_128_weights(monkeypatch):
    """FORMATS' "1x128 weights": 1x128 blocks on every operand (TE's 1-D weight block scaling), so
    that fprop and dgrad scale B a column at a time as the wgrad does."""
    quantizer = Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False)
    monkeypatch.setitem(FORMATS, "1x128 weights", (quantizer,) * 3)
    return "1x128 weights"


def test_plan_gives_it_the_gemms_of_1x128_weights(hopper, one_by_128_weights):
    assert selections(one_by_128_weights, False) == dict.fromkeys(("fprop", "dgrad", "wgrad"), backends.GemmBackend(grouped_fp8.BACKEND))


def test_plan_leaves_few_tokens_an_expert_to_the_triton_kernel(hopper):
    chosen = selections("rowwise", False, groups.FEW_TOKEN_ROWS)
    assert chosen == dict.fromkeys(("fprop", "dgrad", "wgrad"), backends.GemmBackend(backends.triton_grouped_fp8.BACKEND))


@pytest.fixture
def k_tiles_of_128(monkeypatch):
    """The Triton kernel's tokens x tokens products on its 128-long K tiles alone: its autotuner may
    otherwise take 64-long ones, which promote every 64 products (other bits), so that every
    weight gradient is compared bit for bit, not only where the autotuner happened to take them."""
    kernels = backends.triton_grouped_fp8
    tiles = kernels._TOKENS_BY_TOKENS_TILES
    monkeypatch.setitem(tiles, "promoted", [t for t in tiles["promoted"] if t.kwargs["BLOCK_K"] == grouped_fp8.PROMOTE_EVERY])
    monkeypatch.setattr(kernels._tokens_by_tokens, "cache", {})


@pytest.fixture
def device():
    if not (torch.cuda.is_available() and grouped_fp8.extension_runs(torch.device("cuda"))):
        pytest.skip("needs graphquant's extension on an sm_90 GPU")
    if not backends.TRITON_GROUPED_GEMMS:
        pytest.skip("needs Triton, to compare with")
    return "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("name,gemm", CASES, ids=["-".join(case) for case in CASES])
@pytest.mark.parametrize("shape", [GPU_SHAPE, ((300, 0, 513, 64), 720, 199)], ids=["moe", "edges"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_grouped_fp8_gemm_within_bound_and_triton_bits(device, k_tiles_of_128, name, gemm, shape, out_dtype):
    """Ragged groups and an empty one; "edges": a K of a partial block and an expert of an odd
    number of output features, fewer than a tile (TMA zero-fills past its edges; its output rows
    are stored a value at a time)."""
    kernels = BesideTriton()
    assert excess(name, gemm, "promoted", *shape, out_dtype, device, kernels) <= 0
    assert kernels.compared == 1


@pytest.mark.gpu
@pytest.mark.parametrize("gemm", ["fprop", "dgrad"])
def test_grouped_fp8_gemm_of_1x128_weights_within_bound_and_triton_bits(device, one_by_128_weights, gemm):
    kernels = BesideTriton()
    assert excess(one_by_128_weights, gemm, "promoted", *GPU_SHAPE, torch.bfloat16, device, kernels) <= 0
    assert kernels.compared == 1


@pytest.mark.gpu
def test_a_call_of_fewer_rows_a_group_than_its_plan_was_made_for_fails_clearly(device):
    qx, qw, _ = FORMATS["rowwise"]
    tokens = groups.padding(torch.tensor([3, 5], dtype=torch.int32, device=device), 5, groups.FEW_TOKEN_ROWS, 32)
    x = qx.quantize_groups(tokens.pad(torch.randn(5, 64, device=device)), tokens.row_group, 2, ROWWISE, None)
    with pytest.raises(backends.GemmMismatch, match="multiples of 128 rows; this call's start at multiples of 16"):
        grouped_kernels.gemm(x, x, tokens.row_group, tokens, groups.FEW_TOKEN_ROWS, 64, torch.bfloat16,
                             backends.GemmBackend(grouped_fp8.BACKEND), "moe#0 fprop")
