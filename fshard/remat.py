"""``fs.remat``: activation checkpointing with ``jax.checkpoint``'s meaning, under torch.func.

``remat(fn)`` computes the same values as ``fn``; differentiated, it keeps only its inputs for
the backward and recomputes everything else there. It is one ``torch.autograd.Function`` (with
``setup_context`` and a generated vmap rule): the forward runs ``fn`` without recording, the
backward re-runs ``fn`` on the saved inputs under ``torch.func.vjp`` and applies that vjp. So it
works where ``torch.utils.checkpoint`` cannot (its saved-tensor hooks are refused inside
``torch.func.grad``): ``torch.func.grad``/``vjp``/``vmap`` (and ``vmap(grad)``), eager autograd,
``fs.value_and_grad``, double backward. Collectives inside ``fn`` run again in the recompute
(then their transposes), never skipped: the recompute is the whole function.

The inputs and outputs are pytrees of tensors and :class:`~fshard.ShardedArray` values (their
local blocks are what is saved; layouts travel as static data). Inside a ``shard_map`` body the
recompute runs in the body's axis environment again (its mesh, its varying-axes tracker, and in
a partial-manual body the tracking of its global-view ops), with its inputs' varying axes as the
forward saw them, so ``fs.lax`` collectives and the varying-axes bookkeeping (``pcast`` where
an invariant value meets a varying one) are those of the forward. Inside the recompute every
input is an intermediate of the caller's graph: an input that is a pending sum (a residual
added to a row-parallel output before its all-reduce) gets the invariant cotangent of a pending
sum, as without ``remat``; a partial *leaf* is claimed where it enters ``remat``.

Example:
    >>> def block(x, w):
    ...     return torch.tanh(x @ w) @ w.T
    >>> x, w = torch.ones(2, 3), torch.full((3, 3), 0.1)
    >>> g = torch.func.grad(lambda w: remat(block)(x, w).sum())(w)
    >>> torch.allclose(g, torch.func.grad(lambda w: block(x, w).sum())(w))
    True
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable

import optree
import torch

from . import axis_env, lax
from ._function import plain
from .array import ShardedArray, is_sharded
from .collectives import AllGather, AllToAll, Pcast, Ppermute, Psum, PsumScatter
from .executor import claimed_local
from .gradsync import GradSync

__all__ = ["remat"]


#: The collectives the "collectives" policy saves: every op that communicates and is linear
#: (its backward is its transpose, which needs no residual). pmax/pmin are recomputed.
_SAVED_OPS = (AllGather, AllToAll, Ppermute, Psum, PsumScatter)
POLICIES = (None, "nothing", "collectives", "dots")
_FUNCTORCH = torch._C._functorch


class _Saved(torch.autograd.Function):
    """A saved collective output standing in for the collective during the recompute; its
    backward is the collective's transpose applied to the cotangent (as the collective's)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(saved, x, b):
        return saved.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.b = inputs[2]

    @staticmethod
    def backward(ctx, g):
        return None, lax.apply(ctx.b.transpose(), g), None


class _Record(lax.Handler):
    """The "collectives" policy in the forward: the outputs of the ops it saves are kept in
    ``saved`` (the collectives still run)."""

    sees_every_result = True

    def __init__(self, saved: list):
        self.saved = saved

    def process(self, b, x, done, proceed):
        out = proceed(b, x, done)
        if isinstance(b.op, _SAVED_OPS):
            # an alias, not the object: fn may return this very tensor, which must stay
            # differentiable while the residual is marked non-differentiable
            self.saved.append(out.detach())
        return out


class _Replay(lax.Handler):
    """The "collectives" policy in the backward's recompute: each saved op is replaced by its
    saved output (:class:`_Saved`, whose backward is the op's transpose)."""

    sees_every_result = True

    def __init__(self, residuals):
        self.residuals = residuals

    def process(self, b, x, done, proceed):
        if isinstance(b.op, _SAVED_OPS):
            return _Saved.apply(next(self.residuals), x, b)
        return proceed(b, x, done)


#: The matmuls the "dots" policy saves (jax.checkpoint_policies.dots_saveable), on plain tensors.
_DOTS = (
    torch.nn.functional.linear,
    torch.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.matmul,
    torch.mm,
    torch.bmm,
    torch.Tensor.mm,
    torch.Tensor.bmm,
)


