"""Per-op rules: global-view torch ops on ShardedArray.

``torch.matmul(x, w)``, ``x @ w``, ``x + y``, ``x.sum(0)``, ``F.softmax(x, -1)``... on
:class:`~fshard.ShardedArray` values dispatch here (``ShardedArray.__torch_function__``, Tensor
method forwarding and Python operators all call :func:`dispatch`). Each op family has one rule
(:mod:`.elementwise`, :mod:`.reduction`, :mod:`.linalg`, :mod:`.shape`, :mod:`.indexing`,
:mod:`.nn`; random draws: :mod:`.random`; in-place forms: :mod:`.inplace`; custom autograd Functions and other code torch
runs without dispatching: :mod:`.opaque`); see
:mod:`.registry` for the rule protocol, :mod:`.binding` for arguments by name, and :func:`register_rule` to add your own.

Example:
    >>> import torch, fshard as fs
    >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
    >>> x = fs.shard(torch.ones(4, 3), mesh, fs.P("x", None))
    >>> y = (x * 2).sum(0)  # op rules: the dense answer, communicating where the layout needs it
    >>> fs.gather(y)
    tensor([8., 8., 8.])
"""

from ..array import Indexing, install_indexing
from . import (
    elementwise,
    indexing,
    inplace,
    linalg,
    loss,
    nn,
    opaque,
    random,
    reduction,
    shape,
    whole,
)
from .binding import bind
from .registry import (
    SCALAR,
    SHAPE_ONLY,
    OpSharding,
    dispatch,
    register_copies,
    register_rule,
    rule_for,
    tensor_inputs,
)

register_copies()


def _set_item(x, key, value) -> None:
    inplace.rebind(
        x,
        lambda: indexing.index_update(x, key, value, "set"),
        "item assignment x[idx] = v",
        "y = x.at[idx].set(v)",
    )


install_indexing(Indexing(_set_item, indexing.At, inplace.inplace_method, inplace.augmented))

__all__ = [
    "OpSharding",
    "bind",
    "SCALAR",
    "SHAPE_ONLY",
    "dispatch",
    "register_rule",
    "rule_for",
    "tensor_inputs",
    "elementwise",
    "reduction",
    "linalg",
    "shape",
    "nn",
    "loss",
    "whole",
    "indexing",
    "inplace",
    "opaque",
    "random",
]
