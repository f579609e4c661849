"""``torch.export.export`` of whole fshard training steps, replayed with ``.module()`` on new
batches and states against dense oracles (torch.func / autograd on full tensors in one process)
and the eager fshard step; and what export refuses, with the reason.

Non-strict export runs the step's Python on fake tensors: ``_comm.tracing()`` is true (via
``torch.compiler.is_compiling()``), dynamo is not (op plans are the eager cache's, no
``_traced.constant``), ShardedArray inputs are flattened to their ``.local`` tensors, and
``fs.value_and_grad`` is a ``make_fx`` graph of ``torch.func.grad_and_value`` (``fshard/_export.py``:
torch 2.13 exports neither ``torch.func.grad`` nor ``torch.autograd.grad`` correctly).
"""

import torch
import torch.distributed as dist
from torch.func import grad

import fshard as fs
from fshard import _comm, lax
from tests.test_compile import _MLP, _AsModule, _gen, _whole_step_case, whole_step


def test_whole_step_adamw_export_replays_exactly(world2):
    """value_and_grad + adamw + apply_updates, exported once, over 3 new batches and states:
    equal to dense autograd + torch.optim.AdamW. The reductions are functional collectives in
    the graph: TP one all_reduce (the forward psum; pcast's backward reduces the batch's
    gradient, which is not taken), DP four (one per pcast param: none dropped)."""
    assert world2.run(whole_step, "tp", "export") == [(1, 1), (1, 1)]
    assert world2.run(whole_step, "dp", "export") == [(4, 4), (4, 4)]


def exported_sgd_step(kind):
    """The local-view step (pcast/psum on ``.local``) with fs.value_and_grad and SGD, exported
    non-strict; the exported module, the eager fshard step and dense torch.func agree on 2 new
    batches fed back. Returns what the loss saw while exported and the graph's constants."""
    mesh = fs.Mesh.create((2,), ("tp",))
    full, params, loss, dense_losses, batches = _whole_step_case(kind, mesh)
    seen = []

    def watched(ps, x, y):
        seen.append((_comm.tracing(), torch.compiler.is_dynamo_compiling()))
        return loss(ps, x, y)

    def step(ps, x, y):
        value, g = fs.value_and_grad(watched)(ps, x, y)
        return fs.tree_map(lambda p, d: p - 0.1 * d, ps, g), value

    ep = torch.export.export(_AsModule(step), (params, *batches[0]), strict=False)
    exported, traced = ep.module(), list(seen)
    ps = eager = params
    dense = dict(full)
    for x, y in batches[1:]:
        (ps, value), (eager, eager_value) = exported(ps, x, y), step(eager, x, y)
        losses = dense_losses(dense, x, y)
        torch.testing.assert_close(value, eager_value)
        torch.testing.assert_close(value, losses[dist.get_rank() % len(losses)])
        dg = grad(lambda p, x=x, y=y: sum(dense_losses(p, x, y)))(dense)
        dense = {k: v - 0.1 * dg[k] for k, v in dense.items()}
        for k, v in ps.items():
            assert v.layout == params[k].layout
            torch.testing.assert_close(v.local, eager[k].local)
            torch.testing.assert_close(fs.gather(v), dense[k])
    return traced, dict(ep.constants)


def test_sgd_step_export_tp_and_dp(world2):
    """Traced once (tracing() true, not dynamo), with no tensor baked in as a constant."""
    for kind in ("tp", "dp"):
        assert world2.run(exported_sgd_step, kind) == [([(True, False)], {})] * 2


