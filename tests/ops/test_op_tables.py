"""The rule tables added for OpInfo coverage (issue 21 item 6), on 2 ranks: what the OpInfo
conformance test does not pin, the communication (a batched matrix function of a batch-split
value runs with none; ``nansum`` over a split dim leaves a pending sum), and the cases its
samples found (an empty block's backward, a block gathered along a later dim being a strided
view), as values and gradients against dense torch."""

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from tests._opcheck import check, randn

P = fs.P


def _spd(b, n, seed):
    a = randn(b, n, n, seed=seed)
    return a @ a.mT + n * torch.eye(n)


def table_cases():
    mesh = fs.Mesh.create((2,), ("x",))
    a, rhs = _spd(5, 3, 0), randn(5, 3, 2, seed=1)
    sa, srhs = fs.shard(a, mesh, P("x")), fs.shard(rhs, mesh, P("x"))
    with fs.debug.comm_log() as log:
        det = torch.linalg.det(sa)
        sol = torch.linalg.solve(sa, srhs)
        chol = torch.linalg.cholesky(sa)
    assert log == []  # the batch stays split: every rank solves its own matrices
    assert (det.spec, sol.spec, chol.spec) == (P("x"), P("x", None, None), P("x", None, None))
    torch.testing.assert_close(fs.gather(sol), torch.linalg.solve(a, rhs))
    check(mesh, lambda m, r: torch.linalg.solve(m, r), [a, rhs], [P("x"), P("x")], label="solve")
    check(mesh, torch.linalg.det, [a], [P(None, "x")], label="det, matrix dim split")

    x = randn(4, 5, seed=2)
    x[1, 2] = float("nan")
    sx = fs.shard(x, mesh, P(None, "x"))
    with fs.debug.comm_log() as log:
        s = torch.nansum(sx, 1)
    assert log == [] and s.spec == P(None, partial="x")
    torch.testing.assert_close(fs.gather(s), torch.nansum(x, 1))

    # a batch of 1 over 2 ranks: one empty block, whose pixel_shuffle backward is malformed
    check(mesh, lambda t: F.pixel_shuffle(t, 2), [randn(1, 8, 3, 3, seed=3)], [P("x")])
    # blocks gathered along the last dim are strided views: kernels that need stride 1 run
    idx = torch.randint(0, 5, (3, 5), generator=torch.Generator().manual_seed(0))
    check(mesh, lambda t: torch.take_along_dim(t, idx), [randn(3, 5, seed=4)], [P(None, "x")])
    check(mesh, lambda t: torch.view_as_complex(t).abs(), [randn(3, 2, seed=5)], [P(None, "x")])
    return True


@pytest.mark.timeout(300)
def test_rule_tables_on_two_ranks(world2):
    assert world2.run(table_cases) == [True, True]
