"""fs.remat: jax.checkpoint's meaning (only the inputs saved, the rest recomputed in backward).

Oracle: the same function without remat (dense torch / torch.func), and exact counts of the
tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``) and of the collectives the
backward runs (``fs.debug.comm_log``).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vjp, vmap

import fshard as fs
from fshard import P, lax

DT = torch.float64


def _gen(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _close(got, want, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=1e-9, rtol=1e-7), f"{what}: {got} != {want}"


def block(x, w1, w2):
    return F.gelu(torch.tanh(x @ w1) @ w2).sum(-1)


def _saved(loss_fn, *args) -> int:
    """How many tensors autograd saves for the backward of ``loss_fn(*args)`` (eager)."""
    count = [0]

    def pack(t):
        count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(*args)
    return count[0]


def test_values_and_grads_match_under_torch_func():
    X, W1, W2 = _gen(0, 5, 4), _gen(1, 4, 6), _gen(2, 6, 3)
    r = fs.remat(block)
    _close(r(X, W1, W2), block(X, W1, W2), "value")
    argnums = (0, 1, 2)
    for got, want in zip(
        grad(lambda *a: r(*a).sum(), argnums=argnums)(X, W1, W2),
        grad(lambda *a: block(*a).sum(), argnums=argnums)(X, W1, W2),
    ):
        _close(got, want, "grad")
    # vmap(grad): per-example gradients of w1 over the rows of x
    per = vmap(grad(lambda w, x: r(x[None], w, W2).sum()), in_dims=(None, 0))(W1, X)
    want = vmap(grad(lambda w, x: block(x[None], w, W2).sum()), in_dims=(None, 0))(W1, X)
    _close(per, want, "vmap(grad)")
    # double backward: the backward's recompute is itself differentiable
    gg = grad(lambda w: grad(lambda v: r(X, v, W2).sum())(w).pow(2).sum())(W1)
    want = grad(lambda w: grad(lambda v: block(X, v, W2).sum())(w).pow(2).sum())(W1)
    _close(gg, want, "grad of grad")
    # eager autograd, pytree in and out
    w = W1.clone().requires_grad_()
    out = fs.remat(lambda t: {"y": block(t["x"], t["w"], W2), "n": 3 * t["w"]})({"x": X, "w": w})
    (out["y"].sum() + out["n"].sum()).backward()
    _close(w.grad, grad(lambda v: block(X, v, W2).sum() + 3 * v.sum())(W1), "eager backward")


def test_only_inputs_are_saved():
    X, W1, W2 = (t.requires_grad_() for t in (_gen(0, 5, 4), _gen(1, 4, 6), _gen(2, 6, 3)))
    plain = _saved(lambda *a: block(*a).sum(), X, W1, W2)
    rematted = _saved(lambda *a: fs.remat(block)(*a).sum(), X, W1, W2)
    # without remat: mm (x, w1), tanh (its output), mm (h, w2), gelu (its input) = 6
    assert plain == 6, plain
    assert rematted == 3, rematted  # x, w1, w2 only


def sharded_remat():
    """Tensor-parallel MLP: the same values and gradients (fs.value_and_grad, torch.func.grad)
    with the parameters' layouts; the forward's all_reduce runs again in the backward."""
    mesh = fs.Mesh.create((2,), ("tp",))
    X, W1, W2 = _gen(0, 4, 3), _gen(1, 3, 6), _gen(2, 6, 3)
    w1, w2 = fs.shard(W1, mesh, P(None, "tp")), fs.shard(W2, mesh, P("tp"))

    def mlp(x, w1_, w2_):
        return fs.reshard(torch.tanh(x @ w1_) @ w2_, P())  # row parallel: all_reduce over tp

    def dense_x(x, W1_, W2_):
        return torch.tanh(x @ W1_) @ W2_

    def dense(W1_, W2_):
        return dense_x(X, W1_, W2_)

    r = fs.remat(mlp)
    rc = fs.remat(mlp, policy="collectives")
    _close(fs.gather(r(X, w1, w2)), dense(W1, W2), "value")
    _close(fs.gather(rc(X, w1, w2)), dense(W1, W2), "value, collectives saved")
    ct = fs.shard(_gen(3, 4, 3), mesh, P())
    logs = []
    for f in (mlp, r, rc):
        _, back = vjp(lambda a, b, f=f: f(X, a, b), w1, w2)
        with fs.debug.comm_log() as log:
            g1, g2 = back(ct)
        logs.append([(rec.op, rec.axes, rec.nbytes) for rec in log])
        assert g1.layout == w1.layout and g2.layout == w2.layout
        d1, d2 = vjp(dense, W1, W2)[1](ct.local)
        _close(fs.gather(g1), d1, "vjp w1")
        _close(fs.gather(g2), d2, "vjp w2")
    # partial -> replicated has an identity backward; remat's backward re-runs the all_reduce
    # of the (4, 3) float64 output, unless its policy saved it
    assert logs == [[], [("all_reduce", ("tp",), 4 * 3 * 8)], []], logs
    # saved for the backward (eager): x, w1, w2's blocks; with "collectives" also the
    # all_reduce's output
    lw1, lw2 = (
        fs.from_local(t.local.clone().requires_grad_(), mesh, t.spec, t.shape) for t in (w1, w2)
    )
    counts = [_saved(lambda f=f: f(X, lw1, lw2).local.sum()) for f in (r, rc)]
    assert counts == [3, 4], counts
    # vmap(grad) with saved collectives: per-example gradients over the rows of x
    per = vmap(grad(lambda b, x: fs.gather(rc(x[None], w1, b)).sum()), in_dims=(None, 0))(w2, X)
    want = vmap(grad(lambda b, x: dense_x(x[None], W1, b).sum()), in_dims=(None, 0))(W2, X)
    _close(fs.gather(per), want, "vmap(grad), collectives saved")
    d1, d2 = grad(lambda a, b: dense(a, b).sum(), argnums=(0, 1))(W1, W2)
    for f in (r, rc):
        loss, (g1, g2) = fs.value_and_grad(
            lambda a, b, f=f: fs.gather(f(X, a, b)).sum(), argnums=(0, 1)
        )(w1, w2)
        _close(loss, dense(W1, W2).sum(), "value_and_grad loss")
        _close(fs.gather(g1), d1, "value_and_grad w1")
        _close(fs.gather(g2), d2, "value_and_grad w2")
    # inside a shard_map body: the recompute runs in the body's axis environment again (its
    # fs.lax mesh, and the pcast of the replicated w where it meets the batch split over tp)
    dp = fs.shard_map(
        fs.remat(lambda x_, w_: lax.psum(torch.tanh(x_ @ w_).pow(2).sum(), "tp")),
        mesh,
        (P("tp"), P()),
        P(),
    )
    x = fs.shard(X, mesh, P("tp"))
    w = fs.shard(W1, mesh, P())
    gw = grad(lambda w_: fs.gather(dp(x, w_)))(w)
    _close(fs.gather(gw), grad(lambda a: torch.tanh(X @ a).pow(2).sum())(W1), "shard_map grad")
    return True


def test_policy_is_checked():
    try:
        fs.remat(block, policy="dots_with_no_batch_dims")
    except ValueError as e:
        assert "policy must be one of" in str(e) and "'dots'" in str(e), e
    else:
        raise AssertionError("expected ValueError")


def _mms_in_backward(fn, *args) -> int:
    """How many matrix products (aten mm / bmm / addmm) the eager backward of ``fn`` runs."""
    leaves = [a.detach().requires_grad_() for a in args]
    out = fn(*leaves).sum()
    with torch.profiler.profile() as prof:
        out.backward()
    return sum(e.name in ("aten::mm", "aten::bmm", "aten::addmm") for e in prof.events())


def linear_block(x, w1, w2, b):
    return F.gelu(F.linear(torch.tanh(x @ w1), w2, b)).sum(-1)


def test_dots_policy_saves_matmul_outputs_and_matches():
    X, W1, W2, B = _gen(0, 2, 5, 4), _gen(1, 4, 6), _gen(2, 3, 6), _gen(3, 3)
    args = (X, W1, W2, B)
    r = fs.remat(linear_block, policy="dots")
    _close(r(*args), linear_block(*args), "value")
    nums = (0, 1, 2, 3)
    for got, want in zip(
        grad(lambda *a: r(*a).sum(), argnums=nums)(*args),
        grad(lambda *a: linear_block(*a).sum(), argnums=nums)(*args),
    ):
        _close(got, want, "grad")
    per = vmap(grad(lambda w, x: r(x, w, W2, B).sum()), in_dims=(None, 0))(W1, X)
    want = vmap(grad(lambda w, x: linear_block(x, w, W2, B).sum()), in_dims=(None, 0))(W1, X)
    _close(per, want, "vmap(grad)")
    leaves = [a.detach().requires_grad_() for a in args]
    r(*leaves).sum().backward()
    for leaf, want in zip(leaves, grad(lambda *a: linear_block(*a).sum(), argnums=nums)(*args)):
        _close(leaf.grad, want, "eager backward")
    # saved: the 4 inputs and the 2 matmul outputs (nothing saves 6 for the plain block)
    assert _saved(lambda *a: r(*a).sum(), *leaves) == 4 + 2
    assert _saved(lambda *a: fs.remat(linear_block)(*a).sum(), *leaves) == 4
    # the backward differentiates the saved products without recomputing them: 4 products
    # (2 per matmul) where the default policy recomputes the 2 forward ones too
    assert _mms_in_backward(linear_block, *args) == 4
    assert _mms_in_backward(r, *args) == 4
    assert _mms_in_backward(fs.remat(linear_block), *args) == 6


def test_sharded_remat(world2):
    assert world2.run(sharded_remat) == [True, True]


# -- issue 40 item 1: tensors fn closes over get their gradients ----------------------------------


def _layers_loss(params, x, wrap):
    """Two layers, each wrapped as a user wraps a transformer layer (closure, default argument,
    functools.partial, a nested function closing over the weights dict), or not at all."""
    import functools

    h = x

    def layer(h, i):
        return torch.tanh(h @ params[f"w{i}"])

    for i in range(2):
        w = params[f"w{i}"]
        if wrap == "closure":
            h = fs.remat(lambda h: torch.tanh(h @ w))(h)  # noqa: B023 (the mistake: a closure)
        elif wrap == "default":
            h = fs.remat(lambda h, w=w: torch.tanh(h @ w))(h)
        elif wrap == "partial":
            h = fs.remat(functools.partial(lambda h, w: torch.tanh(h @ w), w=w))(h)
        elif wrap == "nested":
            h = fs.remat(lambda h, i=i: layer(h, i))(h)
        else:
            h = torch.tanh(h @ w)
    return (fs.gather(h) if isinstance(h, fs.ShardedArray) else h).sum()


WRAPS = ("closure", "default", "partial", "nested")


def test_closed_over_tensors_get_their_gradients():
    """Was: zeros under torch.func.grad, None under .backward() (gradient error 1.00)."""
    p = {"w0": _gen(3, 4, 4), "w1": _gen(4, 4, 4)}
    x = _gen(5, 3, 4)
    want = grad(_layers_loss)(p, x, "dense")
    for wrap in WRAPS:
        got = grad(_layers_loss)(p, x, wrap)
        for k in p:
            _close(got[k], want[k], f"torch.func.grad {wrap} {k}")
        q = {k: v.clone().requires_grad_() for k, v in p.items()}
        _layers_loss(q, x, wrap).backward()
        for k in p:
            _close(q[k].grad, want[k], f".backward() {wrap} {k}")


def test_closed_over_tensor_still_saves_only_inputs():
    """The weights a closure reads are saved as inputs (references), nothing recomputable."""
    x, w1, w2 = _gen(0, 5, 4), _gen(1, 4, 6).requires_grad_(), _gen(2, 6, 3).requires_grad_()
    assert _saved(lambda: fs.remat(lambda x: block(x, w1, w2))(x).sum()) == 3


_STRAY = torch.nn.Linear(4, 4).double()


def test_a_tensor_remat_cannot_reach_is_refused():
    """A module's parameter read through a global: no silent None gradient, a TypeError."""
    x = _gen(0, 3, 4)
    try:
        fs.remat(lambda h: _STRAY(h))(x).sum().backward()
    except TypeError as e:
        assert "neither an argument nor found in its closure" in str(e), e
    else:
        raise AssertionError("remat of a function reading a global parameter did not refuse")
    with torch.no_grad():  # nothing to differentiate: no refusal
        _close(fs.remat(lambda h: _STRAY(h))(x), _STRAY(x), "no_grad")