def exported_dynamic_batch():
    """The TP step exported with a dynamic batch size (``torch.export.Dim``) on a batch of 4,
    replayed on batches of 6 and 3: equal to the eager step and dense torch.func."""
    mesh = fs.Mesh.create((2,), ("tp",))
    full, params, loss, dense_losses, batches = _whole_step_case("tp", mesh)

    def step(ps, x, y):
        value, g = fs.value_and_grad(loss)(ps, x, y)
        return fs.tree_map(lambda p, d: p - 0.1 * d, ps, g), value

    b = torch.export.Dim("batch", min=2, max=64)
    shapes = ({k: [None] for k in params}, {0: b}, {0: b})  # a ShardedArray: its [local]
    ep = torch.export.export(
        _AsModule(step), (params, *batches[0]), strict=False, dynamic_shapes={"args": shapes}
    )
    for n in (6, 3):
        x, y = _gen(50 + n, n, 8), _gen(60 + n, n, 8)
        (ps, value), (eager, eager_value) = ep.module()(params, x, y), step(params, x, y)
        dg = grad(lambda p, x=x, y=y: dense_losses(p, x, y)[0])(full)
        torch.testing.assert_close(value, eager_value)
        torch.testing.assert_close(value, dense_losses(full, x, y)[0])
        for k, v in ps.items():
            torch.testing.assert_close(v.local, eager[k].local)
            torch.testing.assert_close(fs.gather(v), full[k] - 0.1 * dg[k])
    return True


def test_dynamic_batch_export(world2):
    assert world2.run(exported_dynamic_batch) == [True, True]


def exported_global_view():
    """fs.nn.functional_call of a Megatron-sharded MLP (op rules, a partial row-parallel output
    resharded by the plan) + fs.value_and_grad + SGD, exported non-strict: equal to the eager
    step and to dense torch.func over 2 new batches."""
    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    model = _MLP().double()
    params = fs.nn.shard_params(model, mesh, fs.nn.megatron_plan(column=["fc1"], row=["fc2"]))

    def loss(ps, x, y):
        return fs.gather(((fs.nn.functional_call(model, ps, (x,)) - y) ** 2).mean())

    def step(ps, x, y):
        value, g = fs.value_and_grad(loss)(ps, x, y)
        return fs.tree_map(lambda p, d: p - 0.1 * d, ps, g), value

    def dense_loss(p, x, y):
        return ((torch.func.functional_call(model, p, (x,)) - y) ** 2).mean()

    def batch(i):
        return [fs.shard(_gen(s + i, 4, 8), mesh, fs.P()) for s in (30, 40)]

    ep = torch.export.export(_AsModule(step), (params, *batch(0)), strict=False)
    exported, code = ep.module(), ep.graph_module.code
    ps = eager = params
    dense = {k: fs.gather(v) for k, v in params.items()}
    for i in (1, 2):
        x, y = batch(i)
        (ps, value), (eager, eager_value) = exported(ps, x, y), step(eager, x, y)
        dx, dy = fs.gather(x), fs.gather(y)
        torch.testing.assert_close(value, eager_value)
        torch.testing.assert_close(value, dense_loss(dense, dx, dy))
        dg = grad(dense_loss)(dense, dx, dy)
        dense = {k: v - 0.1 * dg[k] for k, v in dense.items()}
        for k, v in ps.items():
            assert v.layout == params[k].layout
            torch.testing.assert_close(v.local, eager[k].local)
            torch.testing.assert_close(fs.gather(v), dense[k])
    return "_c10d_functional.all_reduce" in code, dict(ep.constants)


def test_global_view_step_export(world2):
    assert world2.run(exported_global_view) == [(True, {})] * 2


def exported_shard_map_step():
    """A data-parallel shard_map step: the replicated w meets the batch-sharded x, so the
    shard_map body's varying-axis tracking (a TorchFunctionMode, kept during fshard's inner
    trace) inserts the pcast whose backward psums the gradient. Exported with
    fs.value_and_grad + SGD, replayed on 2 new batches: equal to dense torch.func and eager."""
    mesh = fs.Mesh.create((2,), ("x",))
    body = fs.shard_map(
        lambda w_, x_: lax.psum(((x_ @ w_) ** 2).sum(), "x"), mesh, (fs.P(), fs.P("x")), fs.P()
    )

    def step(w, x):
        value, g = fs.value_and_grad(lambda w, x: fs.gather(body(w, x)))(w, x)
        return w - 0.1 * g, value

    W = _gen(1, 3, 2)
    batch = [_gen(20 + i, 6, 3) for i in range(3)]
    ep = torch.export.export(
        _AsModule(step),
        (fs.shard(W, mesh, fs.P()), fs.shard(batch[0], mesh, fs.P("x"))),
        strict=False,
    )
    w = eager = fs.shard(W, mesh, fs.P())
    for X in batch[1:]:
        x = fs.shard(X, mesh, fs.P("x"))
        (w, value), (eager, eager_value) = ep.module()(w, x), step(eager, x)
        torch.testing.assert_close(value, ((X @ W) ** 2).sum())
        W = W - 0.1 * grad(lambda w_, X=X: ((X @ w_) ** 2).sum())(W)
        torch.testing.assert_close(value, eager_value)
        torch.testing.assert_close(w.local, eager.local)
        torch.testing.assert_close(w.local, W)
    return w.layout == eager.layout, ep.graph_module.code.count("_c10d_functional.all_reduce.")


