"""Autocast (``torch.autocast``) for op rules: what autocast does to one op call, found once per plan.

Rules plan on meta tensors, which autocast never casts (it only casts tensors of its own device
type), and many rules replace the op by a local program of other ops (a vocab-parallel cross
entropy, a softmax over a sharded dim). So autocast cannot be left to act on its own: the plan
would carry the un-autocast dtypes, a mixed-dtype call that autocast would have fixed fails
(``F.scaled_dot_product_attention`` with fp32 q, k and a bf16 v), and a local program's inner
ops would be cast by their own autocast policies instead of the op's.

fshard does what autocast does to the op, once, at planning: :func:`input_casts` runs the op on
fake tensors of the mesh's device type (``torch._subclasses.FakeTensorMode``: no memory, no
compute) under the active autocast and records the casts autocast applies to the inputs (and
whether it changes the output dtype without a visible cast: ``sum``/``softmax`` on CUDA get
``dtype=float32``, ``einsum`` on CPU casts inside). The rule then plans on the inputs' layouts
retyped to those dtypes, and the compiled call casts the local tensors the same way and runs the
local program with autocast disabled for that device type, as autocast runs an op it casts
(its kernels exclude the autocast keys). An op autocast leaves alone is planned and run as
without autocast (under it: elementwise and shape ops cost nothing extra). Planned outputs
thus carry autocast's dtypes, and local values equal the dense op under the same autocast
(bit for bit where the local program is the op itself on the shard).

The plan caches key on :func:`state` (``None`` when no autocast is enabled: one C call).
"""

from __future__ import annotations

import logging

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..spec import BaseLayout, Layout

__all__ = ["state", "input_casts", "disabled"]

#: Device types fshard meshes live on (``Mesh.device_type``).
_DEVICES = ("cpu", "cuda")

_any_enabled = torch._C._is_any_autocast_enabled
_dynamo_compiling = torch.compiler.is_dynamo_compiling
#: Logs every exception a meta kernel raises in fake mode; the probe expects some (the mixed
#: dtypes only autocast makes valid) and handles them.
_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")


def state():
    """The autocast state plans depend on: ``None`` when no autocast is enabled, else
    ``((device_type, dtype), ...)`` for the enabled device types fshard meshes use."""
    if not _any_enabled():
        return None
    return tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICES if torch.is_autocast_enabled(d))


def _eligible(layout: Layout) -> bool:
    """A tensor autocast may cast (autocast's ``is_eligible``: floating, not float64)."""
    return layout.dtype.is_floating_point and layout.dtype is not torch.float64


def input_casts(op, view, unflatten, device_type: str) -> dict[int, torch.dtype] | None:
    """``{leaf index: dtype}``: the dtype autocast (as now enabled for ``device_type``) hands
    ``op`` for each tensor input it casts; ``None`` when it leaves the call alone.

    ``view`` is the call's leaves as a rule sees them (a :class:`Layout` per tensor);
    ``unflatten(leaves)`` rebuilds ``(args, kwargs)`` with run-time placeholders filled in. A
    call the fake evaluation cannot run (a data-dependent shape, an op autocast refuses) gives
    ``None``: the local op then meets autocast as the dense op would.
    """
    if not torch.is_autocast_enabled(device_type):
        return None
    tensors = [i for i, v in enumerate(view) if isinstance(v, BaseLayout)]
    if not any(_eligible(view[i]) for i in tensors):
        return None
    try:
        on_casts, on_out = _run(op, view, unflatten, tensors, device_type, True, {})
    except Exception:  # fake evaluation unsupported, or the op fails under autocast
        return None
    try:
        off_casts, off_out = _run(op, view, unflatten, tensors, device_type, False, {})
    except Exception:  # mixed dtypes that only autocast's casts make valid (sdpa)
        off_casts, off_out = {}, None
    # the op's own casts (x.to(torch.bfloat16)) happen with autocast off too
    casts = {i: dt for i, dt in on_casts.items() if off_casts.get(i) is not dt}
    if not casts:
        if on_out == off_out:
            return None  # autocast leaves this call alone
        # The output dtype changes with no cast of an input at the op: a set_opt_dtype op (CUDA
        # gives sum/softmax dtype=float32) or a composite one cast inside (einsum's bmm on CPU).
        # The op then computes in its output's floating dtype.
        target = next((dt for dt in on_out if dt.is_floating_point), None)
        casts = {i: target for i in tensors if _eligible(view[i]) and view[i].dtype is not target}
        if target is None or not casts:
            return None
    # Run on the cast inputs with autocast off, the op must give autocast's output dtypes.
    try:
        _, check = _run(op, view, unflatten, tensors, device_type, False, casts)
    except Exception:
        return None
    return casts if check == on_out else None


def _run(op, view, unflatten, tensors, device_type, enabled, casts):
    """``op`` on fake tensors of ``device_type`` standing in for ``view``'s layouts (``casts``
    applied), autocast for ``device_type`` on or off: ``({leaf index: dtype autocast cast it
    to}, output dtypes)``."""
    leaves = list(view)
    level = _FAKE_LOG.level
    _FAKE_LOG.setLevel(logging.CRITICAL)
    try:
        return _run_fake(op, leaves, view, unflatten, tensors, device_type, enabled, casts)
    finally:
        _FAKE_LOG.setLevel(level)


def _run_fake(op, leaves, view, unflatten, tensors, device_type, enabled, casts):
    # Outside every torch.func level, as meta_call: the stand-ins are not batched or wrapped.
    with torch._C._DisableFuncTorch(), FakeTensorMode():
        for i in tensors:
            lay = view[i]
            leaves[i] = torch.empty(lay.shape, dtype=casts.get(i, lay.dtype), device=device_type)
        args, kwargs = unflatten(leaves)
        recorder = _CastRecorder({id(leaves[i]): i for i in tensors})
        prev = torch.is_autocast_enabled(device_type)
        torch.set_autocast_enabled(device_type, enabled)
        try:
            with recorder:
                out = op(*args, **kwargs)
        finally:
            torch.set_autocast_enabled(device_type, prev)
    dtypes = tuple(t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    return recorder.casts, dtypes


_TO_COPY = torch.ops.aten._to_copy.default


class _CastRecorder(TorchDispatchMode):
    """Records the casts of the inputs (``aten._to_copy``, what autocast's casts lower to) that
    open the op's run, before any other op: ``casts = {leaf index: dtype}``. Autocast casts the
    arguments first; a cast later is the op's own (the math attention upcasts to float32)."""

    def __init__(self, inputs: dict[int, int]):
        super().__init__()
        self.inputs, self.casts, self.open = inputs, {}, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.open and func.namespace != "prim":  # prim.device: autocast asking the device
            i = self.inputs.get(id(args[0])) if func is _TO_COPY and args else None
            if i is None or i in self.casts:
                self.open = False
            else:
                self.casts[i] = kwargs.get("dtype") or args[0].dtype
        return func(*args, **kwargs)


def disabled(fn, device_type: str):
    """``fn`` run with autocast disabled for ``device_type`` (as autocast runs an op it cast)."""
    is_enabled, set_enabled = torch.is_autocast_enabled, torch.set_autocast_enabled

    def run(*args, **kwargs):
        if _dynamo_compiling():  # traced as a context manager (eager that costs ~14 us)
            with torch.autocast(device_type, enabled=False):
                return fn(*args, **kwargs)
        prev = is_enabled(device_type)
        set_enabled(device_type, False)
        try:
            return fn(*args, **kwargs)
        finally:
            set_enabled(device_type, prev)

    return run