def _sharded_closures():
    mesh = fs.Mesh.create((2,), ("x",))
    p = {"w0": _gen(3, 4, 4), "w1": _gen(4, 4, 4)}
    x = _gen(5, 3, 4)
    want = grad(_layers_loss)(p, x, "dense")
    sp = {"w0": fs.shard(p["w0"], mesh, P(None, "x")), "w1": fs.shard(p["w1"], mesh, P("x"))}
    for wrap in WRAPS:
        got = grad(_layers_loss)(sp, x, wrap)
        for k in p:
            assert got[k].spec == sp[k].spec, (wrap, k, got[k].spec)
            _close(fs.gather(got[k]), want[k], f"sharded {wrap} {k}")
        value, g = fs.value_and_grad(_layers_loss)(sp, x, wrap)
        _close(fs.gather(g["w1"]), want["w1"], f"value_and_grad {wrap}")
    return True


def test_closed_over_sharded_arrays_get_their_gradients(world2):
    assert world2.run(_sharded_closures) == [True, True]


def _unpermuted(w):
    """transformers' grouped-mm experts restoring token order: an in-place assignment into a
    value the function made (``inv_perm = torch.empty_like(perm); inv_perm[perm] = ...``)."""
    perm = torch.argsort(w)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0])
    return (torch.tanh(w)[perm] * torch.arange(1.0, w.shape[0] + 1, dtype=w.dtype))[inv]


