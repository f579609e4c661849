"""Losses, as ``optax.losses``: per-example values (no reduction), written as global-view torch
code, so they take plain tensors and ShardedArrays alike.

On sharded inputs fshard's op rules do the communication, and these formulas are chosen so it
stays small: with logits split over the class dim (tensor-parallel vocabulary),
:func:`softmax_cross_entropy_with_integer_labels` is a ``logsumexp`` (one ``pmax`` and one
``psum`` of a value per example) minus the label's logit picked by comparing an ``arange`` of
the classes with the labels (a pending sum over the class axes: the loss comes back partial,
and reducing it, e.g. in ``.mean()`` or ``fs.gather``, is one more all_reduce of a value per
example): three all_reduces of ``batch`` floats in all, never a gather of the logits (``torch.take_along_dim`` on a sharded class dim
would all-gather them). Reductions over a split dim (:func:`cosine_similarity`'s norms,
:func:`softmax_cross_entropy`'s sum) are one all_reduce of the reduced size. Element-wise
losses never communicate. Gradients follow (``fs.value_and_grad``): the dense gradient, in
the inputs' layouts.

Example:
    >>> import torch, fshard as fs
    >>> logits = torch.tensor([[2.0, 0.0, 0.0]])
    >>> fs.optim.losses.softmax_cross_entropy_with_integer_labels(logits, torch.tensor([0]))
    tensor([0.2395])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..array import ShardedArray

__all__ = [
    "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
    "sigmoid_binary_cross_entropy",
    "squared_error",
    "l2_loss",
    "huber_loss",
    "cosine_similarity",
    "cosine_distance",
    "smooth_labels",
]


def _floating(x, name: str) -> None:
    if not isinstance(x, (torch.Tensor, ShardedArray)):
        raise TypeError(f"{name} must be a tensor or ShardedArray, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")


def _axis(axis, ndim: int, name: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{name} must be an int, got {axis!r}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name} must be in [{-ndim}, {ndim}), got {axis}")
    return axis % ndim


def softmax_cross_entropy(logits, labels, axis: int = -1):
    """Cross entropy between ``labels`` (a probability distribution over ``axis``) and
    ``softmax(logits)``: ``-(labels * log_softmax(logits)).sum(axis)``, as optax.

    Args:
        logits: floating-point scores (ShardedArray or tensor).
        labels: probabilities of ``logits``' shape (and layout, when sharded).
        axis: the class dim.

    Returns:
        The loss per example: ``logits``' shape without ``axis``.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.losses.softmax_cross_entropy(torch.zeros(1, 4), torch.tensor([[0.5, 0.5, 0.0, 0.0]]))
        tensor([1.3863])
    """
    _floating(logits, "logits")
    axis = _axis(axis, logits.dim())
    return -(labels * torch.log_softmax(logits, axis)).sum(axis)


def softmax_cross_entropy_with_integer_labels(logits, labels, axis: int = -1):
    """Cross entropy with integer class ``labels``: ``logsumexp(logits) - logits[label]`` over
    ``axis``, as optax. With ``logits`` sharded over the class dim the label's logit is
    selected where an ``arange`` of the classes equals the label and summed (a pending sum: the
    result is partial over the class axes), not gathered; see the module docstring.

    Args:
        logits: floating-point scores (ShardedArray or tensor).
        labels: integer classes, ``logits``' shape without ``axis`` (sharded like its other
            dims, or a plain tensor when those are whole).
        axis: the class dim.

    Returns:
        The loss per example: ``labels``' shape.

    Example:
        >>> import torch, fshard as fs
        >>> logits = torch.log(torch.tensor([[0.25, 0.75]]))
        >>> fs.optim.losses.softmax_cross_entropy_with_integer_labels(logits, torch.tensor([1]))
        tensor([0.2877])
    """
    _floating(logits, "logits")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integers, got dtype {labels.dtype}")
    axis = _axis(axis, logits.dim())
    n = logits.shape[axis]
    iota = torch.arange(n, device=logits.device).reshape(
        [n if d == axis else 1 for d in range(logits.dim())]
    )
    label_logits = torch.where(iota == labels.unsqueeze(axis), logits, 0.0).sum(axis)
    return torch.logsumexp(logits, axis) - label_logits


def sigmoid_binary_cross_entropy(logits, labels):
    """Binary cross entropy of ``sigmoid(logits)`` against ``labels`` in [0, 1], element-wise:
    ``-labels * log_sigmoid(logits) - (1 - labels) * log_sigmoid(-logits)``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.losses.sigmoid_binary_cross_entropy(torch.tensor([0.0]), torch.tensor([1.0]))
        tensor([0.6931])
    """
    _floating(logits, "logits")
    labels = labels.to(logits.dtype)
    return -labels * F.logsigmoid(logits) - (1.0 - labels) * F.logsigmoid(-logits)


def squared_error(predictions, targets=None):
    """``(predictions - targets) ** 2`` element-wise (``predictions ** 2`` without targets), as
    optax.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.losses.squared_error(torch.tensor([3.0]), torch.tensor([1.0]))
        tensor([4.])
    """
    _floating(predictions, "predictions")
    if targets is not None and tuple(targets.shape) != tuple(predictions.shape):
        raise ValueError(
            f"targets must have predictions' shape {tuple(predictions.shape)}, got "
            f"{tuple(targets.shape)}"
        )
    errors = predictions - targets if targets is not None else predictions
    return errors**2


def l2_loss(predictions, targets=None):
    """Half the squared error, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.losses.l2_loss(torch.tensor([3.0]), torch.tensor([1.0]))
        tensor([2.])
    """
    return 0.5 * squared_error(predictions, targets)


def huber_loss(predictions, targets=None, *, delta=1.0):
    """Huber loss element-wise: quadratic (``0.5 * e**2``) for errors up to ``delta``, linear
    beyond, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.losses.huber_loss(torch.tensor([0.5, 3.0]))
        tensor([0.1250, 2.5000])
    """
    _floating(predictions, "predictions")
    errors = predictions - targets if targets is not None else predictions
    abs_errors = torch.abs(errors)
    quadratic = torch.clamp(abs_errors, max=delta)
    return 0.5 * quadratic**2 + delta * (abs_errors - quadratic)


def cosine_similarity(predictions, targets, *, epsilon=0.0, axis: int = -1):
    """Cosine similarity over ``axis``, each norm at least ``sqrt(epsilon)``, as optax. Norms
    over a sharded ``axis`` are one all_reduce of the per-example squared norms each.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.losses.cosine_similarity(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]]))
        tensor([0.7071])
    """
    _floating(predictions, "predictions")
    _floating(targets, "targets")
    axis = _axis(axis, predictions.dim())
    a_norm = torch.sqrt(torch.clamp((predictions * predictions).sum(axis, keepdim=True), min=epsilon))  # fmt: skip
    b_norm = torch.sqrt(torch.clamp((targets * targets).sum(axis, keepdim=True), min=epsilon))
    return ((predictions / a_norm) * (targets / b_norm)).sum(axis)


def cosine_distance(predictions, targets, *, epsilon=0.0, axis: int = -1):
    """``1 - cosine_similarity``, as optax.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.losses.cosine_distance(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]]))
        tensor([1.])
    """
    return 1.0 - cosine_similarity(predictions, targets, epsilon=epsilon, axis=axis)


def smooth_labels(labels, alpha, *, axis: int = -1):
    """Label smoothing: ``(1 - alpha) * labels + alpha / num_classes`` (classes along
    ``axis``), as optax.

    Example:
        >>> import torch, fshard as fs
        >>> fs.optim.losses.smooth_labels(torch.tensor([[1.0, 0.0]]), 0.2)
        tensor([[0.9000, 0.1000]])
    """
    _floating(labels, "labels")
    axis = _axis(axis, labels.dim())
    return (1.0 - alpha) * labels + alpha / labels.shape[axis]