class _Defer(lax.Handler):
    """The recompute under a gradient sync (``fs.value_and_grad``'s, a pipeline's): a
    ``pcast`` of one of its leaves that the recompute makes at its own ``torch.func.vjp``
    level (a param replicated over cp, pcast where it meets the sequence's chunks) is taken
    over by the sync (:meth:`~fshard.gradsync.GradSync.defer`): the pcast's cotangent goes to
    the sync (:class:`_Deposit`), which sums it with the other uses' and reduces it in a
    bucket with the other params' after the backward, instead of one all_reduce per param and
    recompute (the sync's stand-ins cannot be read under the vjp: its level would not
    differentiate them). A pcast inside a transform of fn's own (a deeper level) is left as
    it is: its cotangent is not the loss's."""

    def __init__(self, sync: GradSync, level: list, leaf_of: dict):
        # leaf_of: id(the recompute's primal, below the vjp) -> the sync's leaf it stands for
        # (saved for the backward, it may be another tensor object: FSDP's saved-tensor
        # hooks save a leaf detached)
        self.sync, self.level, self.leaf_of = sync, level, leaf_of

    def process(self, b, x, done, proceed):
        if (
            type(b.op) is Pcast
            and self.level
            and _FUNCTORCH.maybe_current_level() == self.level[0]
            and _FUNCTORCH.maybe_get_level(x) == self.level[0]
        ):
            inner = _FUNCTORCH.get_unwrapped(x)
            base = inner if inner._base is None else inner._base
            i = self.leaf_of.get(id(base))
            if i is not None and inner.shape == base.shape and inner.stride() == base.stride():
                k = self.sync.defer(i, b.group, b.op.reduce_dtype)
                if k is not None:
                    return _Deposit.apply(x, self.sync, k)
        return proceed(b, x, done)


class _Deposit(torch.autograd.Function):
    """A deferred ``pcast`` (:class:`_Defer`): forward a copy (no communication), backward
    the cotangent handed to the gradient sync's late entry ``k`` (no communication; its sum
    over the pcast's axes is the sync's, in :meth:`~fshard.gradsync.GradSync.finish`). A
    copy, not a view: a view's base is the leaf, so a later pcast of the result (an op rule's
    over the batch axes after the body's tracker's over cp) read as a pcast of the leaf, was
    deferred too, and the first one's sum was lost (Mixtral ep=2 x cp=2: 1.03 off)."""

    @staticmethod
    def forward(x, sync, k):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.sync, ctx.k = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        ctx.sync.deposit(ctx.k, plain(g))
        return None, None, None


