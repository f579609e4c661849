"""The GPT demo's sharded training (tp=2, dp=2; local and global view) matches dense
single-process training."""

import shlex
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fshard as fs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_gpt as demo  # noqa: E402

CFG = demo.GPTConfig(d_model=32, n_heads=4, n_layers=2, ctx=16)
STEPS, BATCH, SEED = 3, 4, 0
OPT = {"lr": 1e-2, "steps": 10, "warmup": 2, "weight_decay": 0.1, "clip": 0.5}


def _batches():
    data = demo.load_corpus()
    gen = torch.Generator().manual_seed(SEED + 1)
    return [demo.get_batch(data, BATCH, CFG.ctx, gen) for _ in range(STEPS)]


def _dense_grad_and_value(dtype=None):
    """``torch.func.grad_and_value`` of the demo's dense loss; with ``dtype`` the casts of
    ``--bf16``: weights cast where read, logits back to float32."""
    if dtype is None:
        return torch.func.grad_and_value(demo.dense_loss)

    def low_loss(params, model, tokens):
        low = {k: v.to(dtype) for k, v in params.items()}
        logits = torch.func.functional_call(model, low, (tokens[:, :-1],)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    return torch.func.grad_and_value(low_loss)


def dense_run(dtype=None):
    torch.manual_seed(SEED)
    model = demo.GPT(CFG)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = demo.make_optimizer(**OPT)
    state = tx.init(params)
    gv = _dense_grad_and_value(dtype)
    losses, snaps = [], []
    for batch in _batches():
        grads, loss = gv(params, model, batch)
        updates, state = tx.update(grads, state, params)
        params = fs.optim.apply_updates(params, updates)
        losses.append(float(loss))
        snaps.append(params)
    return losses, snaps


def sharded_rank_fn(dp, tp, view, remat=False, bf16=False, fsdp=False, sp=False):
    """The demo's params and step for the flags (``demo.sharded_model``): the local view's
    Megatron (FSDP) plan, or the global view's ``fs.parallel.parallelize``; layouts checked
    every step."""
    args = {"view": view, "dp": dp, "tp": tp, "fsdp": fsdp, "sp": sp, "bf16": bf16,
            "remat": remat, "seed": SEED}  # fmt: skip
    mesh, model, params, loss = demo.sharded_model(args, CFG)
    if tp > 1 and not fsdp:
        assert params["blocks.0.attn.qkv.weight"].spec.dims[0] == ("tp",)
        assert params["blocks.1.mlp.fc2.weight"].spec.dims[1] == ("tp",)
        assert params["head.weight"].local.shape == (CFG.vocab // 2, CFG.d_model)
    layouts = {k: v.layout for k, v in params.items()}
    tx = demo.make_optimizer(**OPT)
    state = tx.init(params)
    step = demo.make_train_step(
        CFG, mesh, tx, loss=loss, fsdp_units=fs.nn.fsdp_units(model) if fsdp and loss is None else None,
        remat=remat, dtype=torch.bfloat16 if bf16 else None,
    )  # fmt: skip
    losses, snaps = [], []
    for batch in _batches():
        if loss is None:  # the local view: this rank's rows
            batch = fs.shard(batch, mesh, fs.P("dp"))
        params, state, value = step(params, state, batch)
        assert {k: v.layout for k, v in params.items()} == layouts
        assert (
            state[1][0].mu["blocks.0.mlp.fc1.weight"].layout == layouts["blocks.0.mlp.fc1.weight"]
        )
        losses.append(float(value))
        # copies: the demo's step donates params (gather of a replicated value is its buffer)
        snaps.append({k: fs.gather(v).clone() for k, v in params.items()})
    return losses, snaps if dist.get_rank() == 0 else None


BASE = (
    f"--steps {STEPS} --layers {CFG.n_layers} --d-model {CFG.d_model} --heads {CFG.n_heads} "
    f"--ctx {CFG.ctx} --batch {BATCH} --seed {SEED} --lr {OPT['lr']} --warmup {OPT['warmup']} "
    f"--wd {OPT['weight_decay']} --clip {OPT['clip']} --microbatches 2 --plot ''"
)


def flags_rank_fn(flags: str):
    """One rank of ``demo.train`` for ``flags`` (3 steps of :data:`CFG`): its losses and every
    param, whole, under the module's names (rank 0; ``{}`` elsewhere)."""
    args = demo.parse_args(shlex.split(f"{BASE} {flags}"))
    args.update(progress=False, return_params=True, schedule_steps=OPT["steps"])
    return demo.train(args)


@pytest.fixture(scope="module")
def dense():
    return dense_run()


@pytest.mark.parametrize("view", ["local", "global"])
@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 1)])
def test_sharded_training_matches_dense(world2, dense, dp, tp, view):
    ref_losses, ref_snaps = dense
    assert ref_losses[-1] < ref_losses[0]  # it actually trains
    out = world2.run(sharded_rank_fn, dp, tp, view)
    losses, snaps = out[0]
    assert out[0][0] == out[1][0]  # every rank reports the same loss
    for i in range(STEPS):
        assert losses[i] == pytest.approx(ref_losses[i], rel=1e-4), (i, losses, ref_losses)
        for k, ref in ref_snaps[i].items():
            torch.testing.assert_close(snaps[i][k], ref, rtol=1e-4, atol=1e-5, msg=f"step {i} {k}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "dp,tp,view,fsdp", [(1, 2, "local", False), (2, 1, "local", False), (2, 1, "local", True)]
)
def test_remat_training_matches_dense(world2, dense, dp, tp, view, fsdp):
    """``--remat``: every block under fs.remat (collectives recomputed in the backward; inside
    FSDP units too), the same training as dense."""
    ref_losses, ref_snaps = dense
    losses, snaps = world2.run(sharded_rank_fn, dp, tp, view, True, False, fsdp)[0]
    for i in range(STEPS):
        assert losses[i] == pytest.approx(ref_losses[i], rel=1e-4), (i, losses, ref_losses)
        for k, ref in ref_snaps[i].items():
            torch.testing.assert_close(snaps[i][k], ref, rtol=1e-4, atol=1e-5, msg=f"step {i} {k}")


