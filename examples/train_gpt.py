"""Train a small byte-level GPT with fshard: Megatron tensor parallelism x data parallelism.

    python examples/train_gpt.py                    # 2 local Gloo ranks, dp=1 x tp=2, 200 steps
    python examples/train_gpt.py --dp 2 --tp 1      # pure data parallel
    python examples/train_gpt.py --fsdp 2           # FSDP over dp=2 x Megatron TP over tp=2
    python examples/train_gpt.py --device cuda      # the local ranks' blocks on the GPU(s)
    torchrun --nproc-per-node 4 examples/train_gpt.py --dp 2 --tp 2   # NCCL with 4 GPUs

Every axis, composed by one library call (the global view: ``fs.parallel.parallelize`` of the
module's own forward; float32 without ``--experts`` prints the losses of ``--dp 1 --tp 2`` in
every combination):

    python examples/train_gpt.py --sp                           # + Megatron sequence parallel
    python examples/train_gpt.py --cp 2 --tp 1                  # the sequence over cp, ring attention
    python examples/train_gpt.py --pp 2 --tp 1 --schedule zb    # pipeline stages
    python examples/train_gpt.py --pp 2 --cp 2 --tp 1 --remat   # stages x ring
    python examples/train_gpt.py --experts 4 --ep 2 --tp 1      # MoE, experts over ep
    python examples/train_gpt.py --fsdp 2 --tp 2 --view global  # FSDP x TP, composed
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
* ``global`` (the default with ``--sp``, ``--pp``, ``--cp``, ``--experts``): every strategy
  through one composition, ``fs.parallel.parallelize(model, mesh, dims, parts=gpt_parts(cfg))``
  (:func:`gpt_parts` names the GPT's plan and pieces, :func:`parallel_dims` reads the flags'
  degrees): the sharded params and ONE pure ``loss(params, batch)``, the module's own
  ``GPT.forward`` run on the sharded params (the op rules insert the collectives; FSDP gathers
  per block, the pipeline runs the blocks as stages, context parallelism splits the sequence
  with ring attention through ``fs.parallel.attention``), differentiated by
  ``fs.value_and_grad`` (one bucketed gradient reduction per step). Nothing to write by hand.

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


class Embed(nn.Module):
    """Token + learned position embeddings."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.ctx, cfg.d_model)

    def forward(self, tokens, position_ids=None):
        """``position_ids``: each token's position (``--cp``: a rank's load-balanced chunks);
        default ``0 .. t-1``."""
        if position_ids is None:
            return self.tok(tokens) + self.pos.weight[: tokens.shape[-1]]
        return self.tok(tokens) + self.pos(position_ids)


