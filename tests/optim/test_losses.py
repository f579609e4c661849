"""fs.optim.losses against optax.losses (values recorded by tools/record_optax.py), and on 2
ranks with the inputs sharded over the class dim (7 = 4 + 3, as a tensor-parallel vocabulary)
and over the batch dim (5 = 3 + 2): values equal the dense ones and the gradients of the mean
loss equal dense torch autograd's, in the inputs' layouts; integer-label cross entropy moves
all_reduces of one value per example, never the logits."""

import functools

import numpy as np
import pytest
import torch

import fshard as fs
from fshard import optim
from tests import optax_cases
from tests._opcheck import nan_max
from tests.optim.test_optax import FSHARD, _load

LOSSES = {name: functools.partial(fn, FSHARD) for name, fn in optax_cases.LOSSES.items()}
#: the float inputs a loss is differentiated against (the others are labels)
DIFF = {"logits", "targets", "probs"}


def _inputs() -> dict:
    ref = _load()
    return {k[12:]: torch.from_numpy(ref[k]) for k in ref if k.startswith("loss_inputs/")}


def test_reference_covers_every_loss():
    assert {k[5:] for k in _load() if k.startswith("loss/")} == set(LOSSES)
    assert set(optim.losses.__all__) <= {n.removesuffix("_axis0").removesuffix("_no_targets") for n in LOSSES}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_losses_match_optax_dense(name):
    got = LOSSES[name](_inputs())
    np.testing.assert_allclose(got.numpy(), _load()[f"loss/{name}"], rtol=1e-12, atol=1e-14)


def _dense_value_and_grads(name, x):
    x = {k: v.clone().requires_grad_(k in DIFF and name != "smooth_labels" or k == "probs") for k, v in x.items()}  # fmt: skip
    out = LOSSES[name](x)
    out.mean().backward()
    return out.detach(), {k: v.grad for k, v in x.items() if v.grad is not None}


#: (logits-like spec, labels spec): the class dim split, then the batch dim
LAYOUTS = {
    "classes": (fs.P(None, "x"), fs.P()),
    "batch": (fs.P("x", None), fs.P("x")),
}


def sharded_losses_rank_fn(layout):
    mesh = fs.Mesh.create((2,), ("x",))
    spec, label_spec = LAYOUTS[layout]
    dense = _inputs()
    errs, comms = {}, {}
    for name in LOSSES:
        want, want_grads = _dense_value_and_grads(name, dense)
        x = {k: fs.shard(v, mesh, label_spec if v.dim() == 1 else spec) for k, v in dense.items()}
        diff = sorted(want_grads)

        def mean_loss(*args, x=x, diff=diff, name=name):
            return LOSSES[name]({**x, **dict(zip(diff, args))}).mean()

        with fs.debug.comm_log() as log:
            value = LOSSES[name](x)
        comms[name] = [(r.op, r.nbytes) for r in log]
        if isinstance(value, fs.ShardedArray):
            comms[name + "/partial"] = value.layout.partial
        got = fs.gather(value) if isinstance(value, fs.ShardedArray) else value
        _, grads = fs.value_and_grad(mean_loss, argnums=tuple(range(len(diff))))(
            *[x[k] for k in diff]
        )
        layouts_kept = all(g.layout == x[k].layout for g, k in zip(grads, diff))
        err = (got - want).abs().max().item()
        gerr = nan_max((fs.gather(g) - want_grads[k]).abs().max() for g, k in zip(grads, diff))
        errs[name] = (err, gerr, layouts_kept)
    return errs, comms


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_losses_sharded_equal_dense_two_ranks(world2, layout):
    for errs, comms in world2.run(sharded_losses_rank_fn, layout):
        for name, (err, gerr, kept) in errs.items():
            assert err < 1e-12 and gerr < 1e-12 and kept, (name, err, gerr, kept)
        ce = comms["softmax_cross_entropy_with_integer_labels"]
        if layout == "classes":  # logsumexp's pmax and psum of 5 float64s; the label's logit
            # leaves the loss a pending sum over x (one more such all_reduce when gathered)
            assert ce == [("all_reduce", 5 * 8)] * 2, ce
            assert comms["softmax_cross_entropy_with_integer_labels/partial"] == ("x",)
        else:  # the batch split: every example's classes are local
            assert ce == [] and comms["cosine_similarity"] == [], comms