@pytest.mark.timeout(600)
def test_sp_training_matches_dense(world2, dense):
    """``--sp``: Megatron sequence parallelism over tp=2 (global view) trains like dense."""
    ref_losses, ref_snaps = dense
    losses, snaps = world2.run(sharded_rank_fn, 1, 2, "global", False, False, False, True)[0]
    for i in range(STEPS):
        assert losses[i] == pytest.approx(ref_losses[i], rel=1e-4), (i, losses, ref_losses)
        for k, ref in ref_snaps[i].items():
            torch.testing.assert_close(snaps[i][k], ref, rtol=1e-4, atol=1e-5, msg=f"step {i} {k}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dp,tp,view", [(1, 2, "local"), (2, 1, "global")])
def test_bf16_training_matches_dense_bf16(world2, dp, tp, view):
    """``--bf16``: bfloat16 compute from float32 masters (the params stay float32), against the
    dense run with the same casts. A split matmul sums its bf16 partial products in another
    order than the dense one, so the comparison has bf16's tolerance."""
    ref_losses, ref_snaps = dense_run(torch.bfloat16)
    fp32_losses = dense_run()[0]
    losses, snaps = world2.run(sharded_rank_fn, dp, tp, view, False, True)[0]
    assert losses != fp32_losses  # bf16 compute happened
    for i in range(STEPS):
        assert losses[i] == pytest.approx(ref_losses[i], abs=1e-3), (i, losses, ref_losses)
    # Per weight, the sharded run's update must agree with the dense one to within a tenth of
    # how far the updates moved it (3 steps, the first at lr 0 in the warmup: 2 updates of at
    # most ~lr each; an elementwise atol cannot tell them apart: Adam turns bf16 noise on tiny
    # gradients into +-lr steps). Measured: at most 0.011 of the movement (1 is a run whose
    # updates were lost). k's bias is left out: its gradient is 0 in exact arithmetic (softmax
    # is shift invariant), so its updates are Adam's steps on bf16 noise.
    torch.manual_seed(SEED)
    init = {k: v.detach() for k, v in demo.GPT(CFG).named_parameters()}
    for k, ref in ref_snaps[-1].items():
        got = snaps[-1][k]
        assert got.dtype == torch.float32, k
        keep = torch.ones_like(ref, dtype=torch.bool)
        if k.endswith("attn.qkv.bias"):  # head-major [h: q k v]
            keep.view(CFG.n_heads, 3, -1)[:, 1] = False
        moved = (ref - init[k])[keep].abs().mean().item()
        off = (got - ref)[keep].abs().mean().item()
        assert moved > 5e-4 and off <= 0.1 * moved, (k, off, moved)


MOE = demo.GPTConfig(d_model=32, n_heads=4, n_layers=2, ctx=16, n_experts=4, top_k=2)


