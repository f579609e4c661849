"""fshard: JAX-style functional sharding for PyTorch.

A sharded value is an immutable pytree of one plain local tensor plus a static layout, so every
``torch.func`` transform sees ordinary tensors; communication happens only in the collective
primitives of :mod:`fshard.lax`.
"""

from . import (
    checkpoint,
    config,
    consistency,
    data,
    debug,
    hf_checkpoint,
    interop,
    launch,
    lax,
    nn,
    ops,
    optim,
    parallel,
)
from .api import empty, from_local, full, gather, ones, rand, randn, reshard, shard, zeros
from .array import ShardedArray
from .autodiff import grad, value_and_grad
from .dryrun import DryRunReport, Hardware, dry_run
from .jacobian import hessian, jacfwd
from .mesh import Mesh
from .planner import Step, plan
from .remat import remat
from .shard_map import shard_map
from .spec import Layout, P, PartitionSpec, Parts, ShardMetadata
from .tree import tree_flatten, tree_leaves, tree_map, tree_structure, tree_unflatten

__all__ = [
    "Mesh",
    "P",
    "PartitionSpec",
    "Parts",
    "Layout",
    "ShardMetadata",
    "ShardedArray",
    "Step",
    "plan",
    "shard",
    "from_local",
    "gather",
    "reshard",
    "shard_map",
    "value_and_grad",
    "remat",
    "dry_run",
    "DryRunReport",
    "Hardware",
    "grad",
    "jacfwd",
    "hessian",
    "zeros",
    "ones",
    "full",
    "empty",
    "rand",
    "randn",
    "tree_map",
    "tree_leaves",
    "tree_flatten",
    "tree_unflatten",
    "tree_structure",
    "lax",
    "debug",
    "config",
    "consistency",
    "ops",
    "launch",
    "optim",
    "nn",
    "checkpoint",
    "hf_checkpoint",
    "interop",
    "data",
    "parallel",
]


def __dir__() -> list[str]:
    """The public API only (``dir(fshard)``, tab completion); the implementation modules
    (``fshard.array``, ``fshard.executor``, ...) stay importable by name."""
    return sorted(__all__)