def _in_place_on_a_fresh_value():
    mesh = fs.Mesh.create((2,), ("x",))
    w = _gen(6, 5)
    want = grad(lambda w: _unpermuted(w).sum())(w)
    sw = fs.shard(w, mesh, P())
    got = fs.value_and_grad(lambda w: fs.gather(fs.remat(_unpermuted)(w)).sum())(sw)[1]
    _close(fs.gather(got), want, "value_and_grad")
    got = grad(lambda w: fs.gather(fs.remat(_unpermuted)(w)).sum())(sw)
    _close(fs.gather(got), want, "torch.func.grad")
    return True


def test_in_place_forms_on_values_fn_makes(world2):
    """Was: TypeError "in-place item assignment ... refused: it crossed a pytree boundary" in
    remat's forward, whose record of the tensors fn reads flattened every ShardedArray as a
    pytree node, marking it as sharing its data (parallelize(remat=True) on a Mixtral)."""
    assert world2.run(_in_place_on_a_fresh_value) == [True, True]


def _residual_block(x, w):
    """A pre-norm residual block whose row-parallel output is a pending sum over tp: with
    ShardedArrays the result is the residual added to that pending sum (still pending)."""
    h = F.layer_norm(x, (x.shape[-1],), w["ln"], w["b"])
    return x + F.linear(F.gelu(h @ w["col"]), w["row"].T, w["b"])


