"""Backward keeps the quantized columnwise representations, not high-precision copies.

Both runs use an aot_autograd inner backend with the min-cut partitioner (aot_eager's) that
records, at run time, the tensors the backward graph receives from the forward: everything but
the tangents. A saved tensor that shares storage with a parameter or a user input costs nothing
(it is alive anyway); the others are the activations backward keeps.
"""

import copy
import re

import models
import pytest
import torch
from reference import GemmTape, Reference, fresh_dynamo  # noqa: F401  (autouse fixture)

import graphquant
from graphquant import recipes


def saved_activations(saved, alive):
    """The saved tensors that do not share storage with ``alive`` (parameters, inputs)."""
    alive_storage = {t.untyped_storage().data_ptr() for t in alive}
    return [t for t in saved if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in alive_storage]


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def same_values(a, b):
    """The same multiset of values (layouts differ: transposes, views, batch-flattened)."""
    return a.numel() == b.numel() and a.dtype == b.dtype and torch.equal(a.flatten().sort().values, b.flatten().sort().values)


def high_precision(tensors):
    return [t for t in tensors if t.is_floating_point() and t.dtype.itemsize >= 2]


def train_step(compiled, model, x):
    xg = x.clone().requires_grad_()
    y = compiled(xg)
    y.backward(torch.ones_like(y))
    return [*model.parameters(), xg]


def linear_inputs(model, x):
    """The input of every nn.Linear of an eager run, by module name."""
    inputs = {}
    hooks = [
        module.register_forward_pre_hook(lambda mod, args, name=name: inputs.__setitem__(name, args[0].detach()))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    model(x)
    for hook in hooks:
        hook.remove()
    return inputs


# model, the GEMM sites whose activation operand a non-GEMM backward needs in high precision
# anyway, and whether backward must keep FP8 data (where no cheap recomputation exists).
CASES = {
    # fc1's input is RMSNorm's output (RMSNorm's backward needs its input and rsqrt); fc2's input
    # is GELU's output (GELU's backward needs fc1's output). MXFP8's two directions come from one
    # kernel call, which the partitioner does not recompute: backward keeps their FP8 copies.
    "norm_mlp": (models.NormMLP, set(), True),
    # softmax's backward needs its output, the probabilities x values matmul's input. q, k, v
    # (GEMM outputs feeding the attention matmuls) are kept as FP8.
    "decoder": (models.DecoderBlock, {"attn.matmul.1#0"}, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_keeps_quantized_representations(name):
    make_model, needed_anyway, keeps_fp8 = CASES[name]
    model = models.seeded(make_model())
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))

    plain_tape = GemmTape()  # records saved tensors of a graph without graphquant ops, too
    plain_model = copy.deepcopy(model)
    plain_alive = train_step(torch.compile(plain_model, backend=plain_tape.backend), plain_model, x)
    plain_act = saved_activations(plain_tape.saved, plain_alive)
    torch._dynamo.reset()

    tape = GemmTape()
    gq_model = copy.deepcopy(model)
    gq_alive = train_step(graphquant.compile(gq_model, recipes.mxfp8_block_scaling(), backend=tape.backend, fullgraph=True), gq_model, x)
    gq_act = saved_activations(tape.saved, gq_alive)
    layout = [(tuple(t.shape), t.dtype) for t in gq_act]

    # backward keeps less than the high-precision run ...
    assert nbytes(gq_act) < nbytes(plain_act), (nbytes(gq_act), nbytes(plain_act), layout)
    # ... the quantized representations where it keeps a GEMM operand ...
    assert any(t.dtype == torch.float8_e4m3fn for t in gq_act) == keeps_fp8, layout

    # ... and no high-precision copy of a GEMM's activation operand, unless a non-GEMM op's
    # backward needs that value too. The teacher-forced reference reproduces the compiled
    # forward bit for bit, so its GEMM operands are the compiled model's.
    reference = Reference(copy.deepcopy(model), recipes.mxfp8_block_scaling(), tape=tape)
    reference(x)
    params = list(model.parameters())
    kept = set()
    for label, x2d, w2d in reference.operands:
        for operand in (x2d, w2d):
            if any(operand.shape == p.shape and torch.equal(operand, p) for p in params):
                continue  # a weight: alive anyway
            if any(same_values(t, operand) for t in high_precision(gq_act)):
                kept.add(label)
    assert kept == needed_anyway, layout

    # the same check finds linears' inputs among what the high-precision run keeps (it can fail)
    inputs = linear_inputs(copy.deepcopy(model), x)
    plain_kept = {n for n, value in inputs.items() if any(same_values(t, value) for t in high_precision(plain_act))}
    assert plain_kept, [(tuple(t.shape), t.dtype) for t in plain_act]


def test_slots_that_quantize_one_input_alike_keep_one_copy():
    """q, k and v read one input, as gate and up do: MXFP8 quantizes each in one kernel call, and
    backward keeps the columnwise copies. The calls of one input are equal (no random stream
    where no quantizer draws random numbers), so the graph keeps one of them and its copy."""
    model = models.seeded(models.DecoderBlock(attention="sdpa"))
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))
    tape = GemmTape()
    alive = train_step(graphquant.compile(model, recipes.mxfp8_block_scaling(), backend=tape.backend, fullgraph=True), model, x)
    fp8 = [t for t in saved_activations(tape.saved, alive) if t.dtype == torch.float8_e4m3fn]
    copies = [(tuple(a.shape), i, j) for i, a in enumerate(fp8) for j, b in enumerate(fp8[:i]) if a.shape == b.shape and torch.equal(a, b)]
    assert fp8 and not copies, copies