def _unbroadcast(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` summed down to ``shape`` (the inverse of matmul's batch broadcasting)."""
    extra = t.dim() - len(shape)
    if extra:
        t = t.sum(tuple(range(extra)))
    dims = tuple(i for i, (a, b) in enumerate(zip(t.shape, shape)) if b == 1 and a != 1)
    return t.sum(dims, keepdim=True) if dims else t


class _SavedDot(torch.autograd.Function):
    """A saved matmul output standing in for the matmul during the recompute; its backward is
    the matmul's (``linear``: ``g W``, ``g^T x``, ``sum g``; ``a @ b``: ``g b^T``, ``a^T g``),
    which needs the operands (recomputed) but not the product."""

    generate_vmap_rule = True

    @staticmethod
    def forward(saved, linear, a, b, bias):
        return saved.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.linear, a, b, bias = inputs
        ctx.has_bias = bias is not None
        ctx.save_for_backward(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        if ctx.linear:  # a: (..., in), b: weight (out, in)
            ga = g @ b
            gb = g.reshape(-1, g.shape[-1]).T @ a.reshape(-1, a.shape[-1])
            gbias = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
            return None, None, ga, gb, gbias
        ga = _unbroadcast(g @ b.mT, a.shape)
        gb = _unbroadcast(a.mT @ g, b.shape)
        return None, None, ga, gb, None


class _DotsMode(torch.overrides.TorchFunctionMode):
    """Records (``saved`` a list) or replays (``saved`` an iterator) the outputs of the matmuls
    on plain tensors that run while it is active."""

    def __init__(self, saved):
        super().__init__()
        self.saved = saved

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operands = _dot_operands(func, args, kwargs)
        if operands is None:
            return func(*args, **kwargs)
        if isinstance(self.saved, list):
            out = func(*args, **kwargs)
            self.saved.append(out.detach())
            return out
        return _SavedDot.apply(next(self.saved), *operands)


def _dot_operands(func, args, kwargs):
    """``(linear, a, b, bias)`` of a matmul the "dots" policy saves, else ``None``: plain tensors
    only (a ShardedArray's matmul runs inside its op rule), matrices (no vector operands)."""
    if func not in _DOTS:
        return None
    if func is torch.nn.functional.linear:
        x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        operands = (True, x, w, bias)
    else:
        if kwargs or len(args) != 2:
            return None
        operands = (False, args[0], args[1], None)
    tensors = [t for t in operands[1:] if t is not None]
    if any(type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) for t in tensors):
        return None
    if operands[1].dim() < (1 if operands[0] else 2) or operands[2].dim() < 2:
        return None
    return operands


def _batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is batched by a ``vmap`` (the forward then runs once per level: the
    "collectives" policy recomputes there instead of saving, see :func:`remat`)."""
    while _FUNCTORCH.is_functorch_wrapped_tensor(t):
        if _FUNCTORCH.is_batchedtensor(t):
            return True
        t = _FUNCTORCH.get_unwrapped(t)
    return False


class _Remat(torch.autograd.Function):
    """Forward: ``run(*tensors)`` unrecorded, returning its outputs then the residuals its
    policy saves; backward: ``run`` again under ``torch.func.vjp``, with the residuals."""

    generate_vmap_rule = True

    @staticmethod
    def forward(run, policy, *tensors):
        if policy not in ("collectives", "dots") or any(map(_batched, tensors)):
            return run(*tensors)
        saved: list = []
        if policy == "dots":
            with _DotsMode(saved):
                outs = run(*tensors)
            return (*outs, *saved)

        with lax.handling(_Record(saved)):
            outs = run(*tensors)
        return (*outs, *saved)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.run = inputs[0]
        ctx.policy = inputs[1]
        ctx.n_inputs = len(inputs) - 2
        residuals = output[ctx.run.n_out :]
        ctx.replays = bool(residuals)
        ctx.mark_non_differentiable(*residuals)
        ctx.save_for_backward(*inputs[2:], *residuals)

    @staticmethod
    def backward(ctx, *cotangents):
        primals = ctx.saved_tensors[: ctx.n_inputs]
        residuals = iter(ctx.saved_tensors[ctx.n_inputs :])
        # Only the inputs asked for are differentiated: a constant's cotangent could cost
        # collectives (the psum behind a replicated operand's pcast) for nothing.
        wanted = [
            i for i, need in enumerate(ctx.needs_input_grad[2:]) if need and i not in ctx.run.unread
        ]

        sync = ctx.run.sync
        level: list = []  # the recompute's vjp level, where its pcasts of leaves are deferred

        def of_wanted(*ts):
            level[:] = [_FUNCTORCH.maybe_current_level()]
            filled = list(primals)
            for i, t in zip(wanted, ts):
                filled[i] = t
            return ctx.run(*filled)

        dots = ctx.replays and ctx.policy == "dots"
        replay = (_Replay(residuals),) if ctx.replays and not dots else ()
        defer = ()
        if sync is not None and any(h is sync for h in lax.active_handlers()):
            leaf_of = {id(p): i for p, i in zip(primals, ctx.run.leaf_of) if i is not None}
            defer = (_Defer(sync, level, leaf_of),)
        with (
            lax.handling(*replay, *defer),
            torch.enable_grad(),
            _DotsMode(residuals) if dots else contextlib.nullcontext(),
        ):
            outs, vjp = torch.func.vjp(of_wanted, *(primals[i] for i in wanted))
        cts = tuple(torch.zeros_like(o) if c is None else c for o, c in zip(outs, cotangents))
        grads = [None] * len(primals)
        for i, g in zip(wanted, vjp(cts[: len(outs)])):
            grads[i] = g
        return (None, None, *grads)


def remat(fn: Callable, policy: str | None = None) -> Callable:
    """``fn``, recomputed in the backward instead of keeping its intermediate values
    (``jax.checkpoint`` / ``jax.remat`` with the default policy: only the inputs are saved).

    Args:
        fn: a function of positional pytrees of tensors / :class:`~fshard.ShardedArray` values
            (other leaves, e.g. Python numbers, are passed through as constants) returning a
            pytree of them. The backward runs it again from the random state its forward
            started from, as ``torch.utils.checkpoint`` does (``preserve_rng_state=True``): the
            default CPU generator, the default CUDA generator of each device its tensor inputs
            are on, and any ``torch.Generator`` passed as an argument, so a dropout inside
            draws the forward's mask again (a generator it closes over is not restored: pass
            it as an argument); the generators are left as the forward left them. Tensors and
            ShardedArrays it closes over (``fs.remat(lambda h: block(h, weights))``, default arguments, a
            ``functools.partial``'s arguments, the closures of the user functions it calls)
            get their gradients as arguments do (as ``torch.utils.checkpoint``'s non-reentrant
            mode); a tensor needing a gradient that it reads from anywhere else (a global, a
            module's parameter) raises a ``TypeError``: pass it as an argument.
        policy: what is saved besides the inputs (``jax.checkpoint``'s ``policy``). ``None``
            (or ``"nothing"``, JAX's ``nothing_saveable``): nothing; the backward re-runs every
            collective of ``fn``. ``"collectives"``: the outputs of ``fn``'s communicating
            linear collectives (all_reduce, all_gather, reduce_scatter, all_to_all, ppermute;
            those of op rules and reshards included) are saved and stand in for them in the
            recompute, so the backward runs only their transposes (``pmax``/``pmin`` are
            recomputed). ``"dots"`` (JAX's ``dots_saveable``): the outputs of the matmuls
            (``F.linear``, ``@`` / ``torch.matmul``, ``mm``, ``bmm``) on plain tensors (the local
            view: shard_map bodies, local-view losses) are saved; the backward recomputes the
            rest and differentiates each saved matmul from its recomputed operands without
            recomputing the product. A ShardedArray's matmul runs inside its op rule and is
            recomputed. Under ``vmap`` (the generated batching rule runs the forward on
            batched values) the saved outputs are recomputed instead: the same values, the
            ``None`` cost.

    Returns:
        A function with ``fn``'s signature and values. Differentiated (``torch.func.grad``,
        ``vjp``, ``vmap`` of them, eager ``backward``, ``fs.value_and_grad``), it saves only
        its tensor inputs; the backward recomputes ``fn`` (collectives included) and then
        differentiates it.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("tp",))
        >>> w1 = fs.shard(torch.full((4, 6), 0.1), mesh, fs.P(None, "tp"))  # column parallel
        >>> w2 = fs.shard(torch.full((6, 4), 0.1), mesh, fs.P("tp"))  # row parallel
        >>> mlp = fs.remat(lambda x, w1, w2: torch.tanh(x @ w1) @ w2)
        >>> x = torch.ones(2, 4)
        >>> g = torch.func.grad(lambda w2: fs.gather(mlp(x, w1, w2)).sum())(w2)
        >>> g.spec, round(float(fs.gather(g)[0, 0]), 4)  # the layout of w2, the dense value
        (P('tp'), 0.7599)
    """
    if not callable(fn):
        raise TypeError(f"remat: fn must be callable, got {type(fn).__name__}")
    if policy not in POLICIES:
        raise ValueError(
            f"remat: policy must be one of {POLICIES} (None / 'nothing': save only the inputs; "
            f"'collectives': also the outputs of fn's collectives; 'dots': also the outputs of "
            f"its matmuls on plain tensors), got {policy!r}"
        )

    @functools.wraps(fn)
    def rematted(*args, **kwargs):
        if kwargs:
            raise TypeError(
                f"remat: pass fn's inputs positionally (they are what is saved); got keyword "
                f"arguments {sorted(kwargs)}"
            )
        differentiated = torch.is_grad_enabled()
        if differentiated:
            args = _claimed(args)
        leaves, treedef = optree.tree_flatten(args, none_is_leaf=True)
        where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        # fn's closed-over differentiable tensors: extra inputs, swapped in where fn reads them
        slots = _captured(fn) if differentiated else []
        extra = [t for slot in slots for t in slot.tensors]
        out_def: list = []  # the output structure, set by each run (the same every time)
        # the random state fn's forward drew from, which each recompute draws from again
        randomness: list = []
        generators = [v for v in leaves if isinstance(v, torch.Generator)]

        # Called in a shard_map body, the backward's recompute runs in that body's axis
        # environment again (its mesh for fs.lax, its varying-axes tracker for the pcasts).
        env = axis_env._STACK[-1] if axis_env._STACK else None
        tracker = env[1] if env is not None else None
        again = tuple(h for h in lax.active_handlers() if h.recompute)
        out_vma: list = []  # the varying axes of the outputs, as fn computed them
        inputs = [leaves[i] for i in where] + extra
        # The varying axes of the inputs as the caller has them (read here: under torch.func
        # fn's forward gets them unwrapped, other tensor objects). The backward's recompute
        # gets other tensor objects too (the saved inputs, wrapped by its vjp), which the
        # tracker has never seen, so they are tagged again; untagged, an input varying over a
        # manual axis would read as invariant there and be pcast (a nested shard_map's inputs,
        # a collective's operand): its cotangent summed over that axis, a wrong gradient.
        in_vma: list = [] if tracker is None else [tracker.vma(t) for t in inputs]

        def run(*tensors):
            # Aliases: in the backward's recompute the inputs are the leaves of its vjp, yet
            # intermediates of the caller's graph; an alias is no leaf, so a partial input
            # gets the invariant cotangent of a pending sum (the Claim a partial leaf needs
            # was applied where the caller passed it, by _claimed), not a leaf's addends.
            tensors = tuple(t.view_as(t) for t in tensors)
            filled = list(leaves)
            for i, t in zip(where, tensors):
                filled[i] = t
            with contextlib.ExitStack() as stack:
                if env is not None and (not axis_env._STACK or axis_env._STACK[-1] is not env):
                    stack.enter_context(axis_env.enter(*env))
                    if tracker is not None:  # its mode, and a partial-manual body's dispatch
                        stack.enter_context(tracker)
                        stack.enter_context(tracker.dispatch())
                elif tracker is not None and tracker.paused:
                    # Under torch.func the Function's apply reaches the body's tracker, paused
                    # for it (below), and fn's forward runs inside the tracker's own handler,
                    # where torch turns the mode off: fn's ops went untracked and its outputs
                    # read as invariant (out_vma), so every later use of a layer's output
                    # skipped its pcasts (parallelize's Llama, cp=2, remat=True under
                    # torch.func.grad: every gradient wrong, 2.8 relative, the loss exact)
                    stack.enter_context(_unpaused(tracker))
                    if not _mode_on(tracker):
                        stack.enter_context(tracker)
                if again and not set(map(id, again)) <= set(map(id, lax.active_handlers())):
                    stack.enter_context(lax.handling(*again))
                for t, axes in zip(tensors, in_vma):
                    if axes:
                        tracker.tag(t, axes)
                if slots:
                    stack.enter_context(_swapped(slots, tensors[len(where) :]))
                reads = None
                if run.first and differentiated:
                    reads = stack.enter_context(_Reads(tensors, len(where)))
                if randomness:  # a recompute: a dropout's mask is the forward's
                    stack.enter_context(randomness[0].replayed())
                elif differentiated and not torch.compiler.is_compiling():
                    randomness.append(_Randomness(tensors, generators))
                out = fn(*optree.tree_unflatten(treedef, filled))
            if reads is not None:  # the forward: which captured inputs fn read
                run.first = False
                run.unread = frozenset(range(len(where), len(tensors))) - reads.read
            out_leaves, spec = optree.tree_flatten(out, none_is_leaf=True)
            bad = [type(v).__name__ for v in out_leaves if not isinstance(v, torch.Tensor)]
            if bad:
                raise TypeError(
                    f"remat: fn must return a pytree of tensors / ShardedArrays, got a {bad[0]} "
                    "leaf; return constants outside the rematerialised function"
                )
            out_def[:] = [spec]
            run.n_out = len(out_leaves)
            if tracker is not None:
                out_vma[:] = [tracker.vma(o) for o in out_leaves]
            return tuple(out_leaves)

        run.first, run.unread = True, frozenset()
        # the innermost gradient sync (fs.value_and_grad's, a pipeline's) and which of its
        # leaves each input is: the recompute's pcasts of those are deferred to it (_Defer)
        syncs = [h for h in lax.active_handlers() if isinstance(h, GradSync)]
        sync = run.sync = syncs[-1] if syncs and differentiated else None
        run.leaf_of = [None if sync is None else sync.leaf_index(t) for t in inputs]
        # Under torch.func the apply reaches the body's tracker, which would align its operands
        # (pcast every input it reads as invariant over the others' axes): a param block split
        # over a manual axis as it is (FSDP over dp_shard x cp in a body over cp) read as
        # invariant, and its gradient was summed over cp (wrong, 1.4 relative). Paused, the
        # apply passes as in eager autograd (which never reaches the mode): fn's own ops align.
        pause = tracker is not None and torch._C._are_functorch_transforms_active()
        if pause:
            tracker.paused += 1
        try:
            outs = _Remat.apply(run, policy, *inputs)[: run.n_out]
        finally:
            if pause:
                tracker.paused -= 1
        if tracker is not None:  # what the body's tracker saw in fn (psum: invariant, ...)
            for o, axes in zip(outs, out_vma):
                tracker.tag(o, axes)
        return optree.tree_unflatten(out_def[0], list(outs))

    return rematted


class _Randomness:
    """The random state a forward of ``fn`` starts from, as ``torch.utils.checkpoint``
    (``preserve_rng_state=True``) keeps it: the default CPU generator's, the default CUDA
    generator's of each device ``fn``'s tensor inputs are on, and that of each
    ``torch.Generator`` passed as an argument. :meth:`replayed` runs a recompute from it, so a
    dropout inside ``fn`` draws the forward's mask again (without it the backward
    differentiated another mask than the loss used: a silently wrong gradient); the
    generators are left as they were before the recompute."""

    __slots__ = ("cpu", "devices", "cuda", "given")

    def __init__(self, tensors, generators):
        self.cpu = torch.get_rng_state()
        self.devices = sorted({t.device.index for t in tensors if t.device.type == "cuda"})
        self.cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.given = [(g, g.get_state()) for g in generators]

    @contextlib.contextmanager
    def replayed(self):
        now = [(g, g.get_state()) for g, _ in self.given]
        with torch.random.fork_rng(devices=self.devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            for d, state in zip(self.devices, self.cuda):
                torch.cuda.set_rng_state(state, d)
            for g, state in self.given:
                g.set_state(state)
            try:
                yield
            finally:
                for g, state in now:
                    g.set_state(state)


@contextlib.contextmanager
def _unpaused(tracker):
    """The tracker tracking again while fn's forward runs inside its paused handler."""
    paused, tracker.paused = tracker.paused, 0
    try:
        yield
    finally:
        tracker.paused = paused


def _mode_on(mode: torch.overrides.TorchFunctionMode) -> bool:
    """Whether ``mode`` is on torch's function-mode stack now (off inside its own handler)."""
    return any(m is mode for m in torch.overrides._get_current_function_mode_stack())


def _claimed(args):
    """``args`` with each partial ShardedArray that is a leaf being differentiated claimed
    (:func:`fshard.executor.claimed_local`) where it enters ``remat``, as fn's first op would
    claim it without ``remat``: inside, every input is an intermediate."""

    def one(v):
        if not isinstance(v, ShardedArray) or not v.layout.partial:
            return v
        local = claimed_local(v)
        return v if local is v.local else ShardedArray._raw(local, v.layout)

    return optree.tree_map(one, args, is_leaf=is_sharded, none_is_leaf=True)


# -- what fn closes over -------------------------------------------------------------------------

#: Modules whose functions are not searched for closed-over tensors (library code).
_LIBRARY = ("torch", "fshard", "optree", "functools", "builtins", "numpy")


class _Slot:
    """One place fn reads a differentiable value from besides its arguments: a closure cell,
    its default arguments, or a ``functools.partial``'s bound arguments; ``tensors`` are the
    differentiable leaves of what it holds (a ShardedArray's local block)."""

    __slots__ = ("get", "set", "leaves", "treedef", "where", "tensors")

    def __init__(self, get, set_, value):
        self.get, self.set = get, set_
        self.leaves, self.treedef = optree.tree_flatten(value, none_is_leaf=True)
        self.where = [i for i, v in enumerate(self.leaves) if _differentiable(v)]
        self.tensors = [self.leaves[i] for i in self.where]

    def value(self, tensors) -> object:
        filled = list(self.leaves)
        for i, t in zip(self.where, tensors):
            filled[i] = t
        return optree.tree_unflatten(self.treedef, filled)


def _differentiable(v) -> bool:
    return isinstance(v, torch.Tensor) and v.requires_grad


def _captured(fn, depth: int = 4, seen: set | None = None) -> list:
    """The :class:`_Slot` s of ``fn`` and of the user functions it closes over (``depth``
    levels): where a closure like ``lambda h: block(h, weights)`` reads its weights from."""
    seen = set() if seen is None else seen
    if id(fn) in seen or depth == 0:
        return []
    seen.add(id(fn))
    slots: list = []

    def add(get, set_, value):
        if callable(value) and not isinstance(value, torch.nn.Module):
            slots.extend(_captured(value, depth - 1, seen))
            return
        slot = _Slot(get, set_, value)
        if slot.tensors:
            slots.append(slot)

    if isinstance(fn, functools.partial):
        func, args, kw, d = fn.__reduce__()[2]

        def set_partial(i):
            def set_(v):
                state = list(fn.__reduce__()[2])
                state[i] = v
                fn.__setstate__(tuple(state))

            return set_

        add(lambda: fn.args, set_partial(1), args)
        add(lambda: fn.keywords, set_partial(2), dict(kw or {}))
        slots.extend(_captured(func, depth - 1, seen))
        return slots
    fn = getattr(fn, "__func__", fn)  # a bound method: its function
    if not isinstance(fn, types.FunctionType) or fn.__module__.startswith(_LIBRARY):
        return slots
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell (a name not yet bound)
            continue
        add(
            lambda cell=cell: cell.cell_contents,
            functools.partial(setattr, cell, "cell_contents"),
            value,
        )
    if fn.__defaults__:
        add(
            lambda: fn.__defaults__, functools.partial(setattr, fn, "__defaults__"), fn.__defaults__
        )
    if fn.__kwdefaults__:
        add(
            lambda: fn.__kwdefaults__,
            functools.partial(setattr, fn, "__kwdefaults__"),
            fn.__kwdefaults__,
        )
    return slots


@contextlib.contextmanager
def _swapped(slots: list, tensors):
    """Each slot holds its value rebuilt with ``tensors`` (the run's inputs) while fn runs."""
    saved = [slot.get() for slot in slots]
    it = iter(tensors)
    try:
        for slot in slots:
            slot.set(slot.value([next(it) for _ in slot.tensors]))
        yield
    finally:
        for slot, v in zip(slots, saved):
            slot.set(v)


class _Reads(torch.overrides.TorchFunctionMode):
    """The forward's record of which captured inputs (positions ``first:``) fn reads, and its
    refusal of a differentiable tensor fn reads from elsewhere (a global, a module's
    parameter, an object's attribute): remat could not give it its gradient."""

    def __init__(self, tensors, first: int):
        super().__init__()
        self.known: dict = {}
        for i, t in enumerate(tensors):
            self.known.setdefault(id(t), []).append(i)
        self.first, self.read, self.made = first, set(), set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in _tensors((args, kwargs)):
            at = self.known.get(id(t))
            if at is not None:
                self.read.update(at)
            elif t.requires_grad and id(t) not in self.made:
                raise TypeError(
                    f"remat: fn reads a tensor that needs a gradient (shape "
                    f"{tuple(t.shape)}, {t.dtype}, in {getattr(func, '__name__', func)}) that "
                    "is neither an argument nor found in its closure (a global, a module's "
                    "parameter or an object's attribute): remat would drop its gradient. Pass "
                    "it to the rematerialised function as an argument, e.g. "
                    "fs.remat(lambda h, w: block(h, w))(h, w); for a module's parameters, "
                    "fs.remat(lambda h, ps: fs.nn.functional_call(layer, ps, (h,)))(h, params)"
                )
        out = func(*args, **kwargs)
        self.made.update(id(t) for t in _tensors(out))
        return out


def _tensors(tree) -> list:
    """The tensors of ``tree``, a ShardedArray's local block among them, without flattening
    the ShardedArray as a pytree node: that marks it as sharing its data with the other side
    (``fshard.ops.inplace``), so an in-place form on a value fn made (transformers' experts:
    ``inv_perm = torch.empty_like(perm); inv_perm[perm] = ...``) was refused in the forward."""
    leaves = optree.tree_leaves(tree, none_is_leaf=True, is_leaf=is_sharded)
    return [
        v.local if isinstance(v, ShardedArray) else v
        for v in leaves
        if isinstance(v, (torch.Tensor, ShardedArray))
    ]
