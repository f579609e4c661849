"""Op rules under the torch.func transforms other than ``grad`` (2 ranks, float64, vs dense).

tests/ops/test_rules.py pins values and ``grad`` of every op rule; here a representative set of ops
(elementwise with broadcasting, matmul / F.linear with a split contracting dim, sum / mean,
amax / logsumexp, softmax / log_softmax, layer_norm, embedding with a vocab-split weight,
vocab-parallel cross_entropy, reshape / transpose, cat / stack, and two small models chaining
them) goes through, for the layouts P(), P("x"), P(None, "x") and P(partial="x") (pairs
chosen to reach every kind of collective a plan runs, see PAIRS), uneven and empty blocks
included:

- ``jvp``: ShardedArray primals with ShardedArray tangents of the same layout; the output
  tangent has the output's layout and is the dense tangent laid out that way;
- ``vmap`` over a leading batch dim of stacked sharded inputs (the output layout is the
  per-example layout with an unsplit batch dim in front), ``in_dims=None`` for sharded params
  with batched plain inputs, a mapped middle dim, and the documented error for a split one;
- ``vmap(grad)``: per-example gradients keep the inputs' (params') layouts plus a batch dim,
  for stacked sharded inputs and for unbatched sharded params with a batched plain input;
- ``jacrev`` w.r.t. ShardedArrays (the Jacobian keeps the input's layout behind the output dims);
- ``hessian`` (``jacfwd`` of ``jacrev``: forward mode through every backward) w.r.t. dense
  tensors sharded inside the transform; in the sweeps of linear ops (add, matmul, cat) only for
  the layouts with a pending sum, to keep the runtime small. ``jacfwd`` builds its standard
  basis from each rank's *local* leaf, so w.r.t. a rank-varying ShardedArray it would mix the
  ranks' basis vectors (and uneven shards give the ranks different batch sizes); a replicated
  tensor sharded inside the transform has one global basis.

Results are compared as this rank's block of the dense result (every rank checks its own), a
partial value after gathering it. A partial value's cotangent is invariant (DESIGN §4): the
gradient of a P(partial="x") input has that layout and every rank's local holds the whole dense
gradient; that is what is checked.

Where torch's own kernel is wrong or cannot be transformed, the dense reference is the same
math unfused: layer_norm's Hessian (``_layer_norm_ref``) and cross_entropy with label smoothing
under vmap (``_cross_entropy_ref``).

Each test runs ONE rank function that loops over many cases (world start-up dominates).
"""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacrev, jvp, vmap

import fshard as fs
from fshard import P

pytestmark = pytest.mark.timeout(120)

DT = torch.float64
B = 3  # vmap batch


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _lead(k, s):
    """``s`` behind ``k`` unsplit leading dims (a vmap batch dim, a Jacobian's output dims)."""
    return P(*([None] * k), *s.dims, partial=s.partial)


def _shard(t, mesh, s):
    return t if s is None else fs.shard(t, mesh, s)


def _close(got, want, what):
    assert isinstance(got, torch.Tensor), (what, type(got))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-9, msg=lambda m: f"{what}: {m}")


def _check_like(g, s, want, what):
    """``g`` has spec ``s`` and is ``want`` laid out that way: this rank's local is its block of
    ``want``. A partial value, and a partial parameter's gradient or Jacobian (README: partial
    values), holds addends: it is gathered."""
    if s is None:  # w.r.t. a plain tensor: a plain (replicated, full) result
        assert not isinstance(g, fs.ShardedArray), (what, g)
        _close(g, want, what)
        return
    assert isinstance(g, fs.ShardedArray), (what, type(g))
    assert g.spec == s, (what, g.spec, s)
    assert tuple(g.shape) == tuple(want.shape), (what, g.shape, want.shape)
    if s.partial:
        _close(fs.gather(g), want, what)
    else:
        _close(g.local, want[g.layout.shard_metadata(g.mesh.rank).slices()], what)


def _stacked(t, seed):
    if t.is_floating_point():
        return _randn(B, *t.shape, seed=seed)
    return torch.stack([t.flatten().roll(k).view(t.shape) for k in range(B)])  # same id set


def _put(args, idx, vals):
    args = list(args)
    for i, v in zip(idx, vals):
        args[i] = v
    return args


