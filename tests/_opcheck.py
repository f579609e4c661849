"""Shared checker for op-rule tests: values and grads against dense torch.func."""

import math

import torch
from torch.func import grad

import fshard as fs


def nan_max(values) -> float:
    """The largest of ``values`` (floats), NaN if any is NaN: Python's ``max()`` keeps a NaN only
    when it comes first (``max([0.1, nan, 0.2]) == 0.2``), which would hide a NaN error."""
    values = [float(v) for v in values]
    return math.nan if any(math.isnan(v) for v in values) else max(values, default=0.0)


def randn(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed + 1000 * len(shape) + sum(shape))
    return torch.randn(shape, generator=g, dtype=dtype)


def check(mesh, f, tensors, specs, *, grad_wrt=None, atol=1e-5, label=""):
    """gather(f(shard(x))) == f(x); grads w.r.t. sharded inputs match dense, with their layouts."""
    xs = [fs.shard(t, mesh, s) if s is not None else t for t, s in zip(tensors, specs)]
    out = f(*xs)
    want = f(*tensors)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    wants = want if isinstance(want, (tuple, list)) else (want,)
    for o, w in zip(outs, wants):
        assert isinstance(o, fs.ShardedArray), (label, type(o))
        assert tuple(o.shape) == tuple(w.shape), (label, o.shape, w.shape)
        assert o.dtype == w.dtype, (label, o.dtype, w.dtype)
        got = fs.gather(o)
        if w.dtype == torch.bool or not w.dtype.is_floating_point:
            assert torch.equal(got, w), (label, got, w)
        else:
            torch.testing.assert_close(got, w, atol=atol, rtol=1e-4, msg=lambda m: f"{label}: {m}")
    # A partial input's cotangent is invariant (every rank holds the full gradient), so its
    # gathered gradient is not the dense one: check values only for those.
    idx = [
        i
        for i, s in enumerate(specs)
        if s is not None and not s.partial and tensors[i].is_floating_point()
    ]
    if grad_wrt is not None:
        idx = [i for i in idx if i in grad_wrt]
    if not idx or not wants[0].is_floating_point():
        return
    cot = randn(*wants[0].shape, seed=7)

    def loss(f_out):
        o = f_out[0] if isinstance(f_out, (tuple, list)) else f_out
        return (o * cot).sum()

    def sharded_loss(sel):
        args = list(xs)
        for i, v in zip(idx, sel):
            args[i] = v
        return loss(fs.gather(_first(f(*args))))

    def dense_loss(sel):
        args = list(tensors)
        for i, v in zip(idx, sel):
            args[i] = v
        return loss(_first(f(*args)))

    gs = grad(sharded_loss)([xs[i] for i in idx])
    gd = grad(dense_loss)([tensors[i] for i in idx])
    for i, g_s, g_d in zip(idx, gs, gd):
        assert isinstance(g_s, fs.ShardedArray), (label, i, type(g_s))
        assert g_s.layout == xs[i].layout, (label, i, g_s.layout, xs[i].layout)
        torch.testing.assert_close(
            fs.gather(g_s), g_d, atol=atol, rtol=1e-4, msg=lambda m, i=i: f"{label} grad {i}: {m}"
        )


def _first(o):
    return o[0] if isinstance(o, (tuple, list)) else o


# -- OpInfo conformance (tests/ops/test_opinfo.py builds the cases; ranks run them here) -----

#: What an op fshard cannot do must raise: these, from fshard's own code, naming the fix.
CLEAR_ERRORS = (NotImplementedError, TypeError, ValueError)
#: The layouts every sample runs in: every tensor input replicated, split on dim 0, split on
#: its last dim (0-d tensors stay replicated; "last" is skipped when no input has 2+ dims,
#: where it would repeat "dim0").
LAYOUTS = ("replicated", "dim0", "last")


