"""Hugging Face GPT-2 and Llama (tiny, random weights, built from configs) train under DP=2 and
TP=2 exactly like the dense loop: ``fs.nn.shard_params`` + ``fs.nn.functional_call`` inside
``torch.func.grad_and_value``, 3 ``fs.optim.adamw`` steps; loss and every gathered gradient
against dense torch each step, layouts kept; ``vmap(grad)`` per-example gradients under TP;
padding attention masks (sharded in DP, replicated in TP) with the model's own loss, and an odd
DP batch.

Each configuration is one ``world2.run`` call (its own test timeout); the models are built once
per rank process and reset to their initial weights after each configuration. A configuration that fails because an op rule is
missing is marked ``xfail(strict=True)`` naming the op, so it flips when the op lands.
"""

import traceback
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fshard as fs

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, STEPS = 256, 4, 16, 3
RTOL, ATOL = 2e-5, 2e-6  # relative to each gradient's largest entry, see _close


def build(kind: str, attn: str) -> torch.nn.Module:
    """The tiny model of issue 13, seeded: every rank builds the same weights."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
        attn_implementation=attn,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def tp_plan(kind: str, model: torch.nn.Module) -> dict:
    """Megatron TP: GPT-2's fused c_attn [q|k|v] is not head-aligned, so it stays replicated
    (megatron_plan refuses it); its tied wte/lm_head is vocab-parallel."""
    if kind == "gpt2":
        return fs.nn.megatron_plan(
            column=["*.mlp.c_fc"],
            row=["*.mlp.c_proj", "*.attn.c_proj"],
            vocab=["transformer.wte"],
            model=model,
        )
    return fs.nn.megatron_plan(
        column=["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj", "lm_head"],
        row=["*.o_proj", "*.down_proj"],
        vocab=["model.embed_tokens"],
        model=model,
    )


def lm_loss(logits, ids):
    """Mean next-token cross entropy (a plain tensor: a replicated loss is gathered)."""
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return fs.gather(loss) if isinstance(loss, fs.ShardedArray) else loss


def _close(got, want, what):
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL + RTOL * scale, msg=what)


def _check_llama_tp_comm(log, layers):
    """Megatron's communication, nothing else (no weight is ever gathered): activation-sized
    all-reduces, forward one after the vocab-parallel embedding and one per row-parallel layer
    (o, down), backward one per column-parallel input (q, k, v, gate, up: each pcasts its input)
    and one for the vocab-parallel head's input; plus the vocab-parallel cross entropy's
    per-row max, sum of exponentials and target logit (3 floats per row)."""
    act, rows = BATCH * SEQ * 64 * 4, BATCH * (SEQ - 1) * 4
    assert all(r.op == "all_reduce" for r in log), log
    assert sum(r.nbytes == act for r in log) == (1 + 2 * layers) + (1 + 5 * layers), log
    assert sum(r.nbytes for r in log if r.nbytes != act) <= 3 * rows, log


def padding_mask(batch: int) -> torch.Tensor:
    """A left-padded first row and a right-padded last row (1 = token, 0 = padding)."""
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[0, :5] = 0
    mask[-1, -3:] = 0
    return mask


def _train(model, kind, job, ids):
    """``job``: ``dp``/``tp``/``tp-pending``; ``-pad``: a padding attention_mask sharded like
    the ids (dp) or replicated (tp) and the model's own loss (labels=ids, padding ignored);
    ``-odd``: an odd batch (rows 2 | 1 over dp)."""
    mode, *flags = job.split("-")
    pending = "pending" in flags  # row-parallel outputs left as pending sums (no Output)
    mesh = fs.Mesh.create((2,), (mode,))
    plan = tp_plan(kind, model) if mode == "tp" else {}
    if pending:
        plan = {k: v for k, v in plan.items() if not isinstance(v, fs.nn.Output)}
    params = fs.nn.shard_params(model, mesh, plan)
    layouts = {k: v.layout for k, v in params.items()}
    if "odd" in flags:
        ids = ids[: BATCH - 1]
    spec = fs.P("dp") if mode == "dp" else fs.P()
    x = fs.shard(ids, mesh, spec)
    kwargs = {"use_cache": False}
    if "pad" in flags:
        mask = padding_mask(ids.shape[0])
        labels = ids.masked_fill(mask == 0, -100)
        kwargs.update(
            attention_mask=fs.shard(mask, mesh, spec), labels=fs.shard(labels, mesh, spec)
        )
        dense_kwargs = {"use_cache": False, "attention_mask": mask, "labels": labels}

    def loss_fn(ps, x):
        out = fs.nn.functional_call(model, ps, (x,), kwargs)
        if "pad" in flags:
            return fs.gather(out.loss)
        return lm_loss(out.logits, x)

    def dense_loss(ps, ids):
        if "pad" in flags:
            return torch.func.functional_call(model, ps, (ids,), dense_kwargs).loss
        logits = torch.func.functional_call(model, ps, (ids,), {"use_cache": False}).logits
        return lm_loss(logits, ids)

    # eps bounds Adam's amplification of rounding noise in near-zero gradient entries
    # (m / (sqrt(v) + eps) turns a 1e-9 difference into lr-sized ones with eps=1e-8)
    tx = fs.optim.adamw(1e-2, eps=1e-4, weight_decay=0.1)
    dense = {k: v.detach().clone() for k, v in model.named_parameters()}
    state, dstate = tx.init(params), tx.init(dense)
    for step in range(STEPS):
        with fs.debug.comm_log() as log:
            grads, loss = torch.func.grad_and_value(loss_fn)(params, x)
        if kind == "llama" and job == "tp":
            _check_llama_tp_comm(log, model.config.num_hidden_layers)
        dgrads, dloss = torch.func.grad_and_value(dense_loss)(dense, ids)
        _close(loss, dloss, f"loss, step {step}")
        assert set(grads) == set(dgrads)
        for k, g in grads.items():
            assert g.layout == layouts[k], (step, k, g.layout, layouts[k])
            _close(fs.gather(g), dgrads[k], f"grad {k}, step {step}")
        params, state = fs.optim.step(tx, grads, state, params, donate=True)
        updates, dstate = tx.update(dgrads, dstate, dense)
        dense = fs.optim.apply_updates(dense, updates)
        assert all(params[k].layout == layouts[k] for k in params)
    fs.nn.load_params(model, params)  # the module now holds the trained values
    for k, v in model.named_parameters():
        _close(v.detach(), dense[k], f"trained {k}")
    return True


def _per_example(model, kind, ids, train):
    model.train(train)
    mesh = fs.Mesh.create((2,), ("tp",))
    params = fs.nn.shard_params(model, mesh, tp_plan(kind, model))
    x = fs.shard(ids, mesh, fs.P())

    def loss_fn(ps, seq):
        logits = fs.nn.functional_call(model, ps, (seq[None],), {"use_cache": False}).logits
        return lm_loss(logits, seq[None])

    def dense_loss(ps, seq):
        logits = torch.func.functional_call(model, ps, (seq[None],), {"use_cache": False})
        return lm_loss(logits.logits, seq[None])

    per = torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None, 0))(params, x)
    dense = {k: v.detach() for k, v in model.named_parameters()}
    want = torch.func.vmap(torch.func.grad(dense_loss), in_dims=(None, 0))(dense, ids)
    for k, g in per.items():
        assert g.shape == (BATCH, *params[k].shape), k
        assert g.spec.dims[1:] == params[k].spec.dims or params[k].spec == fs.P(), k
        _close(fs.gather(g), want[k], f"per-example grad {k}")
    return True


CONFIGS = [
    (kind, attn, job)
    for kind in ("gpt2", "llama")
    for attn in ("sdpa", "eager")
    for job in ("dp", "tp", "vmap-tp")
] + [("llama", "eager", "tp-pending"), ("llama", "eager", "vmap-tp-train")]
# issue 21: padding masks through transformers' masking utilities (eager and sdpa), odd batches
CONFIGS += [("llama", attn, job) for attn in ("sdpa", "eager") for job in ("dp-pad", "tp-pad")]
CONFIGS += [("llama", "sdpa", "dp-pad-odd"), ("gpt2", "eager", "dp-pad-odd")]


_MODELS: dict = {}  # (kind, attn) -> model, built once per rank process


def hf_rank_fn(configs):
    """Every configuration on this rank; ``{config: None | error text}``."""
    warnings.filterwarnings("ignore", module="transformers")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    models, out = _MODELS, {}
    for kind, attn, job in configs:
        if (kind, attn) not in models:
            models[kind, attn] = build(kind, attn)
        model = models[kind, attn]
        initial = {k: v.detach().clone() for k, v in model.named_parameters()}
        try:
            if job.startswith("vmap-tp"):
                _per_example(model, kind, ids, train=job.endswith("train"))
            else:
                _train(model, kind, job, ids)
            out[kind, attn, job] = None
        except Exception as e:  # reported by the test of this configuration
            out[kind, attn, job] = "".join(traceback.format_exception(e))[-3000:]
        finally:
            fs.nn.load_params(model, initial)
            model.train()
    return out


# configuration -> the op rule it still lacks (strict: the test flips when the op lands).
# Empty since the ops branch landed Tensor.to(device), sdpa enable_gqa, vmap-safe dropout
# planning and the contraction fix for two pending operands with one interned layout.
MISSING: dict = {}


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=MISSING[c]))
        if c in MISSING
        else c
        for c in CONFIGS
    ],
    ids=["-".join(c) for c in CONFIGS],
)
def test_hf_matches_dense(world2, config):
    results = world2.run(hf_rank_fn, [config])
    error = results[0][config] or results[1][config]
    assert error is None, f"{config} failed on a rank:\n{error}"


def readme_code() -> str:
    """The code block of the README's "Hugging Face models" section."""
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("## Hugging Face models", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def readme_rank_fn(code):
    warnings.filterwarnings("ignore", module="transformers")
    ns: dict = {"__name__": "readme"}  # a script: its main() is what fs.launch.run runs
    exec(compile(code, "README.md", "exec"), ns)
    trained = ns["main"]()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(ns["cfg"])  # the same weights, dense loop
    dense = {k: v.detach().clone() for k, v in model.named_parameters()}
    tx, state = ns["tx"], ns["tx"].init(dense)

    def dense_loss(ps, ids):
        logits = torch.func.functional_call(model, ps, (ids,), {"use_cache": False}).logits
        return lm_loss(logits, ids)

    for _ in range(3):
        grads = torch.func.grad(dense_loss)(dense, ns["ids"])
        updates, state = tx.update(grads, state, dense)
        dense = fs.optim.apply_updates(dense, updates)
    for k, v in trained.named_parameters():
        _close(v.detach(), dense[k], f"README-trained {k}")
    return True


def test_readme_hf_section_trains_like_dense(world2):
    assert world2.run(readme_rank_fn, readme_code()) == [True, True]
