"""graphquant.numerics: per-GEMM SQNR against the high-precision GEMM, and per-operand stats."""

import contextlib
import json
import math
import types
import warnings

import pytest
import torch
from torch import nn

import graphquant
from graphquant import factories, recipes, zoo
from graphquant.explainer import run_eagerly
from graphquant.ops import recording
from graphquant.numerics_report import _percent
from graphquant.quantizers import Float8CurrentScalingQuantizer

from explain_models import MLP, TinyAttention
from user_formats import Clipped


def sqnr_db(reference, quantized):
    return 10 * math.log10(reference.double().square().sum() / (quantized - reference).double().square().sum())


def by_key(report):
    return {(g.site, g.gemm): g for g in report.gemms}


def test_sqnr_is_that_of_the_quantized_gemm_against_the_high_precision_one():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(32, 64)
    report = by_key(graphquant.numerics(model, zoo.recipe("tensorwise"), x))

    e4m3 = Float8CurrentScalingQuantizer(fp8_dtype="e4m3")
    w1, w2 = model.fc1.weight.detach(), model.fc2.weight.detach()
    fprop = sqnr_db(x @ w1.T, e4m3(x).dequantize() @ e4m3(w1).dequantize().T)
    assert report["fc1#0", "fprop"].sqnr_db == pytest.approx(fprop, abs=1e-3)
    ones = torch.ones(32, 32)  # grad_output of fc2 under output.sum(): exact in E5M2
    dgrad = sqnr_db(ones @ w2, ones @ e4m3(w2).dequantize())
    assert report["fc2#0", "dgrad"].sqnr_db == pytest.approx(dgrad, abs=1e-3)


def test_an_operand_holding_a_nan_reports_a_nan_amax():
    """Python's max(0.0, nan) is 0.0: a NaN-poisoned operand was reported with amax 0, as an
    all-zero one would be."""
    x = torch.randn(32, 64)
    x[0, 0] = float("nan")
    report = by_key(graphquant.numerics(nn.Linear(64, 64), recipes.current_scaling(), x))
    fprop = report["#0", "fprop"]
    assert fprop.a.operand.startswith("input") and math.isnan(fprop.a.amax) and not math.isnan(fprop.b.amax), fprop


def test_every_gemm_that_ran_is_reported_worst_first():
    x = torch.randn(32, 64)
    report = graphquant.numerics(MLP(), zoo.recipe("tensorwise"), x)
    assert ("fc1#0", "dgrad") not in by_key(report)  # x needs no gradient, so no dgrad ran
    assert len(report.gemms) == 5
    assert [g.sqnr_db for g in report.gemms] == sorted(g.sqnr_db for g in report.gemms)
    assert all(20 < g.sqnr_db < 60 for g in report.gemms)

    report = graphquant.numerics(MLP(), zoo.recipe("tensorwise"), x.requires_grad_())
    assert len(report.gemms) == 6


def test_matmul_sites_and_repeated_calls_each_get_their_rows():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return self.fc(torch.relu(self.fc(x)))

    report = by_key(graphquant.numerics(Twice(), zoo.recipe("tensorwise"), torch.randn(32, 32)))
    assert {("fc#0", "fprop"), ("fc#1", "fprop"), ("fc#0", "wgrad"), ("fc#1", "wgrad")} <= set(report)

    report = by_key(graphquant.numerics(TinyAttention(), zoo.recipe("tensorwise"), torch.randn(2, 32, 32)))
    assert report["matmul.0#0", "fprop"].b.operand == "other.rowwise"
    assert report["matmul.1#0", "wgrad"].a.format == "fp8_current(fp8_dtype=e5m2)"


def test_underflow_saturation_and_amax_of_an_operand():
    x = torch.rand(32, 64) + 0.5  # nothing near E4M3's limits but what comes next
    x[0, :8] = 1e-5  # below half the smallest E4M3 subnormal at delayed scaling's first scale (1)
    x[1, :4] = 1000.0  # beyond E4M3's 448
    x[2] = 0.0  # zeros underflow from nothing: the fraction is of the nonzero values
    report = by_key(graphquant.numerics(MLP(), recipes.delayed_scaling(), x))
    stats = report["fc1#0", "fprop"].a
    assert (stats.operand, stats.format) == ("input.rowwise", "fp8_delayed(fp8_dtype=e4m3)")
    assert stats.amax == 1000.0
    assert stats.underflow == 8 / (x.numel() - x.shape[1])
    assert stats.saturated == 4 / x.numel()
    assert report["fc1#0", "wgrad"].b.saturated == 4 / x.numel()  # the columnwise copy clips too


