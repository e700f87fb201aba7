"""passes/writes.py: which node of a Dynamo graph may write a tensor read earlier."""

import pytest
import torch
import torch.nn.functional as F

from graphquant.passes.writes import write_between

@torch._dynamo.allow_in_graph
def opaque(t):
    """A call Dynamo does not trace into: what it writes is not known."""
    return t.mul_(2)


# Each writes h (or its index tok) after h[tok] is read, as Dynamo keeps it in the graph; "none" writes
# only other tensors, or reads h and tok without writing them.
WRITES = {
    "h.mul_": lambda h, tok, other: h.mul_(0.5),
    "h[i] = v": lambda h, tok, other: h.__setitem__(tok, 1.0),
    "h.index_put_": lambda h, tok, other: h.index_put_((tok,), torch.ones_like(h)),
    "torch.index_put_": lambda h, tok, other: torch.index_put_(h, (tok,), torch.ones_like(h)),
    "h.copy_": lambda h, tok, other: h.copy_(h * 2),
    "out=h": lambda h, tok, other: torch.mul(h, 2, out=h),
    "h += 1": lambda h, tok, other: h.__iadd__(1),
    "torch.relu_": lambda h, tok, other: torch.relu_(h),
    "F.relu(inplace=True)": lambda h, tok, other: F.relu(h, inplace=True),
    "F.relu(h, True)": lambda h, tok, other: F.relu(h, True),
    "F.dropout(inplace=True)": lambda h, tok, other: F.dropout(h, 0.0, True, inplace=True),
    "aten.add_": lambda h, tok, other: torch.ops.aten.add_.Tensor(h, 1),
    "h.T.add_": lambda h, tok, other: h.T.add_(1),
    "h[0].zero_": lambda h, tok, other: h[0].zero_(),
    "h.data.mul_": lambda h, tok, other: h.data.mul_(2),
    "tok.add_": lambda h, tok, other: tok.add_(0),
    "an opaque call given h": lambda h, tok, other: opaque(h),
    "F.embedding(max_norm=...) of h": lambda h, tok, other: F.embedding(tok, h, max_norm=0.1),
    "F.batch_norm(training=True) of h's rows": lambda h, tok, other: F.batch_norm(other, h[0], h[1], training=True),
    "none": lambda h, tok, other: (other.mul_(2), other.index_put_((tok,), h * 2), torch.add(h, 1, out=other), h.add(1)),
}


@pytest.mark.parametrize("write", sorted(WRITES))
def test_each_spelling_of_a_write_to_a_tensor_or_its_storage_is_found(write):
    found = []

    def backend(gm, example_inputs):
        [read] = [n for n in gm.graph.nodes if n.name == "read"]
        [use] = [n for n in gm.graph.nodes if n.name == "use"]
        found.append(write_between(read, use, read.args))
        return gm

    def f(h, tok, other):
        tok = tok.clone()
        read = h[tok]
        WRITES[write](h, tok, other)
        use = read * 1
        return use

    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(torch.randn(8, 8), torch.randperm(8), torch.randn(8, 8))
    assert (found[0] is None) == (write == "none"), found