@pytest.mark.slow
def test_traced_mxfp8_quantize_keeps_no_float32_copy_of_its_input():
    """A traced MXFP8 quantize reads its bf16 input twice (block amax, then the cast after the
    scale op). Inductor must not store an fp32 copy of that input (or of the scaled values) in
    between: on the H200 such buffers cost a decoder layer 1.3 GiB of peak memory. They came from
    the amax being taken after the fp32 upcast, and from an integer chain in the cast that pushed
    a long producer (a SwiGLU backward) past Inductor's inlining limit. The generated code
    (forward and backward, with the GPU's realize thresholds) allocates no fp32 buffer in the
    blocked shape of a quantized tensor. (FP8 1x128 blocks share the amax fix, but torch 2.13's
    CPU code generator fails on their SwiGLU backward, so only the GPU runs them.)"""
    from torch._inductor.utils import run_and_get_code

    model = models.seeded(models.SwiGLU(dim=256, hidden=512)).to(torch.bfloat16)
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).requires_grad_()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), fullgraph=True)
    with torch._inductor.config.patch(realize_opcount_threshold=30, realize_acc_reads_threshold=8):
        _, code = run_and_get_code(lambda: compiled(x).sum().backward())
    blocked_fp32 = re.compile(r"empty_strided_\w+\(\((\d+), (\d+), (\d+)\), [^)]*\), torch\.float32\)")
    copies = [m.group(0) for source in code for m in blocked_fp32.finditer(source) if "32" in m.groups()[1:]]
    assert len(code) == 2 and not copies, copies


@pytest.mark.slow
def test_gradient_transposes_come_from_their_rowwise_copies():
    """Per-tensor FP8 gradients: the columnwise (transposed) copy is made from the rowwise copy by
    graphquant::transposed. Traced together, Inductor wrote both copies in one kernel that read
    the gradient's inputs (a SwiGLU backward's gate, up and dh), so all four copies of dgate and
    dup were alive with those inputs: a decoder layer's peak on the H200. Now the kernel that
    reads them writes the rowwise copies only, and each transpose reads the buffer its dgrad GEMM
    reads."""
    from torch._inductor.utils import run_and_get_code

    from graphquant import zoo

    model = models.seeded(models.SwiGLU(dim=256, hidden=512)).to(torch.bfloat16)
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)).requires_grad_()
    compiled = graphquant.compile(model, zoo.recipe("tensorwise"), fullgraph=True)
    _, (forward, backward) = run_and_get_code(lambda: compiled(x).sum().backward())
    dgrad_reads = re.findall(r"graphquant\.gemm\.default\(\[(\w+), \w+, \w+\], 'fp8_current\(fp8_dtype=e5m2\)', 'rowwise'", backward)
    transposed = re.findall(r"graphquant\.transposed\.default\((\w+)\)", backward)
    assert len(dgrad_reads) == 3 and sorted(dgrad_reads) == sorted(transposed), (dgrad_reads, transposed)


def test_per_tensor_weights_columnwise_copies_are_recomputed_from_the_parameters():
    """A per-tensor weight's amax and rowwise copy come from one graphquant::quantize call, and its
    columnwise copy is traced from that amax: backward recomputes that copy from the parameter,
    which lives anyway, and keeps no FP8 copy of any weight (a decoder layer's memory peak on the
    H200 would rise above bf16's with them)."""
    from graphquant import zoo

    model = models.seeded(models.SwiGLU(dim=256, hidden=512))
    x = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(0))
    tape = GemmTape()
    alive = train_step(graphquant.compile(model, zoo.recipe("tensorwise"), backend=tape.backend, fullgraph=True), model, x)
    weight_shapes = {shape for p in model.parameters() if p.dim() == 2 for shape in (tuple(p.shape), tuple(p.shape[::-1]))}
    kept = [(tuple(t.shape), t.dtype) for t in saved_activations(tape.saved, alive) if t.dtype.itemsize == 1]
    assert kept and not [k for k in kept if k[0] in weight_shapes], kept