def _two_blocks(x, w, wrap):
    for _ in range(2):
        x = wrap(_residual_block)(x, w)
    return x


def _residual_weights(mesh, tp):
    d = 4
    dense = {"ln": _gen(11, d), "b": _gen(12, d), "col": _gen(13, d, 6), "row": _gen(14, 6, d)}
    specs = {"ln": P(), "b": P(), "col": P(None, tp), "row": P(tp, None)}
    return dense, {k: fs.shard(v, mesh, specs[k]) for k, v in dense.items()}


def _pending_residuals_under_remat():
    """Issue 36: fs.remat of blocks whose input is a pending sum (the residual stream after a
    row-parallel layer), and a pending leaf differentiated through fs.remat: gradients equal
    to dense and to the same function without remat (was: the recompute took its pending
    input for a partial leaf, kept its cotangent on the first tp rank only: wrong gradients
    of everything before it)."""
    mesh = fs.Mesh.create((2,), ("tp",))
    dense, w = _residual_weights(mesh, "tp")
    X = _gen(15, 3, 4)

    def loss(x, w, wrap):
        return (torch.tanh(fs.gather(_two_blocks(x, w, wrap))) ** 2).sum()

    def dense_loss(x, w):
        return (torch.tanh(_two_blocks(x, w, lambda f: f)) ** 2).sum()

    want = grad(dense_loss, argnums=(0, 1))(X, dense)
    x = fs.shard(X, mesh, P())
    pending = fs.reshard(x, P(partial="tp"))  # a leaf whose value is a pending sum
    for wrap in (fs.remat, lambda f: fs.remat(f, policy="collectives")):
        for what, leaf in (("replicated input", x), ("pending input", pending)):
            gx, gw = grad(loss, argnums=(0, 1))(leaf, w, wrap)
            assert gx.layout == leaf.layout, (what, gx.layout)
            _close(fs.gather(gx), want[0], f"{what}: x")
            for k in dense:
                assert gw[k].spec == w[k].spec, (what, k, gw[k].spec)
                _close(fs.gather(gw[k]), want[1][k], f"{what}: {k}")
            # the same function without remat: the same layouts and local blocks
            plain = grad(loss, argnums=(0, 1))(leaf, w, lambda f: f)
            _close(gx.local, plain[0].local, f"{what}: x's block against no remat")
    return True


