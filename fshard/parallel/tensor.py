"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) over a ``tp`` mesh axis: the plan.

Column-parallel layers (q/k/v, fc1) split their weight on the out-features, so their output
is split on the feature dim; row-parallel layers (the attention out-projection, fc2) split it
on the in-features, so they read that split activation for free and leave a pending sum,
which an :class:`~fshard.nn.Output` entry all-reduces (or reduce-scatters: sequence
parallelism, :mod:`fshard.parallel.sequence`) right after the layer::

    x (replicated) -> column: P(tp, None) -> y split on features -> row: P(None, tp) -> pending sum
    forward:  no comm in the column layer; all_reduce of the row layer's output
    backward: all_reduce of the column layer's input cotangent; nothing for the row layer

The call is :func:`fshard.nn.functional_call`: the op rules run the layers on the sharded
weights, so nothing runs differently, only layouts differ. :func:`hf_tp_plan` reads a
``transformers`` model's own tensor-parallel plan.

Example:
    >>> import fshard as fs
    >>> fs.parallel.megatron_plan(column=["*.fc1"], row=["*.fc2"])["*.fc2.weight"]
    P(None, 'tp')
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

import torch

from ..nn_plan import Output, _matcher
from ..spec import P, Parts
from .expert import _experts_modules, _unsupported_experts

__all__ = ["megatron_plan", "hf_tp_plan"]

_REPLICATED = P()


#: weight dim of the out-features and of the in-features, per module kind
_WEIGHT_DIMS = {"linear": (0, 1), "conv1d": (1, 0), "conv": (0, 1)}


def _linear_kind(mod: torch.nn.Module, name: str) -> str:
    """``"linear"`` (weight (out, in)), ``"conv1d"`` (HF GPT-2 Conv1D, weight (in, out)),
    ``"conv"`` (``nn.Conv1d/2d/3d``, weight (out, in, *kernel))."""
    if isinstance(mod, torch.nn.Linear):
        return "linear"
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "nx"):
        return "conv1d"
    conv = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
    if isinstance(mod, conv) and mod.groups == 1:
        return "conv"
    what = f"a {type(mod).__name__}"
    if isinstance(mod, conv):
        what += f" with groups={mod.groups} (its channels are split per group)"
    raise TypeError(
        f"megatron_plan: module {name!r} is {what}; column/row splits know nn.Linear, "
        "transformers' Conv1D and nn.Conv1d/2d/3d with groups=1; write its fs.P entries by hand"
    )


def _kind_of(module, glob: str, arg: str) -> tuple[str, list]:
    mods = [(n, m) for n, m in module.named_modules() if _matcher(glob)(n)]
    if not mods:
        raise ValueError(f"megatron_plan: {arg} glob {glob!r} matches no module of the model")
    kinds = {_linear_kind(m, n) for n, m in mods}
    if len(kinds) > 1:
        raise ValueError(
            f"megatron_plan: {arg} glob {glob!r} matches modules of kinds {sorted(kinds)} "
            "(their weights store the features in different dims); split it into one glob "
            "per kind"
        )
    return kinds.pop(), mods


def _split_dim(kind: str, axis: str, which: int) -> P:
    """The weight spec of ``kind`` split over ``axis`` on its out- (0) or in-features (1)."""
    dim = _WEIGHT_DIMS[kind][which]
    return P(*[axis if d == dim else None for d in range(max(dim + 1, 2))])


def _features(mod, kind: str) -> tuple[int, int]:
    if kind == "conv1d":
        return mod.nf, mod.nx
    if kind == "conv":
        return mod.out_channels, mod.in_channels
    return mod.out_features, mod.in_features


