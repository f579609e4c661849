"""fs.optim.shampoo against a dense torch Shampoo written here from the definition (global
matrices, explicit block loops, inverse roots by SVD), given the same block partition: the
tiles of each shard. On 2 ranks with a matrix split over rows (5 = 3 + 2), one over columns
(7 = 4 + 3), a replicated one and a vector, 6 steps equal the dense oracle in float64, the step
issues no collective, and each rank's blocks are its shard's tiles."""

import torch

import fshard as fs
from fshard import optim

SHAPES = {"w": (5, 3), "v": (4, 7), "r": (6, 5), "b": (6,)}
SPECS = {"w": fs.P("x"), "v": fs.P(None, "x"), "r": fs.P(), "b": fs.P("x")}
HP = {"b1": 0.8, "b2": 0.9, "block_size": 2, "precondition_frequency": 2, "eps": 1e-6}
GRAFT_EPS, LR, WD, STEPS = 1e-8, 0.05, 0.01, 6


def _problem():
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}
    grads = [
        {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}
        for _ in range(STEPS)
    ]
    return params, grads


def _ranges(n: int, cuts: list[int], size: int) -> list[tuple[int, int]]:
    """Global index ranges of the blocks along one dim: each shard [cuts[i], cuts[i+1]) tiled."""
    out = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        out += [(i, min(i + size, b)) for i in range(a, b, size)]
    return out


def partition(shape, spec_dim_sharded: tuple[bool, bool], ranks: int, size: int) -> list:
    """The blocks of a matrix whose dims are split (``True``) over ``ranks`` as fshard splits
    them (ceil-sized leading shards), each shard tiled by ``size``."""

    def cuts(n, split):
        if not split:
            return [0, n]
        step = -(-n // ranks)
        return sorted({min(i * step, n) for i in range(ranks)} | {n})

    rows = _ranges(shape[0], cuts(shape[0], spec_dim_sharded[0]), size)
    cols = _ranges(shape[1], cuts(shape[1], spec_dim_sharded[1]), size)
    return [(r, c) for r in rows for c in cols]


def _inv_root(m: torch.Tensor) -> torch.Tensor:
    u, s, _ = torch.linalg.svd(m)
    return u @ torch.diag(s**-0.25) @ u.T


def dense_shampoo(params, grads, blocks: dict):
    """Shampoo from the definition on whole tensors: for each block of ``blocks[k]``
    (global ranges), statistics, inverse fourth roots of ``S + eps I`` (refreshed every
    ``precondition_frequency`` steps), grafting to the bias-corrected diagonal direction's norm,
    a bias-corrected first moment, decoupled weight decay."""
    b1, b2, eps, freq = HP["b1"], HP["b2"], HP["eps"], HP["precondition_frequency"]
    p = {k: v.clone() for k, v in params.items()}
    mu = {k: torch.zeros_like(v) for k, v in p.items()}
    nu = {k: torch.zeros_like(v) for k, v in p.items()}
    stats = {}
    for t, g in enumerate(grads, 1):
        for k in p:
            nu[k] = b2 * nu[k] + (1 - b2) * g[k] ** 2
            d = g[k] / (torch.sqrt(nu[k] / (1 - b2**t)) + GRAFT_EPS)
            for i, ((r0, r1), (c0, c1)) in enumerate(blocks.get(k, [])):
                gb = g[k][r0:r1, c0:c1]
                lo, ro, lq, rq = stats.get((k, i), (0.0, 0.0, None, None))
                lo = b2 * lo + (1 - b2) * gb @ gb.T
                ro = b2 * ro + (1 - b2) * gb.T @ gb
                if (t - 1) % freq == 0:
                    lq = _inv_root(lo + eps * torch.eye(r1 - r0, dtype=gb.dtype))
                    rq = _inv_root(ro + eps * torch.eye(c1 - c0, dtype=gb.dtype))
                stats[(k, i)] = (lo, ro, lq, rq)
                pre = lq @ gb @ rq
                d[r0:r1, c0:c1] = pre * d[r0:r1, c0:c1].norm() / pre.norm()
            mu[k] = b1 * mu[k] + (1 - b1) * d
            p[k] = p[k] - LR * (mu[k] / (1 - b1**t) + WD * p[k])
    return p


def _tx():
    return optim.shampoo(LR, graft_eps=GRAFT_EPS, weight_decay=WD, **HP)


def test_shampoo_plain_tensors_equal_dense_oracle():
    params, grads = _problem()
    size = HP["block_size"]
    blocks = {k: partition(s, (False, False), 1, size) for k, s in SHAPES.items() if len(s) == 2}
    want = dense_shampoo(params, grads, blocks)
    tx, p = _tx(), dict(params)
    state = tx.init(p)
    for g in grads:
        p, state = optim.step(tx, g, state, p)
    for k in SHAPES:
        torch.testing.assert_close(p[k], want[k], rtol=1e-10, atol=1e-12)


def _sharded_shampoo():
    mesh = fs.Mesh.create((2,), ("x",))
    params, grads = _problem()
    tx = _tx()
    ps = {k: fs.shard(v, mesh, SPECS[k]) for k, v in params.items()}
    state = tx.init(ps)
    with fs.debug.comm_log() as log:
        for g in grads:
            gs = {k: fs.shard(v, mesh, SPECS[k]) for k, v in g.items()}
            ps, state = optim.step(tx, gs, state, ps)
    shapes = {
        "w": [tuple(x.shape) for x in state[0].left["w"]],
        "v": [tuple(x.shape) for x in state[0].right["v"]],
    }
    return {k: fs.gather(v) for k, v in ps.items()}, len(log), shapes, mesh.rank


def test_shampoo_sharded_equals_dense_with_shard_aligned_blocks(world2):
    params, grads = _problem()
    size = HP["block_size"]
    split = {"w": (True, False), "v": (False, True), "r": (False, False)}
    blocks = {k: partition(SHAPES[k], s, 2, size) for k, s in split.items()}
    assert blocks["w"][2:4] == [((2, 3), (0, 2)), ((2, 3), (2, 3))]  # rank 0's last row tile
    want = dense_shampoo(params, grads, blocks)
    for got, comms, shapes, rank in world2.run(_sharded_shampoo):
        assert comms == 0  # every block is local: no collective in 6 steps
        for k in SHAPES:
            torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12)
        # w's shard is 3 or 2 rows: blocks of rows (2, 1) or (2,); L is (rows, rows)
        assert shapes["w"] == ([(2, 2), (2, 2), (1, 1), (1, 1)] if rank == 0 else [(2, 2)] * 2)
        # v's shard is 4 or 3 columns: R is (cols, cols) per column tile
        assert shapes["v"] == ([(2, 2)] * 4 if rank == 0 else [(2, 2), (1, 1)] * 2)


def test_shampoo_partition_changes_the_numbers():
    """The shard-aligned blocks are a real choice: a 5-row matrix preconditioned as blocks of
    3 + 2 rows differs from 2 + 2 + 1 (so the oracle above is not blind to the partition)."""
    params, grads = _problem()
    a = dense_shampoo(params, grads, {"w": partition((5, 3), (True, False), 2, 2)})
    b = dense_shampoo(params, grads, {"w": partition((5, 3), (False, False), 1, 2)})
    assert (a["w"] - b["w"]).abs().max() > 1e-4


def test_scale_by_shampoo_checks_its_arguments():
    import pytest

    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        optim.scale_by_shampoo(block_size=0)
    with pytest.raises(ValueError, match="b2 must be in"):
        optim.scale_by_shampoo(b2=1.0)
