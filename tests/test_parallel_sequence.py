"""Sequence parallelism (issue 23 item 1): ``fs.parallel.sequence_parallel_plan`` /
``megatron_plan(sequence_parallel=True)``. The example GPT and an HF Llama train 3 AdamW steps
under tp=2 + SP equal to dense (loss, every gathered gradient, trained weights); every step's
``comm_log`` is exactly Megatron-SP's collectives (:func:`fs.parallel.megatron_sp_comm`) plus
the vocab-parallel cross entropy's per-row reductions."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fshard as fs
from tests.test_autodiff import global_loss

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
RTOL, ATOL = 2e-5, 2e-6
STEPS = 3


def _close(got, want, what):
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL + RTOL * scale, msg=what)


def test_plan_is_megatron_with_sequence_split_outputs():
    sp = fs.parallel.sequence_parallel_plan(column=["*.fc1"], row=["*.fc2"], scatter=["tok"])
    tp = fs.nn.megatron_plan(column=["*.fc1"], row=["*.fc2"])
    assert {k: v for k, v in sp.items() if k != "tok"} == {
        **tp,
        "*.fc2": fs.nn.Output(fs.P(None, "tp")),
    }
    assert sp["tok"] == fs.nn.Output(fs.P(None, "tp"))
    assert fs.nn.megatron_plan(column=["*.fc1"], row=["*.fc2"], sequence_parallel=True) == {
        k: v for k, v in sp.items() if k != "tok"
    }
    seq_first = fs.parallel.sequence_parallel_plan(row=["*.fc2"], axis="m", seq_dim=0)
    assert seq_first["*.fc2"] == fs.nn.Output(fs.P("m"))
    with pytest.raises(ValueError, match="row_output"):
        fs.nn.megatron_plan(row=["a"], row_output=fs.P("tp"), sequence_parallel=True)
    with pytest.raises(TypeError, match="seq_dim"):
        fs.parallel.sequence_parallel_plan(row=["a"], seq_dim=-1)
    with pytest.raises(TypeError, match="scatter"):
        fs.parallel.sequence_parallel_plan(row=["a"], scatter="tok")


def test_megatron_sp_comm_formula():
    """Per layer 4 all_gathers of A/tp + 4 reduce_scatters of A: plain TP's 4 all_reduces."""
    got = fs.parallel.megatron_sp_comm(3, 4096, 4, sp_param_bytes=[8, 8])
    assert got == Counter(
        {("all_gather", 1024): 3 * 4 + 2, ("reduce_scatter", 4096): 3 * 4 + 1, ("all_reduce", 8): 2}
    )
    with pytest.raises(ValueError, match="act_bytes"):
        fs.parallel.megatron_sp_comm(1, 10, 4)


def _adamw_steps(loss_fn, dense_loss, params, dense, x, ids, check_log):
    """3 AdamW steps of ``loss_fn`` on sharded params against ``dense_loss`` on dense ones."""
    layouts = {k: v.layout for k, v in params.items()}
    tx = fs.optim.adamw(1e-2, eps=1e-4, weight_decay=0.1)
    state, dstate = tx.init(params), tx.init(dense)
    for step in range(STEPS):
        with fs.debug.comm_log() as log:
            grads, loss = torch.func.grad_and_value(loss_fn)(params, x)
        check_log(log)
        dgrads, dloss = torch.func.grad_and_value(dense_loss)(dense, ids)
        _close(loss, dloss, f"loss, step {step}")
        assert set(grads) == set(dgrads)
        for k, g in grads.items():
            assert g.layout == layouts[k], (step, k, g.layout)
            _close(fs.gather(g), dgrads[k], f"grad {k}, step {step}")
        params, state = fs.optim.step(tx, grads, state, params, donate=True)
        updates, dstate = tx.update(dgrads, dstate, dense)
        dense = fs.optim.apply_updates(dense, updates)
    for k, v in params.items():
        _close(fs.gather(v), dense[k], f"trained {k}")
    return True


def _check(log, want, rows):
    """``log`` is ``want`` plus the vocab-parallel cross entropy's per-row reductions (max, sum
    of exponentials, target logit): all_reduces of at most 3 floats per row in total."""
    got = Counter((r.op, r.nbytes) for r in log)
    assert not want - got, ("missing", want - got)
    extra = got - want
    assert all(op == "all_reduce" for op, _ in extra), extra
    assert sum(n * c for (_, n), c in extra.items()) <= 3 * rows * 4, extra