def op_db():
    """torch's OpInfo database (its test utilities import expecttest only for a base class)."""
    import importlib.util
    import sys
    import types
    import unittest

    if "expecttest" not in sys.modules and importlib.util.find_spec("expecttest") is None:
        shim = types.ModuleType("expecttest")
        shim.TestCase = unittest.TestCase
        sys.modules["expecttest"] = shim
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


_BY_NAME: dict = {}


class OpRef:
    """The function of OpInfo entry ``(name, variant)``, looked up in ``op_db`` where it is
    called: many are lambdas or closures, which do not pickle to a rank."""

    def __init__(self, name: str, variant: str):
        self.name, self.variant = name, variant

    def __reduce__(self):
        return OpRef, (self.name, self.variant)

    def __call__(self, *args, **kwargs):
        if not _BY_NAME:
            _BY_NAME.update({(o.name, o.variant_test_name): o.op for o in op_db()})
        return _BY_NAME[self.name, self.variant](*args, **kwargs)

    def __repr__(self) -> str:
        return f"OpInfo({self.name}{'.' + self.variant if self.variant else ''})"


def _from_fshard(exc: BaseException) -> bool:
    """Raised by fshard itself (the raising frame is fshard's), not a torch error passing
    through an op rule."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and "/fshard/" in frames[-1].filename


def split_dims(tree, how):
    """The dim each tensor leaf of ``tree`` is split on in layout ``how`` (None: replicated)."""
    import optree

    def one(t):
        if not isinstance(t, torch.Tensor) or t.ndim == 0 or how == "replicated":
            return None
        return 0 if how == "dim0" else t.ndim - 1

    return [one(t) for t in optree.tree_leaves(tree, none_is_leaf=True)]


def _shard_leaves(tree, mesh, how):
    import optree

    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    dims = split_dims(tree, how)
    out = [
        fs.shard(t, mesh, fs.P(*[None] * d, "x"))
        if d is not None
        else (fs.shard(t, mesh, fs.P()) if isinstance(t, torch.Tensor) else t)
        for t, d in zip(leaves, dims)
    ]
    return optree.tree_unflatten(spec, out)


def _float_outputs(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [
        o for o in outs if isinstance(o, (torch.Tensor, fs.ShardedArray)) and o.is_floating_point()
    ]


def _compare(got, want, label):
    """gathered ``got`` (a ShardedArray, a tuple/list of them, or a plain value) == ``want``."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), (label, type(got))
        for g, w in zip(got, want):
            _compare(g, w, label)
        return
    if not isinstance(want, torch.Tensor):
        assert got == want, (label, got, want)
        return
    assert isinstance(got, fs.ShardedArray), (label, type(got))
    assert tuple(got.shape) == tuple(want.shape), (label, tuple(got.shape), tuple(want.shape))
    assert got.dtype == want.dtype == got.local.dtype, (label, got.dtype, want.dtype)
    if got.dtype == torch.int16:  # Gloo has no int16 collectives
        got, want = got.int(), want.int()
    full = fs.gather(got)
    torch.testing.assert_close(
        full, want, atol=1e-4, rtol=1e-3, equal_nan=True, msg=lambda m: f"{label}: {m}"
    )


def _seed() -> None:
    """Seed the CPU generator, the one random ops on CPU tensors draw from. Not
    ``torch.manual_seed``: it also queues a seed for each lazily initialised accelerator
    (CUDA, XPU, MTIA) with the caller's formatted stack, which took a sixth of a rank's time
    here (three seeds per run)."""
    torch.default_generator.manual_seed(0)


