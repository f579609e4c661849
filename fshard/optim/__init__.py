"""Optax-style optimizers over pytrees of ShardedArrays (and plain tensors).

A :class:`GradientTransformation` is a NamedTuple of two pure functions::

    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = fs.optim.apply_updates(params, updates)

Laid out as optax: :mod:`~fshard.optim.base` (the interface and the states),
:mod:`~fshard.optim.transform` (the ``scale_by_*`` building blocks),
:mod:`~fshard.optim.alias` (``sgd``, ``adamw``, ... as chains of building blocks),
:mod:`~fshard.optim.combine` (``chain``, ``masked``, ``multi_transform``),
:mod:`~fshard.optim.clipping`, :mod:`~fshard.optim.schedule`,
:mod:`~fshard.optim.wrappers` (``MultiSteps``, ``apply_if_finite``, ``inject_hyperparams``)
and :mod:`~fshard.optim.update` (``apply_updates``, ``step``); losses as ``optax.losses`` in
:mod:`fs.optim.losses <fshard.optim.losses>`.

Nothing is ever mutated: every ``update`` returns new tensors, computed leaf by leaf on the
*local* shards with plain torch ops, so the step can be differentiated (meta-learning: the
gradient w.r.t. the learning rate or the initial params through ``apply_updates``), batched
with ``torch.func.vmap`` (a batch of optimizers) and compiled with
``torch.compile(fullgraph=True)`` (step counts stay tensors). The one opt-in exception is
:func:`step` with ``donate=True`` (JAX's ``donate_argnums``): params and state buffers are then
reused in place with ``torch.optim``'s own foreach kernels where the transformation carries a
``donated_step`` (sgd, adam, adamw), which on CPU saves the page faults and memory passes of
fresh parameter-sized tensors every step.

State tensors are ShardedArrays with the parameters' layouts (a sharded param's Adam moments
are sharded the same way), so optimizer memory is sharded with the params and element-wise
transformations never communicate. The transformations that need whole leaves (global norms,
trust ratios, Adafactor's factored moments, NaN checks) reduce over the mesh axes that shard
them, with one small all_reduce per group of leaves sharded alike.

Hyperparameters may be floats, 0-d tensors (differentiable) or *schedules*: callables of the
step count (0 for the first update), e.g. :func:`warmup_cosine_decay_schedule`.

Example:
    >>> import torch, fshard as fs
    >>> params = {"w": torch.ones(3)}
    >>> tx = fs.optim.adamw(1e-2, weight_decay=0.1)
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": torch.ones(3)}, state, params)
    >>> new = fs.optim.apply_updates(params, updates)
    >>> bool((new["w"] < 1).all())
    True
"""

from . import (
    _muon,
    _shampoo,
    alias,
    base,
    clipping,
    combine,
    contrib,
    linesearch,
    losses,  # noqa: F401  (the namespace fs.optim.losses, as optax.losses)
    schedule,
    transform,
    update,
    wrappers,
)
from ._muon import *  # noqa: F403
from ._shampoo import *  # noqa: F403
from .alias import *  # noqa: F403
from .base import *  # noqa: F403
from .clipping import *  # noqa: F403
from .combine import *  # noqa: F403
from .contrib import *  # noqa: F403
from .linesearch import *  # noqa: F403
from .schedule import *  # noqa: F403
from .transform import *  # noqa: F403
from .update import *  # noqa: F403
from .wrappers import *  # noqa: F403

__all__ = [
    *base.__all__,
    *transform.__all__,
    *alias.__all__,
    *_muon.__all__,
    *combine.__all__,
    *contrib.__all__,
    *linesearch.__all__,
    *clipping.__all__,
    *schedule.__all__,
    *_shampoo.__all__,
    *wrappers.__all__,
    *update.__all__,
]
