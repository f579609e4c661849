"""torchtitan's own model code (issue 37 item 4): its llama3, qwen3 (tied head), qwen3 MoE and
deepseek-v3 (MLA + MoE) from torchtitan 0.3.0, tiny (2 layers, built with torchtitan's own
layer builders), in dp, dp with an odd batch, tp and fsdp against dense: ``tests/test_hf.py``'s
``train_like_dense`` (3 AdamW steps; loss, every gradient and its layout, trained weights).
The MoE models run with ``functional_call(..., mutable=True)`` (their load-balancing counter is
a buffer the forward updates in place, item 8) and a registered rule for torchtitan's custom
``deterministic_scatter_add`` (the fix fshard's refusal names).

torchtitan installs with ``pip install --no-deps torchtitan==0.3.0 spmd-types tyro
docstring-parser typeguard triton`` (its model code imports them); without it the file skips.
Attention is torchtitan's ``ScaledDotProductAttention`` (causal): its language-model backends
(flex, varlen) need a ``BlockMask`` or CUDA.
"""

from typing import NamedTuple

import pytest
import torch

import fshard as fs

pytest.importorskip("torchtitan.models.deepseek_v3.model", exc_type=ImportError)

from tests.hf_zoo import tp_plan_by_names  # noqa: E402
from tests.test_hf import ARTOL, train_like_dense  # noqa: E402

VOCAB, SEQ, BATCH = 128, 8, 4
BF16_RTOL = 2e-2  # a few bfloat16 ulps (2^-8), relative to each gradient's largest entry


class Logits(NamedTuple):
    logits: torch.Tensor


class LM(torch.nn.Module):
    """A torchtitan decoder whose output reads like a transformers one (``.logits``)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return Logits(self.model(input_ids))


def _sdpa(cfg):
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def _llama3():
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    dim, heads = 32, 4
    return Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=2, dim=dim, n_heads=heads, n_kv_heads=2, hidden_dim=64, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=10000.0),
        ),
    )  # fmt: skip


def _qwen3(moe: bool):
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        Qwen3Model,
        _build_qwen3_layers,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    dim, head_dim = 32, 8
    common = dict(
        n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, attn_backend="flex",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=10000.0),
    )  # fmt: skip
    if moe:
        layers = _build_qwen3_moe_layers(
            **common, moe_hidden_dim=16, num_experts=4, top_k=2, moe_comm_backend="standard"
        )
    else:
        layers = _build_qwen3_layers(**common, hidden_dim=64)
    return Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=not moe,  # qwen3's small dense models tie the head
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=layers,
    )


def _deepseek_v3():
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers

    dim = 32
    layers = _build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mscale=0.70,
        dense_hidden_dim=64, moe_hidden_dim=16, num_experts=4, num_shared_experts=1,
        router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0),
    )  # fmt: skip
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=layers,
    )


MODELS = {
    "llama3": _llama3,
    "qwen3": lambda: _qwen3(moe=False),
    "qwen3_moe": lambda: _qwen3(moe=True),
    "deepseek_v3": _deepseek_v3,
}
JOBS = ("dp", "dp-odd", "tp", "fsdp")


def build(name: str) -> LM:
    torch.manual_seed(0)
    model = _sdpa(MODELS[name]()).build()
    model.init_states()
    return LM(model)


_BUILT: dict = {}


def titan_rank_fn(name: str, job: str):
    """``None`` (equal to dense) or the error text of this rank."""
    import traceback
    import warnings

    warnings.filterwarnings("ignore")
    if name not in _BUILT:
        _BUILT[name] = build(name)
    model = _BUILT[name]
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    mode, *flags = job.split("-")
    batch = BATCH - 1 if "odd" in flags else BATCH
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))
    moe = any("tokens_per_expert" in k for k in buffers)
    if moe:
        _register_scatter_add_rule()
    try:
        # torchtitan's experts compute in bfloat16 (x.bfloat16() @ w.bfloat16()): a rank's rows
        # summed apart (fsdp) round differently from all rows at once, by a few bfloat16 ulps
        # (2^-8 relative) of the expert weights' gradients; everything else is float32
        rtol = BF16_RTOL if moe else ARTOL
        train_like_dense(
            model, "causal", tp_plan_by_names, mode, {"input_ids": ids}, ids.clone(), moe, rtol
        )
        return None
    except Exception as e:
        return "".join(traceback.format_exception(e))[-3000:]
    finally:
        fs.nn.load_params(model, initial)
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])


CONFIGS = [(m, j) for m in MODELS for j in JOBS]


@pytest.mark.parametrize("name, job", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_torchtitan_model_matches_dense(world2, name, job):
    errors = world2.run(titan_rank_fn, name, job)
    assert errors == [None, None], f"{name} {job}:\n{errors[0] or errors[1]}"


def _register_scatter_add_rule():
    """torchtitan's MoE combines the experts' outputs with its custom op
    ``torchtitan::deterministic_scatter_add`` (``out.scatter_add(0, index, src)``), which
    fshard has no rule for (a clear ``NotImplementedError`` naming ``fs.ops.register_rule``):
    the user's fix, a rule running it on whole values."""
    from torchtitan.ops.scatter_add import deterministic_scatter_add

    def rule(op, args, kwargs):
        out = args[0]
        whole = fs.P(*[None] * len(out.shape))
        return fs.ops.OpSharding(in_specs=(whole,) * 3, out=out.with_spec(whole), local=op)

    for op in (deterministic_scatter_add, torch.ops.torchtitan.deterministic_scatter_add.default):
        fs.ops.register_rule(op, rule)


