"""Expert parallelism: MoE experts split over an ``ep`` mesh axis, tokens dispatched to the rank
that holds their expert and combined back with ragged all_to_alls (torchtitan's expert
parallelism, MaxText's ``shard_map`` MoE), as a pure function that composes with
``torch.func.grad`` and :func:`fshard.value_and_grad`.

Per MoE layer, inside a ``shard_map`` manual over the token axes (the ``ep`` axis among them)::

    rank r: tokens x (T, H), router top-k (idx, w) (T, k), experts E/ep of E (gate_up, down)
    1. sort the T*k assignments by expert; counts per expert   (local)
    2. size_exchange of the counts (E int64 per rank)          (the sizes, before the data)
    3. ragged all_to_all of the assigned rows to the experts' ranks     forward: routed rows only
    4. each local expert on its rows (all sources, token order)          backward: the reverse
    5. ragged all_to_all back; * w; index_add into (T, H)                all_to_all of cotangents

Only the routed rows move (``sum(counts) * H`` elements each way, plus the sizes); the backward
of each ragged all_to_all is the reverse exchange. With ``capacity_factor`` each source sends an
expert at most ``ceil(capacity_factor * T * k / E)`` assignments (the first in token order; the
others are dropped: they add nothing to the output, GShard / Switch's capacity).

HF MoE models (transformers' ``@use_experts_implementation`` experts, stacked ``gate_up_proj``
``(E, 2I, H)`` and ``down_proj`` ``(E, H, I)``: Mixtral, Qwen2-MoE, ...) run unchanged:
:func:`expert_parallel_plan` gives the layouts (experts split on dim 0 over ``axis``), and
:func:`expert_parallel_call` runs the module with transformers' experts implementation switched
to this dispatch for the call. The router, the shared experts and the load-balancing loss run in
the global view (their op rules).

Example:
    >>> import fshard as fs
    >>> fs.parallel.expert_parallel_plan.__name__
    'expert_parallel_plan'
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping

import torch

from .. import _comm
from ..api import reshard
from ..array import ShardedArray
from ..lax import axis_index, pcast, ragged_all_to_all
from ..mesh import Mesh
from ..module import functional_call
from ..shard_map import shard_map
from ..spec import P, PartsLayout

__all__ = ["moe_experts", "expert_parallel_plan", "expert_parallel_call"]


def _expert_rows(rows, gate_up, down, counts, apply_gate):
    """Each local expert ``e`` on its ``counts[e]`` consecutive rows (HF's eager expert math).
    ``gate_up``: the stacked ``[gate; up]`` weights, or (with tp) the pair ``(gate, up)``,
    each used as it came in (a view of its weight, not a concatenation of the two: FSDP's
    gathered weights are tracked through views, so a use that meets the tokens' split over
    the FSDP axes becomes its varying gather, reduce-scattered, where a concatenation was
    pcast expert by expert, its gradient all-reduced)."""
    linear = torch.nn.functional.linear
    outs, off = [], 0
    for e, n in enumerate(counts):
        seg = rows[off : off + n]
        if isinstance(gate_up, tuple):
            h = apply_gate(torch.cat([linear(seg, gate_up[0][e]), linear(seg, gate_up[1][e])], -1))
        else:
            h = apply_gate(linear(seg, gate_up[e]))
        outs.append(torch.nn.functional.linear(h, down[e]))
        off += n
    return torch.cat(outs, 0) if outs else rows[:0, : down.shape[1]]


def _dispatch_local(x, idx, w, gate_up, down, *, axis, mesh, apply_gate, capacity_factor):
    """The per-rank body (see the module docstring): ``x`` (T, H), ``idx``/``w`` (T, k), the
    local experts ``gate_up`` (E_l, 2I, H) (with tp the pair of its gate and up halves, each
    (E_l, I_l, H)), ``down`` (E_l, H, I). Returns (T, H)."""
    ep = mesh.size(axis) if axis else 1
    e_local = (gate_up[0] if isinstance(gate_up, tuple) else gate_up).shape[0]
    n_experts = e_local * ep
    t, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)  # grouped by expert, token order within
    counts = torch.bincount(flat, minlength=n_experts)
    if capacity_factor is not None:
        cap = math.ceil(capacity_factor * t * k / n_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        order = order[rank_in_expert < cap]
        counts = counts.clamp(max=cap)
    counts_l = counts.tolist()
    if axis is None:  # every expert here: this rank's rows, no exchange
        y = _expert_rows(x[order // k], gate_up, down, counts_l, apply_gate)
        y = y * w.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        return torch.zeros_like(x).index_add(0, order // k, y.to(x.dtype))
    table = _comm.size_exchange(counts_l, mesh.group(axis), x.device)  # [source][expert]
    me = int(axis_index(axis, mesh=mesh))
    mine = [row[me * e_local : (me + 1) * e_local] for row in table]  # [source][local expert]
    send = [sum(counts_l[j * e_local : (j + 1) * e_local]) for j in range(ep)]
    recv = [sum(r) for r in mine]
    got = ragged_all_to_all(x[order // k], axis, send, recv, mesh=mesh)  # source-major
    # source-major (source, expert) segments -> expert-major, sources in order within: a
    # stable sort of each received row's local expert
    segment_sizes = torch.tensor([n for row in mine for n in row], device=x.device)
    expert_of_row = torch.arange(e_local, device=x.device).repeat(ep)
    perm = torch.argsort(torch.repeat_interleave(expert_of_row, segment_sizes), stable=True)
    per_expert = [sum(mine[s][e] for s in range(ep)) for e in range(e_local)]
    y = _expert_rows(got[perm], gate_up, down, per_expert, apply_gate)
    back = torch.empty_like(y).index_copy(0, perm, y)  # source-major again
    out_rows = ragged_all_to_all(back, axis, recv, send, mesh=mesh)  # rows in `order` order
    out_rows = out_rows * w.reshape(-1)[order].unsqueeze(-1).to(out_rows.dtype)
    return torch.zeros_like(x).index_add(0, order // k, out_rows.to(x.dtype))


def moe_experts(
    hidden: ShardedArray,
    top_k_index: ShardedArray,
    top_k_weights: ShardedArray,
    gate_up_proj: ShardedArray,
    down_proj: ShardedArray,
    *,
    apply_gate=None,
    capacity_factor: float | None = None,
) -> ShardedArray:
    """MoE experts with expert parallelism: tokens dispatched to their experts' ranks.

    Args:
        hidden: ``(T, H)`` tokens, dim 0 split over the token axes (any, the expert axis
            included or not: a token layout without it is split over it first, for free, and
            the output gathered back). Its feature dim split (or a pending sum) is gathered
            (summed) first: each token's row is whole where the experts read it.
        top_k_index: ``(T, k)`` each token's experts, laid out like ``hidden``.
        top_k_weights: ``(T, k)`` their weights, laid out like ``hidden``.
        gate_up_proj: ``(E, 2I, H)`` stacked ``[gate; up]`` weights, dim 0 split over one mesh
            axis (the expert axis) or whole; with tensor parallelism inside the experts each
            of gate and up split on I over tp (``fs.Parts(P(ep, "tp", None), 1, (I, I))``,
            :func:`fshard.nn.hf_tp_plan`); replicated otherwise.
        down_proj: ``(E, H, I)``, laid out like ``gate_up_proj`` on dim 0, and on dim 2 over
            the same tp axes (the output is then summed over tp: one all_reduce).
        apply_gate: ``(rows, 2I) -> (rows, I)``; default ``silu(gate) * up``.
        capacity_factor: ``None``: dropless. Else each rank sends an expert at most
            ``ceil(capacity_factor * T_local * k / E)`` assignments, the first in token order.

    Returns:
        ``(T, H)`` laid out like ``hidden``: ``sum_j w[t, j] * expert_{idx[t, j]}(x[t])``.

    Example:
        >>> mesh = fs.Mesh.create((2,), ("ep",))  # 2 ranks
        >>> _ = torch.manual_seed(0)
        >>> x, gu, dn = torch.randn(6, 4), torch.randn(4, 6, 4), torch.randn(4, 4, 3)
        >>> idx, w = torch.tensor([[0, 3], [1, 2], [2, 0], [3, 1], [0, 1], [2, 3]]), torch.rand(6, 2)
        >>> tok = lambda t: fs.shard(t, mesh, fs.P("ep"))
        >>> y = fs.parallel.moe_experts(tok(x), tok(idx), tok(w), tok(gu), tok(dn))
        >>> dense = sum(w[:, j, None] * torch.stack([
        ...     torch.nn.functional.silu(x[t] @ gu[e, :3].T) * (x[t] @ gu[e, 3:].T) @ dn[e].T
        ...     for t, e in enumerate(idx[:, j].tolist())]) for j in range(2))
        >>> torch.allclose(fs.gather(y), dense, atol=1e-5)
        True
    """
    for name, v in (("hidden", hidden), ("top_k_index", top_k_index), ("top_k_weights", top_k_weights), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):  # fmt: skip
        if not isinstance(v, ShardedArray):
            raise TypeError(f"moe_experts: {name} must be a ShardedArray, got {type(v).__name__}")
    mesh = gate_up_proj.mesh
    axis, tp = _experts_axes(gate_up_proj, down_proj)
    n_experts, ep = gate_up_proj.shape[0], mesh.size(axis) if axis else 1
    if n_experts % ep:
        raise ValueError(
            f"moe_experts: {n_experts} experts do not split evenly over {axis!r} ({ep})"
        )
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(
            f"moe_experts: capacity_factor must be > 0 or None, got {capacity_factor!r}"
        )
    given = hidden.spec
    tokens = given.padded(2)[0]
    if top_k_index.spec.padded(2)[0] != tokens or top_k_weights.spec.padded(2)[0] != tokens:
        raise ValueError(
            f"moe_experts: top_k_index ({top_k_index.spec}) and top_k_weights "
            f"({top_k_weights.spec}) must split dim 0 like hidden ({given})"
        )
    # a token's row whole first: fshard's global view leaves the gather of a split feature dim
    # (a hf plan's colwise_gather_output, Qwen3-Next's linear attention) or the sum of a
    # pending one to the op that needs the row, this one (it was refused: in a pipeline, on
    # the first stage alone)
    hidden = reshard(hidden, P(tokens)) if any(given.padded(2)[1:]) or given.partial else hidden
    token_spec = hidden.spec
    if set(tp) & set(tokens):
        raise ValueError(
            f"moe_experts: hidden's tokens ({token_spec}) are split over the experts' "
            f"tensor-parallel axes {tp}; the tokens must be whole over them"
        )
    split = tokens if axis is None or axis in tokens else (*tokens, axis)
    spec = P(split if len(split) > 1 else split[0] if split else None)
    args = [hidden, top_k_index, top_k_weights]
    if split != tokens:  # a slice of each rank's tokens: no communication
        args = [reshard(a, spec) for a in args]
    apply_gate = apply_gate or _silu_gate
    e = axis  # the experts' dim: split over axis, or whole
    if tp:  # [gate | up] split per part over tp: the two parts at the part boundary (no comm)
        half = gate_up_proj.shape[1] // 2
        weights = (*gate_up_proj.split(half, 1), down_proj)
        specs = (P(e, tp), P(e, tp), P(e, None, tp))
    else:
        weights, specs = (gate_up_proj, down_proj), (P(e), P(e))

    def local(x, i, wt, *ws):
        gu = tuple(ws[:2]) if tp else ws[0]  # this rank's gate and up rows
        if tp:  # the tokens (whole over tp) meet tp's blocks here, once: their gradients'
            # sums over tp are of x and wt (not of every dispatched row: k x x's bytes)
            x, wt = pcast(x, tp), pcast(wt, tp)
        return _dispatch_local(
            x, i, wt, gu, ws[-1], axis=axis, mesh=mesh, apply_gate=apply_gate,
            capacity_factor=capacity_factor,
        )  # fmt: skip

    body = shard_map(
        local,
        mesh,
        in_specs=(spec, spec, spec, *specs),
        # with tp each rank's expert output is its addend of the sum over the I dim
        out_specs=P(*spec.dims, partial=tp) if tp else spec,
        out_shapes=tuple(hidden.shape),  # known: no exchange of the local shapes
        # manual over every axis: the routing runs on plain local tensors (the experts are
        # whole over the axes other than ``axis`` and ``tp``, so the body needs no collective
        # over them)
    )  # fmt: skip
    out = body(*args, *weights)
    # with tp: the sum over tp (all_reduce, or a reduce_scatter into a hidden given split on
    # its features), as Megatron's row layer; back in the layout hidden was given in
    back = token_spec if given.partial else given
    if split != tokens or tp or back != token_spec:
        out = reshard(out, back)
    return out


def _experts_axes(gate_up, down) -> tuple[str | None, tuple[str, ...]]:
    """``(the experts' axis or None, the tensor-parallel axes of their I dim)`` of stacked
    experts laid out as :func:`expert_parallel_plan` (dim 0 over one axis) and, with tensor
    parallelism, :func:`fshard.nn.hf_tp_plan` (``gate_up`` ``(E, 2I, H)``: each of gate and up
    split on dim 1 over tp, a :class:`~fshard.Parts` of two halves; ``down`` ``(E, H, I)``:
    dim 2 over tp); else ``ValueError``."""
    parts = isinstance(gate_up.layout, PartsLayout)
    gdims = (gate_up.layout.base if parts else gate_up.layout).spec.padded(3)
    ddims = down.spec.padded(3)
    tp = gdims[1] if parts else ()
    ok = (
        len(gdims[0]) <= 1
        and not gdims[2]
        and (not parts or (gate_up.layout.dim == 1 and len(set(gate_up.layout.sizes)) == 1))
        and (parts or not gdims[1])
        and ddims == (gdims[0], (), tp)
        and not gate_up.spec.partial
        and not down.spec.partial
    )
    if not ok:
        raise ValueError(
            f"moe_experts: gate_up_proj and down_proj must be split on dim 0 (the experts) over "
            f"one mesh axis (or none), and with tensor parallelism gate_up_proj's [gate | up] "
            f"halves on dim 1 (fs.Parts(P(ep, tp), 1, (I, I))) and down_proj on dim 2 over the "
            f"same axes, replicated otherwise; got {gate_up.spec} and {down.spec}; use "
            "fs.parallel.expert_parallel_plan and fs.nn.hf_tp_plan"
        )
    return (gdims[0][0] if gdims[0] else None), tp


def _silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# -- transformers' MoE models ------------------------------------------------------------------


def _experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """transformers' ``@use_experts_implementation`` experts modules of ``model``."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if hasattr(m, "_is_expert_parallel")
        and isinstance(getattr(m, "gate_up_proj", None), torch.Tensor)
    ]


def expert_parallel_plan(model: torch.nn.Module, mesh: Mesh, axis: str = "ep") -> dict[str, P]:
    """Layouts for expert parallelism: each MoE layer's stacked experts split on dim 0 over ``axis``.

    Args:
        model: a transformers MoE model (experts declared with ``@use_experts_implementation``
            and stacked ``gate_up_proj`` / ``down_proj``: Mixtral, Qwen2-MoE, ...).
        mesh: the mesh (the expert count must split evenly over ``axis``).
        axis: the expert-parallel mesh axis.

    Returns:
        ``{param name: P(axis)}`` for :func:`fshard.nn.shard_params` (merge it with a data- or
        tensor-parallel plan for the other params).

    Example:
        >>> import transformers
        >>> cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=8, intermediate_size=8,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        ...     num_local_experts=4)
        >>> mesh = fs.Mesh.create((2,), ("ep",))
        >>> fs.parallel.expert_parallel_plan(transformers.MixtralForCausalLM(cfg), mesh)
        {'model.layers.0.mlp.experts.gate_up_proj': P('ep'), 'model.layers.0.mlp.experts.down_proj': P('ep')}
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"expert_parallel_plan: model must be a torch.nn.Module, got {type(model).__name__}"
        )
    if axis not in mesh.axis_names:
        raise ValueError(
            f"expert_parallel_plan: axis {axis!r} is not a mesh axis; the mesh has {mesh.axis_names}"
        )
    found = _experts_modules(model)
    if not found:
        raise ValueError(
            "expert_parallel_plan: the model has no transformers experts module (a "
            "@use_experts_implementation class with a stacked gate_up_proj); for your own MoE "
            "layer call fs.parallel.moe_experts"
        )
    plan = {}
    for name, m in found:
        _check_experts(name, m)
        if m.gate_up_proj.shape[0] % mesh.size(axis):
            raise ValueError(
                f"expert_parallel_plan: {name} has {m.gate_up_proj.shape[0]} experts, not "
                f"divisible by {axis!r} ({mesh.size(axis)})"
            )
        plan[f"{name}.gate_up_proj"] = P(axis)
        plan[f"{name}.down_proj"] = P(axis)
    return plan


def _unsupported_experts(m: torch.nn.Module) -> list[str]:
    """What :func:`moe_experts` cannot run of transformers' experts module ``m`` (empty: it
    runs it)."""
    return [
        what
        for what, bad in (
            ("interleaved gate/up", not getattr(m, "is_concatenated", True)),
            ("transposed weights", getattr(m, "is_transposed", False)),
            ("biases", getattr(m, "has_bias", False)),
            ("no gate", not getattr(m, "has_gate", True)),
            ("a post-expert norm", getattr(m, "has_post_expert_norm", False)),
        )
        if bad
    ]


def _check_experts(name: str, m: torch.nn.Module) -> None:
    unsupported = _unsupported_experts(m)
    if unsupported:
        raise ValueError(
            f"expert parallelism: experts {name!r} ({type(m).__name__}) have {unsupported}; "
            "supported: concatenated [gate; up] (E, 2I, H) and down (E, H, I) without bias"
        )


def _ep_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """transformers' experts forward, registered as the ``"fshard_ep"`` implementation."""
    return moe_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        self.gate_up_proj,
        self.down_proj,
        apply_gate=self._apply_gate,
        capacity_factor=_CAPACITY[-1] if _CAPACITY else None,
    )