def test_a_format_that_cannot_say_which_codes_saturate_shows_n_a_and_nearly_all_is_not_1e_plus_02():
    """A format of one's own with its codes in no FP8 dtype (x clipped at 1, in bf16), clipping most
    of x, was reported as saturating none; high precision saturates none. A share of 99.5% or more
    printed as 1e+02%."""
    factory = lambda role: Clipped() if role.tensor_type == "input" else graphquant.IdentityQuantizer()  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recipe leaves most GEMMs in high precision, and says so
        report = graphquant.numerics(MLP(), graphquant.CustomRecipe(factory), torch.randn(32, 64) * 4)
    fprop = by_key(report)["fc1#0", "fprop"]
    assert (fprop.a.saturated, fprop.b.saturated) == (None, 0)
    lines = str(report).splitlines()
    first = next(i for i, line in enumerate(lines) if line.split()[:2] == ["fc1#0", "fprop"])
    assert [line.split()[-1] for line in lines[first : first + 2]] == ["n/a", "0"]
    assert {g["a"]["saturated"] for g in json.loads(report.to_json())["gemms"] if g["gemm"] == "fprop"} == {None}
    assert [_percent(f) for f in (0.994, 0.996, 0.9996, 1.0, 0.0123)] == ["99%", "99.6%", "100%", "100%", "1.2%"]


def test_hadamard_operands_are_judged_against_the_transformed_values():
    # Each 16-token chunk of a column holds one 1.0: its Hadamard transform is 16 values of equal
    # magnitude, which NVFP4 holds exactly. Judged against x itself the 1.0 would look clipped.
    x = torch.zeros(32, 64)
    x[::16] = 1.0
    report = by_key(graphquant.numerics(MLP(), recipes.nvfp4_block_scaling(), x))
    stats = report["fc1#0", "wgrad"].b
    assert stats.format == "nvfp4(with_rht=True, with_post_rht_amax=True)"
    assert (stats.underflow, stats.saturated) == (0, 0)


def test_exact_formats_give_infinite_sqnr():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recipe quantizes nothing, and says so
        report = graphquant.numerics(MLP(), graphquant.CustomRecipe(factories.high_precision_factory), torch.randn(32, 64))
    assert all(g.sqnr_db == math.inf for g in report.gemms)
    assert {g["sqnr_db"] for g in json.loads(report.to_json())["gemms"]} == {"inf"}


def test_report_prints_two_lines_per_gemm_and_renders_json():
    report = graphquant.numerics(MLP(), zoo.recipe("mxfp8_fwd_nvfp4_bwd"), torch.randn(32, 64))
    lines = str(report).splitlines()
    assert lines[0].split() == ["site", "gemm", "SQNR", "dB", "operand", "format", "amax", "underflow", "saturated"]
    assert len(lines) == 2 + 2 * len(report.gemms)
    first = json.loads(report.to_json())["gemms"][0]
    assert set(first) == {"site", "module_type", "gemm", "sqnr_db", "a", "b"}
    assert set(first["a"]) == {"operand", "format", "amax", "underflow", "saturated"}


def test_loss_fn_gradients_and_the_recorder_are_left_as_they_were():
    class TwoOutputs(MLP):
        def forward(self, x):
            y = super().forward(x)
            return y, y * 2

    model = TwoOutputs()
    with pytest.raises(TypeError, match="loss_fn"):
        graphquant.numerics(model, zoo.recipe("tensorwise"), torch.randn(32, 64))
    report = graphquant.numerics(model, zoo.recipe("tensorwise"), torch.randn(32, 64), loss_fn=lambda out: out[1].sum())
    assert len(report.gemms) == 5
    assert all(p.grad is None for p in model.parameters())
    assert not recording.listening()


def test_an_output_that_carries_its_loss_is_named_in_the_loss_fn_advice():
    class WithLoss(MLP):  # a transformers model given labels returns its loss beside the logits
        def forward(self, x):
            y = super().forward(x)
            return types.SimpleNamespace(loss=y.pow(2).mean(), logits=y)

    with pytest.raises(TypeError, match=r"loss_fn=lambda output: output\.loss"):
        graphquant.numerics(WithLoss(), zoo.recipe("tensorwise"), torch.randn(32, 64))


