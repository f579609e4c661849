"""The composed step against torch's own composition (issue 36 item 7): ``fs.parallel.parallelize``
next to FSDP2 ``fully_shard`` + ``parallelize_module`` + ``torch.distributed.pipelining`` on the
same transformers Llama, on local Gloo ranks (CPU), printed side by side in one run.

    python benchmarks/composed_step.py [--reps 6] [--steps 3] [--eight]

The model: a transformers ``LlamaForCausalLM`` (hidden 256, intermediate 512, 4 layers, 8 heads,
4 kv heads, vocab 1024, sdpa attention), batch 8 x 128, next-token cross entropy, AdamW. A step
is forward + backward + the optimizer update.

* fshard: ``params, loss = fs.parallel.parallelize(model, dims.mesh(), dims)``, then
  ``fs.value_and_grad(loss)`` and ``fs.optim.step(fs.optim.adamw(...), donate=True)`` (the
  params and the state updated in place by the foreach kernels, as torch.optim does; the pure
  update took 4-5 ms of CPU a step on an FSDP x PP rank, donated 2.2); the pipeline 1F1B over 4
  microbatches, the embedding on the first stage (its ``input_fn``).
* torch, as torchtitan composes it: the model split into stage modules (the first with the
  embedding, the last with the norm and the head: contiguous halves of the layers), on each
  ``parallelize_module`` over ``tp`` (colwise q/k/v/gate/up, rowwise o/down: HF's shipped
  plan, and the head colwise with its output gathered), then ``fully_shard`` over ``dp`` per
  layer and on the stage, then ``PipelineStage`` + ``Schedule1F1B`` (4 microbatches) over
  ``pp``; ``torch.optim.AdamW(foreach=True)`` (one per kind of
  parameter: foreach refuses a list mixing plain tensors and DTensors). Each dp rank feeds its block of the batch.

Each (configuration, library) runs in its own World (so the peak RSS, the process's high-water
mark growth over the mark taken before the model is built, holds nothing of the other); the two
libraries' Worlds are up together and take the reps in turn (torch first on even reps), so a
drift of the machine's load lands on both; a rep times ``--steps`` steps after a barrier (the
slowest rank's mean); the table shows the median over reps, and a second table each rank's process CPU time a step (median over reps: what a
rank computes, which other load on the machine moves less than the wall time). The first step's losses of the two libraries are printed (equal up to float
rounding: the same weights, the same batch). Run only on an otherwise idle machine (load < 1):
8 ranks (``--eight``) oversubscribe 2 cores 4x.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fshard as fs
from fshard.launch import World

VOCAB, MICROBATCHES = 1024, 4
CONFIGS = [
    ("fsdp x tp", {"dp_shard": 2, "tp": 2}),
    ("tp x pp", {"tp": 2, "pp": 2}),
    ("fsdp x pp", {"dp_shard": 2, "pp": 2}),
]
EIGHT = [("fsdp x tp x pp", {"dp_shard": 2, "tp": 2, "pp": 2})]


def _model():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=256,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _next_token_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


class _Stage(nn.Module):
    """Layers ``lo:hi`` of a Llama, with the embedding on the first stage and the norm and head
    on the last (torchtitan's split: the other modules are not held)."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[lo:hi])
        self.rotary = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x):
        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1]).unsqueeze(0)
        pe = self.rotary(h, pos)
        for layer in self.layers:
            out = layer(h, position_embeddings=pe, position_ids=pos)
            h = out[0] if isinstance(out, tuple) else out
        return self.head(self.norm(h)) if self.head is not None else h


