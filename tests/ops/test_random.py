"""Random draws on ShardedArrays (fshard/ops/random.py): every rank draws the whole tensor and
keeps its block. Oracle: the same draw on the dense tensor from the same seed (values, and the
gradients of what they multiply), on 2 ranks, replicated, split and pending; and the
generators' states of the ranks holding one value compared (per-rank seeds raise)."""

import torch

import fshard as fs
from fshard.consistency import ConsistencyError
from tests._opcheck import check, randn

P = fs.P

#: label -> a draw from x's shape (a fresh seed each call: the sharded and the dense call draw
#: the same numbers); each multiplies x so that its gradient is checked too
DRAWS = {
    "rand_like": lambda x: x * torch.rand_like(x),
    "randn_like": lambda x: x * torch.randn_like(x),
    "randint_like(x, 7)": lambda x: x * torch.randint_like(x, 7),
    "randint_like(x, 3, 9)": lambda x: x * torch.randint_like(x, 3, 9),
    "randn_like float64": lambda x: x * torch.randn_like(x, dtype=torch.float64),
    # a router's jitter (Mixtral, PhiMoE, MiniMax): torch.empty_like(h).uniform_(1 - e, 1 + e)
    "empty_like().uniform_": lambda x: x * torch.empty_like(x).uniform_(0.9, 1.1),
    "normal_(1, 2)": lambda x: x * torch.empty_like(x).normal_(1.0, 2.0),
    "normal_(mean=, std=)": lambda x: x * torch.empty_like(x).normal_(mean=-1.0, std=0.5),
    "exponential_": lambda x: x * torch.empty_like(x).exponential_(2.0),
    "cauchy_": lambda x: x * torch.empty_like(x).cauchy_(),
    "log_normal_": lambda x: x * torch.empty_like(x).log_normal_(),
    "geometric_": lambda x: x * torch.empty_like(x).geometric_(0.4),
    "random_(3, 9)": lambda x: x * torch.empty_like(x).random_(3, 9),
    "bernoulli_(0.3)": lambda x: x * torch.empty_like(x).bernoulli_(0.3),
    "uniform_(generator=)": lambda x: (
        x * torch.empty_like(x).uniform_(generator=torch.Generator().manual_seed(4))
    ),
    # the draw rebinds x itself (a fresh value: in place)
    "x.uniform_ in place": lambda x: (x * 1).uniform_(-1.0, 1.0) + x,
}


def _seeded(draw):
    def f(x):
        torch.manual_seed(11)
        return draw(x)

    return f


def random_cases():
    mesh = fs.Mesh.create((2,), ("x",))
    a = randn(4, 6)
    n = 0
    for s in (P(), P("x"), P(None, "x"), P(partial="x")):
        for label, draw in DRAWS.items():
            check(mesh, _seeded(draw), [a], [s], label=f"{label} {s}")
            n += 1
    return n


def test_random_draws_equal_dense(world2):
    """Were: no rule (rand_like, randn_like, randint_like: NotImplementedError) or no
    functional form (uniform_, normal_, ...: TypeError), so Mixtral's router jitter in train
    mode stopped the step."""
    assert world2.run(random_cases) == [4 * len(DRAWS)] * 2


def per_rank_seed_cases():
    """Per-rank seeds: a draw of a value replicated over the axis raises on both ranks (checked
    at once in "every" mode); a draw split over the axis is each rank's block of its own draw."""
    mesh = fs.Mesh.create((2,), ("x",))
    torch.manual_seed(20 + mesh.rank)
    raised = []
    with fs.config.consistency("every"):
        for s in (P(), P(partial="x")):
            x = fs.shard(torch.ones(4, 6), mesh, s)
            try:
                torch.empty_like(x).uniform_()
            except ConsistencyError as e:
                raised.append("generator state" in str(e) and "uniform_" in str(e))
        split = fs.gather(torch.rand_like(fs.shard(torch.ones(4, 6), mesh, P("x"))))
    own = [torch.Generator().manual_seed(20 + r) for r in range(2)]
    want = torch.cat([torch.rand(4, 6, generator=g)[2 * r : 2 * r + 2] for r, g in enumerate(own)])
    return raised, torch.equal(split, want)


def test_per_rank_seeds_before_a_replicated_draw_raise(world2):
    for raised, split_equal in world2.run(per_rank_seed_cases):
        assert raised == [True, True], raised
        assert split_equal


def refused_case():
    x = fs.shard(torch.ones(4), fs.Mesh.create((2,), ("x",)), P("x"))
    try:
        x.bernoulli_(torch.full((4,), 0.5))
    except TypeError as e:
        return str(e)
    return "no error"


def test_draws_that_need_the_whole_input_are_refused(world2):
    """``Tensor.bernoulli_(p)`` with a tensor of probabilities (its values would have to be
    whole on every rank): refused by name, before any draw."""
    for message in world2.run(refused_case):
        assert "bernoulli_ with tensor arguments is not supported" in message, message
