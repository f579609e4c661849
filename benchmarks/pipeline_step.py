"""Pipeline schedules on 2 local Gloo ranks (pp=2, CPU): step time and peak memory of
``fs.parallel.pipeline``'s GPipe, 1F1B, interleaved 1F1B and ZB-H1 next to
``torch.distributed.pipelining``'s ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B, on
the same model and the same microbatches, with torch's two zero-bubble schedules
(ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble, 2 stages a rank: torch has no ZB-H1)
as the measure of what splitting the backward gains at the size run.

    python benchmarks/pipeline_step.py [--layers 4] [--dim 64] [--ctx 32] [--batch 8] [--mb 4]
        [--interleave ROUNDS [--attribute] [--floor] | --calls [--steps N]]

The model is ``examples/train_gpt.py``'s GPT (fp32). torch's stages are modules: rank 0 the
embeddings and the first half of the blocks, rank 1 the second half, the final norm and the
head, the loss ``F.cross_entropy`` in the schedule's ``loss_fn``; with 2 stages a rank, 4 stages of
``layers / 4`` blocks each, the ends as above: stages 0 and 2 on rank 0, 1 and 3 on rank 1 (ZBV's
V: 0 and 3 on rank 0, 1 and 2 on rank 1). fshard's stages are the
blocks stacked over ``pp`` (``fs.parallel.stack_stages``), the embeddings in ``input_fn`` (on
rank 0 only, as torch's), the final norm, head and loss in ``loss_fn``, each end's params held
by its rank only (``fs.parallel.on_stage``, as torch's stage modules hold them); a stage runs its
blocks with ``fs.nn.functional_call`` (fshard's call of a module on given values, which
``fs.parallel.parallelize`` uses; until 2026-12-05 ``torch.func.functional_call``, ~50 us a call
more); interleaved runs 4 stages of ``layers / 4`` blocks (2 per rank). A step is one forward + backward of the whole batch
(``fs.value_and_grad`` / ``schedule.step``), gradients produced, no optimizer; each
library's gradients live from its step's backward until its next step starts (torch's
``.grad`` until ``zero_grad(set_to_none=True)``, fshard's returned tree until the next call:
the memory the allocator holds between steps is alike). Each
configuration runs in its own pair of rank processes (peak RSS is the process's high-water
mark, ``ru_maxrss``, so nothing of another configuration is in it); *peak saved* is the most
bytes autograd held for the backward at once during one more step, counted by saved-tensor
hooks per storage (the activations a schedule stashes, plus the weights the matmuls save, and
for fshard the stage gradients its Function keeps for its backward); the step time is the
median over ``--reps`` of the slowest rank's mean over ``--steps`` steps; *CPU ms* the same
steps' process CPU time (``time.process_time``, all of a rank's threads; the larger rank's),
which other jobs on a shared machine disturb less than the step time. ``--interleave ROUNDS``
runs every configuration's step in one pair of ranks, one step each in turn after a barrier,
and prints each one's step time (the slowest rank's, median over rounds), the median of its
per-round ratio to torch's same schedule stepped in the same round (ZB-H1: to both 1F1Bs; load
drift cancels), each rank's process CPU time a step with its ratio and its minor page faults a
step (glibc's heap trims, faulted back; both libraries share the processes' allocator history
here, unlike runs in separate processes); ``--attribute`` adds each
rank's main-thread CPU time a step in buckets (:class:`_Attribution`: the blocks' forward, which
both libraries run on the same modules, each backward by who called it, the rest), to tell the
compute the libraries share from their own costs, and the step's two ends in wall time (the call
to the first block forward, the schedule's last backward to the return: on rank 0, the 1F1B
critical path's Python). ``--floor`` adds two rows that tell what a cross-rank agreement a
step costs from what a library costs: torch's 1F1B with a 4-word all_reduce before each step
(the shape of fshard's default consistency check of a step's plain inputs: one small exchange
whose verdict the step's first transfer waits for) and fshard's 1F1B with the checks off
(``fs.config.consistency(False)``); fshard's rows are also given as a ratio to the first.
``--calls`` counts each configuration's Python calls a step and rank
(cProfile's count, C functions included) by source: where the compute is small (the default
size) a step's Python is what separates the libraries, and a count does not move with the
machine's load as a time does. Comparing two versions
of fshard: run it from each checkout's directory with ``PYTHONPATH`` set to it, in turn (the
ranks' fork server puts its working directory first on their ``sys.path``; it prints the
ranks' fshard).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import fshard as fs  # noqa: E402
from fshard.launch import World  # noqa: E402

CONFIGS = [
    ("torch GPipe", "torch", "gpipe", 1),
    ("torch 1F1B", "torch", "1f1b", 1),
    ("torch interleaved v=2", "torch", "interleaved", 2),
    ("torch interleaved ZB v=2", "torch", "izb", 2),
    ("torch ZBV v=2", "torch", "zbv", 2),
    ("fshard gpipe", "fshard", "gpipe", 1),
    ("fshard 1f1b", "fshard", "1f1b", 1),
    ("fshard interleaved v=2", "fshard", "interleaved", 2),
    ("fshard zb (ZB-H1)", "fshard", "zb", 1),
]

#: ``--floor``'s rows: what one cross-rank agreement a step costs, apart from the library that
#: makes it. fshard's default consistency check exchanges the step's plain inputs' digest in
#: one small all_reduce whose verdict comes before the step's first transfer (no data moves
#: between ranks that disagree); torch's 1F1B is given the same shape of agreement (a 4-word
#: all_reduce, MAX, before each step), and fshard's 1F1B is run with the checks off
FLOOR = [
    ("torch 1F1B + all_reduce", "torch+agree", "1f1b", 1),
    ("fshard 1f1b, checks off", "fshard-unchecked", "1f1b", 1),
]


class _First(nn.Module):
    def __init__(self, gpt, blocks):
        super().__init__()
        self.embed, self.blocks = gpt.embed, nn.ModuleList(blocks)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return x


class _Middle(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class _Last(nn.Module):
    def __init__(self, gpt, blocks):
        super().__init__()
        self.blocks, self.ln_f, self.head = nn.ModuleList(blocks), gpt.ln_f, gpt.head

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class _Saved:
    """Saved-tensor hooks counting the bytes autograd holds for the backward (each storage once,
    released when the graph that saved it goes): the activation memory a schedule stashes."""

    class _Handle:
        __slots__ = ("t", "__weakref__")

        def __init__(self, t):
            self.t = t

    def __init__(self):
        self.cur = self.peak = 0
        self.refs: dict = {}

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        n, c = self.refs.get(key, (t.untyped_storage().nbytes(), 0))
        if c == 0:
            self.cur += n
            self.peak = max(self.peak, self.cur)
        self.refs[key] = (n, c + 1)
        h = self._Handle(t.detach())  # detached: a saved output would hold its own node
        weakref.finalize(h, self._release, key)
        return h

    def _release(self, key):
        n, c = self.refs[key]
        if c == 1:
            del self.refs[key]
            self.cur -= n
        else:
            self.refs[key] = (n, c - 1)

    @staticmethod
    def unpack(h):
        return h.t


def _ce(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _torch_step(gpt, schedule, virtual, tokens, targets, mb):
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    # stage j * 2 + rank on this rank (fshard's order: fs.parallel.stage_order; ZBV's V: 0
    # and 3 on rank 0, 1 and 2 on rank 1), each of layers / (2 * virtual) blocks; the first
    # also embeds, the last also norms and projects
    rank, stages = dist.get_rank(), 2 * virtual
    per = len(gpt.blocks) // stages
    held = [(0, 3), (1, 2)][rank] if schedule == "zbv" else range(rank, stages, 2)
    modules = []
    for s in held:
        blocks = gpt.blocks[s * per : (s + 1) * per]
        if s == 0:
            modules.append(_First(gpt, blocks))
        elif s == stages - 1:
            modules.append(_Last(gpt, blocks))
        else:
            modules.append(_Middle(blocks))
    built = [PipelineStage(m, s, stages, torch.device("cpu")) for m, s in zip(modules, held)]
    kind = {
        "gpipe": ScheduleGPipe,
        "1f1b": Schedule1F1B,
        "interleaved": ScheduleInterleaved1F1B,
        "izb": ScheduleInterleavedZeroBubble,
        "zbv": ScheduleZBVZeroBubble,
    }[schedule]
    sched = kind(built if virtual > 1 else built[0], n_microbatches=mb, loss_fn=_ce)
    first, last = 0 in held, stages - 1 in held

    def step():
        for m in modules:
            m.zero_grad(set_to_none=True)
        args = (tokens,) if first else ()
        kwargs = {"target": targets, "losses": []} if last else {}
        sched.step(*args, **kwargs)

    return step


def _fshard_step(gpt, schedule, virtual, tokens, targets, mb):
    mesh = fs.Mesh.create((2,), ("pp",))
    stages = 2 * virtual
    per = len(gpt.blocks) // stages
    named = {k: v.detach() for k, v in gpt.named_parameters()}
    # the ends' params held by their stage's rank only, as torch's stage modules hold them
    # (replicated, their gradients were all-reduced over pp every step)
    params = {
        "emb": {
            n: fs.parallel.on_stage(named[n], mesh, 0)
            for n in ("embed.tok.weight", "embed.pos.weight")
        },
        "stages": fs.parallel.stack_stages(named, mesh, prefix="blocks", virtual=virtual),
        "head": {
            n: fs.parallel.on_stage(named[n], mesh, 1)
            for n in ("ln_f.weight", "ln_f.bias", "head.weight")
        },
    }
    block = gpt.blocks[0]

    def stage_fn(p, x):
        for i in range(per):
            x = fs.nn.functional_call(block, {n: v[i] for n, v in p.items()}, (x,))
        return x

    def loss_fn(hp, y, target):
        h = F.layer_norm(y, y.shape[-1:], hp["ln_f.weight"], hp["ln_f.bias"])
        return _ce(F.linear(h, hp["head.weight"]), target)

    def input_fn(ep, tokens):  # the first stage's piece: every microbatch's embeddings
        x = F.embedding(tokens, ep["embed.tok.weight"])
        return x + ep["embed.pos.weight"][: tokens.shape[-1]]

    b, t = tokens.shape
    act = torch.empty(b // mb, t, gpt.embed.tok.weight.shape[1], device="meta")

    def loss(params, tokens, targets):
        return fs.parallel.pipeline(
            stage_fn, params["stages"], tokens, mesh, loss_fn=loss_fn, loss_params=params["head"],
            targets=targets, input_fn=input_fn, input_params=params["emb"], activation=act,
            schedule=schedule, virtual=virtual,
        )  # fmt: skip

    vg = fs.value_and_grad(loss)
    tok_mb = tokens.reshape(mb, b // mb, t)
    tgt_mb = targets.reshape(mb, b // mb, t)
    held = [None]

    def step():
        # the gradients live until the next step starts, as torch's .grad until its step's
        # zero_grad(set_to_none=True) (a training loop hands them to the optimizer)
        held[0] = None
        held[0] = vg(params, tok_mb, tgt_mb)

    return step


def _step(lib, schedule, virtual, layers, dim, ctx, batch, mb):
    import train_gpt as tg

    torch.manual_seed(0)
    gpt = tg.GPT(tg.GPTConfig(vocab=256, d_model=dim, n_heads=4, n_layers=layers, ctx=ctx))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (batch, ctx + 1), generator=gen)
    tokens, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if lib == "torch":
        return _torch_step(gpt, schedule, virtual, tokens, targets, mb)
    if lib == "torch+agree":  # --floor: an agreement of the consistency exchange's shape first
        step, words = _torch_step(gpt, schedule, virtual, tokens, targets, mb), torch.zeros(4)

        def agreed():
            dist.all_reduce(words, op=dist.ReduceOp.MAX)
            step()

        return agreed
    step = _fshard_step(gpt, schedule, virtual, tokens, targets, mb)
    if lib == "fshard-unchecked":  # --floor: the consistency checks off (fs.config.consistency)
        return fs.config.consistency(False)(step)
    return step


class _Attribution:
    """Main-thread CPU time of a step in buckets (``--attribute``): the GPT blocks' forward
    (``Block.forward``, the same modules in both libraries), each ``torch.autograd.backward``
    (or ``torch.autograd.grad``: the zero-bubble schedules' split backward) by its caller's
    function (torch's ``stage_backward``; fshard's ``_steps``, a stage's backward per
    microbatch and ``input_fn``'s, and ``_top_level``, ``fs.value_and_grad``'s backward
    through the pipeline's Function), and the rest of the step (schedule, transfers,
    loss and embedding forwards, each library's own bookkeeping). A call inside another counted
    one counts in the outer one only. Also the step's two ends in wall time: from
    the call to the rank's first block forward, and from its last backward of the schedule
    (not fshard's ``_top_level``) to the return: on the first stage's rank, the 1F1B critical
    path's Python (the second stage waits for its first activation; its end is the step's).
    And the gaps between a rank's compute calls in wall time (each step's median, then the
    median over rounds): between two block forwards (one stage's layers: fshard's
    ``functional_call`` swap per layer, torch's module call), from a forward to the next backward
    (the loss, the tick's transfers), from a backward to the next forward (its cotangent sent,
    the next activation received), and a schedule backward's own length; on the last stage, whose
    microbatches follow each other in 1F1B's steady state, each is paid once per microbatch on the
    critical path (waits included: a gap that waits for the peer is long in both libraries)."""

    def __init__(self):
        self.acc: dict = {}
        self.inside = False
        self.first = self.last = None  # perf_counter of the first block forward, last backward
        self.events: list = []  # ("f" | "b", enter, exit) of the blocks' forwards and backwards

    def wrap(self, owner, name: str, label: str | None) -> None:
        f = getattr(owner, name)

        def counted(*args, **kwargs):
            if self.inside:
                return f(*args, **kwargs)
            self.inside = True
            t0 = time.thread_time()
            if label is not None and self.first is None:
                self.first = time.perf_counter()
            w0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.inside = False
                key = label or f"backward in {sys._getframe(1).f_code.co_name}"
                self.acc[key] = self.acc.get(key, 0.0) + time.thread_time() - t0
                if label is not None:
                    self.events.append(("f", w0, time.perf_counter()))
                elif key != "backward in _top_level":
                    self.last = time.perf_counter()
                    self.events.append(("b", w0, self.last))

        setattr(owner, name, counted)

    def step(self, step) -> tuple[dict, tuple]:
        """``step()`` run: its buckets, and its two ends and gaps (the class docstring), in ms."""
        self.acc = {}
        self.first = self.last = None
        self.events = []
        t0, w0 = time.thread_time(), time.perf_counter()
        step()
        total, w1 = time.thread_time() - t0, time.perf_counter()
        out = {k: v * 1e3 for k, v in self.acc.items()}
        out["rest"] = (total - sum(self.acc.values())) * 1e3
        gaps: dict = {k: [] for k in _GAPS}
        for (k0, _, out0), (k1, in1, _) in zip(self.events, self.events[1:]):
            gaps[k0 + k1].append(in1 - out0)
        gaps["b"] = [t1 - t0 for k, t0, t1 in self.events if k == "b"]
        medians = tuple(statistics.median(gaps[k]) * 1e3 if gaps[k] else 0.0 for k in _GAPS)
        return out, ((self.first - w0) * 1e3, (w1 - self.last) * 1e3, *medians)


#: :class:`_Attribution`'s gaps: block forward to block forward, forward to backward, backward
#: to forward (the keys of consecutive calls), and a backward's length; "bb" (two backwards in a
#: row) is counted but not shown
_GAPS = ("ff", "fb", "bf", "b", "bb")


def interleaved_fn(configs, layers, dim, ctx, batch, mb, rounds, attribute=False):
    """Every configuration's step in the same pair of rank processes, run in turn one step at
    a time after a barrier, so that a shared machine's load drifting over the run hits every
    configuration alike: per configuration, each round's step time (the slowest rank's, taken
    after the step, outside its timing), this rank's process CPU time and its minor page faults
    (fresh pages the allocator asked the kernel for: glibc returns freed heap memory over its
    trim threshold, which the next allocation faults back in); with ``attribute``, each
    round's :class:`_Attribution` buckets instead of the CPU time's whole."""
    import train_gpt as tg

    torch.set_num_threads(1)
    attribution = _Attribution() if attribute else None
    if attribution is not None:
        attribution.wrap(tg.Block, "forward", "blocks forward")
        attribution.wrap(torch.autograd, "backward", None)
        attribution.wrap(torch.autograd, "grad", None)  # the zero-bubble schedules' split
    steps = {c[0]: _step(*c[1:], layers, dim, ctx, batch, mb) for c in configs}
    for step in steps.values():
        for _ in range(2):
            step()
    wall: dict = {name: [] for name in steps}
    cpu: dict = {name: [] for name in steps}
    buckets: dict = {name: [] for name in steps}
    ends: dict = {name: [] for name in steps}
    faults: dict = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            dist.barrier()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, c0 = time.perf_counter(), time.process_time()
            if attribution is None:
                step()
            else:
                counted, step_ends = attribution.step(step)
                buckets[name].append(counted)
                ends[name].append(step_ends)
            cpu[name].append(time.process_time() - c0)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            wall[name].append(float(dt))
    return wall, cpu, str(Path(fs.__file__).parent), buckets, faults, ends


def calls_fn(configs, layers, dim, ctx, batch, mb, steps):
    """``--calls``: per configuration, the Python function calls (C functions included) this
    rank makes a step, counted by ``cProfile`` over ``steps`` steps after two warm-up steps:
    ``(calls a step, {source: calls a step})``, sources an fshard module's path, a torch
    file's path under ``torch/``, or ``builtins`` (the C functions). A count, not a time: it
    does not move with the machine's load, and a step's Python costs about in proportion to
    it (what separates the libraries where the compute is small)."""
    import cProfile
    import pstats

    import train_gpt as tg  # noqa: F401  (the model's module, imported before the counts)

    torch.set_num_threads(1)
    out = {}
    for name, *cfg in configs:
        step = _step(*cfg, layers, dim, ctx, batch, mb)
        for _ in range(2):
            step()
        dist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        per: dict = {}
        for (path, _, _), row in pstats.Stats(prof).stats.items():
            if path == "~":
                source = "builtins"
            elif "/fshard/" in path:
                source = "fshard/" + path.rsplit("/fshard/", 1)[1]
            elif "/torch/" in path:
                source = "torch/" + path.rsplit("/torch/", 1)[1]
            else:
                source = Path(path).name
            per[source] = per.get(source, 0) + row[1] / steps
        out[name] = (sum(per.values()), per)
        dist.barrier()
    return out


def rank_fn(lib, schedule, virtual, layers, dim, ctx, batch, mb, steps, reps):
    torch.set_num_threads(1)
    step = _step(lib, schedule, virtual, layers, dim, ctx, batch, mb)
    for _ in range(2):
        step()
    times, cpu = [], []
    for _ in range(reps):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step()
        cpu.append((time.process_time() - c0) / steps)
        dt = torch.tensor([(time.perf_counter() - t0) / steps], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    saved = _Saved()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        step()
    return statistics.median(times), peak / 1024, saved.peak / 2**20, statistics.median(cpu)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mb", type=int, default=4, help="microbatches")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="instead: every configuration in one pair of ranks, one step each in turn for "
        "ROUNDS rounds; prints the step time (slowest rank) and its per-round ratio to "
        "torch's same schedule (both 1F1Bs for ZB-H1), and each "
        "rank's process CPU ms a step, the measure to use on a shared machine",
    )
    ap.add_argument(
        "--attribute",
        action="store_true",
        help="with --interleave: also each rank's main-thread CPU ms a step in buckets (the GPT "
        "blocks' forward, each autograd.backward by its caller, the rest), medians over rounds",
    )
    ap.add_argument(
        "--only",
        nargs="*",
        help="with --interleave: the fshard configurations to run (torch's always run), e.g. "
        "'fshard 1f1b' 'fshard zb (ZB-H1)'",
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="with --interleave or --calls: also torch's 1F1B with a 4-word all_reduce before "
        "each step (the shape of fshard's consistency exchange) and fshard's 1F1B with the "
        "checks off: what one cross-rank agreement a step costs, whichever library makes it",
    )
    ap.add_argument(
        "--calls",
        action="store_true",
        help="instead: each configuration's Python calls a step and rank (cProfile's count, "
        "C functions included, over --steps steps), by source; a count, not a time",
    )
    a = ap.parse_args(argv)
    if a.layers % 4 or a.batch % a.mb or a.mb % 2:
        ap.error("--layers must divide by 4, --batch by --mb, --mb by 2")
    if a.calls:
        return _calls(a)
    if a.interleave:
        return _interleaved(a)
    rows = []
    for name, lib, schedule, virtual in CONFIGS:
        args = (lib, schedule, virtual, a.layers, a.dim, a.ctx, a.batch, a.mb, a.steps, a.reps)
        world = World(2, timeout=600)
        try:
            res = world.run(rank_fn, *args)
        finally:
            world.close()
        t = max(r[0] for r in res)
        cpu = max(r[3] for r in res)
        rows.append((name, t, [r[1] for r in res], [r[2] for r in res], cpu))
        print(f"  done: {name}", file=sys.stderr)
    base = rows[0][1]
    print(f"pp=2 (2 Gloo ranks, CPU, 1 thread each): GPT layers={a.layers} d_model={a.dim} "
          f"ctx={a.ctx}, batch {a.batch} in {a.mb} microbatches")  # fmt: skip
    print(f"{'schedule':26s} {'step ms':>9s} {'x torch GPipe':>14s} {'CPU ms':>8s} "
          f"{'peak RSS MiB (r0, r1)':>24s} {'peak saved MiB (r0, r1)':>24s}")  # fmt: skip
    for name, t, peak, saved, cpu in rows:
        print(f"{name:26s} {t * 1e3:9.1f} {t / base:14.2f} {cpu * 1e3:8.1f} "
              f"{peak[0]:11.0f} {peak[1]:11.0f} {saved[0]:11.2f} {saved[1]:11.2f}")  # fmt: skip
    for name, (sched, v) in {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1),
                             "interleaved": ("interleaved", 2), "zb": ("zb", 1)}.items():  # fmt: skip
        s = fs.parallel.pipeline_schedule(sched, 2, a.mb, v)
        print(f"table {name:12s} ticks {s.ticks:3d}  bubble {s.bubble_fraction[0]:.3f} "
              f"(theory {s.theory_bubble:.3f})  peak stash per rank {s.peak_stash}")  # fmt: skip


#: each schedule's reference in ``--interleave``: torch's same schedule, and for ZB-H1 (which
#: torch has only interleaved or V-shaped) both 1F1Bs
_REFS = {
    "gpipe": ("torch GPipe",),
    "1f1b": ("torch 1F1B",),
    "interleaved": ("torch interleaved v=2",),
    "izb": ("torch interleaved v=2",),
    "zbv": ("torch interleaved v=2",),
    "zb": ("torch 1F1B", "fshard 1f1b"),
}


def _configs(a) -> list:
    """The configurations to run: torch's, the fshard ones ``--only`` names (all without it),
    and ``--floor``'s rows."""
    configs = [c for c in CONFIGS if not a.only or c[0] in a.only or c[1] == "torch"]
    return configs + (FLOOR if a.floor else [])


def _calls(a) -> None:
    configs = _configs(a)
    world = World(2, timeout=1800)
    try:
        res = world.run(calls_fn, configs, a.layers, a.dim, a.ctx, a.batch, a.mb, a.steps)
    finally:
        world.close()
    print(f"pp=2, GPT layers={a.layers} d_model={a.dim} ctx={a.ctx}, batch {a.batch} in "
          f"{a.mb} microbatches; Python calls a step and rank (cProfile, {a.steps} steps), "
          "r0 / r1, and the sources with the most calls (both ranks' mean)")  # fmt: skip
    for name, *_ in configs:
        totals = " / ".join(f"{r[name][0]:.0f}" for r in res)
        print(f"{name:24s} {totals:>15s}")
        mean: dict = {}
        for r in res:
            for source, n in r[name][1].items():
                mean[source] = mean.get(source, 0) + n / len(res)
        top = sorted(mean.items(), key=lambda kv: -kv[1])[:8]
        print("    " + ", ".join(f"{source} {n:.0f}" for source, n in top))


def _interleaved(a) -> None:
    configs = _configs(a)
    world = World(2, timeout=1800)
    try:
        res = world.run(
            interleaved_fn,
            configs,
            a.layers,
            a.dim,
            a.ctx,
            a.batch,
            a.mb,
            a.interleave,
            a.attribute,
        )
    finally:
        world.close()
    wall, cpus, faults = res[0][0], [r[1] for r in res], [r[4] for r in res]
    ranks_fshard = sorted({r[2] for r in res})
    print(f"pp=2, GPT layers={a.layers} d_model={a.dim} ctx={a.ctx}, batch {a.batch} in "
          f"{a.mb} microbatches, the ranks' fshard {', '.join(ranks_fshard)}; {a.interleave} rounds, "
          "the configurations one step each in turn in one pair of ranks")  # fmt: skip
    print("step ms: the slowest rank's, median over rounds; ratio: the median over rounds of "
          "the round's ratio to the reference's step in the same round; CPU ms: each rank's "
          "process CPU time a step (median), its ratio: of the medians (r0+r1); faults: each "
          "rank's minor page faults a step (median)")  # fmt: skip
    print(f"{'configuration':24s} {'step ms':>8s} {'ratio to':>36s} {'CPU ms r0 / r1':>16s} "
          f"{'CPU ratio':>15s} {'faults r0 / r1':>15s}")  # fmt: skip

    def cpu_sum(name):
        return sum(statistics.median(c[name]) for c in cpus)

    for name, lib, schedule, _ in configs:
        # fshard's 1F1B also against torch's with the agreement its default check makes
        agreed = ("torch 1F1B + all_reduce",) if lib != "torch" and schedule == "1f1b" else ()
        refs = [r for r in (*_REFS[schedule], *agreed) if r in wall and r != name]
        ratios = [
            f"{statistics.median(x / y for x, y in zip(wall[name], wall[r])):.3f}x {r}"
            for r in refs
        ]
        cpu_ratio = [f"{cpu_sum(name) / cpu_sum(r):.3f}x" for r in refs]
        cpu_cell = " / ".join(f"{statistics.median(c[name]) * 1e3:.1f}" for c in cpus)
        fault_cell = " / ".join(f"{statistics.median(f[name]):.0f}" for f in faults)
        print(f"{name:24s} {statistics.median(wall[name]) * 1e3:8.1f} "
              f"{', '.join(ratios) or '-':>36s} {cpu_cell:>16s} {', '.join(cpu_ratio) or '-':>15s} "
              f"{fault_cell:>15s}")  # fmt: skip
    if a.attribute:
        _print_attribution(configs, [r[3] for r in res], [r[5] for r in res])


def _print_attribution(configs, per_rank: list, ends: list) -> None:
    """``--attribute``'s tables: each bucket's median ms over rounds, ``r0 / r1``; the step's
    ends (see :class:`_Attribution`)."""
    keys: list = []
    for buckets in per_rank:
        for rounds in buckets.values():
            for b in rounds:
                keys += [k for k in b if k not in keys]
    keys = sorted(keys, key=lambda k: (k == "rest", k))
    print("\nmain-thread CPU ms a step by bucket (median over rounds, r0 / r1):")
    print(f"{'configuration':24s} " + " ".join(f"{k:>25s}" for k in keys))
    for name, *_ in configs:
        cells = []
        for k in keys:
            per = [statistics.median(b.get(k, 0.0) for b in bk[name]) for bk in per_rank]
            cells.append(" / ".join(f"{v:.1f}" for v in per))
        print(f"{name:24s} " + " ".join(f"{c:>25s}" for c in cells))
    print("\nthe step's ends, wall ms (median over rounds, r0 / r1): from the call to the first "
          "block forward; from the last backward of the schedule to the return")  # fmt: skip
    print(f"{'configuration':24s} {'call -> first block':>22s} {'last backward -> return':>24s}")
    for name, *_ in configs:
        cells = [
            " / ".join(f"{statistics.median(e[i] for e in per[name]):.2f}" for per in ends)
            for i in (0, 1)
        ]
        print(f"{name:24s} {cells[0]:>22s} {cells[1]:>24s}")
    print("\nthe gaps between compute calls, wall us (each step's median, median over rounds, "
          "r0 / r1): block forward to the next, forward to backward, backward to forward; a "
          "schedule backward's length")  # fmt: skip
    heads = ("block -> block", "forward -> backward", "backward -> forward", "backward")
    print(f"{'configuration':24s} " + " ".join(f"{h:>20s}" for h in heads))
    for name, *_ in configs:
        cells = [
            " / ".join(f"{statistics.median(e[i] for e in per[name]) * 1e3:.0f}" for per in ends)
            for i in range(2, 2 + len(heads))
        ]
        print(f"{name:24s} " + " ".join(f"{c:>20s}" for c in cells))


if __name__ == "__main__":
    main()
