"""Every parallelism at once (issue 36): the demo's flags, through its one training path
(``train_gpt.train``: one global-view loss per model, FSDP by ``fs.nn.fsdp_call``, the pipeline
by ``fs.parallel.pipeline``, context parallelism by a ``shard_map`` over ``cp``), on 4 local
ranks, against the dense computation in one process (3 AdamW steps: every loss and every
parameter)."""

import shlex
import sys
from pathlib import Path

import pytest
import torch

import fshard as fs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_gpt as demo  # noqa: E402

from tests.test_train_gpt import OPT, dense_run, moe_dense_run  # noqa: E402

BASE = (
    "--view global --steps 3 --layers 2 --d-model 32 --heads 4 --ctx 16 --batch 4 "
    f"--lr {OPT['lr']} --warmup {OPT['warmup']} --wd {OPT['weight_decay']} "
    f"--clip {OPT['clip']} --microbatches 2 --plot ''"
)


def train_rank_fn(flags: str):
    args = demo.parse_args(shlex.split(f"{BASE} {flags}"))
    args.update(progress=False, return_params=True, schedule_steps=OPT["steps"])
    return demo.train(args)


def _named(params: dict) -> dict:
    """The pipeline's ``{"emb", "stages", "head"}`` as the module's parameter names."""
    if "stages" not in params:
        return params
    named = {**params["emb"], **params["head"]}
    for n, full in params["stages"].items():  # (stages, blocks per stage, ...), pp order
        for s in range(full.shape[0]):
            for i in range(full.shape[1]):
                named[f"blocks.{s * full.shape[1] + i}.{n}"] = full[s, i]
    return named


@pytest.fixture(scope="module")
def references():
    return {
        "dense": dense_run(),
        "moe": moe_dense_run(),
        "bf16": dense_run(torch.bfloat16),
    }


ROWS = [
    ("--fsdp 2 --tp 2", "dense"),
    ("--fsdp 2 --tp 2 --sp", "dense"),
    ("--fsdp 2 --cp 2 --tp 1", "dense"),
    ("--fsdp 2 --pp 2 --tp 1", "dense"),
    ("--tp 2 --sp --pp 2", "dense"),
    ("--experts 4 --ep 2 --fsdp 2 --tp 1", "moe"),
    ("--experts 4 --ep 2 --cp 2 --tp 1", "moe"),
    ("--experts 4 --ep 2 --pp 2 --tp 1", "moe"),
    ("--bf16 --fsdp 2 --tp 2", "bf16"),
    ("--bf16 --pp 2 --tp 2", "bf16"),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("flags,reference", ROWS, ids=[r[0] for r in ROWS])
def test_demo_flags_compose_like_dense(world4, references, flags, reference):
    ref = references[reference]
    ref_losses = ref[0]
    ref_params = ref[1][-1] if isinstance(ref[1], list) else ref[1]
    out = world4.run(train_rank_fn, flags)[0]
    params = _named(out["params"])
    assert set(params) == set(ref_params)
    if reference == "bf16":  # as test_train_gpt's bf16 check: Adam turns bf16 noise into
        for got, want in zip(out["losses"], ref_losses):  # +-lr steps on tiny gradients
            assert got == pytest.approx(want, abs=1e-3)
        for k, want in ref_params.items():
            assert params[k].dtype == torch.float32
            torch.testing.assert_close(params[k], want, rtol=0, atol=3e-2, msg=k)
        return
    assert out["losses"] == pytest.approx(ref_losses, rel=1e-4)
    for k, want in ref_params.items():
        torch.testing.assert_close(params[k], want, rtol=1e-4, atol=1e-5, msg=k)


EIGHT = ["--fsdp 2 --tp 2 --pp 2", "--fsdp 2 --tp 2 --cp 2"]


def eight_rank_fn():
    return [train_rank_fn(flags) for flags in EIGHT]


@pytest.mark.timeout(900)
def test_three_strategies_on_eight_ranks(references):
    """FSDP x TP x PP and FSDP x TP x CP (the standard large-model configurations) on 8 local
    ranks, in one launch: 3 steps like dense."""
    ref_losses, ref_snaps = references["dense"]
    for flags, out in zip(EIGHT, fs.launch.run(eight_rank_fn, 8, timeout=900)[0]):
        params = _named(out["params"])
        assert out["losses"] == pytest.approx(ref_losses, rel=1e-4), flags
        for k, want in ref_snaps[-1].items():
            torch.testing.assert_close(params[k], want, rtol=1e-4, atol=1e-5, msg=f"{flags} {k}")
