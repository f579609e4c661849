"""Train a small byte-level GPT with fshard: Megatron tensor parallelism x data parallelism.

    python examples/train_gpt.py                    # 2 local Gloo ranks, dp=1 x tp=2, 200 steps
    python examples/train_gpt.py --dp 2 --tp 1      # pure data parallel
    python examples/train_gpt.py --fsdp 2           # FSDP over dp=2 x Megatron TP over tp=2
    python examples/train_gpt.py --device cuda      # the local ranks' blocks on the GPU(s)
    torchrun --nproc-per-node 4 examples/train_gpt.py --dp 2 --tp 2   # NCCL with 4 GPUs

Every axis (the global view runs the module's own forward; float32 without ``--experts``
prints the losses of ``--dp 1 --tp 2`` in every combination):

    python examples/train_gpt.py --view global --sp             # + Megatron sequence parallel
    python examples/train_gpt.py --view global --cp 2 --tp 1    # the sequence over cp, ring attention
    python examples/train_gpt.py --view global --pp 2 --tp 1 --schedule zb   # pipeline stages
    python examples/train_gpt.py --view global --pp 2 --cp 2 --tp 1 --remat  # stages x ring
    python examples/train_gpt.py --view global --experts 4 --ep 2 --tp 1     # MoE, experts over ep
    python examples/train_gpt.py --remat --bf16                 # activation checkpointing, bf16

``--device`` (``cpu`` or ``cuda``) is where the params, optimizer state and batches live; by
default ``cuda`` when the process group is NCCL (torchrun with a GPU per rank, see
``fs.launch.default_backend``) and ``cpu`` otherwise (Gloo: the local ranks, or torchrun with
more ranks than GPUs, where ``--device cuda`` shares the GPUs between the ranks).

What it shows:

* ``fs.nn.shard_params(model, mesh, plan)`` shards an ordinary ``nn.Module``'s parameters with
  a Megatron plan (:func:`gpt_plan`): qkv, fc1 and the LM head column-parallel (torch weight
  ``(out, in)`` split on out-features, ``P('tp', None)``), attention-out and fc2 row-parallel
  (``P(None, 'tp')``), embeddings and LayerNorms replicated.
* The batch is sharded over ``dp`` with ``fs.shard(batch, mesh, P('dp'))``.
* The step is functional: ``torch.func.grad_and_value`` of the loss, one bucketed
  ``fs.lax.pmean`` of the gradient pytree over ``dp`` (DDP-like buckets; donated, so large
  grads are reduced in place), ``fs.optim.adamw`` (warmup + cosine schedule, clipping) and
  ``fs.optim.apply_updates``. Gradients and optimizer state keep the params' layouts.

Two ways to write the sharded forward (``--view``):

* ``local`` (default, :func:`tp_loss`): fshard's *local view*, what ``fs.shard_map`` bodies
  see. Each rank computes on its shards with explicit JAX-style collectives (``pcast`` where a
  replicated activation enters a column-parallel layer, ``psum`` after a row-parallel one), and
  the gradients are averaged over ``dp`` by one bucketed ``fs.lax.pmean``.
* ``global`` (:func:`global_loss`): the module's own ``GPT.forward``, run on the sharded
  params and batch by ``fs.nn.functional_call``; the op rules insert the collectives. A
  replicated param meets the ``dp``-sharded batch through ``pcast``, whose backward sums its
  gradient over ``dp`` (one all_reduce per param, not bucketed), so the step needs no explicit
  gradient reduction. Slower, and nothing to write by hand.

``--fsdp N`` (local view, dp=N): FSDP (ZeRO-3) by layouts. ``fs.nn.fsdp_plan`` adds ``'dp'`` to
dim 0 of every param of the Megatron plan (params and AdamW moments sharded over dp x tp), and
:func:`fsdp_loss` gathers each block's weights over dp just before use (``fs.nn.fsdp_gather``:
to a varying value, so the gradient is a reduce_scatter; the next block prefetched, re-gathered
in the backward instead of kept), differentiated with ``fs.value_and_grad``.

``GPT.forward`` on plain tensors is the dense reference: the test checks that both views train
exactly like it.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _device import add_device_flag, checked_device
from torch import nn

import fshard as fs
from fshard.launch import run as launch_run

DATA = Path(__file__).resolve().parent / "data" / "corpus.txt"


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    ctx: int = 64
    n_experts: int = 0  # > 0: each block's MLP is a top-k routed mixture of experts
    top_k: int = 2


# -- the model (dense definition; also the source of parameter names and init) ---------------


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        # qkv output features are head-major: [h0: q k v | h1: q k v | ...], so a contiguous
        # split of the out-features over tp gives every rank whole heads (Megatron layout).
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, self.n_heads, 3, -1)
        return self.proj(_attend(qkv).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.fc2 = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoE(nn.Module):
    """Top-k routed experts (``--experts E``): a router, and ``E`` GELU MLPs stored stacked
    (``gate_up`` ``(E, 2 I, d)``, ``down`` ``(E, d, I)``, transformers' layout).

    With the experts sharded over a mesh axis (``--ep``) the tokens go to their experts' ranks
    and back (``fs.parallel.moe_experts``: ragged all_to_alls of the routed rows only);
    otherwise (dense, or experts replicated) every expert runs on every token and is weighted
    by its routing weight, zero where the token is not routed to it: the same sum.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d, inner = cfg.d_model, 2 * cfg.d_model
        self.top_k = cfg.top_k
        self.router = nn.Linear(d, cfg.n_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(cfg.n_experts, 2 * inner, d))
        self.down = nn.Parameter(torch.empty(cfg.n_experts, d, inner))
        nn.init.normal_(self.gate_up, std=0.02)
        nn.init.normal_(self.down, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(self, x):
        b, t, d = x.shape
        h = x.reshape(b * t, d)
        w, idx = torch.softmax(self.router(h), -1).topk(self.top_k, -1)
        if isinstance(self.gate_up, fs.ShardedArray) and self.gate_up.spec.padded(3)[0]:
            y = fs.parallel.moe_experts(h, idx, w, self.gate_up, self.down, apply_gate=_gelu_gate)
        else:
            y = 0
            for e in range(self.gate_up.shape[0]):
                weight = (w * (idx == e)).sum(-1, keepdim=True)
                out = F.linear(_gelu_gate(F.linear(h, self.gate_up[e])), self.down[e])
                y = y + weight * out
        return y.reshape(b, t, d)


def _gelu_gate(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg) if cfg.n_experts else MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A pre-LayerNorm GPT: token + position embeddings, ``n_layers`` blocks, LM head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.ctx, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
                if name.endswith(("proj.weight", "fc2.weight")):
                    p.data.mul_(1 / math.sqrt(2 * cfg.n_layers))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, tokens, positions=None):
        """``positions``: each token's position (``--cp``: a rank's load-balanced chunks);
        default ``0 .. t-1``."""
        t = tokens.shape[1]
        pos = self.pos.weight[:t] if positions is None else F.embedding(positions, self.pos.weight)
        x = self.tok(tokens) + pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


#: ``(axis, mesh)`` while :func:`context_loss` runs the model on a rank's sequence chunks
_CONTEXT: list = []


def _attend(qkv):
    """Causal attention on ``(b, t, heads, 3, hd)``: returns ``(b, t, heads, hd)``. Under
    :func:`context_loss` (``--cp``) the sequence is split over the context-parallel axis and
    the attention is ``fs.parallel.ring_attention`` (k/v blocks passed around the ring)."""
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    if not _CONTEXT:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    axis, mesh = _CONTEXT[-1]

    def ring(q, k, v):
        return fs.parallel.ring_attention(q, k, v, axis, causal=True, mesh=mesh)

    if isinstance(q, fs.ShardedArray):  # the blocks of the other axes (heads over tp)
        ring = fs.shard_map(ring, mesh, (q.spec, k.spec, v.spec), q.spec)
    return ring(q, k, v).transpose(1, 2)


def gpt_plan(axis: str = "tp", experts: str | None = None, sp: bool = False) -> dict:
    """The Megatron plan of :class:`GPT` for :func:`fshard.nn.shard_params`; with ``experts``
    (a mesh axis, :class:`MoE` blocks) the experts split over it (expert parallelism) and the
    routers replicated; with ``sp`` Megatron sequence parallelism (``--sp``: norms and residuals
    on sequence-split activations, ``fs.parallel.sequence_parallel_plan``)."""
    mlp = ([], []) if experts else (["blocks.*.mlp.fc1"], ["blocks.*.mlp.fc2"])
    plan = (fs.parallel.sequence_parallel_plan if sp else fs.nn.megatron_plan)(
        column=["blocks.*.attn.qkv", *mlp[0]],
        row=["blocks.*.attn.proj", *mlp[1]],
        axis=axis,
        **({"scatter": ["tok"]} if sp else {}),
    )
    plan.update(fs.nn.megatron_plan(column=["head"], axis=axis, bias=False))
    if experts:
        plan.update({"blocks.*.mlp.gate_up": fs.P(experts), "blocks.*.mlp.down": fs.P(experts)})
    return plan


def dense_loss(params: dict, model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """Reference loss: the dense module on plain tensors (single process)."""
    logits = torch.func.functional_call(model, params, (tokens[:, :-1],))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# -- the sharded model, local view ----------------------------------------------------------


def tp_loss(
    params: dict,
    tokens: torch.Tensor,
    cfg: GPTConfig,
    mesh: fs.Mesh,
    get=None,
    *,
    remat: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean next-byte cross entropy over this rank's sequences, Megatron TP over ``'tp'``.

    ``params`` maps names to ShardedArrays (from :func:`gpt_plan`); this function reads their
    local shards. Replicated activations enter each column-parallel layer through
    ``fs.lax.pcast`` (no forward comm; the backward all-reduces their gradient once) and leave
    each row-parallel layer through ``fs.lax.psum``; the vocab-sharded logits are all-gathered.
    The result is the same on every ``tp`` rank and differs over ``dp``.

    ``get(unit) -> {name: local block}`` supplies each FSDP unit's weights just before use
    (:func:`fsdp_loss`); by default every param's local shard. ``remat``: each block under
    ``fs.remat`` (only its input and weights saved; the rest, collectives included, recomputed
    in the backward). ``dtype``: compute dtype (``--bf16``): the weights are cast to it where
    read (their gradients come back in float32), the logits back to float32 for the loss.
    """
    if get is None:
        whole = {k: v.local for k, v in params.items()}

        def get(unit):
            return whole

    if dtype is not None:
        fetch = get

        def get(unit):
            return {k: v.to(dtype) if v.is_floating_point() else v for k, v in fetch(unit).items()}

    root = get("")
    p = dict(root)
    tp = mesh.size("tp")
    heads, hd = cfg.n_heads // tp, cfg.d_model // cfg.n_heads
    x_tok, y = tokens[:, :-1], tokens[:, 1:]
    b, t = x_tok.shape

    def column(x, name, bias=True):
        return F.linear(
            fs.lax.pcast(x, "tp", mesh=mesh),
            p[name + ".weight"],
            p.get(name + ".bias") if bias else None,
        )

    def row(x, name):
        return fs.lax.psum(F.linear(x, p[name + ".weight"]), "tp", mesh=mesh) + p[name + ".bias"]

    def ln(x, name):
        return F.layer_norm(x, (cfg.d_model,), p[name + ".weight"], p[name + ".bias"])

    def block(x, weights, pre):
        nonlocal p
        p = weights
        qkv = column(ln(x, pre + "ln1"), pre + "attn.qkv").view(b, t, heads, 3, hd)
        x = x + row(_attend(qkv).reshape(b, t, heads * hd), pre + "attn.proj")
        h = F.gelu(column(ln(x, pre + "ln2"), pre + "mlp.fc1"))
        return x + row(h, pre + "mlp.fc2")

    x = F.embedding(x_tok, p["tok.weight"]) + p["pos.weight"][:t]
    for i in range(cfg.n_layers):
        pre = f"blocks.{i}."
        weights = get(pre[:-1])  # the previous block's weights can be freed
        if remat:  # the weights are arguments: their gradients flow through the recompute
            x = fs.remat(lambda x, w, pre=pre: block(x, w, pre))(x, weights)
        else:
            x = block(x, weights, pre)
    p = root
    logits = column(ln(x, "ln_f"), "head", bias=False)
    logits = fs.lax.all_gather(logits, "tp", dim=-1, to="invariant", mesh=mesh)
    return F.cross_entropy(logits.reshape(-1, cfg.vocab).float(), y.reshape(-1))


def fsdp_loss(
    params: dict,
    tokens: torch.Tensor,
    cfg: GPTConfig,
    mesh: fs.Mesh,
    units: dict,
    remat: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`tp_loss` with params sharded over ``dp`` too (``fs.nn.fsdp_plan``): each block's
    weights are all-gathered over ``dp`` just before use (to a varying value, so their gradient
    is a reduce_scatter), the next block's gather prefetched, and re-gathered in the backward
    instead of kept. Averaged over ``dp``: the gradients come out already reduced. ``units``:
    ``fs.nn.fsdp_units(model)`` (the root, then each block). With ``dtype`` (``--bf16``) the
    blocks are gathered in it and the gradients reduce-scattered in float32
    (``fs.nn.MixedPrecisionPolicy``)."""
    policy = fs.nn.MixedPrecisionPolicy(dtype, torch.float32) if dtype is not None else None
    rep = replicate_axis(mesh)
    with fs.nn.fsdp_gather(params, units, mesh=mesh, mp_policy=policy, replicate=rep) as get:
        loss = tp_loss(params, tokens, cfg, mesh, get=get, remat=remat)
    return fs.lax.pmean(loss, ("rep", "dp") if rep else "dp", mesh=mesh)


def data_axes(mesh: fs.Mesh) -> tuple[str, ...]:
    """The mesh axes the batch is split over: HSDP's replicate axis ``rep`` (``--hsdp``), ``dp``
    and ``ep`` (expert parallelism carves its ranks out of the data), those the mesh has."""
    return tuple(a for a in ("rep", "dp", "ep") if a in mesh.axis_names)


def replicate_axis(mesh: fs.Mesh) -> str | None:
    """HSDP's replicate axis (``--hsdp R``: params sharded over ``dp``, replicated over it)."""
    return "rep" if "rep" in mesh.axis_names and mesh.size("rep") > 1 else None


def run_model(
    module: nn.Module,
    params: dict,
    args: tuple,
    kwargs=None,
    *,
    fsdp=False,
    mp_policy=None,
    outputs=None,
):
    """The module's own forward on sharded params (the global view): ``fs.nn.functional_call``,
    or, with ``fsdp`` (params from ``fs.nn.fsdp_plan``), ``fs.nn.fsdp_call``, which gathers
    each block's weights over ``dp`` just before its forward (their gradients are
    reduce-scattered). The op rules insert every other collective (tp, sp, ep, cp).
    ``outputs``: submodules' output layouts (a plan's ``fs.nn.Output`` entries)."""
    if fsdp:
        mesh = next(iter(params.values())).mesh  # inside a shard_map body: its auto axes'
        return fs.nn.fsdp_call(
            module, params, args, kwargs, mesh=mesh, axis="dp", mp_policy=mp_policy,
            replicate=replicate_axis(mesh), outputs=outputs,
        )  # fmt: skip
    return fs.nn.functional_call(module, params, args, kwargs, mp_policy=mp_policy, outputs=outputs)


def pieces(model: GPT, *, fsdp=False, remat=False, dtype: torch.dtype | None = None, outputs=None):
    """``GPT.forward`` in the three pieces that ``--pp`` pipelines and ``--remat`` checkpoints
    block by block: ``embed(emb, ids, positions=None) -> x``, ``blocks(per_block, x) -> x``
    (each block's params a dict; each block the module's own ``Block.forward`` through
    :func:`run_model`, under ``fs.remat`` with ``remat``: only its input and weights saved, the
    rest, collectives included, recomputed in the backward) and ``logits(head, x)``. With
    ``dtype`` (``--bf16``) every weight is cast where read, the logits come out float32.
    ``outputs``: the blocks' submodules' output layouts (see :func:`_blockwise`)."""
    cfg = model.cfg
    policy = fs.nn.MixedPrecisionPolicy(dtype, torch.float32) if dtype is not None else None
    cast = policy.cast_param if policy is not None else (lambda t: t)

    context = _CONTEXT[-1] if _CONTEXT else None  # --cp: ring attention, in the recompute too

    def run(p, x):
        if context is not None:
            _CONTEXT.append(context)
        try:
            return run_model(model.blocks[0], p, (x,), fsdp=fsdp, mp_policy=policy, outputs=outputs)
        finally:
            if context is not None:
                _CONTEXT.pop()

    def embed(emb, ids, positions=None):
        emb = {k: cast(v) for k, v in emb.items()}
        if positions is None:
            return F.embedding(ids, emb["tok.weight"]) + emb["pos.weight"][: ids.shape[-1]]
        return F.embedding(ids, emb["tok.weight"]) + F.embedding(positions, emb["pos.weight"])

    def blocks(per_block, x):
        for one in per_block:
            x = fs.remat(run)(one, x) if remat else run(one, x)
        return x

    def logits(hp, x):
        hp = {k: cast(v) for k, v in hp.items()}
        h = F.layer_norm(x, (cfg.d_model,), hp["ln_f.weight"], hp["ln_f.bias"])
        return F.linear(h, hp["head.weight"]).float()

    return embed, blocks, logits


EMB, HEAD = ("tok.weight", "pos.weight"), ("ln_f.weight", "ln_f.bias", "head.weight")


def _blockwise(params, model, ids, positions=None, *, fsdp=False, dtype=None):
    """The logits of :func:`pieces` on flat params, every block under ``fs.remat``, each
    row-parallel output all-reduced where it leaves its layer (the plan's ``fs.nn.Output``
    entries, as the whole module's call applies them: the same collectives as without
    ``--remat``). Not needed for the gradients: ``fs.remat`` of a block whose input is a pending
    sum (the residual stream before its all-reduce) is exact too (issue 36)."""
    rows = fs.P(data_axes(next(iter(params.values())).mesh))  # the batch keeps its split
    outputs = {"attn.proj": rows} | ({} if model.cfg.n_experts else {"mlp.fc2": rows})
    embed, blocks, logits = pieces(model, fsdp=fsdp, remat=True, dtype=dtype, outputs=outputs)
    per_block = [
        {k[len(pre) :]: v for k, v in params.items() if k.startswith(pre)}
        for pre in (f"blocks.{i}." for i in range(len(model.blocks)))
    ]
    x = blocks(per_block, embed({k: params[k] for k in EMB}, ids, positions))
    return logits({k: params[k] for k in HEAD}, x)


def global_loss(
    params: dict, model: GPT, tokens: fs.ShardedArray, fsdp=False, remat=False, dtype=None
) -> torch.Tensor:
    """Mean next-byte cross entropy of the global batch: the module's own forward on sharded
    params (:func:`run_model`), collectives inserted by the op rules; with ``remat`` block by
    block, each under ``fs.remat`` (:func:`pieces`).

    ``tokens`` is the ``(batch, ctx + 1)`` batch sharded over ``dp``. The loss is replicated,
    and :func:`fshard.gather` of a replicated value is its local tensor (no communication).
    """
    if remat:
        logits = _blockwise(params, model, tokens[:, :-1], fsdp=fsdp, dtype=dtype)
    else:
        logits = run_model(model, params, (tokens[:, :-1],), fsdp=fsdp)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return fs.gather(loss)


def context_batch(batch: torch.Tensor, mesh: fs.Mesh, microbatches: int | None = None) -> dict:
    """The ``--cp`` inputs of a full ``(batch, ctx + 1)`` batch: ids, positions and next-byte
    targets in the load-balanced order (``fs.parallel.load_balance``: rank i of ``cp`` holds
    chunks i and 2cp-1-i), split over dp x ep on the batch and over cp on the sequence. With
    ``microbatches`` (``--pp``) each is ``(microbatches, batch / microbatches, ctx)``, the
    microbatch dim not split."""
    cp = mesh.size("cp")
    ids, targets = batch[:, :-1], batch[:, 1:]
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    spec = fs.P(data_axes(mesh), "cp")
    if microbatches is not None:
        spec = fs.P(None, *spec.dims)

    def split(t):
        t = fs.parallel.load_balance(t, cp, 1)
        return t if microbatches is None else t.reshape(microbatches, -1, t.shape[-1])

    return {
        k: fs.shard(split(t), mesh, spec)
        for k, t in (("ids", ids), ("positions", positions), ("targets", targets))
    }


def context_loss(
    params: dict,
    model: GPT,
    batch: dict,
    mesh: fs.Mesh,
    fsdp: bool = False,
    remat: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`global_loss` with the sequence split over ``cp`` (``--cp``): a ``shard_map``
    manual over ``cp`` (the params keep their layouts over dp and tp) runs the module's own
    forward on each rank's chunks at their global positions, with ring attention; the
    cross-entropy sums are added over ``cp``."""
    count = batch["targets"].numel()

    def body(ps, ids, positions, targets):
        _CONTEXT.append(("cp", mesh))
        try:
            if remat:
                logits = _blockwise(ps, model, ids, positions, fsdp=fsdp, dtype=dtype)
            else:
                logits = run_model(model, ps, (ids,), {"positions": positions}, fsdp=fsdp)
        finally:
            _CONTEXT.pop()
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        )
        return fs.lax.psum(ce, "cp") / count

    seq = fs.P(None, "cp")
    run = fs.shard_map(body, mesh, (fs.P(), seq, seq, seq), fs.P(), axis_names={"cp"})
    return fs.gather(run(params, batch["ids"], batch["positions"], batch["targets"]))


def pipeline_params(
    model: GPT, mesh: fs.Mesh, virtual: int = 1, *, sp: bool = False, fsdp: bool = False
) -> dict:
    """The params for ``--pp``: ``{"emb": tok/pos, "stages": the blocks stacked as pipeline
    stages over ``pp`` (``fs.parallel.stack_stages``, with the Megatron plan over ``tp``,
    sequence-parallel with ``sp``, sharded over ``dp`` too with ``fsdp``), "head": ln_f +
    head}``."""
    named = {k: v.detach() for k, v in model.named_parameters()}
    plan = gpt_plan("tp", experts="ep" if model.cfg.n_experts else None, sp=sp)
    if fsdp:
        plan = fs.nn.fsdp_plan(model, mesh, "dp", base=plan)
    specs = fs.nn.match_plan(named, plan)
    shard = lambda n: fs.shard(named[n], mesh, specs[n])  # noqa: E731
    stages = fs.parallel.stack_stages(named, mesh, prefix="blocks", plan=plan, virtual=virtual)
    return {
        "emb": {n: shard(n) for n in ("tok.weight", "pos.weight")},
        "stages": stages,
        "head": {n: shard(n) for n in ("ln_f.weight", "ln_f.bias", "head.weight")},
    }


def pipeline_loss(
    params: dict,
    tokens,
    model: GPT,
    mesh: fs.Mesh,
    schedule: str,
    virtual: int = 1,
    remat: bool = False,
    fsdp: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Mean next-byte cross entropy with the blocks pipelined over ``pp`` (``--pp``):
    ``tokens`` is ``(microbatches, batch / microbatches, ctx + 1)``, split over dp x ep on dim
    1, or (``--cp``) :func:`context_batch`'s microbatched ids, positions and targets, the
    sequence split over cp too (each block's attention a ring over cp). The embedding runs
    before the pipeline (on every pp rank), each stage runs its blocks (the module's own
    ``Block.forward`` through ``fs.nn.functional_call``, under ``fs.remat`` with ``remat``),
    the final norm, head and loss run on the last stage. ``fs.parallel.pipeline`` is
    differentiable: ``fs.value_and_grad`` of this gives the params' gradients in their
    layouts."""
    # --bf16: every weight cast where read, activations in bf16 between the stages, the logits
    # in float32 (the global view's policy, written out for the pieces around the pipeline)
    embed, blocks, logits = pieces(model, fsdp=fsdp, remat=remat, dtype=dtype)

    def stage(p, x):  # one stage's blocks, stacked on dim 0
        return blocks(
            [{n: v[i] for n, v in p.items()} for i in range(len(next(iter(p.values()))))], x
        )

    def head(hp, y, target):
        out = logits(hp, y)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    if isinstance(tokens, dict):  # --cp: the rank's load-balanced chunks at their positions
        y = tokens["targets"]
        x = embed(params["emb"], tokens["ids"], tokens["positions"])
        _CONTEXT.append(("cp", mesh))
    else:
        y = tokens[..., 1:]
        x = embed(params["emb"], tokens[..., :-1])
    try:
        return fs.parallel.pipeline(
            stage, params["stages"], x, mesh, loss_fn=head, loss_params=params["head"],
            targets=y, schedule=schedule, virtual=virtual,
        )  # fmt: skip
    finally:
        if isinstance(tokens, dict):
            _CONTEXT.pop()


# -- training --------------------------------------------------------------------------------


def load_corpus(path: Path = DATA) -> torch.Tensor:
    """The corpus as a uint8 tensor of bytes."""
    data = path.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def get_batch(data: torch.Tensor, batch: int, ctx: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``ctx + 1`` bytes, as int64 (same on every rank)."""
    starts = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
    return torch.stack([data[s : s + ctx + 1] for s in starts.tolist()]).long()


def _decays(params) -> dict:
    """Weight decay on matrices only: a flat ``{name: value}`` (a param's ndim), or the
    pipeline's ``{"emb", "stages", "head"}`` tree (a stage param's ndim without its two leading
    stage dims)."""
    if "stages" not in params:
        return {k: v.ndim >= 2 for k, v in params.items()}
    lead = {"stages": 2}
    return {g: {k: v.ndim - lead.get(g, 0) >= 2 for k, v in d.items()} for g, d in params.items()}


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float):
    """AdamW with linear warmup + cosine decay, global-norm clipping, no decay on vectors."""
    schedule = fs.optim.warmup_cosine_decay_schedule(
        0.0, lr, min(warmup, steps - 1), max(steps, 2), end_value=lr / 10
    )
    return fs.optim.chain(
        fs.optim.clip_by_global_norm(clip),
        fs.optim.adamw(
            schedule,
            b2=0.95,
            weight_decay=weight_decay,
            mask=_decays,
        ),
    )


def make_train_step(
    model_cfg: GPTConfig,
    mesh: fs.Mesh,
    tx,
    *,
    model: GPT | None = None,
    fsdp_units: dict | None = None,
    remat: bool = False,
    dtype: torch.dtype | None = None,
    pipeline: dict | None = None,
    context: bool = False,
    fsdp: bool = False,
):
    """The functional step ``(params, opt_state, batch) -> (params, opt_state, loss)``.

    With ``model`` the step differentiates :func:`global_loss` (the module's own forward);
    with ``fsdp_units`` (params sharded by ``fs.nn.fsdp_plan``) :func:`fsdp_loss` through
    ``fs.value_and_grad``; otherwise the local-view :func:`tp_loss`. ``remat`` and ``dtype``
    as in :func:`tp_loss` (``dtype`` of the global view: the policy ``shard_params`` recorded).
    With ``pipeline`` (``{"schedule", "virtual", "microbatches"}``, params from
    :func:`pipeline_params`) :func:`pipeline_loss` through ``fs.value_and_grad``; with
    ``context`` (the batch from :func:`context_batch`) :func:`context_loss`. ``fsdp``: the
    global view's params are sharded over ``dp`` too (``fs.nn.fsdp_plan``), run by
    ``fs.nn.fsdp_call`` (:func:`run_model`).
    """
    dp = mesh.size("dp")
    if pipeline is not None:
        pp_grad = fs.value_and_grad(pipeline_loss)

        def loss_and_grads(params, batch):  # (microbatches, rows, ctx + 1), or --cp's dict
            loss, grads = pp_grad(
                params, batch, model, mesh, pipeline["schedule"], pipeline["virtual"], remat,
                fsdp, dtype,
            )  # fmt: skip
            return grads, loss

    elif context:
        cp_grad = fs.value_and_grad(context_loss)

        def loss_and_grads(params, batch):  # batch: context_batch's ids/positions/targets
            loss, grads = cp_grad(params, model, batch, mesh, fsdp, remat, dtype)
            return grads, loss

    elif fsdp_units is not None:
        fsdp_grad = fs.value_and_grad(fsdp_loss)

        def loss_and_grads(params, batch):  # grads arrive reduce-scattered over dp
            loss, grads = fsdp_grad(params, batch.local, model_cfg, mesh, fsdp_units, remat, dtype)
            return grads, loss

    elif model is not None and fsdp:
        fsdp_global_grad = fs.value_and_grad(global_loss)

        def loss_and_grads(params, batch):  # gathered per block; grads reduce-scattered
            loss, grads = fsdp_global_grad(params, model, batch, True, remat, dtype)
            return grads, loss

    elif model is not None:
        global_grad = torch.func.grad_and_value(global_loss)

        def loss_and_grads(params, batch):  # dp reduction: in the backward of the op rules' pcast
            return global_grad(params, model, batch, False, remat, dtype)

    else:
        local_grad = torch.func.grad_and_value(tp_loss)

        def loss_and_grads(params, batch):
            grads, loss = local_grad(params, batch.local, model_cfg, mesh, remat=remat, dtype=dtype)
            if dp > 1:  # the whole gradient pytree, bucketed; the fresh grads are donated
                grads, loss = fs.lax.pmean((grads, loss), "dp", mesh=mesh, donate=True)
            return grads, loss

    def step(params, opt_state, batch: fs.ShardedArray):
        grads, loss = loss_and_grads(params, batch)
        # tx.update + apply_updates, with the params' and moments' buffers reused in place
        # (jax.jit donate_argnums): the previous params are not used after this step
        params, opt_state = fs.optim.step(tx, grads, opt_state, params, donate=True)
        return params, opt_state, loss

    return step


def train(args: dict) -> dict:
    """One rank of the training run; returns losses (and timing) for rank 0."""
    cfg = GPTConfig(**args["model"])
    pp, dp, ep, tp = args.get("pp", 1), args["dp"], args.get("ep", 1), args["tp"]
    cp = args.get("cp", 1)
    rep = args.get("hsdp", 1)
    if dist.get_world_size() != pp * rep * dp * ep * cp * tp:
        raise ValueError(f"world size {dist.get_world_size()} != pp * hsdp * dp * ep * cp * tp")
    # The composition's mesh, outermost first as torchtitan's: the batch is split over
    # rep x dp x ep (HSDP's replicate axis, data / FSDP, expert parallelism carving its ranks
    # out of the data), the sequence over cp, the weights over tp (and the blocks over pp).
    mesh = fs.Mesh.create(
        (pp, rep, dp, ep, cp, tp),
        ("pp", "rep", "dp", "ep", "cp", "tp"),
        device_type=args.get("device"),
    )
    torch.manual_seed(args["seed"])
    model = GPT(cfg).to(mesh.device())
    plan = gpt_plan("tp", experts="ep" if cfg.n_experts else None, sp=args.get("sp", False))
    if args.get("fsdp"):
        plan = fs.nn.fsdp_plan(model, mesh, "dp", base=plan)
    dtype = torch.bfloat16 if args.get("bf16") else None
    policy = None  # the global view's: bf16 compute, fp32 gradient reductions and logits
    if dtype is not None and args["view"] == "global":
        policy = fs.nn.MixedPrecisionPolicy(dtype, torch.float32, torch.float32)
    pipe = None
    if pp > 1:
        pipe = {k: args[k] for k in ("schedule", "virtual", "microbatches")}
        params = pipeline_params(
            model, mesh, pipe["virtual"], sp=args.get("sp", False), fsdp=args.get("fsdp", False)
        )
    else:
        params = fs.nn.shard_params(model, mesh, plan, mp_policy=policy)
    schedule_steps = args.get("schedule_steps", args["steps"])  # the LR schedule's length
    tx = make_optimizer(args["lr"], schedule_steps, args["warmup"], args["wd"], args["clip"])
    opt_state = tx.init(params)  # same layouts as the params: sharded over dp with --fsdp
    step = make_train_step(
        cfg,
        mesh,
        tx,
        model=model if args["view"] == "global" else None,
        fsdp_units=fs.nn.fsdp_units(model)
        if args.get("fsdp") and args["view"] == "local"
        else None,
        fsdp=bool(args.get("fsdp")) and args["view"] == "global",
        remat=args.get("remat", False),
        dtype=dtype,
        pipeline=pipe,
        context=cp > 1,
    )
    data = load_corpus(Path(args["data"]))
    gen = torch.Generator().manual_seed(args["seed"] + 1)
    rank0 = dist.get_rank() == 0
    losses, times = [], []
    tokens_per_step = args["batch"] * cfg.ctx
    progress = _progress(args["steps"]) if rank0 and args["progress"] else None
    task = (
        progress.add_task("train", total=args["steps"], loss=float("nan"), tps=0.0)
        if progress
        else None
    )
    try:
        for _ in range(args["steps"]):
            t0 = time.perf_counter()
            batch = get_batch(data, args["batch"], cfg.ctx, gen).to(mesh.device())
            if cp > 1:
                batch = context_batch(batch, mesh, pipe and pipe["microbatches"])
            elif pipe is None:
                batch = fs.shard(batch, mesh, fs.P(data_axes(mesh)))
            else:  # microbatches, each split over dp x ep
                batch = batch.reshape(pipe["microbatches"], -1, cfg.ctx + 1)
                batch = fs.shard(batch, mesh, fs.P(None, data_axes(mesh)))
            params, opt_state, loss = step(params, opt_state, batch)
            loss = float(loss)
            dt = time.perf_counter() - t0
            losses.append(loss)
            times.append(dt)
            if progress:
                recent = times[-10:]
                progress.update(
                    task, advance=1, loss=loss, tps=tokens_per_step * len(recent) / sum(recent)
                )
    finally:
        if progress:
            progress.stop()
    steady = times[min(5, len(times) - 1) :]
    out = {"losses": losses, "tokens_per_s": tokens_per_step * len(steady) / sum(steady)}
    if args.get("return_params"):
        out["params"] = fs.tree_map(
            fs.gather, params, is_leaf=lambda v: isinstance(v, fs.ShardedArray)
        )
    return out if rank0 else {}


def _progress(total: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss [cyan]{task.fields[loss]:.3f}"),
        TextColumn("[green]{task.fields[tps]:,.0f} tok/s"),
        TimeElapsedColumn(),
    )
    progress.start()
    return progress


def parse_args(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    ap.add_argument(
        "--fsdp",
        type=int,
        default=0,
        help="FSDP over this many data-parallel ranks (sets --dp): params and optimizer state "
        "sharded over dp, each block gathered just before use",
    )
    ap.add_argument(
        "--hsdp",
        type=int,
        default=1,
        help="HSDP (with --fsdp): this many replicas of the FSDP-sharded model; the batch is "
        "split over hsdp x fsdp, each shard's gradient reduce-scattered over fsdp then "
        "all-reduced over the replicas",
    )
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--view",
        choices=("local", "global"),
        default="local",
        help="local: explicit collectives (tp_loss); global: the module's own forward",
    )
    ap.add_argument(
        "--remat",
        action="store_true",
        help="activation checkpointing: each block under fs.remat (every view, the pipeline's "
        "stages and --cp's chunks included)",
    )
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="compute in bfloat16 from float32 master params (fs.nn.MixedPrecisionPolicy)",
    )
    ap.add_argument(
        "--experts",
        type=int,
        default=0,
        help="MoE: each block's MLP is E top-k routed experts (global view)",
    )
    ap.add_argument("--topk", type=int, default=2, help="experts per token (with --experts)")
    ap.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel ranks: the sequence split over them, ring attention (global view)",
    )
    ap.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel ranks: the blocks as stages over pp (global view)",
    )
    ap.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "interleaved", "zb"),
        default="1f1b",
        help="pipeline schedule (with --pp)",
    )
    ap.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches")
    ap.add_argument(
        "--virtual", type=int, default=2, help="stages per rank with --schedule interleaved"
    )
    ap.add_argument(
        "--sp",
        action="store_true",
        help="Megatron sequence parallelism over tp (global view): activations between the "
        "tensor-parallel layers split on the sequence",
    )
    ap.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks: the experts split over them, tokens dispatched with "
        "ragged all_to_alls (with --experts; the batch is split over dp x ep)",
    )
    add_device_flag(ap, "params, optimizer state and batches")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--plot", default="train_gpt_loss.png", help="loss-curve PNG ('' to skip)")
    a = ap.parse_args(argv)
    if a.fsdp:
        if a.dp not in (1, a.fsdp):
            raise SystemExit(f"--fsdp {a.fsdp} sets the dp size; drop --dp {a.dp}")
        a.dp = a.fsdp
    if a.ep > 1 and not a.experts:
        raise SystemExit("--ep splits the experts: add --experts E")
    if a.experts:
        if a.view != "global":
            raise SystemExit(
                "--experts runs the global view (fs.parallel.moe_experts in the module's "
                "forward): add --view global"
            )
        if a.experts % a.ep or not 1 <= a.topk <= a.experts:
            raise SystemExit(
                f"--experts ({a.experts}) must split over --ep ({a.ep}) and be >= --topk ({a.topk})"
            )
    if a.pp > 1:
        if a.view != "global":
            raise SystemExit("--pp runs the global view's blocks as stages: add --view global")
        virtual = a.virtual if a.schedule == "interleaved" else 1
        if a.layers % (a.pp * virtual) or a.batch % (a.microbatches * a.hsdp * a.dp * a.ep):
            raise SystemExit(
                f"--pp: --layers ({a.layers}) must split into pp x virtual ({a.pp * virtual}) "
                f"stages and --batch ({a.batch}) into --microbatches ({a.microbatches}) of "
                "hsdp x dp x ep"
            )
    if a.cp > 1:
        if a.view != "global":
            raise SystemExit(
                "--cp runs the global view's forward on sequence chunks: add --view global"
            )
        if a.ctx % (2 * a.cp):
            raise SystemExit(f"--ctx ({a.ctx}) must split into 2 x --cp ({2 * a.cp}) chunks")
    if a.remat and a.sp and a.pp == 1:
        raise SystemExit(
            "--remat with --sp runs in the pipeline's stages only (--pp): outside it each "
            "block's call all-reduces its row-parallel outputs (no sequence split)"
        )
    if a.sp and a.view != "global":
        raise SystemExit(
            "--sp runs the global view (a plan, the module's forward): add --view global"
        )
    for name in (
        "pp",
        "hsdp",
        "dp",
        "ep",
        "cp",
        "tp",
        "microbatches",
        "virtual",
        "steps",
        "batch",
        "layers",
        "heads",
        "ctx",
    ):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name} must be >= 1")
    if a.hsdp > 1 and not a.fsdp:
        raise SystemExit("--hsdp replicates the FSDP-sharded model: add --fsdp N")
    if a.batch % (a.hsdp * a.dp * a.ep):
        raise SystemExit(
            f"--batch ({a.batch}) must be divisible by --hsdp x --dp x --ep "
            f"({a.hsdp * a.dp * a.ep})"
        )
    if a.heads % a.tp:
        raise SystemExit(f"--heads ({a.heads}) must be divisible by --tp ({a.tp})")
    if a.d_model % a.heads:
        raise SystemExit(f"--d-model ({a.d_model}) must be divisible by --heads ({a.heads})")
    checked_device(a.device)
    model = {"d_model": a.d_model, "n_heads": a.heads, "n_layers": a.layers, "ctx": a.ctx,
             "n_experts": a.experts, "top_k": a.topk}  # fmt: skip
    return {
        "dp": a.dp, "tp": a.tp, "steps": a.steps, "batch": a.batch, "lr": a.lr,
        "warmup": a.warmup, "wd": a.wd, "clip": a.clip, "seed": a.seed, "data": a.data,
        "model": model, "plot": a.plot, "progress": True, "view": a.view, "fsdp": a.fsdp > 0, "hsdp": a.hsdp,
        "device": a.device, "remat": a.remat, "bf16": a.bf16, "ep": a.ep, "sp": a.sp,
        "pp": a.pp, "cp": a.cp, "schedule": a.schedule, "microbatches": a.microbatches,
        "virtual": a.virtual if a.schedule == "interleaved" else 1,
    }  # fmt: skip


def save_plot(losses: list, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(losses, lw=1, alpha=0.5, label="loss")
    k = max(1, len(losses) // 20)
    smooth = [
        sum(losses[max(0, i - k) : i + 1]) / len(losses[max(0, i - k) : i + 1])
        for i in range(len(losses))
    ]
    ax.plot(smooth, lw=2, label=f"running mean ({k + 1})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/byte)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    world = args.get("pp", 1) * args.get("hsdp", 1) * args["dp"] * args.get("ep", 1)
    world *= args.get("cp", 1) * args["tp"]
    under_torchrun = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))
    out = launch_run(train, world, (args,), timeout=3600)[0]
    if under_torchrun and int(os.environ["RANK"]) != 0:  # run() closed its group
        return out
    losses = out["losses"]
    first, last = sum(losses[:10]) / len(losses[:10]), sum(losses[-10:]) / len(losses[-10:])
    print(
        f"dp={args['dp']} ep={args.get('ep', 1)} tp={args['tp']} view={args['view']} "
        f"fsdp={args.get('fsdp', False)} sp={args.get('sp', False)} pp={args.get('pp', 1)} "
        f"cp={args.get('cp', 1)} "
        f"experts={args['model'].get('n_experts', 0)} "
        f"remat={args.get('remat', False)} bf16={args.get('bf16', False)} "
        f"steps={args['steps']}: "
        f"loss {first:.3f} (first 10) -> {last:.3f} (last 10), "
        f"{out['tokens_per_s']:,.0f} tokens/s"
    )
    marks = sorted({0, len(losses) // 4, len(losses) // 2, 3 * len(losses) // 4, len(losses) - 1})
    print("loss at step " + ", ".join(f"{i}: {losses[i]:.3f}" for i in marks))
    if args["plot"]:
        title = f"byte-level GPT, dp={args['dp']} x tp={args['tp']}, {args['view']} view"
        save_plot(losses, args["plot"], title)
        print(f"loss curve: {args['plot']}")
    return out


if __name__ == "__main__":
    main()
