"""Peak memory of a one-rank training step (issue 27: "the torch.func.grad_and_value form, no more
memory than eager; find where the second copy lives"), measured exactly from the CPU allocator's
events (``torch.profiler``, ``profile_memory=True``: the running sum of every allocation and
free in the step, its maximum). Allocation sizes do not depend on the CPU's float rounding.

Found: the excess of the torch.func form is torch.func's own. ``torch.func.grad`` differentiates
with ``torch.autograd.grad(..., create_graph=True)`` (so that transforms can nest), which keeps
every saved activation until the whole backward ends, where ``.backward()`` frees each as its
node runs. Plain torch shows it with no fshard in sight; ``fs.value_and_grad`` (the README's
form) differentiates with ``create_graph=False`` at the top level and peaks exactly where eager
``.backward()`` does.
"""

import ctypes
import gc

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import fshard as fs
from fshard import _comm
from tests._memory import allocator_counts_every_thread, peak_above_start


def _peak_bytes(fn) -> int:
    fn()  # warm: lazily made buffers are not part of the step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start
    )
    now = top = 0
    for e in events:
        now += e.cpu_memory_usage
        top = max(top, now)
    return top


def _peaks():
    torch.manual_seed(0)
    d = 64
    model = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(4)])  # fmt: skip
    x = torch.randn(128, d)
    mesh = fs.Mesh.create((1,), ("dp",))
    params = {k: fs.shard(v.detach(), mesh, fs.P()) for k, v in model.named_parameters()}
    plain = {k: v.detach() for k, v in model.named_parameters()}

    def loss(ps, x):
        out = fs.nn.functional_call(model, ps, (x,))
        out = fs.gather(out) if isinstance(out, fs.ShardedArray) else out
        return out.pow(2).mean()

    def eager():
        model.zero_grad(set_to_none=True)
        torch.func.functional_call(model, dict(model.named_parameters()), (x,)).pow(2).mean().backward()  # fmt: skip

    def torch_func_plain():
        return torch.func.grad_and_value(
            lambda ps, x: torch.func.functional_call(model, ps, (x,)).pow(2).mean()
        )(plain, x)

    vg = fs.value_and_grad(loss)
    return {
        "eager": _peak_bytes(eager),
        "fs.value_and_grad": _peak_bytes(lambda: vg(params, x)),
        "torch.func, plain torch": _peak_bytes(torch_func_plain),
        "torch.func, fshard": _peak_bytes(lambda: torch.func.grad_and_value(loss)(params, x)),
    }


def test_one_rank_step_memory_equals_eager_and_torch_func_excess_is_torch_funcs(world1):
    (p,) = world1.run(_peaks)
    assert p["fs.value_and_grad"] == p["eager"], p
    # fshard adds nothing to the torch.func form; torch.func's create_graph=True keeps the
    # saved activations of the whole backward alive
    assert p["torch.func, fshard"] == p["torch.func, plain torch"] > p["eager"], p


def test_storage_id_keeps_no_tensor_alive():
    """``_compat.storage_id`` (FSDP's pack hook asks it of every saved tensor, psum donation of
    every gradient) was ``functools.cache``-d by a misplaced decorator: every tensor it saw
    stayed alive for the process (issue 36 item 7: +47 MiB a step on the composed FSDP x TP
    Llama, the benchmark's 2.7x peak RSS)."""
    import weakref

    from fshard import _compat

    t = torch.empty(1024)
    ref = weakref.ref(t)
    assert _compat.storage_id(t) == t.untyped_storage().data_ptr()
    del t
    assert ref() is None


def _llama_cfg(layers: int = 2, hidden: int = 64):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, vocab_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip


def _dry_step(degrees: dict, rows: int):
    """One ``fs.value_and_grad`` + AdamW step of ``parallelize``'s loss on a small transformers
    Llama (2 layers, d 64) on the abstract mesh: rank 0's dry-run report."""
    import transformers

    extra = {"pp_microbatches": 2} if "pp" in degrees else {}
    dims = fs.parallel.ParallelDims(**degrees, **extra)
    cfg = _llama_cfg()

    def init(m):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg)
        params, loss = fs.parallel.parallelize(model, m, dims)
        opt = fs.optim.adamw(1e-3)
        ids = torch.zeros((rows, 16), dtype=torch.long, device="meta")
        return params, opt.init(params), {"input_ids": ids}, loss, opt

    def step(params, opt_state, batch, loss, opt):
        _, grads = fs.value_and_grad(loss)(params, batch)
        return fs.optim.step(opt, grads, opt_state, params)

    return fs.dry_run(step, init, dims.abstract_mesh(), ranks=[0]).classes[0]