def _torch_step(degrees: dict, batch: int, seq: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    pp, dp, tp = (degrees.get(k, 1) for k in ("pp", "dp_shard", "tp"))
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    model = _model()
    layers = model.config.num_hidden_layers
    s = mesh["pp"].get_local_rank()
    first, last = s == 0, s == pp - 1
    stage = _Stage(model, s * layers // pp, (s + 1) * layers // pp, first, last)
    if tp > 1:
        plan = {f"self_attn.{m}_proj": ColwiseParallel() for m in "qkv"}
        plan |= {"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()}
        plan |= {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()}
        for layer in stage.layers:
            parallelize_module(layer, mesh["tp"], plan)
        if last:
            parallelize_module(stage.head, mesh["tp"], ColwiseParallel(output_layouts=Replicate()))
    if dp > 1:
        for layer in stage.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=pp == 1)
        fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=pp == 1)
    # one foreach AdamW per kind: with tp and no dp the norms and embedding stay plain tensors,
    # and foreach refuses a list mixing them with DTensors
    kinds: dict = {}
    for q in stage.parameters():
        kinds.setdefault(type(q), []).append(q)
    opts = [torch.optim.AdamW(qs, lr=1e-4, foreach=True) for qs in kinds.values()]

    def update():
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    d = mesh["dp"].get_local_rank()
    ids = _ids(batch, seq)[d * batch // dp : (d + 1) * batch // dp]
    if pp == 1:

        def step():
            loss = _next_token_loss(stage(ids), ids)
            loss.backward()
            update()
            return float(loss)

        return step
    pipe = PipelineStage(stage, s, pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, n_microbatches=MICROBATCHES, loss_fn=_next_token_loss)

    def step():
        losses: list = []
        if first:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=losses)
        update()
        return float(torch.stack(losses).mean()) if losses else None

    return step


def _fshard_step(degrees: dict, batch: int, seq: int):
    extra = {"pp_schedule": "1f1b", "pp_microbatches": MICROBATCHES} if "pp" in degrees else {}
    dims = fs.parallel.ParallelDims(**degrees, **extra)
    params, loss = fs.parallel.parallelize(_model(), dims.mesh(), dims)
    tx = fs.optim.adamw(1e-4)
    state = {"params": params, "opt": tx.init(params)}
    b = {"input_ids": _ids(batch, seq)}

    def step():
        value, grads = fs.value_and_grad(loss)(state["params"], b)
        state["params"], state["opt"] = fs.optim.step(
            tx, grads, state["opt"], state["params"], donate=True
        )
        return float(value)

    return step


_STEP: dict = {}


def _build(lib: str, degrees: dict, batch: int, seq: int):
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    _STEP["rss0"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _STEP["fn"] = (_fshard_step if lib == "fshard" else _torch_step)(degrees, batch, seq)
    first = _STEP["fn"]()
    _STEP["fn"]()  # warm-up
    return first


def _time(steps: int) -> tuple[float, list[float]]:
    """The slowest rank's mean step time, and every rank's mean process CPU time a step (all
    its threads: the step's own and Gloo's), in rank order."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        _STEP["fn"]()
    cpu = torch.tensor([(time.process_time() - c0) / steps])
    out = torch.tensor([(time.perf_counter() - t0) / steps])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    cpus = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(cpus, cpu)
    return float(out), [float(c) for c in cpus]


def _peak_rss_mib() -> float:
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - _STEP["rss0"]
    out = torch.tensor([grown / 1024.0])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--eight", action="store_true", help="also fsdp x tp x pp on 8 ranks")
    p.add_argument("--only", nargs="*", help="configurations to run, e.g. 'tp x pp'")
    a = p.parse_args(argv)
    rows = []
    for name, degrees in CONFIGS + (EIGHT if a.eight else []):
        if a.only and name not in a.only:
            continue
        n = fs.parallel.ParallelDims(**degrees).world_size
        result, libs = {}, ("torch", "fshard")
        # both libraries' worlds up at once (a waiting world's ranks sleep in a pipe read), the
        # reps alternated between them, torch first on even reps: a drift of the machine's
        # load lands on both (timed one library after the other, the ratio moved by 15-20%)
        with World(n, timeout=3600) as wt, World(n, timeout=3600) as wf:
            worlds = dict(zip(libs, (wt, wf)))
            losses = {lib: w.run(_build, lib, degrees, a.batch, a.seq) for lib, w in worlds.items()}
            reps: dict = {lib: [] for lib in libs}
            for i in range(a.reps):
                for lib in libs if i % 2 == 0 else libs[::-1]:
                    reps[lib].append(worlds[lib].run(_time, a.steps)[0])
            rss = {lib: w.run(_peak_rss_mib)[0] for lib, w in worlds.items()}
        for lib in libs:
            loss = [x for x in losses[lib] if x is not None]
            times = [t for t, _ in reps[lib]]
            cpus = [statistics.median(c[r] for _, c in reps[lib]) for r in range(n)]
            result[lib] = (statistics.median(times), rss[lib], sum(loss) / len(loss), cpus)
        rows.append((name, n, result))
        print(name, result, flush=True)
    print()
    print(
        "| configuration | ranks | torch ms/step | fshard ms/step | time ratio | torch peak RSS "
        "growth (MiB) | fshard (MiB) | memory ratio | first loss torch / fshard |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, n, r in rows:
        (tt, tm, tl, _), (ft, fm, fl, _) = r["torch"], r["fshard"]
        print(
            f"| {name} | {n} | {tt * 1e3:.0f} | {ft * 1e3:.0f} | {ft / tt:.2f}x | {tm:.0f} "
            f"| {fm:.0f} | {fm / tm:.2f}x | {tl:.4f} / {fl:.4f} |"
        )
    print()
    print(
        "Process CPU ms a step per rank (median over reps; all threads; less sensitive to other "
        "load than the wall time):"
    )
    print("| configuration | torch | fshard | ratio of the sums |")
    print("|---|---|---|---|")
    for name, _, r in rows:
        tc, fc = r["torch"][3], r["fshard"][3]
        show = " / ".join
        print(
            f"| {name} | {show(f'{c * 1e3:.0f}' for c in tc)} | "
            f"{show(f'{c * 1e3:.0f}' for c in fc)} | {sum(fc) / sum(tc):.2f}x |"
        )


if __name__ == "__main__":
    main()