def titan_state_rank_fn(name: str, mode: str, batch: int):
    """One step of ``name`` with ``fs.nn.functional_call(..., mutable=True)``: the loss, the
    gradients and the buffers the forward updated (the MoE load-balancing counters)."""
    _register_scatter_add_rule()
    mesh = fs.Mesh.create((2,), (mode,))
    model = build(name)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))
    plan = tp_plan_by_names(model) if mode == "tp" else {}
    params = fs.nn.shard_params(model, mesh, plan)
    x = fs.shard(ids, mesh, fs.P("dp") if mode == "dp" else fs.P())

    def loss_fn(ps):
        out, state = fs.nn.functional_call(model, ps, (x,), mutable=True)
        logits = out.logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        return fs.gather(loss), state

    (loss, state), grads = fs.value_and_grad(loss_fn, has_aux=True)(params)
    before = {k: v.detach().clone() for k, v in model.named_buffers()}
    return (
        loss,
        {k: fs.gather(g) for k, g in grads.items()},
        {k: (fs.gather(v), v.spec) for k, v in state.items()},
        before,
    )


def _dense_state_step(name: str, batch: int):
    model = build(name)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    logits = model(ids).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    loss.backward()
    after = dict(model.named_buffers())
    changed = {k for k in after if not torch.equal(after[k], buffers[k])}
    return loss, {k: p.grad for k, p in model.named_parameters()}, after, changed


@pytest.mark.parametrize("mode, batch", [("dp", BATCH), ("dp", BATCH - 1), ("tp", BATCH)])
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_forward_updated_buffers_come_back(world2, name, mode, batch):
    """Issue 37 item 8: torchtitan's MoE layers count the tokens each expert got in a buffer
    (``self.tokens_per_expert.add_(counts)``), which was refused (an in-place update of the
    module's plain buffer by a sharded value). With ``mutable=True`` the buffers go in as fresh
    replicated values, the update rebinds them, and the call returns them: the counts over the
    whole batch, as the dense module counts, with the loss and gradients equal to dense; the
    module's own buffers are untouched."""
    loss, grads, after, changed = _dense_state_step(name, batch)
    assert any("tokens_per_expert" in k for k in changed), changed
    for got_loss, got_grads, state, before in world2.run(titan_state_rank_fn, name, mode, batch):
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
        for k, g in got_grads.items():
            scale = grads[k].abs().max().item()
            torch.testing.assert_close(g, grads[k], rtol=1e-4, atol=1e-6 + 1e-4 * scale, msg=k)
        assert set(state) == set(after)
        for k, (value, spec) in state.items():
            assert spec == fs.P(), k
            torch.testing.assert_close(value, after[k], msg=k)
        for k in changed:  # the module's own buffers keep their values
            assert not torch.equal(before[k], after[k]), k