def _dry_step_pooled(degrees: dict, rows: int):
    """:func:`_dry_step`, and the bytes of the wire buffers it left in the pool for the next
    step (from an empty pool)."""
    _comm._POOL.clear()
    report = _dry_step(degrees, rows)
    pooled = sum(b.numel() * b.element_size() for bs in _comm._POOL.values() for b in bs)
    _comm._POOL.clear()
    return report, pooled


def test_fsdp_x_pp_saves_and_keeps_what_pp_alone_does():
    """FSDP x PP at the rows per rank of PP alone: the forward saves what PP alone saves plus
    exactly one gathered copy of the stage's params (a stage gathers each unit once per step and
    keeps it for the step's microbatches, as torchtitan's FSDP2 under PP with
    reshard_after_forward=False: 180,736 B here, rank 0's decoder layer and the embedding it
    holds) and a part that grows with the rows, not the weights (24 B a token: index tensors of
    the local-view pieces), and after the step only the new state is live (before: each
    fsdp_call's session kept its gathered values and tracked tensors in a cycle through the
    backward's hooks: 2x the activations, 3x the end bytes). (Until the ends were held by their
    stage, PP alone's params also held the head, which stage 0 never gathers, and the bound
    was that larger sum: 213,760 B.)"""
    both, pooled_both = _dry_step_pooled({"dp_shard": 2, "pp": 2}, rows=8)
    pp, pooled_pp = _dry_step_pooled({"pp": 2}, rows=4)
    extra = both.activations - pp.activations
    extra2 = (
        _dry_step({"dp_shard": 2, "pp": 2}, rows=16).activations
        - _dry_step({"pp": 2}, rows=8).activations
    )
    # the part that does not grow with the rows: one copy of the stage's gathered weights, not
    # one per microbatch (PP alone holds the stage's whole params as its arguments:
    # pp.args["params"]); the rest doubles with the rows, at most 3 int64 a token of the
    # rank's 4 rows of 16
    weights = 2 * extra - extra2
    assert weights == pp.args["params"], (extra, extra2, pp.args)
    assert 0 <= extra - weights <= 3 * 8 * 4 * 16, (extra, weights)

    # at the end: the arguments and the new params and optimizer state, the wire buffers kept
    # for the next step (fshard._comm.pooled: with FSDP the reduce_scatters' packs of the
    # stage's gradients, 180,736 B here: at most one copy of the stage's whole params, as DDP
    # keeps its buckets; PP alone none: with the ends held by their stage no param is
    # replicated over pp, so there is no bucket to keep, where its all_reduce's were 65,792 B),
    # and at most what the pipeline alone keeps besides (its cached layer kwargs)
    def kept(c, pooled):
        return c.end - 2 * (c.args["params"] + c.args["opt_state"]) - c.args["batch"] - pooled

    assert 0 < pooled_both <= pp.args["params"]
    assert pooled_pp == 0
    assert 0 <= kept(both, pooled_both) <= kept(pp, pooled_pp)


def _dry_forward(layers: int, grad: bool):
    """The forward of ``parallelize``'s loss under FSDP (``dp_shard=4``) on the abstract mesh,
    with or without ``fs.value_and_grad`` around it: rank 0's dry-run report."""
    import transformers

    dims = fs.parallel.ParallelDims(dp_shard=4)

    def init(m):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(_llama_cfg(layers))
        params, loss = fs.parallel.parallelize(model, m, dims)
        return params, {"input_ids": torch.zeros((4, 16), dtype=torch.long, device="meta")}, loss

    def step(params, batch, loss):
        if grad:
            return fs.value_and_grad(loss)(params, batch)
        with torch.no_grad():
            return loss(params, batch)

    return fs.dry_run(step, init, dims.abstract_mesh(), ranks=[0]).classes[0]


def test_fsdp_frees_each_units_gathered_params_after_its_forward():
    """FSDP2's reshard after forward: a unit's gathered params are freed once its forward no
    longer uses them, so the forward's memory above the arguments does not grow with the
    layers. Before, ``_Pcasts`` held every gathered value it tracked until the forward ended:
    the whole model gathered at the forward's peak (about 16 GiB a rank on the 70B dry run of
    ``docs/sizing.md``), here 3 more layers' gathered params at 6 layers than at 3."""
    import transformers

    model = transformers.LlamaForCausalLM(_llama_cfg(1))
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    three, six = _dry_forward(3, grad=False), _dry_forward(6, grad=False)
    above = [c.peak - sum(c.args.values()) for c in (three, six)]
    assert abs(above[1] - above[0]) < layer // 4, (above, layer)  # before: 3 * layer more
    # with the backward to come the forward saves activations per layer (the weights are
    # gathered again in the backward, not saved): the peak above the arguments grows by the
    # saved activations alone
    three, six = _dry_forward(3, grad=True), _dry_forward(6, grad=True)
    growth = (six.peak - sum(six.args.values())) - (three.peak - sum(three.args.values()))
    saved = six.activations - three.activations
    assert saved > 0 and abs(growth - saved) < layer // 4, (growth, saved, layer)


