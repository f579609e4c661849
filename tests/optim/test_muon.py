"""fs.optim.muon against torch.optim.Muon (+ torch.optim.AdamW for the other leaves) on dense
params, with the matrices sharded as tensor parallel (rows, columns), FSDP (rows, uneven) and
replicated on 2 ranks: 3 steps equal within float32 tolerance, the momentum keeps each param's
layout, and the only communication is one bfloat16 all_gather per sharded matrix per step."""

import torch

import fshard as fs

SHAPES = {"col": (6, 4), "row": (3, 8), "uneven": (5, 3), "rep": (4, 6), "bias": (5,)}
SPECS = {
    "col": fs.P("x", None),  # a column-parallel weight: output rows split
    "row": fs.P(None, "x"),  # a row-parallel weight: input columns split
    "uneven": fs.P("x", None),  # FSDP's dim-0 split, 3 | 2
    "rep": fs.P(),
    "bias": fs.P("x"),
}
KW = {"lr": 0.02, "weight_decay": 0.1}


def _problem():
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}
    grads = [{k: torch.randn(*s, generator=g) for k, s in SHAPES.items()} for _ in range(3)]
    return params, grads


def _torch_reference(params, grads):
    tp = {k: v.clone().requires_grad_() for k, v in params.items()}
    muon = torch.optim.Muon([v for v in tp.values() if v.ndim == 2], **KW)
    adamw = torch.optim.AdamW([v for v in tp.values() if v.ndim != 2], **KW)
    for g in grads:
        for k, v in tp.items():
            v.grad = g[k].clone()
        muon.step()
        adamw.step()
    return {k: v.detach() for k, v in tp.items()}


def _sharded_muon():
    mesh = fs.Mesh.create((2,), ("x",))
    params, grads = _problem()
    ref = _torch_reference(params, grads)
    tx = fs.optim.muon(KW["lr"], weight_decay=KW["weight_decay"])
    ps = {k: fs.shard(v, mesh, SPECS[k]) for k, v in params.items()}
    state = tx.init(ps)
    with fs.debug.comm_log() as log:
        for g in grads:
            ps, state = fs.optim.step(tx, {k: fs.shard(v, mesh, SPECS[k]) for k, v in g.items()}, state, ps)  # fmt: skip
    errors = {k: (fs.gather(ps[k]) - ref[k]).abs().max().item() for k in ps}
    layouts = all(ps[k].layout == fs.Layout(mesh, SPECS[k], SHAPES[k]) for k in ps)
    momentum = state.inner_states["muon"][0].mu  # the chain's (muon, decay, lr) states
    matrices = sorted(k for k in SHAPES if len(SHAPES[k]) == 2)  # optree's dict order
    kept = [m.layout for m in momentum] == [ps[k].layout for k in matrices]
    comm = [(r.op, r.axes, r.nbytes) for r in log]
    return errors, layouts, kept, comm, mesh.rank


def test_muon_equals_torch_optim_muon_on_sharded_matrices(world2):
    for errors, layouts, kept, comm, rank in world2.run(_sharded_muon):
        assert all(e < 1e-6 for e in errors.values()), errors
        assert layouts and kept
        # per step, one bfloat16 all_gather of this rank's block of each sharded matrix
        block = {"col": 3 * 4, "row": 3 * 4, "uneven": (3 if rank == 0 else 2) * 3}
        want = [("all_gather", ("x",), 2 * n) for n in block.values()] * 3
        assert sorted(comm) == sorted(want), comm


def test_muon_plain_tensors_equal_torch():
    params, grads = _problem()
    ref = _torch_reference(params, grads)
    tx = fs.optim.muon(KW["lr"], weight_decay=KW["weight_decay"])
    ps, state = dict(params), tx.init(params)
    for g in grads:
        ps, state = fs.optim.step(tx, g, state, ps)
    for k in ps:
        torch.testing.assert_close(ps[k], ref[k], rtol=0, atol=1e-6)


def test_scale_by_muon_checks_its_arguments():
    import pytest

    with pytest.raises(ValueError, match="every leaf must be a 2-D matrix"):
        fs.optim.scale_by_muon().init({"b": torch.zeros(3)})
    with pytest.raises(ValueError, match="ns_steps must be an int"):
        fs.optim.scale_by_muon(ns_steps=0)
    with pytest.raises(ValueError, match="adjust_lr_fn must be"):
        fs.optim.scale_by_muon(adjust_lr_fn="sqrt")
