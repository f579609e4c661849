"""Apply fshard's ``torch.autograd.Function``\\ s without torch.func's per-call class building.

Under ``torch.func.grad`` (or ``jvp``) ``Function.apply`` goes through functorch's
``custom_function_call``, which on *every call* builds a fresh ``_SingleLevelFunction`` class
(and its backward class), runs ``inspect.signature`` twice and maps pytrees over the operands:
about 0.2-0.5 ms per apply on this machine, against ~10 us for an aten op. A tensor-parallel step
applies two (the forward ``psum`` and its transposed ``pcast`` in the backward), which is several
percent of a 25 ms step.

:func:`call` does what that generated class does, with one class built at import:
:class:`_AtLevel` unwraps the operands from the top grad/jvp level, runs the Function one level
down (recursively through :func:`call`), wraps the result back, and records the Function's own
``setup_context``/``backward``/``jvp`` at this level. A ``vmap`` level on top goes through
``Function.apply`` (torch's ``vmap`` rule calls the Function's ``vmap`` staticmethod, which calls
back into :func:`call`). :func:`untracked` finds the tensors no transform can see, which
need no Function at all. Outside any transform, ``call`` skips ``Function.apply``'s
``inspect.signature`` default-argument binding (fshard passes every argument).

This uses functorch's private Python API (``_unwrap_for_grad``/``_wrap_for_grad``, the
interpreter stack, ``_SingleLevelFunction``), the same calls torch's own generated class makes;
``tests/test_lax.py::test_level_functions`` checks grad, grad of grad, jvp and vmap(grad) against
dense results and that torch's per-call generator is never reached.

Under ``torch.compile`` both step aside: dynamo traces ``Function.apply`` (forward, backward
and the transforms around it) on its own, and cannot trace the private calls; a Function
with a ``jvp`` is applied as its :func:`traced` twin there.
"""

from __future__ import annotations

import torch
from torch._C._functorch import (
    TransformType,
    _unwrap_for_grad,
    _wrap_for_grad,
    get_interpreter_stack,
    get_single_level_autograd_function_allowed,
    get_unwrapped,
    is_functorch_wrapped_tensor,
    peek_interpreter_stack,
    set_single_level_autograd_function_allowed,
)
from torch._functorch.pyfunctorch import coerce_cinterpreter
from torch.autograd import forward_ad
from torch.autograd.forward_ad import _set_fwd_grad_enabled
from torch.autograd.function import _SingleLevelFunction

from ._export import check_no_grad_transform

_LEVEL_KEYS = (TransformType.Grad, TransformType.Jvp)
_dynamo_compiling = torch.compiler.is_dynamo_compiling  # False in eager, for the cost of a call
_APPLY = torch._C._FunctionBase.__dict__["apply"]  # the C++ apply, unbound


def _base_apply(fn, *args):
    return _APPLY.__get__(None, fn)(*args)


def call(fn: type[torch.autograd.Function], *args):
    """``fn.apply(*args)``, for a new-style Function (``setup_context`` defined) given every
    argument positionally."""
    if _dynamo_compiling():
        return traced_apply(fn, *args)  # pass a Function with a jvp through traced() first
    if not torch._C._are_functorch_transforms_active():
        return _base_apply(fn, *args)
    check_no_grad_transform(fn.__name__)
    top = peek_interpreter_stack()
    if top.key() not in _LEVEL_KEYS:
        return fn.apply(*args)
    allowed = get_single_level_autograd_function_allowed()
    set_single_level_autograd_function_allowed(True)
    try:
        return _base_apply(_AtLevel, fn, top.level(), coerce_cinterpreter(top), *args)
    finally:
        set_single_level_autograd_function_allowed(allowed)


def _compiled_levels() -> str:
    """The functorch transforms active while dynamo traces, outermost first, as one string
    (``"Grad > Vmap"``; ``""`` for none). A string, not a tuple: torch 2.11's dynamo cannot
    guard a comparison of the tuple this constant would be."""
    return " > ".join(ci.key().name for ci in get_interpreter_stack() or ())


# Evaluated at trace time, its result a constant of the graph (what
# torch.compiler.assume_constant_result sets; calling that would import dynamo at fshard import).
# Dynamo guards on the functorch stack, so a graph is never reused under other transforms.
_compiled_levels._dynamo_marked_constant = True