def opinfo_case(mesh, fn, inp, args, kwargs, how, values=True):
    """One OpInfo sample under one layout: ``'ok'``, ``'error'`` (a clear fshard error) or
    ``'skip'`` (dense raises). A wrong value or gradient, or an unclear error, raises."""
    import optree

    try:
        _seed()  # random ops (dropout) draw the same numbers dense and sharded
        want = fn(inp, *args, **kwargs)
    except Exception:
        return "skip"
    s_inp, s_args, s_kwargs = _shard_leaves((inp, args, kwargs), mesh, how)
    try:
        _seed()
        got = fn(s_inp, *s_args, **s_kwargs)
    except CLEAR_ERRORS as e:
        if _from_fshard(e):
            return "error: " + str(e)[:200]
        raise
    if values:
        _compare(got, want, "value")
    else:
        _compare_shapes(got, want)
    # gradients w.r.t. every float tensor input, through the float outputs
    wants = _float_outputs(want)
    leaves, spec = optree.tree_flatten((inp, args, kwargs), none_is_leaf=True)
    s_leaves = optree.tree_leaves(
        (s_inp, s_args, s_kwargs),
        none_is_leaf=True,
        is_leaf=lambda v: isinstance(v, fs.ShardedArray),
    )
    idx = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not wants or not idx or not values:
        return "ok"
    cots = [randn(*w.shape, seed=i) for i, w in enumerate(wants)]

    def call(sel, base, gather):
        vals = list(base)
        for i, v in zip(idx, sel):
            vals[i] = v
        a, b, c = optree.tree_unflatten(spec, vals)
        _seed()
        outs = _float_outputs(fn(a, *b, **c))
        return sum(((fs.gather(o) if gather else o) * ct).sum() for o, ct in zip(outs, cots))

    try:
        gd = torch.func.grad(lambda sel: call(sel, leaves, False))([leaves[i] for i in idx])
    except Exception:
        return "ok"  # no dense gradient
    try:
        gs = torch.func.grad(lambda sel: call(sel, s_leaves, True))([s_leaves[i] for i in idx])
    except CLEAR_ERRORS as e:
        if _from_fshard(e):
            return "grad error: " + str(e)[:200]
        raise
    for i, g_s, g_d in zip(idx, gs, gd):
        assert g_s.layout == s_leaves[i].layout, ("grad layout", i, g_s.layout, s_leaves[i].layout)
        torch.testing.assert_close(
            fs.gather(g_s),
            g_d,
            atol=1e-4,
            rtol=1e-3,
            equal_nan=True,
            msg=lambda m, i=i: f"grad {i}: {m}",
        )
    return "ok"


def _compare_shapes(got, want):
    gots = got if isinstance(got, (tuple, list)) else (got,)
    wants = want if isinstance(want, (tuple, list)) else (want,)
    for g, w in zip(gots, wants):
        assert tuple(g.shape) == tuple(w.shape) and g.dtype == w.dtype, (g, w.shape, w.dtype)


class Method:
    """``Method(name)(x, *args)`` calls ``x.<name>(*args)`` (picklable, for ShardedArray too)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, x, *args, **kwargs):
        return getattr(x, self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tensor.{self.name}"


def opinfo_cases(cases):
    """Run every ``(name, fn, input, args, kwargs, values)`` case in each of :data:`LAYOUTS`
    over a 2-rank mesh; returns ``[(name, how, outcome, message)]`` (outcome ``'wrong'`` for a
    wrong value/gradient or an unclear error, with its message)."""
    mesh = fs.Mesh.create((2,), ("x",))
    results = []
    for name, fn, inp, args, kwargs, values in cases:
        for how in layouts_of((inp, args, kwargs)):
            try:
                outcome = opinfo_case(mesh, fn, inp, args, kwargs, how, values)
                outcome, _, msg = outcome.partition(": ")
            except Exception as e:  # noqa: BLE001 - every other failure is reported
                outcome, msg = "wrong", f"{type(e).__name__}: {str(e)[:300]}"
            results.append((name, how, outcome, msg))
    return results


def layouts_of(tree) -> list[str]:
    """The :data:`LAYOUTS` a sample runs in ("last" only where it differs from "dim0")."""
    if split_dims(tree, "last") == split_dims(tree, "dim0"):
        return [h for h in LAYOUTS if h != "last"]
    return list(LAYOUTS)
