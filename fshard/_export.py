"""Gradients inside ``torch.export.export``: a ``make_fx`` graph of ``torch.func.grad_and_value``
replayed into the graph being exported.

torch 2.13's export (pre-dispatch tracing) cannot capture a backward pass:

* ``torch.func.grad``: its inputs are wrapped (``_wrap_for_grad``) below the pre-dispatch tracer,
  which then records them as *constants* of the graph (``c_lifted_tensor_*``, fake tensors): the
  exported module returns ``FakeTensor``\\ s or fails in ``lift_constants_pass``
  (``Unsupported: attempted to apply meta conversion to view functorch tensor``), and export
  records ``_unwrap_for_grad`` but no ``_wrap_for_grad`` (``torch/_functorch/predispatch.py``).
* ``torch.autograd.grad``: tensors that a composite op (``linear``) saves for its backward are
  made below the tracer too, so the backward reads them as constants (``RuntimeError: We found a
  fake tensor in the exported program constant's list``, ``torch/export/_trace.py``).

``make_fx`` (not pre-dispatch) traces ``torch.func.grad`` exactly, with fshard's collectives as
functional collectives and their waits (``tests/test_compile.py``). So ``fs.value_and_grad``
under export traces ``grad_and_value(f)`` with ``make_fx`` while export's own tracing modes are
suspended, and calls the resulting graph: export records its aten ops and collectives like any
other code. Strict export (dynamo) cannot trace ``make_fx`` and is refused, as is
``torch.func.grad`` of fshard collectives under export (:func:`check_no_grad_transform`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree

from . import _compat

_INNER = False  # True while value_and_grad's make_fx trace runs (export's modes suspended)

#: Modules of the torch-function modes export pushes (pre-dispatch recording, non-strict
#: handling, metadata): suspended for the inner trace, which records into its own graph.
_EXPORT_MODE_MODULES = ("torch.export", "torch._export", "torch.fx")


@contextlib.contextmanager
def _suspended():
    """Run with export's tracing modes off (its torch-function modes, its pre-dispatch proxy
    mode); the fake mode and any other torch-function mode (a ``shard_map`` body's) stay."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    global _INNER
    c = torch._C
    modes = [c._pop_torch_function_stack() for _ in range(c._len_torch_function_stack())]
    modes.reverse()  # bottom first
    keep = [m for m in modes if not type(m).__module__.startswith(_EXPORT_MODE_MODULES)]
    outer = _INNER
    try:
        for m in keep:
            c._push_on_torch_function_stack(m)
        _INNER = True
        with disable_proxy_modes_tracing():
            yield
    finally:
        _INNER = outer
        for _ in range(c._len_torch_function_stack()):
            c._pop_torch_function_stack()
        for m in modes:
            c._push_on_torch_function_stack(m)


def exporting() -> bool:
    """Whether ``torch.export`` is tracing the caller (and not this module's inner trace)."""
    return _compat.is_exporting() and not _INNER


def value_and_grad(f: Callable, argnums, has_aux: bool, args: tuple, kwargs: dict):
    """``(value, grads)`` of ``torch.func.grad_and_value(f, argnums, has_aux)(*args, **kwargs)``
    under ``torch.export`` (non-strict): traced by ``make_fx`` outside export's modes, then
    replayed so export records the graph's ops. Tensors (also inside ShardedArrays) are the
    graph's inputs; everything else is a trace-time constant, as under export itself."""
    if torch.compiler.is_dynamo_compiling():
        raise NotImplementedError(
            "fs.value_and_grad under torch.export(strict=True): dynamo cannot trace the make_fx "
            "trace that replaces torch.func.grad under export (torch 2.13 exports neither "
            "torch.func.grad nor torch.autograd.grad correctly); export with strict=False"
        )
    from torch.fx.experimental.proxy_tensor import make_fx

    leaves, spec = pytree.tree_flatten((args, kwargs))
    where = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    gv = torch.func.grad_and_value(f, argnums=argnums, has_aux=has_aux)

    out_spec = []

    def run(*tensors):
        full = list(leaves)
        for i, t in zip(where, tensors):
            full[i] = t
        a, k = pytree.tree_unflatten(full, spec)
        out, s = pytree.tree_flatten(gv(*a, **k))  # the graph's outputs: plain tensors
        out_spec.append(s)
        return out

    tensors = [leaves[i] for i in where]
    with _suspended():
        graph = make_fx(run)(*tensors)
    grads, value = pytree.tree_unflatten(graph(*tensors), out_spec[0])
    return value, grads


def check_no_grad_transform(what: str) -> None:
    """Raise if ``torch.func`` transforms are active while ``torch.export`` traces (outside
    :func:`value_and_grad`'s own trace): export would bake the differentiated inputs into the
    graph as constants (see the module docstring)."""
    if exporting():
        raise NotImplementedError(
            f"{what} under torch.func.grad (or another torch.func transform) inside "
            "torch.export: torch 2.13's export records the transform's inputs as constants of "
            "the graph (a wrong program, not an error). Use fs.value_and_grad / fs.grad in the "
            "exported function (non-strict export): fshard traces the gradient with make_fx "
            "and export records that graph"
        )