def moe_dense_run(dtype=None):
    torch.manual_seed(SEED)
    model = demo.GPT(MOE)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx = demo.make_optimizer(**OPT)
    state = tx.init(params)
    gv = _dense_grad_and_value(dtype)
    losses = []
    for batch in _batches():
        grads, loss = gv(params, model, batch)
        updates, state = tx.update(grads, state, params)
        params = fs.optim.apply_updates(params, updates)
        losses.append(float(loss))
    return losses, params


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags", ["--experts 4 --ep 2 --tp 1", "--experts 4 --dp 2 --tp 1"])
def test_moe_training_matches_dense(world2, flags):
    """``--experts 4``: ep=2 (experts split, tokens dispatched with ragged all_to_alls) and
    dp=2 (experts replicated, every expert weighted per token) train like the dense MoE."""
    ref_losses, ref_params = moe_dense_run()
    out = world2.run(flags_rank_fn, flags)[0]
    assert out["losses"] == pytest.approx(ref_losses, rel=1e-4)
    assert out["params"]["blocks.0.mlp.gate_up"].shape == ref_params["blocks.0.mlp.gate_up"].shape
    for k, v in ref_params.items():
        torch.testing.assert_close(out["params"][k], v, rtol=1e-4, atol=1e-5, msg=k)


def _check_flags(out: dict, dense) -> None:
    ref_losses, ref_snaps = dense
    assert out["losses"] == pytest.approx(ref_losses, rel=1e-4)
    assert set(out["params"]) == set(ref_snaps[-1])
    for k, ref in ref_snaps[-1].items():
        torch.testing.assert_close(out["params"][k], ref, rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "flags",
    ["--pp 2 --tp 1 --schedule gpipe", "--pp 2 --tp 1 --schedule 1f1b",
     "--pp 2 --tp 1 --schedule zb", "--pp 2 --dp 2 --tp 1"],
)  # fmt: skip
def test_pipeline_training_matches_dense(flags, dense, request):
    """``--pp 2``: the blocks as pipeline stages, each schedule, 3 steps of the example's
    optimizer (``fs.optim.step`` included, whose consistency check spans the whole mesh while
    each stage ran its own collectives) like dense; pp x dp on 4 ranks."""
    world = request.getfixturevalue("world4" if "--dp 2" in flags else "world2")
    _check_flags(world.run(flags_rank_fn, flags)[0], dense)


@pytest.mark.timeout(600)
def test_cp_training_matches_dense(world2, dense):
    """``--cp 2``: the sequence split over cp (load-balanced chunks, ring attention through
    ``fs.parallel.attention``), 3 steps like dense."""
    _check_flags(world2.run(flags_rank_fn, "--cp 2 --tp 1")[0], dense)


@pytest.mark.timeout(900)
def test_dp_tp_sp_cp_on_eight_ranks(world8, dense):
    """Every axis at once on 8 local ranks (issue 23 item 4): dp=2 x cp=2 x tp=2 with sequence
    parallelism, 3 steps of the example's step equal to dense."""
    out = world8.run(flags_rank_fn, "--dp 2 --cp 2 --tp 2 --sp", timeout=900)[0]
    _check_flags(out, dense)


def test_parse_args_validation():
    with pytest.raises(SystemExit, match="divisible"):
        demo.parse_args(["--batch", "5", "--dp", "2"])
    with pytest.raises(SystemExit, match="heads"):
        demo.parse_args(["--tp", "3"])
    assert demo.parse_args([])["tp"] == 2
    assert demo.parse_args([])["view"] == "local"
    assert demo.parse_args(["--view", "global"])["view"] == "global"
    with pytest.raises(SystemExit):
        demo.parse_args(["--view", "dense"])
    assert demo.parse_args(["--remat", "--view", "global", "--tp", "2"])["remat"]
    assert demo.parse_args(["--remat", "--cp", "2", "--pp", "2"])["remat"]
    assert demo.parse_args(["--remat", "--cp", "2"])["remat"]  # issue 36
    assert demo.parse_args(["--remat", "--sp"])["remat"]  # per-layer remat in parallelize
    assert demo.parse_args(["--remat", "--bf16"])["remat"] is True
    # a strategy of the composition needs no --view: it runs in the global view
    for flags in (["--sp"], ["--pp", "2"], ["--cp", "2"], ["--experts", "4"]):
        assert demo.parse_args(flags)["view"] == "global", flags
        with pytest.raises(SystemExit, match=r"global view .*drop --view local"):
            demo.parse_args([*flags, "--view", "local"])
    with pytest.raises(SystemExit, match="must split into pp x virtual"):
        demo.parse_args(["--pp", "2", "--layers", "3"])
    with pytest.raises(SystemExit, match="must split into 2 x --cp"):
        demo.parse_args(["--cp", "3", "--ctx", "8"])
    with pytest.raises(SystemExit, match="--ep splits the experts"):
        demo.parse_args(["--ep", "2"])
    with pytest.raises(SystemExit, match="must split over --ep"):
        demo.parse_args(["--experts", "3", "--ep", "2"])
