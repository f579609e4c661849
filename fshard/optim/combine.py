"""Combinators: :func:`chain`, :func:`masked`, :func:`multi_transform` (optax ``partition``).

Example:
    >>> import torch, fshard as fs
    >>> tx = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.sgd(0.1))
    >>> p = {"w": torch.zeros(1)}
    >>> tx.update({"w": torch.tensor([5.0])}, tx.init(p), p)[0]["w"]
    tensor([-0.1000])
"""

from __future__ import annotations

import inspect

from .._leaf_errors import LeafErrors, paths
from . import _tree
from .base import GradientTransformation, MaskedState, MultiTransformState, set_to_zero


def _takes_extra_args(update) -> bool:
    """Whether ``update`` accepts keyword arguments beyond ``(updates, state, params)``
    (optax's ``GradientTransformationExtraArgs``: ``value=``, ``grad=``, ``value_fn=``)."""
    try:
        params = inspect.signature(update).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind in (p.VAR_KEYWORD, p.KEYWORD_ONLY) for p in params)


__all__ = ["chain", "masked", "multi_transform", "partition", "freeze", "selective_transform"]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Applies ``transforms`` in order; the state is the tuple of their states.

    The chain has a ``donated_step`` when its last transformation has one: the others run
    their (pure) ``update`` on the grads first. Extra keyword arguments of ``update``
    (``value=``, ``grad=``, ``value_fn=``, as optax's ``GradientTransformationExtraArgs``)
    reach the transformations whose ``update`` takes keywords (:func:`scale_by_polyak`, the
    line searches) and no others.

    Args:
        *transforms: :class:`GradientTransformation` objects.

    Returns:
        A :class:`GradientTransformation`.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.chain(fs.optim.scale(2.0), fs.optim.scale(3.0))
        >>> tx.update({"w": torch.ones(1)}, tx.init(None))[0]
        {'w': tensor([6.])}
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is {type(t).__name__}, not a GradientTransformation"
            )

    def init(params):
        if params is not None:
            _tree.flatten(params, "params")  # integer params are refused up front
        return tuple(t.init(params) for t in transforms)

    def check_state(state):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain: state must be a tuple of {len(transforms)} states (from this chain's "
                f"init), got {type(state).__name__}"
            )

    extra = [_takes_extra_args(t.update) for t in transforms]

    def update(updates, state, params=None, **extra_args):
        check_state(state)
        if params is not None:  # the gradients against the params before any transform runs
            pleaves, pspec = _tree.flatten(params, "params")
            _tree.flatten_like(updates, pspec, pleaves, "updates", "params")
        new_state = []
        for t, s, e in zip(transforms, state, extra):
            updates, s = (
                t.update(updates, s, params, **extra_args) if e else t.update(updates, s, params)
            )
            new_state.append(s)
        return updates, tuple(new_state)

    donated = None
    if transforms and transforms[-1].donated_step is not None:
        last_step = transforms[-1].donated_step

        def donated(grads, state, params):
            check_state(state)
            new_state = []
            for t, s in zip(transforms[:-1], state):
                grads, s = t.update(grads, s, params)
                new_state.append(s)
            res = last_step(grads, state[-1], params)
            if res is None:
                return None
            return res[0], (*new_state, res[1])

    return GradientTransformation(init, update, donated)


def _mask_flags(mask, tree, spec, n: int, name: str) -> list[bool]:
    if callable(mask):
        mask = mask(tree)
    if isinstance(mask, bool):
        return [mask] * n
    try:
        flags = spec.flatten_up_to(mask)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{name} must be a bool, a pytree of bools with the params' structure, or a callable "
            f"params -> such a pytree ({e})"
        ) from e
    errors = LeafErrors(f"{name} leaves must be bools", name)
    for key, f in zip(paths(spec), flags):
        if not isinstance(f, bool):
            errors.add(key, f"got {type(f).__name__} {f!r}", TypeError)
    errors.raise_if_any()
    return list(flags)


def _select(tree, flags, name):
    leaves, spec = _tree.flatten(tree, name)
    return [x for x, f in zip(leaves, flags) if f], leaves, spec


