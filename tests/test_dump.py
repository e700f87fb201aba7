"""Graph dumps, and golden tests that pin the rewritten graph and the plan table of two small
models: any change to either is a reviewed diff (EXPECTTEST_ACCEPT=1 rewrites the goldens)."""

import dataclasses
import json
import os
import re
import tempfile
from unittest import mock

import expecttest
import torch

import graphquant
from graphquant import zoo
from graphquant import Plan
from graphquant.kernels import backends, emulation, scaled_mm
from graphquant.kernels.backends import GemmBackend
from graphquant.ops.site import Site

from explain_models import MLP, TinyAttention

FILES = ("captured.py", "plan.json", "plan.txt", "rewritten.py")


def dump(model, recipe, *inputs, **kwargs):
    """{file name: text} of the dumps that one compile and one forward write."""
    with tempfile.TemporaryDirectory() as tmp:
        graphquant.compile(model, recipe, backend="eager", dump_dir=tmp, **kwargs)(*inputs)
        return {name: open(os.path.join(tmp, name)).read() for name in sorted(os.listdir(tmp))}


def body(code):
    """The graph code after the dump's header line."""
    return code.split("\n", 1)[1]


class TestGoldens(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()  # static, fresh graphs: the goldens must not depend on test order

    def test_mlp(self):
        files = dump(MLP(), zoo.recipe("mxfp8_fwd_nvfp4_bwd"), torch.randn(32, 64), dynamic=False)
        self.assertExpectedInline(body(files["graph_000_rewritten.py"]), """\
def forward(self, L_self_modules_fc1_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_fc1_parameters_bias_ : torch.nn.parameter.Parameter, L_x_ : torch.Tensor, L_self_modules_fc2_parameters_weight_ : torch.nn.parameter.Parameter, L_self_modules_fc2_parameters_bias_ : torch.nn.parameter.Parameter, graphquant_state_0):
    l_self_modules_fc1_parameters_weight_ = L_self_modules_fc1_parameters_weight_
    l_self_modules_fc1_parameters_bias_ = L_self_modules_fc1_parameters_bias_
    l_x_ = L_x_
    l_self_modules_fc2_parameters_weight_ = L_self_modules_fc2_parameters_weight_
    l_self_modules_fc2_parameters_bias_ = L_self_modules_fc2_parameters_bias_
    quantized_linear = graphquant_ops_functional_quantized_linear(l_x_, l_self_modules_fc1_parameters_weight_, l_self_modules_fc1_parameters_bias_, site = Site(name='fc1', call=0, input='hybrid(rowwise_quantizer=mxfp8(fp8_dtype=e4m3), columnwise_quantizer=nvfp4(with_rht=True, with_post_rht_amax=True), columnwise_source=original)', weight='hybrid(rowwise_quantizer=mxfp8(fp8_dtype=e4m3), columnwise_quantizer=nvfp4(), columnwise_source=rowwise_dequantized)', grad_output='nvfp4(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True)', streams=(0, 1, 2), fprop=GemmBackend('dequantize + high-precision matmul'), wgrad=GemmBackend('dequantize + high-precision matmul')), states = (None, None, None), rng = graphquant_state_0);  l_x_ = l_self_modules_fc1_parameters_weight_ = l_self_modules_fc1_parameters_bias_ = None
    relu = torch.nn.functional.relu(quantized_linear);  quantized_linear = None
    quantized_linear_1 = graphquant_ops_functional_quantized_linear(relu, l_self_modules_fc2_parameters_weight_, l_self_modules_fc2_parameters_bias_, site = Site(name='fc2', call=0, input='hybrid(rowwise_quantizer=mxfp8(fp8_dtype=e4m3), columnwise_quantizer=nvfp4(with_rht=True, with_post_rht_amax=True), columnwise_source=original)', weight='hybrid(rowwise_quantizer=mxfp8(fp8_dtype=e4m3), columnwise_quantizer=nvfp4(), columnwise_source=rowwise_dequantized)', grad_output='nvfp4(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True)', streams=(3, 4, 5), fprop=GemmBackend('dequantize + high-precision matmul'), dgrad=GemmBackend('dequantize + high-precision matmul'), wgrad=GemmBackend('dequantize + high-precision matmul')), states = (None, None, None), rng = graphquant_state_0);  relu = l_self_modules_fc2_parameters_weight_ = l_self_modules_fc2_parameters_bias_ = graphquant_state_0 = None
    return (quantized_linear_1,)
""")
        self.assertExpectedInline(files["graph_000_plan.txt"], """\
graphquant plan on cpu: 2 GEMM sites, 5 GEMMs (5 emulated)

site    module_type    gemm    operand a                                                                                        operand b                                                        backend                             bucket    why
------  -------------  ------  -----------------------------------------------------------------------------------------------  ---------------------------------------------------------------  ----------------------------------  --------  ----------------------------
fc1#0   linear         fprop   input.rowwise: mxfp8(fp8_dtype=e4m3)                                                             weight.rowwise: mxfp8(fp8_dtype=e4m3)                            dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
fc1#0   linear         wgrad   grad_output.columnwise: nvfp4(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True)  input.columnwise: nvfp4(with_rht=True, with_post_rht_amax=True)  dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
fc2#0   linear         fprop   input.rowwise: mxfp8(fp8_dtype=e4m3)                                                             weight.rowwise: mxfp8(fp8_dtype=e4m3)                            dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
fc2#0   linear         dgrad   grad_output.rowwise: nvfp4(stochastic_rounding=True)                                             weight.columnwise: nvfp4() of rowwise_dequantized                dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
fc2#0   linear         wgrad   grad_output.columnwise: nvfp4(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True)  input.columnwise: nvfp4(with_rht=True, with_post_rht_amax=True)  dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
""")

    def test_tiny_attention(self):
        files = dump(TinyAttention(), zoo.recipe("tensorwise"), torch.randn(2, 32, 32), dynamic=False)
        self.assertExpectedInline(body(files["graph_000_rewritten.py"]), """\
def forward(self, L_self_modules_qkv_parameters_weight_ : torch.nn.parameter.Parameter, L_x_ : torch.Tensor):
    l_self_modules_qkv_parameters_weight_ = L_self_modules_qkv_parameters_weight_
    l_x_ = L_x_
    quantized_linear = graphquant_ops_functional_quantized_linear(l_x_, l_self_modules_qkv_parameters_weight_, None, site = Site(name='qkv', call=0, input='fp8_current(fp8_dtype=e4m3)', weight='fp8_current(fp8_dtype=e4m3)', grad_output='fp8_current(fp8_dtype=e5m2)', streams=(0, 1, 2), fprop=GemmBackend('dequantize + high-precision matmul'), wgrad=GemmBackend('dequantize + high-precision matmul')), states = (None, None, None), rng = None);  l_x_ = l_self_modules_qkv_parameters_weight_ = None
    chunk = quantized_linear.chunk(3, dim = -1);  quantized_linear = None
    q = chunk[0]
    k = chunk[1]
    v = chunk[2];  chunk = None
    transpose = k.transpose(-2, -1);  k = None
    quantized_matmul = graphquant_ops_functional_quantized_matmul(q, transpose, site = Site(name='matmul.0', call=0, input='fp8_current(fp8_dtype=e4m3)', other='fp8_current(fp8_dtype=e4m3)', grad_output='fp8_current(fp8_dtype=e5m2)', streams=(3, 4, 5), fprop=GemmBackend('dequantize + high-precision matmul'), dgrad=GemmBackend('dequantize + high-precision matmul'), wgrad=GemmBackend('dequantize + high-precision matmul')), states = (None, None, None), rng = None);  q = transpose = None
    mul = quantized_matmul * 0.1767766952966369;  quantized_matmul = None
    weights = torch.softmax(mul, dim = -1);  mul = None
    quantized_matmul_1 = graphquant_ops_functional_quantized_matmul(weights, v, site = Site(name='matmul.1', call=0, input='fp8_current(fp8_dtype=e4m3)', other='fp8_current(fp8_dtype=e4m3)', grad_output='fp8_current(fp8_dtype=e5m2)', streams=(6, 7, 8), fprop=GemmBackend('dequantize + high-precision matmul'), dgrad=GemmBackend('dequantize + high-precision matmul'), wgrad=GemmBackend('dequantize + high-precision matmul')), states = (None, None, None), rng = None);  weights = v = None
    return (quantized_matmul_1,)
""")
        self.assertExpectedInline(files["graph_000_plan.txt"], """\
graphquant plan on cpu: 3 GEMM sites, 8 GEMMs (8 emulated)

site        module_type    gemm    operand a                                            operand b                                      backend                             bucket    why
----------  -------------  ------  ---------------------------------------------------  ---------------------------------------------  ----------------------------------  --------  ----------------------------
qkv#0       linear         fprop   input.rowwise: fp8_current(fp8_dtype=e4m3)           weight.rowwise: fp8_current(fp8_dtype=e4m3)    dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
qkv#0       linear         wgrad   grad_output.columnwise: fp8_current(fp8_dtype=e5m2)  input.columnwise: fp8_current(fp8_dtype=e4m3)  dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
matmul.0#0  matmul         fprop   input.rowwise: fp8_current(fp8_dtype=e4m3)           other.rowwise: fp8_current(fp8_dtype=e4m3)     dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
matmul.0#0  matmul         dgrad   grad_output.rowwise: fp8_current(fp8_dtype=e5m2)     other.columnwise: fp8_current(fp8_dtype=e4m3)  dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
matmul.0#0  matmul         wgrad   grad_output.columnwise: fp8_current(fp8_dtype=e5m2)  input.columnwise: fp8_current(fp8_dtype=e4m3)  dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
matmul.1#0  matmul         fprop   input.rowwise: fp8_current(fp8_dtype=e4m3)           other.rowwise: fp8_current(fp8_dtype=e4m3)     dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
matmul.1#0  matmul         dgrad   grad_output.rowwise: fp8_current(fp8_dtype=e5m2)     other.columnwise: fp8_current(fp8_dtype=e4m3)  dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
matmul.1#0  matmul         wgrad   grad_output.columnwise: fp8_current(fp8_dtype=e5m2)  input.columnwise: fp8_current(fp8_dtype=e4m3)  dequantize + high-precision matmul  emulated  no low-precision GEMM on cpu
""")


class TestDumps(expecttest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def test_captured_graph_is_the_graph_before_rewrite(self):
        files = dump(MLP(), zoo.recipe("tensorwise"), torch.randn(32, 64), dynamic=False)
        captured, rewritten = files["graph_000_captured.py"], files["graph_000_rewritten.py"]
        self.assertEqual(captured.count("torch._C._nn.linear("), 2)
        self.assertNotIn("graphquant_ops", captured)
        self.assertEqual(rewritten.count("graphquant_ops_functional_quantized_linear("), 2)
        self.assertNotIn("torch._C._nn.linear(", rewritten)
        self.assertIn("input='fp8_current(fp8_dtype=e4m3)'", rewritten)

    def test_each_gemm_gets_one_site_that_its_printed_call_rebuilds(self):
        files = dump(TinyAttention(), zoo.recipe("tensorwise"), torch.randn(2, 32, 32), dynamic=False)
        printed = re.findall(r"site = (Site\(.*?\)), states", files["graph_000_rewritten.py"])
        sites = [eval(text, {"Site": Site, "GemmBackend": GemmBackend}) for text in printed]
        self.assertEqual([repr(site) for site in sites], printed)
        self.assertEqual([(s.label, s.weight is not None) for s in sites], [("qkv#0", True), ("matmul.0#0", False), ("matmul.1#0", False)])
        self.assertEqual(len(set(sites)), 3)  # frozen and hashable
        with self.assertRaisesRegex(ValueError, "fc#0: give the second operand's format as weight="):
            Site(
                name="fc",
                call=0,
                input="fp8_current(fp8_dtype=e4m3)",
                grad_output="fp8_current(fp8_dtype=e5m2)",
                streams=(0, 1, 2),
                fprop=GemmBackend(backends.EMULATION),
            )

    def test_a_recipes_fast_accumulation_is_in_every_call_and_the_plan(self):
        """On a Hopper (capability faked; the emulated GEMM stands in for cuBLASLt on this CPU), each
        call's backend sums in the accumulator where the recipe says so, and the plan says the same."""
        fast = GemmBackend(scaled_mm.TENSORWISE, fast_accumulation=True)

        def stand_in(backend, a, b, out_dtype, bias=None):
            return emulation.gemm(a, b, 1, out_dtype, bias)[0]

        backends.clear_caches()
        try:
            with mock.patch.object(backends, "capability", lambda device: (9, 0)), mock.patch.object(scaled_mm, "run", stand_in):
                everywhere = dataclasses.replace(zoo.recipe("tensorwise"), fast_accumulation=("fprop", "dgrad", "wgrad"))
                files = dump(MLP(), everywhere, torch.randn(32, 64, requires_grad=True), dynamic=False)
                torch._dynamo.reset()
                default = dump(MLP(), zoo.recipe("tensorwise"), torch.randn(32, 64, requires_grad=True), dynamic=False)  # fprop only
        finally:
            backends.clear_caches()
        self.assertEqual(files["graph_000_rewritten.py"].count(repr(fast)), 6)
        plan = Plan.from_json(files["graph_000_plan.json"])
        self.assertEqual(plan.fast_accumulation, ("fprop", "dgrad", "wgrad"))
        self.assertEqual({g.backend for g in plan.gemms}, {fast})
        self.assertEqual(default["graph_000_rewritten.py"].count(f"fprop={fast!r}, dgrad=GemmBackend('cublaslt fp8 tensorwise'), "), 2)
        plan = Plan.from_json(default["graph_000_plan.json"])
        self.assertEqual(plan.fast_accumulation, ("fprop",))
        self.assertEqual([g.backend.fast_accumulation for g in plan.gemms], [True, False, False] * 2)

    def test_environment_variable_and_recompiles_get_their_own_files(self):
        with tempfile.TemporaryDirectory() as tmp, mock.patch.dict(os.environ, {"GRAPHQUANT_DUMP": tmp}):
            compiled = graphquant.compile(MLP(), zoo.recipe("tensorwise"), backend="eager")
            compiled(torch.randn(32, 64))
            compiled(torch.randn(16, 64))  # a new shape: a recompile, a second graph
            names = sorted(os.listdir(tmp))
            self.assertEqual(names, [f"graph_{i:03d}_{f}" for i in range(2) for f in FILES])
            plan = Plan.from_json(open(os.path.join(tmp, "graph_001_plan.json")).read())
            self.assertEqual(plan, compiled.graphquant.plans[1])
            self.assertEqual(open(os.path.join(tmp, "graph_001_plan.txt")).read(), f"{plan}\n")

    def test_a_second_model_in_the_same_directory_does_not_overwrite(self):
        with tempfile.TemporaryDirectory() as tmp:
            for model in (MLP(), TinyAttention()):
                graphquant.compile(model, zoo.recipe("tensorwise"), backend="eager", dump_dir=tmp)(
                    torch.randn(2, 32, 64 if isinstance(model, MLP) else 32)
                )
            plans = [json.load(open(os.path.join(tmp, f"graph_{i:03d}_plan.json"))) for i in range(2)]
            self.assertEqual([p["gemms"][0]["site"] for p in plans], ["fc1#0", "qkv#0"])

    def test_a_refused_plan_dumps_its_captured_graph_and_the_refusal(self):
        with tempfile.TemporaryDirectory() as tmp:
            compiled = graphquant.compile(MLP(), graphquant.recipes.mxfp8_block_scaling(), backend="eager", dump_dir=tmp, dynamic=False)
            with self.assertRaisesRegex(graphquant.PlanError, "dim 0 of the 30x64 tensor must be a multiple of 32") as refused:
                compiled(torch.randn(30, 64, requires_grad=True))  # MXFP8's columnwise blocks need whole 32s of tokens
            self.assertEqual(sorted(os.listdir(tmp)), ["graph_000_captured.py", "graph_000_refused.txt"])
            self.assertEqual(open(os.path.join(tmp, "graph_000_refused.txt")).read(), f"PlanError: {refused.exception}\n")
            self.assertEqual(open(os.path.join(tmp, "graph_000_captured.py")).read().count("torch._C._nn.linear("), 2)

    def test_dumps_are_deterministic_and_free_of_addresses(self):
        first = dump(MLP(), zoo.recipe("mxfp8_fwd_nvfp4_bwd"), torch.randn(32, 64), dynamic=False)
        torch._dynamo.reset()
        second = dump(MLP(), zoo.recipe("mxfp8_fwd_nvfp4_bwd"), torch.randn(32, 64), dynamic=False)
        self.assertEqual(first, second)
        for text in first.values():
            self.assertIsNone(re.search(r"0x[0-9a-f]{6,}", text))