class Checker:
    """Runs every transform on one op call, sharded vs dense.

    The dense side depends on the op and its inputs, not on their layouts: it is computed once
    per ``(name, ref, data)`` and reused across the layouts the op is checked with."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.count = 0
        self.hessians = 0
        self.params_seen = set()
        self.dense = {}

    def __call__(self, name, f, tensors, specs, *, data=None, ref=None, second=True):
        """Check op call ``f(*tensors)`` with inputs laid out as ``specs`` (``None``: a plain
        tensor); ``data``: the input batched as a plain tensor against unbatched sharded params;
        ``ref``: the dense reference when it must differ from ``f`` (default ``f``); ``second``:
        also the Hessian (off in some sweeps of linear ops, to keep the runtime small)."""
        mesh = self.mesh
        label = f"{name} {specs}"
        diff = [i for i, t in enumerate(tensors) if t.is_floating_point()]
        params = tuple(i for i in diff if i != data)
        key = (name, ref is not None, data)
        if key not in self.dense:
            self.dense[key] = _dense_side(f if ref is None else ref, tensors, diff, data, params)
        want = self.dense[key]
        cot, tans, Xs = want["cot"], want["tans"], want["Xs"]
        argnums = tuple(diff)
        xs = [_shard(t, mesh, s) for t, s in zip(tensors, specs)]
        out = f(*xs)
        assert isinstance(out, fs.ShardedArray), (label, type(out))
        _check_like(out, out.spec, want["value"], f"{label} value")

        def loss(*args):  # a scalar that is the same on every rank
            return (torch.sin(fs.gather(f(*args))) * cot).sum()

        # -- jvp: tangents are ShardedArrays with the primals' layouts ----------------------
        val, tan = jvp(
            lambda *d: f(*_put(xs, diff, d)),
            tuple(xs[i] for i in diff),
            tuple(_shard(t, mesh, specs[i]) for i, t in zip(diff, tans)),
        )
        assert val.layout == out.layout, (label, "jvp value", val.layout, out.layout)
        _check_like(val, out.spec, want["value"], f"{label} jvp value")
        _check_like(tan, out.spec, want["jvp"], f"{label} jvp tangent")

        # -- vmap over stacked sharded inputs -------------------------------------------------
        Xs_s = [X if s is None else fs.shard(X, mesh, _lead(1, s)) for X, s in zip(Xs, specs)]
        got = vmap(f)(*Xs_s)
        _check_like(got, _lead(1, out.spec), want["vmap"], f"{label} vmap")

        # -- vmap(grad): per-example grads of stacked sharded inputs --------------------------
        per = vmap(grad(loss, argnums=argnums))(*Xs_s)
        for i, g, w in zip(diff, per, want["vmap_grad"]):
            s = None if specs[i] is None else _lead(1, specs[i])
            _check_like(g, s, w, f"{label} vmap(grad) input {i}")

        # -- in_dims=None: unbatched sharded params, a batched plain input --------------------
        seen = (name, tuple(s for i, s in enumerate(specs) if i != data))
        has_params = any(s is not None for i, s in enumerate(specs) if i != data)
        if data is not None and has_params and seen not in self.params_seen:
            self.params_seen.add(seen)
            in_dims = tuple(0 if i == data else None for i in range(len(tensors)))
            args = _put(xs, [data], [Xs[data]])
            one = f(*_put(xs, [data], [tensors[data]]))  # per-example layout, plain data
            got = vmap(f, in_dims=in_dims)(*args)
            what = f"{label} vmap in_dims={in_dims}"
            _check_like(got, _lead(1, one.spec), want["vmap_params"], what)
            if params:
                per = vmap(grad(loss, argnums=params), in_dims=in_dims)(*args)
                for i, g, w in zip(params, per, want["vmap_grad_params"]):
                    s = None if specs[i] is None else _lead(1, specs[i])
                    _check_like(g, s, w, f"{label} per-example grad of param {i}")

        # -- jacrev w.r.t. the ShardedArrays --------------------------------------------------
        jr = jacrev(lambda *a: fs.gather(f(*a)), argnums=argnums)(*xs)
        for i, g, w in zip(diff, jr, want["jacrev"]):
            s = None if specs[i] is None else _lead(out.ndim, specs[i])
            _check_like(g, s, w, f"{label} jacrev input {i}")

        self.count += 1
        if not second:
            return

        # -- hessian (jacfwd of jacrev) w.r.t. dense tensors sharded inside the transform ----
        def inner(*d):
            args = _put(tensors, diff, [_shard(t, mesh, specs[i]) for i, t in zip(diff, d)])
            return fs.gather(f(*args))

        primals = [tensors[i] for i in diff]
        nums = tuple(range(len(diff)))
        h = hessian(lambda *d: (torch.sin(inner(*d)) * cot).sum(), argnums=nums)(*primals)
        if "hessian" not in want:
            want["hessian"] = _dense_hessian(f if ref is None else ref, tensors, diff, cot)
        for (a, b), got, w in zip(itertools.product(diff, diff), _flat2(h), want["hessian"]):
            _close(got, w, f"{label} hessian {a},{b}")
        self.hessians += 1


def _dense_side(fd, tensors, diff, data, params):
    """Every reference result for op ``fd`` on dense ``tensors``, in one process."""
    cot = _randn(*fd(*tensors).shape, seed=1)
    tans = [_randn(*tensors[i].shape, seed=10 + i) for i in diff]
    Xs = [_stacked(t, 20 + i) for i, t in enumerate(tensors)]
    argnums = tuple(diff)

    def loss(*args):
        return (torch.sin(fd(*args)) * cot).sum()

    def inner(*d):
        return fd(*_put(tensors, diff, d))

    primals = [tensors[i] for i in diff]
    want = {"cot": cot, "tans": tans, "Xs": Xs, "value": fd(*tensors)}
    want["jvp"] = jvp(inner, tuple(primals), tuple(tans))[1]
    want["vmap"] = vmap(fd)(*Xs)
    want["vmap_grad"] = vmap(grad(loss, argnums=argnums))(*Xs)
    if data is not None:
        in_dims = tuple(0 if i == data else None for i in range(len(tensors)))
        args = _put(tensors, [data], [Xs[data]])
        want["vmap_params"] = vmap(fd, in_dims=in_dims)(*args)
        if params:
            want["vmap_grad_params"] = vmap(grad(loss, argnums=params), in_dims=in_dims)(*args)
    want["jacrev"] = jacrev(fd, argnums=argnums)(*tensors)
    return want


def _dense_hessian(fd, tensors, diff, cot):
    def scalar(*d):
        return (torch.sin(fd(*_put(tensors, diff, d))) * cot).sum()

    nums = tuple(range(len(diff)))
    return _flat2(hessian(scalar, argnums=nums)(*[tensors[i] for i in diff]))


def _flat2(h):
    return [blk for row in h for blk in row]


# -- the cases ------------------------------------------------------------------------------


def _mesh():
    return fs.Mesh.create((2,), ("x",))


R, S0, S1, PX = P(), P("x"), P(None, "x"), P(partial="x")  # the 2-D layouts (S0: row split)

# Layout pairs for binary ops: every layout against every other one would repeat what
# tests/ops/test_rules.py pins values and grad; under the transforms what matters is which collectives
# the plan runs, and these pairs reach each kind: no communication (R with S0/S1: a local
# slice), all_to_all (S0 with S1), a pending sum kept (R/PX into an additive or scaling op),
# reduced (PX into a nonlinear op, PX / PX), zeroed addends (R into PX), and plain tensors.
PAIRS = [
    (R, R), (R, S0), (R, S1), (S1, S1), (S0, S1), (PX, R), (R, PX), (PX, PX), (PX, S1), (S0, PX),
    (S1, None), (PX, None),
]  # fmt: skip


def elementwise_cases():
    mesh = _mesh()
    check = Checker(mesh)
    a, b, v = _randn(5, 4, seed=0), _randn(5, 4, seed=1), _randn(4, seed=2)
    bpos = b.abs() + 0.5
    for sa, sb in PAIRS:
        check("add", lambda x, y: x + y, [a, b], [sa, sb], data=0, second=PX in (sa, sb))
    for sa, sb in [(PX, R), (R, PX), (PX, PX), (S0, S1), (PX, S1)]:
        check("mul", torch.mul, [a, b], [sa, sb], data=0)
    for sa, sb in [(PX, R), (R, PX), (S0, S1), (S1, None)]:
        check("div", lambda x, y: x / y, [a, bpos], [sa, sb], data=0)
        check("maximum", torch.maximum, [a, b], [sa, sb], data=0)
    # broadcasting a row vector (5, 4) op (4,), both operand orders
    vec = [(S1, S0), (S1, R), (S0, S0), (R, S0), (PX, PX), (PX, R), (R, PX), (S1, None)]
    for sa, sv in vec:
        check("add bcast", lambda x, y: x + y, [a, v], [sa, sv], data=0, second=PX in (sa, sv))
    for sa, sv in [(S1, S0), (S0, S0), (PX, PX), (PX, R), (R, PX)]:
        check("mul bcast-r", torch.mul, [v, a], [sv, sa], data=1)
    unary = {
        "exp": torch.exp,
        "gelu": F.gelu,
        "scalars": lambda x: 2.0 - x * 3 + 1 / (x * x + 1),
        "where": lambda x: torch.where(x > 0, x, x * 0.1),
    }
    for name, f in unary.items():
        for sa in [S1, PX] if name == "exp" else [S1] if name == "where" else [PX]:
            check(name, f, [a], [sa])
    return check.count, check.hessians


def test_elementwise_under_transforms(world2):
    assert world2.run(elementwise_cases)[0] == (43, 32)  # (cases, of which with a Hessian)


def linalg_reduction_cases():
    mesh = _mesh()
    check = Checker(mesh)
    a, b = _randn(5, 4, seed=0), _randn(4, 3, seed=1)
    for sa, sb in PAIRS + [(S1, S0)]:  # a split contracting dim (R @ S0, S1 @ S0): partial
        check("matmul", lambda x, y: x @ y, [a, b], [sa, sb], data=0, second=PX in (sa, sb))
    w, bias = _randn(3, 4, seed=2), _randn(3, seed=3)
    linear = [
        (S1, S1, R),  # row-parallel (partial) + a replicated bias (zeroed addends)
        (R, S0, S0),  # column-parallel
        (S0, R, R),  # data-parallel
        (S1, S1, PX),
        (PX, R, S0),
        (R, S1, None),
        (S0, S1, S0),
    ]
    for sa, sw, sb in linear:
        check("linear", F.linear, [a, w, bias], [sa, sw, sb], data=0)
    for sa, sw in [(S1, S1), (PX, R)]:
        check("linear nobias", lambda x, w: F.linear(x, w), [a, w], [sa, sw], data=0)
    reductions = {
        "sum0": (lambda x: x.sum(0), [S0, PX]),
        "sum1k": (lambda x: x.sum(1, keepdim=True), [S1]),
        "sum": (lambda x: x.sum(), [PX]),
        "mean-1": (lambda x: torch.mean(x, -1), [S1, PX]),
        "mean": (lambda x: x.mean(), [S0]),
        "amax-1": (lambda x: torch.amax(x, -1), [S1]),  # pmax: gradient to the maxima
        "logsumexp-1": (lambda x: torch.logsumexp(x, -1), [S1]),
    }
    for name, (f, layouts) in reductions.items():
        for sa in layouts:
            check(name, f, [a], [sa])
    return check.count, check.hessians


def test_linalg_and_reductions_under_transforms(world2):
    assert world2.run(linalg_reduction_cases)[0] == (31, 24)


def _layer_norm(x, w, b):
    return F.layer_norm(x, (6,), w, b)


def _layer_norm_ref(x, w, b):
    """F.layer_norm(x, (6,), w, b) unfused. torch 2.13's fused kernel has a wrong second
    derivative d(grad w)/dx (its Hessian is not symmetric; finite differences agree with this
    formula); first-order results of both agree to rounding."""
    d = x - x.mean(-1, keepdim=True)
    return d * torch.rsqrt((d * d).mean(-1, keepdim=True) + 1e-5) * w + b


def _cross_entropy_ref(x, t, reduction, smoothing):
    """F.cross_entropy(x, t, ignore_index=-100, label_smoothing=...) from log_softmax (a dense
    reference that vmaps where torch's kernel does not)."""
    lsm = x.log_softmax(-1)
    valid = t != -100
    nll = -lsm.gather(-1, torch.where(valid, t, 0).unsqueeze(-1)).squeeze(-1)
    loss = torch.where(valid, (1 - smoothing) * nll - smoothing * lsm.mean(-1), 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


def nn_cases():
    mesh = _mesh()
    check = Checker(mesh)
    a = _randn(5, 6, seed=0)
    for sa in [S0, S1, PX]:
        for d in (0, -1):
            check(f"softmax{d}", lambda x, d=d: F.softmax(x, dim=d), [a], [sa])
    for sa in [S1, PX]:
        check("log_softmax", lambda x: x.log_softmax(-1), [a], [sa])
    w, b = _randn(6, seed=1), _randn(6, seed=2)
    # Over a split normalized dim the rule computes layer_norm from psum'd moments, whose
    # second derivatives are exact; torch's fused kernel gets the d(grad weight)/d(input) block
    # of forward-over-reverse and reverse-over-reverse wrong (torch 2.13, see _layer_norm_ref),
    # so there the dense reference is the same formula unfused.
    for sa, sw in [(S1, S0), (S1, R), (S1, None), (S0, R), (R, S0), (PX, S0)]:
        ref = _layer_norm_ref if sa == S1 else None
        check("layer_norm", _layer_norm, [a, w, b], [sa, sw, sw], data=0, ref=ref)
    for sa in [S1, PX]:
        check("layer_norm plain", lambda x: F.layer_norm(x, (6,)), [a], [sa])
    ids = torch.tensor([[0, 3, 6], [9, 2, 2]])
    emb = _randn(10, 4, seed=3)
    for si, sw in [(R, S0), (None, S0), (S0, S0), (S0, S1), (S0, R)]:  # S0: vocab split
        check("embedding", F.embedding, [ids, emb], [si, sw], data=0)
    logits, tgt = _randn(6, 11, seed=4), torch.tensor([0, 10, 5, -100, 6, 3])
    ce = [(S1, R, red, ls) for red in ("mean", "sum", "none") for ls in (0.0, 0.1)]  # vocab split
    ce += [(S0, R, "mean", 0.0), (S0, R, "sum", 0.1)]
    ce += [(PX, None, "mean", 0.1), (R, R, "none", 0.1)]
    for sl, st, red, ls in ce:
        f = lambda x, t, red=red, ls=ls: F.cross_entropy(x, t, reduction=red, label_smoothing=ls)  # noqa: E731
        ref = lambda x, t, red=red, ls=ls: _cross_entropy_ref(x, t, red, ls)  # noqa: E731
        # torch 2.13's cross_entropy kernel cannot vmap label smoothing over a batched target
        # with unbatched logits (dense too: "vmap: inplace arithmetic"); the rule runs that
        # kernel unless the vocab dim is split, so that leg runs for vocab-split logits only.
        data = 1 if ls == 0 or sl == S1 else None
        check(f"ce {red} {ls}", f, [logits, tgt], [sl, st], data=data, ref=ref if ls else None)
    # Empty blocks (one row/class over two ranks: rank 1 holds none). Under vmap every rank's
    # local result must be batched the same way, or the psum that follows gets different
    # shapes on different ranks (a Gloo abort): ids / targets batched, weight / logits not.
    one_row = torch.zeros(2, 3, dtype=torch.long)
    check("embedding empty block", F.embedding, [one_row, _randn(1, 4, seed=5)], [R, S0], data=0)
    one_class, t0 = _randn(4, 1, seed=6), torch.tensor([0, 0, -100, 0])
    for red in ("mean", "none"):
        f = lambda x, t, red=red: F.cross_entropy(x, t, reduction=red)  # noqa: E731
        check(f"ce empty block {red}", f, [one_class, t0], [S1, R], data=1)
    check("softmax empty block", lambda x: F.softmax(x, -1), [_randn(3, 1, seed=7)], [S1])
    return check.count, check.hessians


def test_nn_ops_under_transforms(world2):
    assert world2.run(nn_cases)[0] == (35, 35)


def shape_cases():
    mesh = _mesh()
    check = Checker(mesh)
    a, c = _randn(4, 6, seed=0), _randn(4, 6, seed=1)
    shapes = {
        "reshape3": (lambda x: x.reshape(2, 2, 6), [S0, PX]),
        "reshape_last": (lambda x: x.reshape(4, 2, 3), [S1, R]),
        "transpose": (lambda x: x.transpose(0, 1), [S0, PX]),
        "T_sin": (lambda x: torch.sin(x.T), [S1]),
        "flatten": (lambda x: x.flatten(), [S0]),
    }
    for name, (f, layouts) in shapes.items():
        for sa in layouts:
            check(name, f, [a], [sa])
    for sa, sb in [(S1, S1), (S0, S0), (PX, R), (S0, S1)]:
        cat0 = lambda x, y: torch.cat([x, y * 2], 0)  # noqa: E731
        check("cat0", cat0, [a, c], [sa, sb], data=0, second=PX in (sa, sb))
    for sa, sb in [(S0, S1), (S1, R), (PX, PX)]:
        cat1 = lambda x, y: torch.cat([x, y], dim=1)  # noqa: E731
        check("cat1", cat1, [a, c], [sa, sb], data=0, second=PX in (sa, sb))
    for sa, sb in [(S1, S0), (PX, None)]:
        check("stack", lambda x, y: torch.stack([x, y], 1), [a, c], [sa, sb], data=0)
    # vmap maps over an unsplit dim only: a mapped middle dim works, a split one is refused
    t = _randn(3, 4, 5, seed=2)
    y = fs.shard(t, mesh, S0)
    got = vmap(lambda u: F.softmax(u.sum(0) * 2, -1), in_dims=1)(y)
    want = vmap(lambda u: F.softmax(u.sum(0) * 2, -1), in_dims=1)(t)
    _check_like(got, R, want, "vmap in_dims=1 over a split input")
    with pytest.raises(ValueError, match="vmap can only map over an unsharded dim"):
        vmap(torch.sin)(fs.shard(a[:, :5], mesh, S0))
    # ...also when dropping another, unsplit dim would fit the local shape: (4, 2) split over
    # dim 0 has (2, 2) blocks, which look like dim 1 of the (4, 2) value mapped away
    sq = fs.shard(_randn(4, 2, seed=3), mesh, S0)
    with pytest.raises(ValueError, match="cannot map over dim 0 of this ShardedArray"):
        vmap(torch.sin)(sq)
    torch.testing.assert_close(
        fs.gather(vmap(torch.sin, in_dims=1)(sq)), torch.sin(_randn(4, 2, seed=3)).T
    )
    return check.count, check.hessians


def test_shape_ops_under_transforms(world2):
    assert world2.run(shape_cases)[0] == (17, 12)


def model_cases():
    """Two small models chaining the rules (Megatron MLP; embedding -> norm -> vocab-parallel
    head -> cross entropy), with params split the tensor-parallel way and replicated."""
    mesh = _mesh()
    check = Checker(mesh)
    x = _randn(4, 6, seed=0)
    w1, b1, w2 = _randn(8, 6, seed=1), _randn(8, seed=2), _randn(5, 8, seed=3)

    def mlp(x, w1, b1, w2):
        return F.log_softmax(F.linear(F.gelu(F.linear(x, w1, b1)), w2), -1)

    check("mlp megatron", mlp, [x, w1, b1, w2], [R, S0, S0, S1], data=0)
    check("mlp replicated", mlp, [x, w1, b1, w2], [R, R, R, R], data=0)
    check("mlp data-parallel", mlp, [x, w1, b1, w2], [S0, R, R, R], data=0)
    ids, tgt = torch.tensor([1, 7, 3, 9]), torch.tensor([2, 0, 8, 4])
    emb, g, head = _randn(10, 6, seed=4), _randn(6, seed=5), _randn(10, 6, seed=6)

    def lm(ids, emb, g, head, tgt):
        h = F.layer_norm(F.embedding(ids, emb), (6,), g)
        return F.cross_entropy(F.linear(h, head), tgt)

    def lm_ref(ids, emb, g, head, tgt):  # layer_norm unfused: see _layer_norm_ref
        h = _layer_norm_ref(F.embedding(ids, emb), g, 0.0)
        return F.cross_entropy(F.linear(h, head), tgt)

    for se, sh in [(S0, S0), (S1, S0), (R, S1)]:
        ref = lm_ref if se == S1 else None  # layer_norm over a split dim
        check(f"lm {se} {sh}", lm, [ids, emb, g, head, tgt], [R, se, R, sh, R], data=0, ref=ref)
    return check.count, check.hessians


def test_models_under_transforms(world2):
    assert world2.run(model_cases)[0] == (6, 6)
