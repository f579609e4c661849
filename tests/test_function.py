"""``fshard._function``: the Function calls fshard's collectives go through under torch.func."""

import torch
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from fshard._function import plain, under_plain_graph, untracked


def test_untracked_with_the_interpreter_stack_cleared():
    """Where the interpreter stack is cleared (an autograd Function's forward under
    ``torch.func.grad``, a collective launched on the plain data), a tensor the transform wrapped
    but does not differentiate is untracked (its plain value), one it differentiates is not.
    ``get_interpreter_stack()`` is ``None`` there, not empty: iterating it raised ``TypeError:
    'NoneType' object is not iterable`` (``fs.remat`` around a pipelined loss)."""
    seen = []

    def f(x, c):
        with temporarily_clear_interpreter_stack():
            plain = untracked(c)
            seen.append((plain is not None and not plain.requires_grad, untracked(x) is None))
        return (x * c).sum()

    grad = torch.func.grad(f)(torch.ones(2), torch.full((2,), 3.0))
    assert seen == [(True, True)]
    assert torch.equal(grad, torch.full((2,), 3.0))


def test_under_plain_graph_only_where_a_plain_graph_holds_a_transformed_input():
    """A plain autograd graph around a ``torch.func`` level: the level open and the tensor under
    its wrappers requiring grad (an ``nn.Parameter``, or a value of an outer autograd graph).
    Not at top level (no level), not for a plain input the transform differentiates."""
    seen = []
    x, param = torch.ones(2), torch.nn.Parameter(torch.ones(2))

    def f(t):
        seen.append((under_plain_graph(t), plain(t) is not t, plain(plain(t)) is plain(t)))
        return (t * t).sum()

    torch.func.grad(f)(x)
    torch.func.grad(f)(param)
    assert seen == [(False, True, True), (True, True, True)]
    assert plain(param) is param and not under_plain_graph(param)