def test_shard_map_step_export(world2):
    """Two all_reduces: the forward psum and the pcast's gradient psum (none dropped)."""
    assert world2.run(exported_shard_map_step) == [(True, 2)] * 2


def exported_grad_forms():
    """fs.value_and_grad's other forms under export, replayed on new values, equal to eager
    fshard's (checked against dense in test_autodiff / test_transforms): a partial-layout input
    (refused under torch.compile, where its gradient came back 2x) and ``argnums=(0, 1)`` with
    ``has_aux``."""
    mesh = fs.Mesh.create((2,), ("x",))
    r = dist.get_rank()

    def part(seed):
        return fs.from_local(_gen(seed + r, 2, 3), mesh, fs.P(None, None, partial=("x",)), (2, 3))

    def loss(p, w):
        full = fs.reshard(p, fs.P(None, None)).local
        return (full * w).pow(2).sum(), full.sum()

    f = fs.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    ep = torch.export.export(_AsModule(f), (part(0), _gen(5, 2, 3)), strict=False)
    ((value, aux), (gp, gw)) = ep.module()(part(10), _gen(6, 2, 3))
    ((want_value, want_aux), (want_p, want_w)) = f(part(10), _gen(6, 2, 3))
    torch.testing.assert_close((value, aux, gw), (want_value, want_aux, want_w))
    torch.testing.assert_close(gp.local, want_p.local)
    return gp.layout == want_p.layout == part(0).layout


def test_grad_forms_export(world2):
    assert world2.run(exported_grad_forms) == [True, True]


def export_refusals():
    """What export cannot take raises, naming why: torch.func.grad of fshard collectives
    (torch would bake its inputs into the graph as constants) and fs.value_and_grad under
    strict export (dynamo cannot trace the make_fx trace that replaces torch.func.grad)."""
    mesh = fs.Mesh.create((2,), ("tp",))
    _, params, loss, _, batches = _whole_step_case("tp", mesh)
    out = []
    for strict, grad_of in ((False, grad), (True, grad), (True, fs.grad)):
        try:
            torch.export.export(_AsModule(grad_of(loss)), (params, *batches[0]), strict=strict)
            out.append("exported")
        except Exception as e:
            msg = str(e)
            out.append(
                "records the transform's inputs as constants" in msg
                if grad_of is grad
                else "export with strict=False" in msg
            )
    return out


def test_export_refusals(world2):
    assert world2.run(export_refusals) == [[True, True, True]] * 2


def exported_forward_strict_and_not():
    """Export of a TP forward (no gradient) in both modes: a functional all_reduce in the graph,
    replayed on a new batch equal to dense."""
    mesh = fs.Mesh.create((2,), ("tp",))
    full, params, loss, dense_losses, batches = _whole_step_case("tp", mesh)
    out = []
    for strict in (False, True):
        ep = torch.export.export(_AsModule(loss), (params, *batches[0]), strict=strict)
        x, y = batches[1]
        torch.testing.assert_close(ep.module()(params, x, y), dense_losses(full, x, y)[0])
        out.append("_c10d_functional.all_reduce" in ep.graph_module.code)
    return out


def test_forward_export_both_modes(world2):
    assert world2.run(exported_forward_strict_and_not) == [[True, True]] * 2