_CAPACITY: list = []  # the capacity factor of the expert_parallel_call in progress (a stack)


@contextlib.contextmanager
def _experts_implementation(model: torch.nn.Module, capacity_factor):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    if "fshard_ep" not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register("fshard_ep", _ep_experts_forward)
    configs = {id(m.config): m.config for _, m in _experts_modules(model)}
    before = {k: c._experts_implementation for k, c in configs.items()}
    _CAPACITY.append(capacity_factor)
    try:
        for c in configs.values():
            c._experts_implementation = "fshard_ep"
        yield
    finally:
        _CAPACITY.pop()
        for k, c in configs.items():
            c._experts_implementation = before[k]


def expert_parallel_call(
    model: torch.nn.Module,
    params: Mapping,
    args=(),
    kwargs=None,
    *,
    capacity_factor: float | None = None,
    call: Callable | None = None,
):
    """Run a transformers MoE ``model`` on sharded ``params`` with expert parallelism.

    :func:`fshard.nn.functional_call`, with the model's experts (sharded by
    :func:`expert_parallel_plan`) run by :func:`moe_experts` for the call: transformers'
    experts implementation is switched to ``"fshard_ep"`` and restored after. No model edits.

    Args:
        model: the transformers MoE model.
        params: ``{name: ShardedArray}`` from :func:`fshard.nn.shard_params` with an
            :func:`expert_parallel_plan` among its entries.
        args: positional arguments (e.g. ``(input_ids,)`` sharded over the token axes).
        kwargs: keyword arguments (``labels=``, ``output_router_logits=`` for the
            load-balancing loss, ...).
        capacity_factor: as in :func:`moe_experts` (``None``: dropless).
        call: what runs the model, ``call(model, params, args, kwargs)``:
            :func:`fshard.nn.functional_call` (``None``), or another strategy's call, e.g.
            ``functools.partial(fs.nn.fsdp_call, mesh=mesh, axis="dp")`` for FSDP x EP
            (params from ``fs.nn.fsdp_plan(model, mesh, "dp", base=expert_parallel_plan(...))``).

    Returns:
        What the model returns.

    Example:
        >>> import transformers
        >>> cfg = transformers.MixtralConfig(vocab_size=32, hidden_size=8, intermediate_size=8,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        ...     num_local_experts=4)
        >>> mesh = fs.Mesh.create((2,), ("ep",))
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.MixtralForCausalLM(cfg)
        >>> params = fs.nn.shard_params(model, mesh, fs.parallel.expert_parallel_plan(model, mesh))
        >>> ids = torch.randint(0, 32, (2, 5))
        >>> out = fs.parallel.expert_parallel_call(model, params, (fs.shard(ids, mesh, fs.P("ep")),))
        >>> torch.allclose(fs.gather(out.logits), model(ids).logits, atol=1e-5)
        True
    """
    if call is not None and not callable(call):
        raise TypeError(f"expert_parallel_call: call must be callable, got {type(call).__name__}")
    with _experts_implementation(model, capacity_factor):
        return (call or functional_call)(model, params, args, kwargs)