def traced_apply(fn: type[torch.autograd.Function], x: torch.Tensor, *args):
    """``fn.apply(x, *args)`` under ``torch.compile``, for a :func:`traced` Function.

    Compiled code gets one reverse-mode level (``.backward()``/``autograd.grad``, or one
    ``torch.func.grad``); any other transform stack raises. ``x`` goes through ``view_as``:
    dynamo reports an input of ``torch.func.grad`` as not requiring grad, and then inlines the
    Function's forward and drops its backward (a wrong gradient, no error); an intermediate
    reports the truth.
    """
    levels = _compiled_levels()
    if levels:
        check_no_grad_transform(fn.__name__)
    if levels and levels != "Grad":
        raise NotImplementedError(
            f"fshard collectives under torch.compile support no transform or one "
            f"torch.func.grad, got {levels} (grad of grad, vmap, jvp, jacrev: the "
            "compiled backward of a collective is not differentiable and has no batching "
            "rule); run this step eagerly, or compile only the innermost function"
        )
    return fn.apply(x.view_as(x), *args)


def traced(
    fn: type[torch.autograd.Function], forward=None, backward=None
) -> type[torch.autograd.Function]:
    """The twin of ``fn`` to apply under ``torch.compile``: the same Function (``forward`` and
    ``backward`` replacing its own if given) without its ``jvp`` and ``vmap`` (dynamo refuses
    a Function with a custom ``jvp``), so compiled code gets reverse mode only."""
    return type(
        fn.__name__ + "Traced",
        (torch.autograd.Function,),
        {
            "forward": staticmethod(forward or fn.forward),
            "setup_context": staticmethod(fn.setup_context),
            "backward": staticmethod(backward or fn.backward),
        },
    )


def untracked(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor under ``t`` if no transform can see ``t``, else ``None``.

    Unseen: no forward-AD level is open, and ``t`` has no autograd history at any level, where
    its only wrappers are ``torch.func.grad`` levels (``grad`` wraps every tensor argument, also
    the ones it does not differentiate, such as the input batch).
    """
    if forward_ad._current_level >= 0 or _dynamo_compiling():
        return None
    if is_functorch_wrapped_tensor(t):
        if any(ci.key() != TransformType.Grad for ci in get_interpreter_stack() or ()):
            return None
        while is_functorch_wrapped_tensor(t):
            if t.requires_grad:
                return None
            t = get_unwrapped(t)
    return None if t.requires_grad else t


def unwrappings(t: torch.Tensor):
    """``t``, then each tensor under its ``torch.func`` wrappers, down to the plain one."""
    yield t
    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
        yield t


def plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every ``torch.func`` wrapper of ``t``."""
    while is_functorch_wrapped_tensor(t):
        t = get_unwrapped(t)
    return t


def under_plain_graph(*tensors) -> bool:
    """Whether a ``torch.func`` level is open while a plain autograd graph holds one of
    ``tensors`` (under its wrappers): a derivative around the transform (``fs.value_and_grad``
    at top level over a function that runs as ``torch.func.grad``, a ``torch.func.grad`` of an
    ``nn.Parameter`` differentiated again by ``torch.autograd.grad``) can then differentiate
    what the transform computes, a gradient included. A Function whose backward computes
    without autograd (overlapped transfers, gradients its forward computed) would hand that
    derivative constants there."""
    return bool(get_interpreter_stack()) and any(
        isinstance(t, torch.Tensor) and plain(t).requires_grad for t in tensors
    )


def _unwrap(a, level: int):
    """Operand ``a`` one grad/jvp level down: a tensor unwrapped from ``level``, and so is each
    tensor of a tuple (``fs.lax.apply``'s boxed ``done``, a result computed at this level: kept
    boxed so the Function does not take it as an input, unwrapped so it does not cross levels)."""
    if isinstance(a, torch.Tensor):
        return _unwrap_for_grad(a, level)
    if type(a) is tuple:
        return tuple(_unwrap_for_grad(t, level) if isinstance(t, torch.Tensor) else t for t in a)
    return a


class _AtLevel(_SingleLevelFunction):
    """``fn`` at one grad/jvp level (torch's ``generate_single_level_function``, built once)."""

    @staticmethod
    def forward(fn, level, interpreter, *args):
        inner = tuple(_unwrap(a, level) for a in args)
        with torch.enable_grad(), _set_fwd_grad_enabled(True), interpreter.lower():
            out = call(fn, *inner)
        for a, u in zip(args, inner):
            if out is u:  # fn returned an operand itself: keep its identity, as torch does
                return a
        return _wrap_for_grad(out, level)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.fn = inputs[0]
        inputs[0].setup_context(ctx, inputs[3:], output)

    @staticmethod
    def backward(ctx, *grads):
        out = ctx.fn.backward(ctx, *grads)
        return (None, None, None, *(out if isinstance(out, tuple) else (out,)))

    @staticmethod
    def jvp(ctx, *tangents):
        return ctx.fn.jvp(ctx, *tangents[3:])
