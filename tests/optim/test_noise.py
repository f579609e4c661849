"""fs.optim.add_noise / noisy_sgd: the noise is torch's (optax draws from JAX's PRNG, which no
torch generator reproduces), so the tests check optax's *statistics* (variance
``eta / t**gamma`` at step ``t``, zero mean, fresh noise every step) and that the noise does
not depend on the layout: unevenly sharded params get exactly the dense noise."""

import math

import torch

import fshard as fs
from fshard import optim

SHAPES = {"w": (5, 3), "v": (4, 7), "b": (6,)}
SPECS = {"w": fs.P("x"), "v": fs.P(None, "x"), "b": fs.P()}


def _grads(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(*s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}


def _dense(steps: int, key: int) -> list:
    tx = optim.noisy_sgd(0.1, eta=0.3, gamma=0.55, key=key)
    params = {k: torch.zeros(s, dtype=torch.float64) for k, s in SHAPES.items()}
    state, out = tx.init(params), []
    for t in range(steps):
        params, state = optim.step(tx, _grads(t), state, params)
        out.append(params)
    return out


def test_noise_statistics_follow_optax_variance():
    eta, gamma, n = 0.5, 0.55, 200_000
    tx = optim.add_noise(eta, gamma, key=7)
    zeros = {"a": torch.zeros(n, dtype=torch.float64), "b": torch.zeros(2, n // 2)}
    state, draws = tx.init(zeros), []
    for t in range(1, 4):
        noise, state = tx.update(zeros, state)
        var = eta / t**gamma
        for x in noise.values():
            assert abs(x.double().var().item() / var - 1) < 0.02, (t, x.var(), var)
            assert abs(x.double().mean().item()) < 5 * math.sqrt(var / x.numel())
        draws.append(noise["a"])
    corr = torch.corrcoef(torch.stack(draws))  # every step draws fresh noise
    assert (corr - torch.eye(3)).abs().max() < 0.02
    assert int(state.count) == 3


def test_noise_is_reproducible_per_key():
    a, b, c = _dense(2, key=1), _dense(2, key=1), _dense(2, key=2)
    assert all(torch.equal(a[-1][k], b[-1][k]) for k in SHAPES)
    assert not torch.equal(a[-1]["w"], c[-1]["w"])


def _sharded_noisy_sgd():
    mesh = fs.Mesh.create((2,), ("x",))
    tx = optim.noisy_sgd(0.1, eta=0.3, gamma=0.55, key=3)
    params = {k: fs.shard(torch.zeros(s, dtype=torch.float64), mesh, SPECS[k]) for k, s in SHAPES.items()}  # fmt: skip
    state = tx.init(params)
    with fs.debug.comm_log() as log:
        for t in range(3):
            grads = {k: fs.shard(v, mesh, SPECS[k]) for k, v in _grads(t).items()}
            params, state = optim.step(tx, grads, state, params)
    return {k: fs.gather(v) for k, v in params.items()}, len(log)


def test_noisy_sgd_sharded_equals_dense_exactly(world2):
    """Rows split 3 + 2, columns 4 + 3: each rank's noise is its block of the dense noise,
    with no communication."""
    want = _dense(3, key=3)[-1]
    for got, comms in world2.run(_sharded_noisy_sgd):
        assert comms == 0
        for k in SHAPES:
            assert torch.equal(got[k], want[k]), k
