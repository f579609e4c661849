"""Op-rule arguments bound by name (fshard.ops.binding): pure binding checks, and calls that
pass the same arguments positionally, by keyword and out of order, against dense torch."""

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from fshard.ops.binding import bind, signature_of
from tests._opcheck import check, randn

P = fs.P


def test_bind_fills_defaults_by_name():
    b = bind(F.layer_norm, ("x", (4,)), {"eps": 1e-6})  # the Python signature
    assert b == {"input": "x", "normalized_shape": (4,), "weight": None, "bias": None, "eps": 1e-6}
    b = bind(torch.topk, ("x", 3), {"largest": False})  # the ATen schema
    assert b == {"input": "x", "k": 3, "dim": -1, "largest": False, "sorted": True}
    assert bind(F.scaled_dot_product_attention, ("q", "k", "v"), {})["scale"] is None
    assert signature_of(torch.topk) is signature_of(torch.topk)  # built once


def test_bind_picks_the_overload_and_packs_varargs():
    assert "dim" not in bind(torch.Tensor.sum, ("x",), {})  # sum(self, *, dtype)
    assert bind(torch.Tensor.sum, ("x", 0), {})["dim"] == 0  # sum.dim_IntList
    assert bind(torch.Tensor.flip, ("x", 0, 1), {})["dims"] == (0, 1)  # x.flip(0, 1)
    assert bind(torch.Tensor.flip, ("x", (0, 1)), {})["dims"] == (0, 1)


@pytest.mark.parametrize(
    "op, args",
    [
        (torch.Tensor.__matmul__, ("x", "y")),  # neither a Python signature nor a schema
        (torch.Tensor.__add__, ("x", "y")),
        (torch.Tensor.__radd__, ("x", "y")),  # reflected: __add__'s arity
        (torch.Tensor.__rand__, ("x", "y")),
        (torch.Tensor.__eq__, ("x", "y")),
        (torch.Tensor.__invert__, ("x",)),  # unary
    ],
)
def test_bind_reads_an_operator_method_as_python_calls_it(op, args):
    assert bind(op, args, {}) == dict(zip(("input", "other"), args))
    with pytest.raises(TypeError, match="cannot bind"):
        bind(op, (*args, "z"), {})  # one argument more than the operator takes


def test_bind_refuses_a_call_no_signature_takes():
    with pytest.raises(TypeError, match="cannot bind the arguments of"):
        bind(F.layer_norm, ("x", (4,)), {"epsilon": 1e-6})
    with pytest.raises(TypeError, match="cannot bind"):
        bind(torch.topk, ("x",), {})  # k is required


def test_bind_takes_the_numpy_names_torch_takes():
    """torch's argument parser takes ``axis`` for ``dim``, ``keepdims`` for ``keepdim``,
    ``x``/``a``/``x1`` for ``input``, ``x2`` for ``other``; so does binding (was: refused)."""
    b = bind(torch.Tensor.cumsum, ("x",), {"axis": 1})
    assert b["dim"] == 1 and "axis" not in b
    b = bind(torch.Tensor.mean, ("x",), {"axis": 2, "keepdims": True})
    assert b["dim"] == 2 and b["keepdim"] is True
    assert bind(torch.add, (), {"x1": "a", "x2": "b"})["input"] == "a"
    with pytest.raises(TypeError, match="cannot bind"):
        bind(torch.Tensor.cumsum, ("x",), {"axes": 1})


def _numpy_names():
    """Reductions and dim ops called with ``axis=`` on every layout, against dense: the
    reductions planned a reduction over every dim for ``x.mean(axis=2, keepdim=True)`` and
    computed another value (silently; ibert's layer norm), the others were refused."""
    mesh = fs.Mesh.create((2,), ("x",))
    a = randn(4, 3, 6)
    calls = {
        "mean": lambda t: t.mean(axis=2, keepdim=True),
        "sum": lambda t: torch.sum(t, axis=2, keepdims=True),
        "amax": lambda t: t.amax(axis=-1),
        "var": lambda t: t.var(axis=2, correction=0),
        "std": lambda t: torch.std(t, axis=(1, 2)),
        "cumsum": lambda t: torch.cumsum(t, axis=2),
        "softmax": lambda t: torch.softmax(t, axis=2),
        "argmax": lambda t: t.argmax(axis=2),
        "cat": lambda t: torch.cat([t, t * 2], axis=2),
        "sort": lambda t: t.sort(axis=2)[0],
    }
    for s in (P(), P("x"), P(None, None, "x")):
        for name, f in calls.items():
            grad_wrt = () if name == "argmax" else None
            check(mesh, f, [a], [s], label=f"{name} {s}", grad_wrt=grad_wrt)
    return True


def test_numpy_names_match_dense(world2):
    assert world2.run(_numpy_names) == [True, True]


def _keyword_calls():
    mesh = fs.Mesh.create((2,), ("x",))
    x, w, b = randn(5, 6), randn(4, 6, seed=1), randn(4, seed=2)
    for s in (P(), P("x"), P(None, "x")):
        check(mesh, lambda x, w, b: F.linear(bias=b, weight=w, input=x), [x, w, b], [s, P(), P()])
        check(
            mesh,
            lambda x, w, b: F.layer_norm(x, (6,), bias=b, weight=w, eps=1e-3),
            [x, randn(6, seed=3), randn(6, seed=4)],
            [s, P(), P()],
            label=f"layer_norm {s}",
        )
        check(mesh, lambda x: x.flip(0, 1), [x], [s], label=f"flip varargs {s}")
        check(mesh, lambda x: torch.topk(x, 2, largest=False)[0], [x], [s], label=f"topk {s}")
    c, m1, m2 = randn(5, 4), randn(5, 6, seed=5), randn(6, 4, seed=6)
    check(
        mesh,
        lambda c, a, b: torch.addmm(c, mat2=b, mat1=a, beta=0.5),
        [c, m1, m2],
        [P(), P(None, "x"), P("x")],
    )
    t = torch.tensor([0, 3, 1, 2, 3])
    check(
        mesh,
        lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1, ignore_index=1),
        [x, t],
        [P(None, "x"), P()],
        grad_wrt=(0,),
    )
    check(mesh, lambda x, y: F.mse_loss(x, y, reduction="sum"), [x, randn(5, 6)], [P("x"), P()])


def test_keyword_and_varargs_calls_match_dense(world2):
    world2.run(_keyword_calls)