class GPT(nn.Module):
    """A pre-LayerNorm GPT: token + position embeddings, ``n_layers`` blocks, LM head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
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

    def forward(self, tokens, position_ids=None):
        x = self.embed(tokens, position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _attend(qkv):
    """Causal attention on ``(b, t, heads, 3, hd)``: returns ``(b, t, heads, hd)``.
    ``fs.parallel.attention`` is ``F.scaled_dot_product_attention``, and with the sequence
    split over a context-parallel axis (``--cp``) ring attention (k/v blocks passed around the
    ring)."""
    q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
    return fs.parallel.attention(q, k, v, is_causal=True).transpose(1, 2)


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
        **({"scatter": ["embed"]} if sp else {}),
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

    x = F.embedding(x_tok, p["embed.tok.weight"]) + p["embed.pos.weight"][:t]
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
    instead of kept (the root's, embedding and head, kept, as FSDP2 keeps its root). Averaged over ``dp``: the gradients come out already reduced. ``units``:
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


# -- the sharded model, global view: every strategy through one composition -----------------


def gpt_parts(cfg: GPTConfig, sp: bool = False) -> fs.parallel.ModelParts:
    """:class:`GPT` for ``fs.parallel.parallelize``: its Megatron plan over ``tp`` (with ``sp``
    sequence parallel; with ``cfg.n_experts`` the experts over ``ep``) and its pieces (the
    embedding, the blocks the pipeline stacks as stages, the final norm and the head)."""
    return fs.parallel.ModelParts(
        plan=gpt_plan("tp", experts="ep" if cfg.n_experts else None, sp=sp),
        embed="embed", layers="blocks", norm="ln_f", head="head",
    )  # fmt: skip


def parallel_dims(args: dict) -> fs.parallel.ParallelDims:
    """The flags' degrees: ``--dp`` replicas (DDP), or with ``--fsdp`` that many FSDP shards
    times ``--hsdp`` replicas (HSDP); ``--tp``, ``--cp``, ``--ep``, ``--pp`` with its schedule,
    microbatches and virtual stages."""
    fsdp, pp = bool(args.get("fsdp")), args.get("pp", 1)
    return fs.parallel.ParallelDims(
        dp_replicate=args.get("hsdp", 1) if fsdp else args["dp"],
        dp_shard=args["dp"] if fsdp else 1,
        cp=args.get("cp", 1),
        tp=args["tp"],
        ep=args.get("ep", 1),
        pp=pp,
        pp_schedule=args.get("schedule", "1f1b"),
        pp_microbatches=args.get("microbatches") if pp > 1 else None,
        pp_virtual=args.get("virtual", 1) if pp > 1 else 1,
    )


def token_batch(tokens: torch.Tensor) -> dict:
    """A full ``(batch, ctx + 1)`` window of bytes as ``parallelize``'s batch: the first
    ``ctx`` bytes in, each position predicting the byte after it."""
    return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}


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
    """Weight decay on matrices only: a param's ndim, or for the pipeline's stacked blocks
    (``params["blocks"]``, a dict: ``(stages, blocks per stage, ...)``) its ndim without the
    two leading dims."""
    return {
        k: {n: t.ndim - 2 >= 2 for n, t in v.items()} if isinstance(v, dict) else v.ndim >= 2
        for k, v in params.items()
    }


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
    loss=None,
    fsdp_units: dict | None = None,
    remat: bool = False,
    dtype: torch.dtype | None = None,
):
    """The functional step ``(params, opt_state, batch) -> (params, opt_state, loss)``.

    With ``loss`` (``fs.parallel.parallelize``'s: the global view, every strategy composed)
    the step differentiates it with ``fs.value_and_grad`` and ``batch`` is the full ``(batch,
    ctx + 1)`` tokens (:func:`token_batch`; each rank keeps its block). Otherwise the local
    view, ``batch`` sharded over the data axes: with ``fsdp_units`` (params sharded by
    ``fs.nn.fsdp_plan``) :func:`fsdp_loss` through ``fs.value_and_grad``, else
    :func:`tp_loss` and one bucketed ``fs.lax.pmean`` of the gradients over ``dp``. ``remat``
    and ``dtype`` as in :func:`tp_loss`.
    """
    dp = mesh.size("dp") if "dp" in mesh.axis_names else 1
    if loss is not None:
        global_grad = fs.value_and_grad(loss)

        def loss_and_grads(params, batch):  # every reduction in the composition's backward
            value, grads = global_grad(params, token_batch(batch))
            return grads, value

    elif fsdp_units is not None:
        fsdp_grad = fs.value_and_grad(fsdp_loss)

        def loss_and_grads(params, batch):  # grads arrive reduce-scattered over dp
            loss, grads = fsdp_grad(params, batch.local, model_cfg, mesh, fsdp_units, remat, dtype)
            return grads, loss

    else:
        local_grad = torch.func.grad_and_value(tp_loss)

        def loss_and_grads(params, batch):
            grads, loss = local_grad(params, batch.local, model_cfg, mesh, remat=remat, dtype=dtype)
            if dp > 1:  # the whole gradient pytree, bucketed; the fresh grads are donated
                grads, loss = fs.lax.pmean((grads, loss), "dp", mesh=mesh, donate=True)
            return grads, loss

    def step(params, opt_state, batch):
        grads, loss = loss_and_grads(params, batch)
        # tx.update + apply_updates, with the params' and moments' buffers reused in place
        # (jax.jit donate_argnums): the previous params are not used after this step
        params, opt_state = fs.optim.step(tx, grads, opt_state, params, donate=True)
        return params, opt_state, loss

    return step


def sharded_model(args: dict, cfg: GPTConfig) -> tuple:
    """``(mesh, model, params, loss)`` of the flags. The global view: ``fs.parallel.parallelize``
    of :class:`GPT` (:func:`gpt_parts`) for :func:`parallel_dims` on its mesh (axes ``pp,
    dp_replicate, dp_shard, ep, cp, tp``), ``--bf16`` as its mixed-precision policy, ``--remat``
    per block. The local view (``loss`` None): the Megatron plan over ``tp``, FSDP's over
    ``dp`` with ``--fsdp``, on a ``(rep, dp, tp)`` mesh."""
    dtype = torch.bfloat16 if args.get("bf16") else None
    if args["view"] == "global":
        dims = parallel_dims(args)
        mesh = dims.mesh(device_type=args.get("device"))
        torch.manual_seed(args["seed"])
        model = GPT(cfg).to(mesh.device())
        # bf16 compute, fp32 gradient reductions and logits
        policy = fs.nn.MixedPrecisionPolicy(dtype, torch.float32, torch.float32) if dtype else None
        params, loss = fs.parallel.parallelize(
            model, mesh, dims, parts=gpt_parts(cfg, args.get("sp", False)), mp_policy=policy,
            remat=bool(args.get("remat")),
        )  # fmt: skip
        return mesh, model, params, loss
    shape = (args.get("hsdp", 1), args["dp"], args["tp"])
    mesh = fs.Mesh.create(shape, ("rep", "dp", "tp"), device_type=args.get("device"))
    torch.manual_seed(args["seed"])
    model = GPT(cfg).to(mesh.device())
    plan = gpt_plan("tp")
    if args.get("fsdp"):
        plan = fs.nn.fsdp_plan(model, mesh, "dp", base=plan)
    return mesh, model, fs.nn.shard_params(model, mesh, plan), None


def train(args: dict) -> dict:
    """One rank of the training run; returns losses (and timing) for rank 0."""
    cfg = GPTConfig(**args["model"])
    pp, dp, ep, tp = args.get("pp", 1), args["dp"], args.get("ep", 1), args["tp"]
    cp, rep = args.get("cp", 1), args.get("hsdp", 1)
    if dist.get_world_size() != pp * rep * dp * ep * cp * tp:
        raise ValueError(f"world size {dist.get_world_size()} != pp * hsdp * dp * ep * cp * tp")
    mesh, model, params, loss_fn = sharded_model(args, cfg)
    schedule_steps = args.get("schedule_steps", args["steps"])  # the LR schedule's length
    tx = make_optimizer(args["lr"], schedule_steps, args["warmup"], args["wd"], args["clip"])
    opt_state = tx.init(params)  # the params' layouts: sharded over dp with --fsdp
    local_fsdp = args.get("fsdp") and loss_fn is None
    step = make_train_step(
        cfg, mesh, tx, loss=loss_fn, fsdp_units=fs.nn.fsdp_units(model) if local_fsdp else None,
        remat=args.get("remat", False), dtype=torch.bfloat16 if args.get("bf16") else None,
    )  # fmt: skip
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
            if loss_fn is None:  # the local view: this rank's rows
                batch = fs.shard(batch, mesh, fs.P(data_axes(mesh)))
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
    if args.get("return_params"):  # every param whole, under the module's names
        full = fs.tree_map(fs.gather, params, is_leaf=lambda v: isinstance(v, fs.ShardedArray))
        if isinstance(full.get("blocks"), dict):  # the pipeline's stages
            virtual = args.get("virtual", 1)
            stages = full.pop("blocks")
            full.update(fs.parallel.unstack_stages(stages, prefix="blocks", pp=pp, virtual=virtual))
        out["params"] = full
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
        default=None,
        help="local: explicit collectives (tp_loss; --dp/--fsdp/--hsdp x --tp); global: the "
        "module's own forward, every strategy through fs.parallel.parallelize (the default "
        "with --sp, --pp, --cp, --ep or --experts; otherwise local)",
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
    global_only = [f for f, on in (("--sp", a.sp), ("--pp", a.pp > 1), ("--cp", a.cp > 1),
                                   ("--experts", a.experts)) if on]  # fmt: skip
    if a.view is None:
        a.view = "global" if global_only else "local"
    if a.view == "local" and global_only:
        raise SystemExit(
            f"{' '.join(global_only)} run(s) in the global view (fs.parallel.parallelize of the "
            "module's own forward): drop --view local"
        )
    if a.experts and (a.experts % a.ep or not 1 <= a.topk <= a.experts):
        raise SystemExit(
            f"--experts ({a.experts}) must split over --ep ({a.ep}) and be >= --topk ({a.topk})"
        )
    if a.pp > 1:
        virtual = a.virtual if a.schedule == "interleaved" else 1
        if a.layers % (a.pp * virtual) or a.batch % (a.microbatches * a.hsdp * a.dp * a.ep):
            raise SystemExit(
                f"--pp: --layers ({a.layers}) must split into pp x virtual ({a.pp * virtual}) "
                f"stages and --batch ({a.batch}) into --microbatches ({a.microbatches}) of "
                "hsdp x dp x ep"
            )
    if a.cp > 1 and a.ctx % (2 * a.cp):
        raise SystemExit(f"--ctx ({a.ctx}) must split into 2 x --cp ({2 * a.cp}) chunks")
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