def test_recording_observes_the_computation_without_changing_it():
    # bf16 linears with biases: the bias is added inside the GEMM before its one rounding, so a
    # bias added after the GEMM would round twice and change the bits.
    torch.manual_seed(0)
    model = MLP().to(torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    seen = {}

    def step(backend, record):
        torch._dynamo.reset()
        compiled = graphquant.compile(model, zoo.recipe("tensorwise"), backend=backend)
        listen = recording.recording(lambda gemm: seen.update({(gemm.site.label, gemm.gemm): gemm.out})) if record else contextlib.nullcontext()
        with listen:
            y = compiled(x)
            return y, torch.autograd.grad(y.float().square().sum(), [x, *model.parameters()])

    recorded, unobserved, trained = step(run_eagerly, True), step(run_eagerly, False), step("aot_eager", False)
    for y, grads in (unobserved, trained):
        assert torch.equal(recorded[0], y)
        assert all(torch.equal(a, b) for a, b in zip(recorded[1], grads))
    assert torch.equal(seen["fc2#0", "fprop"].reshape(trained[0].shape), trained[0])  # the report sees what trains


def test_grouped_gemms_are_measured_group_by_group_against_the_high_precision_product():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 64, 48, dtype=torch.bfloat16) / 8)

        def forward(self, x, offs):
            return torch._grouped_mm(x, self.w, offs=offs)

    torch.manual_seed(0)
    model, x = Experts(), torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([10, 10, 33, 40], dtype=torch.int32)  # an empty group, none of whole blocks
    report = by_key(graphquant.numerics(model, zoo.recipe("tensorwise"), x, offs))

    # Each expert's input rows and weights quantized alone (one scale a group), as TE's grouped linear does.
    # Both products are bf16, as the GEMMs' outputs are.
    e4m3, w = Float8CurrentScalingQuantizer(fp8_dtype="e4m3"), model.w.detach().float()
    starts, ends = [0, 10, 10, 33], offs.tolist()
    x_groups = [x.detach().float()[s:e] for s, e in zip(starts, ends)]
    exact = torch.cat([xg @ w[g] for g, xg in enumerate(x_groups)]).bfloat16()
    fprop = torch.cat([e4m3(xg).dequantize() @ e4m3(w[g].T).dequantize().T for g, xg in enumerate(x_groups) if xg.numel()])
    assert report["grouped_linear.0#0", "fprop"].sqnr_db == pytest.approx(sqnr_db(exact, fprop.bfloat16()), abs=1e-3)
    ones = torch.ones(40, 48)  # grad_output under output.sum(): exact in E5M2
    dgrad = torch.cat([ones[s:e] @ e4m3(w[g].T).dequantize() for g, (s, e) in enumerate(zip(starts, ends))]).bfloat16()
    reference = torch.cat([ones[s:e] @ w[g].T for g, (s, e) in enumerate(zip(starts, ends))]).bfloat16()
    assert report["grouped_linear.0#0", "dgrad"].sqnr_db == pytest.approx(sqnr_db(reference, dgrad), abs=1e-3)
    wgrad = report["grouped_linear.0#0", "wgrad"]
    assert 20 < wgrad.sqnr_db < 60 and wgrad.a.operand == "grad_output.columnwise" and wgrad.b.amax == x.abs().max().item()

def test_a_recorder_that_starts_listening_after_a_grouped_forward_sees_what_it_can():
    """The forward kept no high-precision input for a recorder that was not listening: its
    backward's wgrad is left out, not failed on; dgrad (of grad_output and the weights) reports."""
    w = torch.nn.Parameter(torch.randn(4, 64, 48, dtype=torch.bfloat16) / 8)
    compiled = graphquant.compile(lambda x, offs: torch._grouped_mm(x, w, offs=offs), zoo.recipe("tensorwise"), backend=run_eagerly)
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    y = compiled(x, torch.tensor([10, 10, 33, 40], dtype=torch.int32))
    seen = []
    with recording.recording(lambda gemm: seen.append(gemm.gemm)):
        y.float().sum().backward()
    assert sorted(seen) == ["dgrad"]