def test_remat_of_blocks_whose_input_is_a_pending_sum(world2):
    assert world2.run(_pending_residuals_under_remat) == [True, True]


def _remat_in_a_partial_manual_body():
    """Issue 36: fs.remat inside a shard_map manual over cp whose values keep their tp layouts
    (the demo's --cp with --tp or --fsdp). Was: the recompute ran without the body's tracking
    of its global-view ops (no pcast of the weights, invariant over cp, where they met the
    cp-varying activations), so each cp rank's weight gradient was its own addend, labelled
    replicated; and its inputs lost their varying axes, so a nested shard_map (ring
    attention) took them for invariant and summed their cotangents over cp."""
    mesh = fs.Mesh.create((2, 2), ("cp", "tp"))
    dense, w = _residual_weights(mesh, "tp")
    X = _gen(16, 2, 8, 4)  # (batch, seq, d): the sequence over cp, load-balanced
    seq = fs.P(None, "cp")

    def attend(x):  # causal self-attention of one head, ring attention over cp
        q = x.unsqueeze(1)

        def ring(a, b, c):
            return fs.parallel.ring_attention(a, b, c, "cp", causal=True, mesh=mesh)

        ring = fs.shard_map(ring, mesh, (q.spec, q.spec, q.spec), q.spec)
        return x + ring(q, q * 0.5, q * 2.0).squeeze(1)

    def loss(x, w, wrap):
        def body(x, w):
            y = _two_blocks(wrap(attend)(x), w, wrap)
            return fs.lax.psum((torch.tanh(y) ** 2).sum(), "cp")

        return fs.gather(fs.shard_map(body, mesh, (seq, P()), P(), axis_names={"cp"})(x, w))

    def dense_loss(x, w):
        q = x.unsqueeze(1)
        a = F.scaled_dot_product_attention(q, q * 0.5, q * 2.0, is_causal=True)
        y = _two_blocks(x + a.squeeze(1), w, lambda f: f)
        return (torch.tanh(y) ** 2).sum()

    want = grad(dense_loss, argnums=(0, 1))(X, dense)
    x = fs.shard(fs.parallel.load_balance(X, 2, 1), mesh, seq)
    for wrap in (lambda f: f, fs.remat):
        loss_, (gx, gw) = fs.value_and_grad(loss, argnums=(0, 1))(x, w, wrap)
        _close(fs.parallel.load_balance_inverse(fs.gather(gx), 2, 1), want[0], "x")
        for k in dense:
            assert gw[k].spec == w[k].spec, (k, gw[k].spec)
            _close(fs.gather(gw[k]), want[1][k], k)
    return True


def test_remat_in_a_partial_manual_shard_map(world4):
    assert world4.run(_remat_in_a_partial_manual_body) == [True] * 4


