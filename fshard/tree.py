"""optree utilities with ShardedArray registered as a pytree node (children: its local tensor).

``fs.tree_map(f, tree)`` maps over local tensors; pass ``is_leaf=fs.tree.is_sharded`` to map over
whole ShardedArrays instead.

Example:
    >>> import torch, fshard as fs
    >>> mesh = fs.Mesh.create((2,), ("x",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
    >>> tree = {"w": fs.shard(torch.ones(4), mesh, fs.P("x")), "step": torch.tensor(3)}
    >>> [tuple(t.shape) for t in fs.tree_leaves(tree)]  # the leaves are the local blocks
    [(), (2,)]
    >>> doubled = fs.tree_map(lambda t: 2 * t, tree)  # a new tree, the same layouts
    >>> doubled["w"].spec, fs.gather(doubled["w"])
    (P('x'), tensor([2., 2., 2., 2.]))
    >>> leaves, spec = fs.tree_flatten(tree)
    >>> fs.tree_unflatten(spec, leaves)["w"].layout == tree["w"].layout
    True
    >>> fs.tree_structure(tree) == spec
    True
"""

from __future__ import annotations

import optree

from .array import is_sharded

__all__ = [
    "tree_map",
    "tree_leaves",
    "tree_flatten",
    "tree_unflatten",
    "tree_structure",
    "is_sharded",
]

tree_map = optree.tree_map
tree_leaves = optree.tree_leaves
tree_flatten = optree.tree_flatten
tree_unflatten = optree.tree_unflatten
tree_structure = optree.tree_structure