def gpt_rank_fn(batch=3):
    import train_gpt as tg

    mesh = fs.Mesh.create((2,), ("tp",))
    torch.manual_seed(0)
    cfg = tg.GPTConfig(vocab=64, d_model=32, n_heads=4, n_layers=2, ctx=16)
    model = tg.GPT(cfg)
    plan = fs.parallel.sequence_parallel_plan(
        column=["blocks.*.attn.qkv", "blocks.*.mlp.fc1"],
        row=["blocks.*.attn.proj", "blocks.*.mlp.fc2"],
        scatter=["embed.tok"],
    )
    plan.update(fs.nn.megatron_plan(column=["head"], bias=False))
    params = fs.nn.shard_params(model, mesh, plan)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.ctx + 1), generator=gen)
    b, t, h = batch, cfg.ctx, cfg.d_model
    act = b * t * h * 4
    ln = [n for n in params if ".ln" in n or n.startswith("ln_f")]
    want = fs.parallel.megatron_sp_comm(
        cfg.n_layers, act, 2, sp_param_bytes=[params[n].numel() * 4 for n in ln]
    )
    # the model adds its position embedding after the embedding module (Megatron adds it
    # inside): its rows enter the sequence split too, one all_gather of its gradient
    want[("all_gather", t * h * 4 // 2)] += 1

    def check_log(log):
        _check(log, want, b * t)

    loss_fn = lambda ps, x: global_loss(ps, model, x)  # noqa: E731
    dense_loss = lambda ps, ids: tg.dense_loss(ps, model, ids)  # noqa: E731
    dense = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = fs.shard(ids, mesh, fs.P())
    return _adamw_steps(loss_fn, dense_loss, params, dense, x, ids, check_log)


@pytest.mark.parametrize("batch", [3, 16])
def test_gpt_sequence_parallel_two_ranks(world2, batch):
    """Batch 16 x ctx 16 = 256 tokens, more than any layer's out-features (at most 128): a
    linear still all-gathers its sequence-split activation, never its weight (Megatron)."""
    assert world2.run(gpt_rank_fn, batch) == [True, True]


def llama_rank_fn(attn):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    vocab, b, t, h, layers = 128, 1, 16, 64, 2
    cfg = transformers.LlamaConfig(
        hidden_size=h, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=t,
        attn_implementation=attn,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    mesh = fs.Mesh.create((2,), ("tp",))
    plan = fs.nn.megatron_plan(
        column=["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj", "lm_head"],
        row=["*.o_proj", "*.down_proj"],
        vocab=["model.embed_tokens"],
        model=model,
        sequence_parallel=True,
    )
    params = fs.nn.shard_params(model, mesh, plan)
    ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(1))
    norms = [n for n in params if "norm" in n]
    # b * t * h < every column weight's size, so the linear rule gathers the activation, not
    # the weight (at b * t > out-features it gathers the weight instead: not Megatron-SP)
    assert all(b * t * h < params[n].numel() for n in params if "_proj" in n or "lm_head" in n)
    # q, k, v and gate, up are separate projections here: each all-gathers its input
    want = fs.parallel.megatron_sp_comm(
        layers, b * t * h * 4, 2, columns=5, scatter=False, vocab=True,
        sp_param_bytes=[params[n].numel() * 4 for n in norms],
    )  # fmt: skip

    def lm_loss(logits, ids):
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        return fs.gather(loss) if isinstance(loss, fs.ShardedArray) else loss

    def loss_fn(ps, x):
        return lm_loss(fs.nn.functional_call(model, ps, (x,), {"use_cache": False}).logits, x)

    def dense_loss(ps, ids):
        logits = torch.func.functional_call(model, ps, (ids,), {"use_cache": False}).logits
        return lm_loss(logits, ids)

    dense = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = fs.shard(ids, mesh, fs.P())
    return _adamw_steps(
        loss_fn, dense_loss, params, dense, x, ids, lambda log: _check(log, want, b * (t - 1))
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_llama_sequence_parallel_two_ranks(world2, attn):
    pytest.importorskip("transformers")
    assert world2.run(llama_rank_fn, attn) == [True, True]


def test_gather_varying_fuses_only_a_trailing_invariant_gather_under_the_pcast():
    from fshard.collectives import AllGather, PsumScatter
    from fshard.executor import gather_varying, program

    mesh = fs.Mesh.abstract((2, 2), ("dp", "tp"))
    layout = fs.Layout(mesh, fs.P(None, "tp"), (4, 8))
    prog = program(layout, fs.P())
    assert isinstance(prog.steps[-1].op, AllGather) and prog.steps[-1].op.invariant
    fused, rest = gather_varying(prog, ("dp", "tp"))
    assert rest == ("dp",)
    assert fused.steps[-1].op == AllGather(("tp",), 1, (4, 4), invariant=False)
    assert isinstance(fused.steps[-1].op.transpose(), PsumScatter)  # Megatron-SP's backward
    assert fused.out == prog.out
    assert gather_varying(prog, ("dp",)) == (prog, ("dp",))  # the gather's axis is not pcast
    sliced = program(fs.Layout(mesh, fs.P(), (4, 8)), fs.P("tp"))
    assert gather_varying(sliced, ("tp",)) == (sliced, ("tp",))  # no gather to fuse
