"""Random draws on ShardedArrays (fshard/ops/random.py): every rank draws the whole tensor and
keeps its block. Oracle: the same draw on the dense tensor from the same seed (values, and the
gradients of what they multiply), on 2 ranks, replicated, split and pending; and the
generators' states of the ranks holding one value compared (per-rank seeds raise)."""

import torch
import torch.nn.functional as F

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


def draw_cases(table: str) -> int:
    """Each draw of the dict named ``table`` (its lambdas stay on the ranks) on x (4, 6)
    replicated, split on each dim and pending, against dense from one seed (values and
    gradients); the runs."""
    draws = globals()[table]
    mesh = fs.Mesh.create((2,), ("x",))
    a = randn(4, 6)
    n = 0
    for s in (P(), P("x"), P(None, "x"), P(partial="x")):
        for label, draw in draws.items():
            check(mesh, _seeded(draw), [a], [s], label=f"{label} {s}")
            n += 1
    return n


def test_random_draws_equal_dense(world2):
    """Were: no rule (rand_like, randn_like, randint_like: NotImplementedError) or no
    functional form (uniform_, normal_, ...: TypeError), so Mixtral's router jitter in train
    mode stopped the step."""
    assert world2.run(draw_cases, "DRAWS") == [4 * len(DRAWS)] * 2


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


#: the rest of the dropout family (fshard/ops/nn.py's dropout_family_rule): channel-wise noise
#: of ATen's feature shape (an unbatched input's channels first) and alpha dropout's affine map
#: from the one draw; x (4, 6) reshaped to each op's rank, so the split dims land on the batch,
#: the channels and the spatial dims in turn
FAMILY = {
    "dropout1d (N, C, L)": lambda x: F.dropout1d(x.reshape(4, 3, 2), 0.4).reshape(4, 6),
    "dropout1d (C, L)": lambda x: F.dropout1d(x, 0.4),
    "dropout2d": lambda x: F.dropout2d(x.reshape(4, 3, 2, 1), 0.4).reshape(4, 6),
    "dropout3d (N, C, D, H, W)": lambda x: F.dropout3d(x.reshape(2, 2, 3, 2, 1), 0.4).reshape(4, 6),
    "dropout3d (C, D, H, W)": lambda x: F.dropout3d(x.reshape(4, 3, 2, 1), 0.4).reshape(4, 6),
    "alpha_dropout": lambda x: F.alpha_dropout(x, 0.3, training=True),
    "feature_alpha_dropout": lambda x: F.feature_alpha_dropout(
        x.reshape(4, 3, 2), 0.3, True
    ).reshape(4, 6),
    "torch.dropout": lambda x: torch.dropout(x, 0.4, True),
    "torch.feature_dropout": lambda x: torch.feature_dropout(x, 0.4, True),
    "torch.alpha_dropout p=1": lambda x: torch.alpha_dropout(x, 1.0, True),
    "dropout2d eval": lambda x: F.dropout2d(x.reshape(4, 3, 2, 1), 0.4, False).reshape(4, 6),
    # random ops whose draw reads the input's values (fshard/ops/whole.py's drawn_rule): run
    # on the whole input by every rank, replicated
    "bernoulli(p)": lambda x: x * torch.bernoulli(torch.sigmoid(x)),
    "x.bernoulli()": lambda x: x * torch.sigmoid(x).bernoulli(),
    # in place, with a tensor of probabilities (broadcast; its dtype picks torch's draw)
    "x.bernoulli_(p)": lambda x: x * (x * 1).bernoulli_(torch.sigmoid(x)),
    "x.bernoulli_(plain row, float64)": lambda x: (
        x * (x * 1).bernoulli_(torch.linspace(0.1, 0.9, 6, dtype=torch.float64))
    ),
    "multinomial": lambda x: torch.multinomial(torch.softmax(x, -1), 3),
    "multinomial(replacement=True)": lambda x: torch.multinomial(x.exp(), 5, replacement=True),
    "normal(mean, std)": lambda x: torch.normal(x, 0.5),
    "normal(mean, std tensor)": lambda x: torch.normal(x, x.abs() + 0.1),
    "poisson": lambda x: torch.poisson(x.abs()),
    "rrelu(training=True)": lambda x: F.rrelu(x, training=True),
    "gumbel_softmax": lambda x: F.gumbel_softmax(x, tau=0.5),
    "gumbel_softmax(hard=True, dim=0)": lambda x: F.gumbel_softmax(x, hard=True, dim=0),
}


def test_the_dropout_family_and_value_dependent_draws_equal_dense(world2):
    """Were refused by name (NotImplementedError: no sharding rule for dropout1d/2d/3d,
    alpha_dropout, feature_alpha_dropout, torch.dropout, bernoulli with a tensor of
    probabilities, multinomial, normal with a tensor mean, poisson, rrelu in training,
    gumbel_softmax; TypeError: bernoulli_ with tensor arguments): values and gradients against
    dense from one seed."""
    assert world2.run(draw_cases, "FAMILY") == [4 * len(FAMILY)] * 2


def per_rank_seed_family_cases():
    """Per-rank seeds: a value-dependent draw is replicated (raises, whatever its input's
    split); channel-wise dropout of a value split over the batch is each rank's own draw."""
    mesh = fs.Mesh.create((2,), ("x",))
    torch.manual_seed(30 + mesh.rank)
    raised = []
    with fs.config.consistency("every"):
        for s in (P(), P("x")):
            x = fs.shard(torch.ones(4, 6), mesh, s)
            try:
                torch.bernoulli(x * 0.5)
            except ConsistencyError as e:
                raised.append("generator state" in str(e) and "bernoulli" in str(e))
        split = fs.gather(F.dropout2d(fs.shard(torch.ones(4, 3, 2, 1), mesh, P("x")), 0.5))
    own = [torch.Generator().manual_seed(30 + r) for r in range(2)]
    noise = [torch.empty(4, 3, 1, 1).bernoulli_(0.5, generator=g) / 0.5 for g in own]
    want = torch.cat([noise[r][2 * r : 2 * r + 2].expand(2, 3, 2, 1) for r in range(2)])
    return raised, torch.equal(split, want)


def test_per_rank_seeds_before_a_value_dependent_draw_raise(world2):
    for raised, split_equal in world2.run(per_rank_seed_family_cases):
        assert raised == [True, True], raised
        assert split_equal