def _remat_blocks_in_pipeline_stages():
    """Issue 36: two fs.remat blocks per pipeline stage (pp x tp), the second block's input the
    first's pending residual (was: every gradient wrong, as outside the pipeline)."""
    mesh = fs.Mesh.create((2, 2), ("pp", "tp"))
    C, R = _gen(21, 2, 4, 6), _gen(22, 2, 6, 4) * 0.5  # (stage, ...) column / row parallel
    X, T = _gen(23, 2, 3, 4), _gen(24, 2, 3, 4)  # 2 microbatches

    def block(x, col, row):
        return x + F.gelu(x @ col) @ row

    def stage(p, x):
        for _ in range(2):
            x = fs.remat(block)(x, p["col"], p["row"])
        return x

    def head(_, y, t):
        return (torch.tanh(y) ** 2 * t).sum()

    def loss(params, x):
        targets = fs.shard(T, mesh, P())
        out = fs.parallel.pipeline(stage, params, x, mesh, loss_fn=head, targets=targets)
        return fs.gather(out)

    def dense(C, R, X):
        total = 0
        for mb in range(2):
            y = X[mb]
            for s in range(2):
                for _ in range(2):
                    y = block(y, C[s], R[s])
            total = total + head(None, y, T[mb])
        return total / 2

    params = {
        "col": fs.shard(C, mesh, P("pp", None, "tp")),
        "row": fs.shard(R, mesh, P("pp", "tp")),
    }
    got = fs.grad(loss, argnums=(0, 1))(params, fs.shard(X, mesh, P()))
    want = grad(dense, argnums=(0, 1, 2))(C, R, X)
    _close(fs.gather(got[0]["col"]), want[0], "col")
    _close(fs.gather(got[0]["row"]), want[1], "row")
    _close(fs.gather(got[1]), want[2], "x")
    return True


def test_remat_blocks_in_pipeline_stages(world4):
    assert world4.run(_remat_blocks_in_pipeline_stages) == [True] * 4


def _remat_output_in_a_body_under_torch_func(partial: bool):
    """fs.remat in a shard_map body over cp under torch.func.grad: the rematted block's output
    varies over cp (its input does), so a weight invariant over cp that meets it after the
    block (the head) is pcast and its gradient summed over cp. Was: under torch.func the
    Function's apply reaches the body's tracker, which runs fn's forward with its own mode off,
    so the output read as invariant and the head's gradient was this rank's addend alone
    (parallelize's Llama with cp=2 and remat=True: every gradient wrong). ``partial``: a body
    manual over cp alone on a (cp, tp) mesh (tp of 1), as parallelize's."""
    shape, names = ((2, 1), ("cp", "tp")) if partial else ((2,), ("cp",))
    mesh = fs.Mesh.create(shape, names)
    X, W, H = _gen(31, 6, 4), _gen(32, 4, 4), _gen(33, 4, 3)

    def loss(w, h, x, wrap):
        def body(w, h, x):
            y = wrap(lambda x, w: torch.tanh(x @ w))(x, w) @ h
            return fs.lax.psum((y**2).sum(), "cp")

        manual = {"axis_names": {"cp"}} if partial else {}
        run = fs.shard_map(body, mesh, (P(), P(), P("cp")), P(), **manual)
        return fs.gather(run(w, h, x))

    def dense(w, h):
        return ((torch.tanh(X @ w) @ h) ** 2).sum()

    want = grad(dense, argnums=(0, 1))(W, H)
    args = [fs.shard(t, mesh, P()) for t in (W, H)] + [fs.shard(X, mesh, P("cp"))]
    for wrap in (lambda f: f, fs.remat):
        got = grad(loss, argnums=(0, 1))(*args, wrap)
        for g, w, what in zip(got, want, ("w", "h")):
            _close(fs.gather(g), w, what)
    return True


def test_remat_output_in_a_body_varies_under_torch_func(world2):
    assert world2.run(_remat_output_in_a_body_under_torch_func, False) == [True, True]
    assert world2.run(_remat_output_in_a_body_under_torch_func, True) == [True, True]


# -- randomness: the recompute draws the forward's random numbers -----------------------------


def _dropped(x, w1, w2):
    """A block with dropout (train mode), as a transformer layer has: the recompute must draw
    the forward's masks."""
    h = F.dropout(torch.tanh(x @ w1), 0.5, training=True)
    return F.dropout(h @ w2, 0.25, training=True).sum(-1)


def _after(seed, run):
    """``run()`` from generator state ``seed``: its result and the next draw after it (the state
    it leaves the default generator in)."""
    torch.manual_seed(seed)
    out = run()
    return out, torch.rand(4, dtype=DT)