def _fused_parts(
    model: torch.nn.Module, name: str, out_f: int, in_f: int, column
) -> tuple[int, ...] | None:
    """The parts of column projection ``name`` (of ``out_f`` features) read from the model's
    config: a fused ``[q | k | v]`` with fewer kv heads (multi-query included) or a fused
    ``[gate | up]``; ``None`` otherwise. Only a projection of the hidden state that is the one column projection of its
    parent module (a Llama ``q_proj`` has the siblings ``k_proj``, ``v_proj``) and not the
    output embedding is taken for fused."""
    cfg = getattr(model, "config", None)
    get = lambda *names: next((getattr(cfg, n) for n in names if getattr(cfg, n, None)), None)  # noqa: E731
    parent = name.rpartition(".")[0]
    if any(n != name and n.rpartition(".")[0] == parent for n in column):
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if in_f != get("hidden_size", "n_embd", "d_model") or model.get_submodule(name) is head:
        return None
    heads = get("num_attention_heads", "n_head", "num_heads")
    if get("new_decoder_architecture"):  # Falcon's grouped [g0: q.. k v | g1: ...]: contiguous
        heads = None
    if heads and isinstance(heads, int):
        head_dim = get("head_dim") or in_f // heads
        for kv in (get("num_key_value_heads", "num_kv_heads"), 1 if get("multi_query") else None):
            if kv and kv != heads and out_f == (heads + 2 * kv) * head_dim:
                return (heads * head_dim, kv * head_dim, kv * head_dim)
    inter = get("intermediate_size", "ffn_dim", "n_inner")
    if isinstance(inter, int) and out_f == 2 * inter:
        return (inter, inter)
    return None


#: transformers' styles that declare a plain contiguous column split head-aligned
_HF_ALIGNED = ("colwise",)


def _shipped_style(model: torch.nn.Module, name: str) -> str | None:
    """The style the model's own tensor-parallel plan gives module ``name`` (None: none)."""
    for pattern, style in _hf_entries(model).items():
        if _matcher(pattern)(name):
            return style
    return None


def _column_weight(name: str, mod, kind: str, axis: str, model, column) -> P | Parts:
    """The layout of column projection ``name``'s weight: its out-features split over ``axis``,
    per part for a fused projection.

    A contiguous split of the out-features gives each rank whole heads only when the features
    are head-major (GPT-NeoX's ``[h0: q k v | h1: q k v | ...]``): the model's own plan says so
    (style ``colwise``), and that split is taken. Fused parts read from the config (``[q | k |
    v]`` with fewer kv heads, ``[gate | up]``) and GPT-2's ``Conv1D`` ``c_attn`` (``[q | k |
    v]``, split by ``n_embd``) are split per part (:class:`~fshard.Parts`): each rank holds its
    heads of q, k and v, so the model's cut of the output into q, k, v (or gate, up) is local.
    An ``nn.Linear`` with out = 3 x in whose order nothing declares warns that a contiguous
    split is head-aligned only if it is head-major."""
    out_f, in_f = _features(mod, kind)
    contiguous = _split_dim(kind, axis, 0)
    if _shipped_style(model, name) in _HF_ALIGNED:
        return contiguous
    parts = _fused_parts(model, name, out_f, in_f, column)
    if parts is None and kind == "conv1d" and out_f == 3 * in_f:  # GPT-2: split(n_embd, dim=2)
        parts = (in_f,) * 3
    if parts is not None:
        return Parts(contiguous, _WEIGHT_DIMS[kind][0], parts)
    if out_f == 3 * in_f:
        warnings.warn(
            f"megatron_plan: column split of {name!r} (and the modules its glob matches) over "
            f"{axis!r}: its {out_f} out-features = 3 x {in_f} look like a fused q|k|v "
            "projection and the model's plan does not say how they are ordered: a contiguous "
            "split is head-aligned if they are head-major ([h0: q k v | h1: q k v | ...], "
            "GPT-NeoX, Falcon); if they are [q | k | v] concatenated, split it per part "
            f"(fs.Parts(fs.P({axis!r}, None), 0, (q, k, v))) or leave it out of column= "
            "(values stay correct, but heads move across ranks every step)",
            stacklevel=4,
        )
    return contiguous