def masked(inner: GradientTransformation, mask) -> GradientTransformation:
    """Applies ``inner`` only to the leaves where ``mask`` is True; other updates pass through
    unchanged (and ``inner`` keeps no state for them). ``inner`` sees the selected leaves as a
    list (optax passes a tree with ``MaskedNode`` placeholders).

    Args:
        inner: the transformation for the selected leaves.
        mask: a bool, a bool pytree with the params' structure, or a callable
            ``params -> pytree``.

    Returns:
        A :class:`GradientTransformation` (state: :class:`MaskedState`).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.masked(fs.optim.scale(0.0), {"w": True, "b": False})
        >>> u = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> tx.update(u, tx.init(u))[0]
        {'w': tensor([0.]), 'b': tensor([1.])}
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(
            f"masked: inner must be a GradientTransformation, got {type(inner).__name__}"
        )

    def flags_for(tree):
        leaves, spec = _tree.flatten(tree, "params")
        return _mask_flags(mask, tree, spec, len(leaves), "mask")

    def init(params):
        sel, _, _ = _select(params, flags_for(params), "params")
        return MaskedState(inner.init(sel))

    def update(updates, state, params=None):
        flags = flags_for(updates if params is None else params)
        sel, leaves, spec = _select(updates, flags, "updates")
        psel = None if params is None else _select(params, flags, "params")[0]
        new_sel, inner_state = inner.update(sel, state.inner_state, psel)
        it = iter(new_sel)
        out = [next(it) if f else x for x, f in zip(leaves, flags)]
        return spec.unflatten(out), MaskedState(inner_state)

    return GradientTransformation(init, update)


def multi_transform(transforms: dict, param_labels) -> GradientTransformation:
    """Applies a different transformation to each group of leaves, by label (optax
    ``multi_transform``, also called ``partition``).

    Args:
        transforms: ``{label: GradientTransformation}``.
        param_labels: a pytree of labels with the params' structure, or a callable
            ``params -> pytree``. Every label must be a key of ``transforms``.

    Returns:
        A :class:`GradientTransformation` (state: :class:`MultiTransformState`).

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.multi_transform(
        ...     {"train": fs.optim.sgd(1.0), "frozen": fs.optim.set_to_zero()},
        ...     {"w": "train", "emb": "frozen"})
        >>> p = {"w": torch.zeros(1), "emb": torch.zeros(1)}
        >>> tx.update({"w": torch.ones(1), "emb": torch.ones(1)}, tx.init(p), p)[0]
        {'w': tensor([-1.]), 'emb': tensor([0.])}
    """
    if not isinstance(transforms, dict) or not transforms:
        raise TypeError("multi_transform: transforms must be a non-empty dict label -> transform")
    for k, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"multi_transform: transforms[{k!r}] is not a GradientTransformation")

    def labels_for(tree):
        leaves, spec = _tree.flatten(tree, "params")
        labels = param_labels(tree) if callable(param_labels) else param_labels
        try:
            flat = spec.flatten_up_to(labels)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"multi_transform: param_labels must match the params' structure ({e})"
            ) from e
        errors = LeafErrors("multi_transform: param_labels with no transform", "param_labels")
        for key, lab in zip(paths(spec), flat):
            if lab not in transforms:
                errors.add(key, f"label {lab!r}; transforms has {sorted(transforms)}")
        errors.raise_if_any(fix="add a transform for each label, or relabel these leaves")
        return flat

    def init(params):
        labels = labels_for(params)
        return MultiTransformState(
            {
                k: t.init(_select(params, [lab == k for lab in labels], "params")[0])
                for k, t in transforms.items()
            }
        )

    def update(updates, state, params=None):
        labels = labels_for(updates if params is None else params)
        leaves, spec = _tree.flatten(updates, "updates")
        out = list(leaves)
        new_states = {}
        for k, t in transforms.items():
            flags = [lab == k for lab in labels]
            sel = [x for x, f in zip(leaves, flags) if f]
            psel = None if params is None else _select(params, flags, "params")[0]
            new_sel, new_states[k] = t.update(sel, state.inner_states[k], psel)
            it = iter(new_sel)
            for i, f in enumerate(flags):
                if f:
                    out[i] = next(it)
        return spec.unflatten(out), MultiTransformState(new_states)

    return GradientTransformation(init, update)


#: optax's newer name for :func:`multi_transform`.
partition = multi_transform


def freeze(mask) -> GradientTransformation:
    """Zeroes the updates of the leaves where ``mask`` is True (``masked(set_to_zero(),
    mask)``), as optax.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.chain(fs.optim.freeze({"w": True, "b": False}), fs.optim.sgd(1.0))
        >>> p = {"w": torch.zeros(1), "b": torch.zeros(1)}
        >>> tx.update({"w": torch.ones(1), "b": torch.ones(1)}, tx.init(p), p)[0]
        {'w': tensor([-0.]), 'b': tensor([-1.])}
    """
    return masked(set_to_zero(), mask)


def selective_transform(
    optimizer: GradientTransformation, *, freeze_mask
) -> GradientTransformation:
    """Runs ``optimizer`` on the leaves where ``freeze_mask`` is False and zeroes the others
    (which then keep no optimizer state), as optax: ``multi_transform({"train": optimizer,
    "freeze": set_to_zero()}, labels)``.

    Args:
        optimizer: the transformation of the trained leaves.
        freeze_mask: a bool pytree with the params' structure (True: frozen), or a bool.

    Example:
        >>> import torch, fshard as fs
        >>> tx = fs.optim.selective_transform(fs.optim.adam(0.1), freeze_mask={"w": False, "emb": True})
        >>> p = {"w": torch.zeros(1), "emb": torch.zeros(1)}
        >>> tx.update({"w": torch.ones(1), "emb": torch.ones(1)}, tx.init(p), p)[0]
        {'w': tensor([-0.1000]), 'emb': tensor([0.])}
    """

    def labels(params):
        leaves, spec = _tree.flatten(params, "params")
        flags = _mask_flags(freeze_mask, params, spec, len(leaves), "freeze_mask")
        return spec.unflatten(["freeze" if f else "train" for f in flags])

    return multi_transform({"train": optimizer, "freeze": set_to_zero()}, labels)
