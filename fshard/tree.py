"""optree utilities with ShardedArray registered as a pytree node (children: its local tensor).

``fs.tree_map(f, tree)`` maps over local tensors; pass ``is_leaf=fs.tree.is_sharded`` to map over
whole ShardedArrays instead.
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