def megatron_plan(
    column: Iterable[str] = (),
    row: Iterable[str] = (),
    vocab: Iterable[str] = (),
    axis: str = "tp",
    bias: bool = True,
    *,
    row_output: P | None = _REPLICATED,
    model: torch.nn.Module | None = None,
    sequence_parallel: bool = False,
) -> dict[str, P | Parts | Output]:
    """A Megatron tensor-parallel plan for ``nn.Linear`` / ``Conv1D`` / ``nn.Conv1d/2d/3d`` /
    ``nn.Embedding``.

    Args:
        column: module-name globs of column-parallel layers (q/k/v, fc1): the weight is split
            on out-features (``nn.Linear`` ``(out, in)``: ``P(axis, None)``; transformers'
            ``Conv1D`` ``(in, out)``: ``P(None, axis)``; ``nn.Conv2d`` ``(out, in, kh, kw)``:
            its out-channels, ``P(axis, None)``), the bias ``P(axis)``; their outputs are
            sharded on the feature dim (the last; a convolution's channel dim 1).
        row: globs of row-parallel layers (attention out-proj, fc2, a ViT's patch-embedding
            ``Conv2d``): the weight is split on in-features (a convolution's in-channels, so a
            replicated input is sliced for free); the bias stays replicated (added once, by
            the first rank's addend of the pending sum; its gradient needs no collective).
        vocab: globs of vocab-parallel Embeddings: the weight ``(vocab, dim)`` is ``P(axis)``.
        axis: the tensor-parallel mesh axis.
        bias: whether the column-parallel layers have a bias (its pattern must match).
            Ignored when ``model`` is given (read from the modules).
        row_output: the layout each row-parallel layer's (and vocab-parallel Embedding's)
            output, a pending sum, is resharded to right after it (an :class:`Output` entry):
            ``P()`` (default, DTensor's ``RowwiseParallel``) all-reduces the pending sum once,
            so the residual stream and every norm after it stay replicated; ``P(None, axis)``
            reduce-scatters over the sequence dim; ``None`` leaves the sum pending for the op
            rules.
        model: the model. When given, each glob must match modules of the model, the weight
            dim is chosen by module type (``Conv1D`` stores its weight transposed), biases are
            detected, and fused projections in ``column`` are split per part: a head-major
            fused q|k|v (GPT-NeoX; the model's own plan gives it the style ``colwise``) is
            split contiguously; GPT-2's ``Conv1D`` ``[q | k | v]`` and fused parts read from
            the config (``[q | k | v]`` with fewer kv heads, multi-query, ``[gate | up]``:
            Phi-3, Falcon) get a :class:`~fshard.Parts` layout (each rank holds its chunk of
            every part, so cutting the output into q, k, v is local; with fewer kv heads than
            ranks, or multi-query, the k/v heads are cut and the attention gathers them); an
            ``nn.Linear`` with out = 3 x in whose order the model does not declare warns that
            it must be head-major.
        sequence_parallel: Megatron-SP (batch-first activations): ``row_output`` becomes
            ``P(None, axis)``, so norms, dropout and residual adds run on sequence-split
            activations; each column-parallel layer's input is all-gathered (reduce-scattered
            in the backward). See :func:`fshard.parallel.sequence_parallel_plan`.

    Returns:
        A plan for :func:`shard_params`; everything else (norms, position embeddings) is
        replicated.

    Example:
        >>> megatron_plan(column=["*.fc1"], row=["*.fc2"])
        {'*.fc1.weight': P('tp', None), '*.fc1.bias': P('tp'), '*.fc2.weight': P(None, 'tp'), '*.fc2': Output(spec=P())}
    """
    if not isinstance(axis, str) or not axis:
        raise TypeError(f"axis must be a mesh axis name, got {axis!r}")
    for arg, value in (("column", column), ("row", row), ("vocab", vocab)):
        if isinstance(value, str):
            raise TypeError(f"{arg} must be a list of globs, not a string ({value!r}); wrap it")
    if sequence_parallel:
        if row_output is not _REPLICATED and row_output != P(None, axis):
            raise ValueError(
                f"sequence_parallel=True sets row_output=P(None, {axis!r}); got row_output="
                f"{row_output!r} too. Pass one of them"
            )
        row_output = P(None, axis)
    if row_output is not None and not isinstance(row_output, P):
        raise TypeError(f"row_output must be a fs.P or None, got {row_output!r}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    plan: dict[str, P | Parts | Output] = {}
    column = list(column)
    if model is not None:
        found = {m: _kind_of(model, m, "column") for m in column}
        names = {n for _, mods in found.values() for n, _ in mods}
    for m in column:
        kind, has_bias = "linear", bias
        if model is not None:
            kind, mods = found[m]
            has_bias = any(getattr(mod, "bias", None) is not None for _, mod in mods)
            weight = _column_weight(*mods[0], kind, axis, model, names)  # one check per glob
        else:
            weight = _split_dim(kind, axis, 0)
        plan[f"{m}.weight"] = weight
        if has_bias:
            parts = weight.sizes if isinstance(weight, Parts) else None
            plan[f"{m}.bias"] = P(axis) if parts is None else Parts(P(axis), 0, parts)
    for m in row:
        kind = _kind_of(model, m, "row")[0] if model is not None else "linear"
        plan[f"{m}.weight"] = _split_dim(kind, axis, 1)
    for m in vocab:
        plan[f"{m}.weight"] = P(axis, None)
    if row_output is not None:  # a row-parallel layer's and a vocab-parallel lookup's output
        for m in (*row, *vocab):  # is a pending sum
            plan[m] = Output(row_output)
    return plan


#: transformers' tensor-parallel styles (``config.base_model_tp_plan``, ``model._tp_plan``) and
#: the megatron_plan role each maps to. An output transformers gathers (``colwise_gather_output``,
#: ``colwise_rep``) stays split here: in fshard's global view the next op reads a split value as
#: it reads a full one (same values), and the gather is left to the op that needs it.
_HF_STYLES = {
    "colwise": "column",
    "colwise_gather_output": "column",
    "colwise_rep": "column",
    "rowwise": "row",
    "rowwise_rep": "row",
    "rowwise_split_input": "row",
    "embedding_rowwise": "vocab",
    "replicate": None,
    # q/k norms (Qwen3, Gemma-3, ...): a replicated parameter whose gradient transformers
    # all-reduces by hand; in fshard's global view a replicated parameter's gradient is whole
    "replicated_with_grad_allreduce": None,
}
#: transformers' styles for the stacked MoE experts' parameters (``(E, 2I, H)`` gate_up_proj,
#: ``(E, H, I)`` down_proj, ``@use_experts_implementation``): each expert's [gate | up] halves
#: split on I over the axis (column-parallel per half), down split on I (row-parallel); the
#: experts module's own style (its output's all_reduce) is :func:`fshard.parallel.moe_experts`'s
_HF_EXPERT_STYLES = {"packed_colwise": "column", "rowwise": "row", "moe_tp_experts": None}


def _hf_entries(model: torch.nn.Module) -> dict[str, str]:
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    out = dict(getattr(model, "_tp_plan", None) or {})
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    has_base = prefix and isinstance(getattr(model, prefix, None), torch.nn.Module)
    for k, v in base.items():
        out[f"{prefix}.{k}" if has_base else k] = v
    return out


def hf_tp_plan(
    model: torch.nn.Module,
    axis: str = "tp",
    *,
    unsupported: str = "error",
    row_output: P | None = _REPLICATED,
) -> dict[str, P | Output]:
    """The tensor-parallel plan a ``transformers`` model ships, as a fshard plan.

    Reads ``model.tp_plan`` (``config.base_model_tp_plan`` under the base model's prefix, plus
    the head's ``_tp_plan``) and maps each style to :func:`megatron_plan`'s roles:
    ``colwise`` (and ``colwise_gather_output``, ``colwise_rep``: the output stays split, see
    below) to ``column``, ``rowwise`` (``rowwise_rep``, ``rowwise_split_input``) to ``row``,
    ``embedding_rowwise`` to ``vocab``, ``replicate`` and ``replicated_with_grad_allreduce``
    (q/k norms) to nothing (a replicated parameter). A tied head (``lm_head.weight`` is the
    embedding's weight) keeps its entry: :func:`shard_params` gives the tied parameter the
    spec its names agree on. An output transformers
    gathers stays split over ``axis`` here: fshard's global view reads it as it reads the full
    value (the same numbers), and only an op that needs it whole gathers it. The stacked MoE
    experts' styles (``packed_colwise`` on ``gate_up_proj`` ``(E, 2I, H)``: each of the gate and
    up halves split on I, a :class:`~fshard.Parts`; ``rowwise`` on ``down_proj`` ``(E, H, I)``:
    I split; ``moe_tp_experts`` on the module: the output's sum over ``axis``, which
    :func:`fshard.parallel.moe_experts` does) map too. An entry naming no module or param of
    this configuration (a dense-MLP entry of a model whose every layer is a mixture of experts)
    is left out. Styles with no fshard equivalent yet
    (``packed_colwise`` on a module, ``sequence_parallel`` ...) raise a ``ValueError`` listing
    them, or, with ``unsupported="replicate"``, leave those modules replicated (correct, less
    sharded).

    Args:
        model: a ``transformers`` model (``PreTrainedModel``).
        axis: the tensor-parallel mesh axis.
        unsupported: ``"error"`` (default) or ``"replicate"``.
        row_output: as in :func:`megatron_plan`.

    Returns:
        A plan for :func:`shard_params` (checked against the model by :func:`megatron_plan`).

    Example:
        >>> import transformers
        >>> mesh = fs.Mesh.create((2,), ("tp",))  # 2 ranks: fs.launch.run(fn, 2) or torchrun
        >>> cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...     num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
        >>> _ = torch.manual_seed(0)  # every rank builds the same weights
        >>> model = transformers.LlamaForCausalLM(cfg)
        >>> plan = fs.nn.hf_tp_plan(model)  # the plan Llama ships, as fshard specs
        >>> params = fs.nn.shard_params(model, mesh, plan)
        >>> params["model.layers.0.self_attn.q_proj.weight"].spec
        P('tp')
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"hf_tp_plan: model must be a torch.nn.Module, got {type(model).__name__}")
    if unsupported not in ("error", "replicate"):
        raise ValueError(
            f"hf_tp_plan: unsupported must be 'error' or 'replicate', got {unsupported!r}"
        )
    entries = _hf_entries(model)
    if not entries:
        raise ValueError(
            f"hf_tp_plan: {type(model).__name__} ships no tensor-parallel plan (neither "
            "config.base_model_tp_plan nor _tp_plan); write one with fs.nn.megatron_plan"
        )
    roles: dict[str, list[str]] = {"column": [], "row": [], "vocab": []}
    skipped, experts = [], {}
    modules = dict(model.named_modules())
    params = [n for n, _ in model.named_parameters()]
    experts_modules = _experts_modules(model)
    for pattern, style in entries.items():
        match = _matcher(pattern)
        stacked = _stacked_experts(experts_modules, match)
        if stacked is not None and style in _HF_EXPERT_STYLES:
            experts.update({n: (_HF_EXPERT_STYLES[style], shape) for n, shape in stacked.items()})
        elif style not in _HF_STYLES:
            skipped.append(f"{pattern!r}: {style!r}")
        elif _HF_STYLES[style] is not None:
            if any(match(n) for n in modules):
                roles[_HF_STYLES[style]].append(pattern)
            elif any(match(n) for n in params):  # a fused parameter, no module
                skipped.append(f"{pattern!r}: {style!r} (a parameter, not a module)")
            # else: an entry for layers this configuration does not build (the dense MLPs of
            # a model whose every layer is a mixture of experts): nothing to split

    if skipped and unsupported == "error":
        raise ValueError(
            f"hf_tp_plan: {type(model).__name__}'s plan has styles with no fshard equivalent "
            f"yet: {', '.join(skipped)}. Pass unsupported='replicate' to keep those modules "
            "replicated (values are the same; they are not sharded), or write the plan with "
            "fs.nn.megatron_plan"
        )
    plan = megatron_plan(**roles, axis=axis, row_output=row_output, model=model)
    for name, (role, shape) in experts.items():
        if role == "column":  # (E, 2I, H): each half split on I
            half = shape[1] // 2
            plan[name] = Parts(P(None, axis, None), 1, (half, half))
        elif role == "row":  # (E, H, I)
            plan[name] = P(None, None, axis)
    return plan


def _stacked_experts(experts: list, match) -> dict | None:
    """``{param name: shape}`` of the stacked experts' parameters (``gate_up_proj``,
    ``down_proj`` of a transformers ``@use_experts_implementation`` module in ``experts``,
    ``[(name, module)]``) a plan pattern names, or the experts modules' (``{}``: the module's
    own style); None when it names neither (or experts :func:`moe_experts` does not run:
    transposed, interleaved, with biases ..., named as unsupported)."""
    out, hit = {}, False
    for n, m in experts:
        if _unsupported_experts(m):
            continue
        if match(n):
            hit = True
        for p in ("gate_up_proj", "down_proj"):
            if match(f"{n}.{p}"):
                out[f"{n}.{p}"] = tuple(getattr(m, p).shape)
    return out if out or hit else None