@pytest.mark.parametrize("policy", [None, "dots"])
def test_dropout_inside_draws_the_forwards_mask(policy):
    """Was: the recompute drew new masks, so the gradient was of another function than the
    loss's (4.5 max abs error on this block, 3.5 per example under vmap; the value right). Oracle: the same block without
    remat from the same seed (``torch.utils.checkpoint`` agrees: ``preserve_rng_state``); the
    default generator is left where the dense call leaves it."""
    X, W1, W2 = _gen(0, 5, 4), _gen(1, 4, 6), _gen(2, 6, 3)
    r = fs.remat(_dropped, policy=policy)

    def loss(f):
        return lambda a, b: f(X, a, b).sum()

    def eager(f):
        a, b = W1.clone().requires_grad_(), W2.clone().requires_grad_()
        f(X, a, b).sum().backward()
        return a.grad, b.grad

    runs = {
        "torch.func.grad": lambda f: grad(loss(f), argnums=(0, 1))(W1, W2),
        "fs.value_and_grad": lambda f: fs.value_and_grad(loss(f), argnums=(0, 1))(W1, W2)[1],
        "backward": eager,
        "grad of grad": lambda f: (
            grad(lambda a: grad(loss(f), argnums=0)(a, W2).pow(2).sum())(W1),
        ),
        **{
            f"vmap(grad, randomness={how!r})": lambda f, how=how: (
                vmap(grad(lambda w, x: f(x[None], w, W2).sum()), in_dims=(None, 0), randomness=how)(
                    W1, X
                ),
            )
            for how in ("different", "same")
        },
    }
    for what, run in runs.items():
        got, after = _after(7, lambda run=run: run(r))
        want, want_after = _after(7, lambda run=run: run(_dropped))
        for g, d in zip(got, want, strict=True):
            _close(g, d, what)
        assert torch.equal(after, want_after), f"{what}: the generator's state after differs"


def test_a_generator_passed_in_is_replayed():
    """A ``torch.Generator`` argument (``torch.bernoulli(..., generator=g)``): the recompute
    draws its forward's numbers, and leaves it where the forward left it."""
    X, W1, W2 = _gen(0, 5, 4), _gen(1, 4, 6), _gen(2, 6, 3)

    def masked(x, w, g):
        h = torch.tanh(x @ w)
        return (h * torch.bernoulli(torch.full_like(h, 0.5), generator=g) @ W2).sum()

    def run(f):
        g = torch.Generator().manual_seed(3)
        out = grad(lambda w: f(X, w, g))(W1)
        return out, torch.rand(3, generator=g, dtype=DT)

    (got, after), (want, want_after) = run(fs.remat(masked)), run(masked)
    _close(got, want, "grad")
    assert torch.equal(after, want_after)


def _family_block(x, w):
    """Channel-wise, alpha and value-dependent draws on ShardedArrays (fshard/ops/nn.py's
    dropout family, fshard/ops/whole.py's drawn_rule) in one block."""
    h = F.dropout2d((x @ w).reshape(4, 3, 2, 1), 0.3).reshape(4, 6)
    h = F.alpha_dropout(torch.tanh(h), 0.2, training=True)
    return (h * torch.bernoulli(torch.sigmoid(h.detach()))).sum()


def _sharded_draws_under_remat():
    """The recompute of a block drawing through the dropout family and a value-dependent draw on
    ShardedArrays draws the forward's numbers: gradients equal to the block without remat
    and to dense, each from one seed, replicated and split over the batch."""
    mesh = fs.Mesh.create((2,), ("x",))
    X, W = _gen(0, 4, 5), _gen(1, 5, 6)
    torch.manual_seed(5)
    want = grad(_family_block, argnums=1)(X, W)
    for spec in (P(), P("x")):
        x, w = fs.shard(X, mesh, spec), fs.shard(W, mesh, P())
        for what, f in (("plain", _family_block), ("remat", fs.remat(_family_block))):
            torch.manual_seed(5)
            _, g = fs.value_and_grad(lambda w, f=f, x=x: f(x, w), argnums=0)(w)
            _close(fs.gather(g), want, f"{spec} {what}")
    return True


def test_sharded_random_draws_inside_remat(world2):
    assert world2.run(_sharded_draws_under_remat) == [True, True]