def _allocator_peak(fn, calls: int = 3) -> int:
    """The CPU allocator's peak live bytes above the start during ``fn()``, every thread's frees
    counted (:mod:`tests._memory`), after a warm call: the lowest of ``calls`` calls (a Gloo
    worker thread the scheduler keeps waiting frees a gathered unit late, which only adds)."""
    fn()
    peaks = []
    for _ in range(calls):
        gc.collect()
        cpu = [ProfilerActivity.CPU]
        with allocator_counts_every_thread(), profile(activities=cpu, profile_memory=True) as prof:
            fn()
        peaks.append(peak_above_start(prof))
    return min(peaks)


def _real_forward_peaks() -> list[int]:
    """The CPU allocator's peak above the start (``_allocator_peak``) of the forward of
    ``parallelize``'s loss under FSDP on this world, at 3 and at 6 layers (d 256: at d 64 a
    layer's 148 KB of params are within the allocator peak's run-to-run spread, 4.0-4.6 MB)."""
    import transformers

    peaks = []
    for layers in (3, 6):
        torch.manual_seed(0)
        dims = fs.parallel.ParallelDims(dp_shard=2)
        model = transformers.LlamaForCausalLM(_llama_cfg(layers, hidden=256))
        params, loss = fs.parallel.parallelize(model, dims.mesh(), dims)
        batch = {"input_ids": torch.randint(0, 128, (4, 16))}

        def forward(loss=loss, params=params, batch=batch):
            with torch.no_grad():
                return loss(params, batch).detach()

        peaks.append(_allocator_peak(forward))
    return peaks


def test_fsdp_frees_gathered_params_in_a_real_run(world2):
    """The real run of the test above, the CPU allocator's events as the oracle: the forward's
    peak does not grow with the layers (before: 3 more layers' gathered params at 6)."""
    import transformers

    model = transformers.LlamaForCausalLM(_llama_cfg(1, hidden=256))
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    for three, six in world2.run(_real_forward_peaks):
        assert abs(six - three) < layer // 4, (three, six, layer)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _heap_bytes() -> int:
    """glibc's live heap bytes over every arena and mmapped chunk (``mallinfo2``: every
    thread's allocations, Gloo's included, tensors and Python objects alike), after a
    collection."""
    gc.collect()
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _fsdp_x_tp_step_growth(steps: int) -> tuple[float, int]:
    """Steady ``fs.value_and_grad`` + AdamW steps of ``parallelize``'s loss under FSDP x TP
    (``dp_shard=2, tp=2``) on this rank, after three warm ones, with the consistency checks off
    (their history grows between exchanges, by design): the live heap's growth a step
    (``_heap_bytes``; the new params and optimizer state replace the old, so about 0 when a
    step keeps nothing) and the bytes of one decoder layer's params on this rank once
    gathered over ``dp_shard`` (its ``tp`` block)."""
    import transformers

    torch.manual_seed(0)
    dims = fs.parallel.ParallelDims(dp_shard=2, tp=2)
    model = transformers.LlamaForCausalLM(_llama_cfg(1, hidden=128))
    params, loss = fs.parallel.parallelize(model, dims.mesh(), dims)
    tx = fs.optim.adamw(1e-3)
    state = {"params": params, "opt": tx.init(params)}
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))

    def step():
        _, grads = fs.value_and_grad(loss)(state["params"], {"input_ids": ids})
        state["params"], state["opt"] = fs.optim.step(tx, grads, state["opt"], state["params"])

    with fs.config.consistency("off"):
        for _ in range(3):
            step()
        start = _heap_bytes()
        for _ in range(steps):
            step()
        grown = (_heap_bytes() - start) / steps
    layer = sum(
        v.local.numel() * v.local.element_size() * 2
        for n, v in params.items()
        if n.startswith("model.layers.0.")
    )
    return grown, layer


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="glibc's mallinfo2")
def test_fsdp_x_tp_step_keeps_nothing_after_it(world4):
    """A step of the composed FSDP x TP Llama leaves nothing live but its new state (issue 36
    item 7: the benchmark's 1.56x peak RSS, +5.5 MiB a step after malloc_trim). FSDP's
    saved-tensor pack hook returned a tensor it did not take over as itself: a node that saves
    its own output (``amax`` for the vocab-parallel cross entropy's max, detached, so never
    reached by the backward) then held that output, whose ``grad_fn`` is the node: a cycle
    through C++ that Python's collector cannot see. The forward's graph, its saved activations,
    the session (the unpack hook) and its last regathered unit (a decoder layer's params)
    stayed alive, every step: 620 KB a step here before, about 25 KB after (the same as FSDP
    alone and TP alone: no tensor kept)."""
    for grown, layer in world4.run(_fsdp_x_tp_step_growth, 6):
        assert grown < layer / 4, (grown, layer)
