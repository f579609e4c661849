"""fs.nn.hf_tp_plan: the tensor-parallel plans transformers ships, as fshard plans (issue 29
item 3), against the hand-written Megatron plans and dense forwards."""

import warnings

import pytest
import torch

import fshard as fs

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8


def _llama(cls="LlamaForCausalLM", cfg="LlamaConfig", **extra):
    torch.manual_seed(0)
    config = getattr(transformers, cfg)(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, **extra,
    )  # fmt: skip
    return getattr(transformers, cls)(config)


def test_llama_plan_is_the_megatron_plan():
    model = _llama()
    want = fs.nn.megatron_plan(
        column=["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj",
                "model.layers.*.self_attn.v_proj", "model.layers.*.mlp.gate_proj",
                "model.layers.*.mlp.up_proj", "lm_head"],
        row=["model.layers.*.self_attn.o_proj", "model.layers.*.mlp.down_proj"],
        # transformers >= 5 also ships the embedding ("embedding_rowwise"); older ones do not
        vocab=["model.embed_tokens"] if "model.embed_tokens" in model.tp_plan else [],
        model=model,
    )  # fmt: skip
    assert fs.nn.hf_tp_plan(model) == want


class _Planned(torch.nn.Module):
    """A module shipping a plan with a style fshard has no equivalent of."""

    tp_plan = {"proj": "sequence_parallel", "out": "rowwise"}

    def __init__(self):
        super().__init__()
        self.proj, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)


def test_unsupported_styles_are_named_or_replicated():
    model = _Planned()
    with pytest.raises(ValueError, match="'proj': 'sequence_parallel'.*unsupported='replicate'"):
        fs.nn.hf_tp_plan(model)
    plan = fs.nn.hf_tp_plan(model, unsupported="replicate")
    assert "proj.weight" not in plan and plan["out.weight"] == fs.P(None, "tp")
    with pytest.raises(ValueError, match="ships no tensor-parallel plan"):
        fs.nn.hf_tp_plan(torch.nn.Linear(2, 2))


def test_mixtral_experts_split_over_tp():
    """Mixtral's stacked experts (``packed_colwise`` gate_up_proj, ``rowwise`` down_proj, the
    ``moe_tp_experts`` module): each expert's [gate | up] halves split on I (a Parts of two
    halves), down split on I; the experts module's output sum is moe_experts's."""
    model = _llama("MixtralForCausalLM", "MixtralConfig", num_local_experts=4)
    plan = fs.nn.hf_tp_plan(model)
    i = model.config.intermediate_size
    for layer in range(model.config.num_hidden_layers):
        pre = f"model.layers.{layer}.mlp.experts"
        assert plan[f"{pre}.gate_up_proj"] == fs.Parts(fs.P(None, "tp", None), 1, (i, i))
        assert plan[f"{pre}.down_proj"] == fs.P(None, None, "tp")
        assert pre not in plan
    assert plan["model.layers.*.self_attn.q_proj.weight"] == fs.P("tp", None)
    # Qwen3-MoE with every layer sparse: the plan's dense-MLP entries (mlp.gate_proj ...) name
    # no module or param of this configuration and are left out (they were refused as
    # "a parameter, not a module")
    qwen = _llama(
        "Qwen3MoeForCausalLM", "Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8, head_dim=8,
    )  # fmt: skip
    plan = fs.nn.hf_tp_plan(qwen)
    assert not any(k.startswith("model.layers.*.mlp.") for k in plan)
    assert plan["model.layers.0.mlp.experts.down_proj"] == fs.P(None, None, "tp")


def hf_plan_forward_rank_fn(cls, cfg, extra):
    mesh = fs.Mesh.create((2,), ("tp",))
    model = _llama(cls, cfg, **extra)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    dense = model(ids).logits
    params = fs.nn.shard_params(model, mesh, fs.nn.hf_tp_plan(model))
    sharded = {k: v.spec for k, v in params.items() if v.spec != fs.P()}
    x = fs.shard(ids, mesh, fs.P())
    out = fs.nn.functional_call(model, params, (x,)).logits
    loss = lambda ps: fs.gather(fs.nn.functional_call(model, ps, (x,)).logits.pow(2).mean())  # noqa: E731
    grads = {k: fs.gather(g) for k, g in fs.grad(loss)(params).items()}
    return dense, fs.gather(out), len(sharded), grads


def _dense_grads(cls, cfg, extra):
    model = _llama(cls, cfg, **extra)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model(ids).logits.pow(2).mean().backward()
    return {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize(
    "cls, cfg, extra",
    [
        ("LlamaForCausalLM", "LlamaConfig", {}),
        ("Qwen2ForCausalLM", "Qwen2Config", {}),  # q/k/v biases
        # MoE experts split over tp (issue 36; replicated before), run by transformers' own
        # experts code in the global view
        ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4}),
        # issue 37 item 5: the plan's lm_head entry names the embedding's weight, which
        # named_parameters() lists once (shard_params refused the entry as matching nothing)
        ("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": True}),
        # issue 37 item 6: q/k norms are "replicated_with_grad_allreduce" (refused before)
        ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 8}),
    ],
)
def test_hf_plan_forward_equals_dense(world2, cls, cfg, extra):
    want = _dense_grads(cls, cfg, extra)
    for dense, got, n_sharded, grads in world2.run(hf_plan_forward_rank_fn, cls, cfg, extra):
        assert n_sharded >= 10  # q, k, v, o, (gate, up, down), embed, lm_head
        torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-5)
        assert set(grads) == set(want)
        for k, g in grads.items():
            scale = want[k].abs().max().item()
            torch.testing.assert_close(g, want[k], rtol=1e-4, atol=1e-6 + 1e-4 * scale, msg=k)


def test_tied_parameter_names_must_agree():
    """A plan naming both names of a tied parameter with different specs is refused (which
    one it meant is unknowable), before anything is sharded."""
    torch.manual_seed(0)
    model = _llama(tie_word_embeddings=True)
    mesh = fs.Mesh.abstract((2,), ("tp",))
    plan = {"lm_head.weight": fs.P("tp", None), "model.embed_tokens.weight": fs.P(None, "tp")}
    with pytest.raises(ValueError, match="one tied parameter.*different specs"):
        fs.nn.shard_params(model, mesh, plan)


def meta_load_rank_fn():
    """Rank 0 builds the model with weights; rank 1 on the meta device (too big for it)."""
    mesh = fs.Mesh.create((2,), ("tp",))
    if mesh.rank == 0:
        model = _llama()
    else:
        with torch.device("meta"):
            model = _llama()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    params = fs.nn.shard_params(model, mesh, fs.nn.hf_tp_plan(model), src=0)
    out = fs.nn.functional_call(model, params, (fs.shard(ids, mesh, fs.P()),)).logits
    return fs.gather(out)


def test_shard_params_from_one_rank_with_meta_modules_elsewhere(world2):
    """Issue 29 item 3: rank 0 loads, the others build on meta, shard_params(..., src=0): the
    forward failed on rank 1 at the rotary inv_freq (a non-persistent buffer, never sent)."""
    model = _llama()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    dense = model(ids).logits
    for got in world2.run(meta_load_rank_fn):
        torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-5)


def one_rank_rank_fn():
    import fshard.array as array_mod

    mesh = fs.Mesh.create((1,), ("tp",))
    model = _llama()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    params = fs.nn.shard_params(model, mesh, fs.nn.hf_tp_plan(model))
    calls = []
    dispatch = array_mod._DISPATCH
    array_mod._DISPATCH = lambda *a: calls.append(a[0]) or dispatch(*a)
    try:

        def loss_fn(ps):
            out = fs.nn.functional_call(model, ps, (fs.shard(ids, mesh, fs.P()),)).logits
            return out, torch.nn.functional.cross_entropy(out.local.flatten(0, 1), ids.flatten())

        out, _ = loss_fn(params)
        n_forward = len(calls)
        loss, grads = fs.value_and_grad(lambda ps: loss_fn(ps)[1])(params)
    finally:
        array_mod._DISPATCH = dispatch
    return out.spec, fs.gather(out), n_forward, loss, {k: fs.gather(g) for k, g in grads.items()}


def test_one_rank_mesh_runs_the_module_on_plain_tensors(world1):
    """Issue 27 (a one-GPU step as fast as plain torch): on a one-rank mesh functional_call
    runs the module on the local tensors (no per-op dispatch), wraps its tensors as replicated
    ShardedArrays, and values and gradients equal dense torch."""
    model = _llama()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    dense = {k: v.detach() for k, v in model.named_parameters()}

    def dense_loss(ps):
        out = torch.func.functional_call(model, ps, (ids,)).logits
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), ids.flatten())

    dgrads, dloss = torch.func.grad_and_value(dense_loss)(dense)
    (spec, logits, n_dispatched, loss, grads) = world1.run(one_rank_rank_fn)[0]
    assert spec == fs.P() and n_dispatched == 0
    torch.testing.assert_close(logits, model(ids).logits)
    torch.testing.assert_close(loss, dloss)
    for k in dgrads:
        torch.testing.assert_close(grads[k], dgrads[k], rtol=1e-5, atol=1e-6)


def _plan_warnings(model, column, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = fs.nn.megatron_plan(column=column, model=model, **kw)
    return plan, [str(w.message) for w in caught if "megatron_plan" in str(w.message)]


def test_fused_projections_are_split_per_part():
    """Issue 21 item 7: a fused projection whose parts differ in size (GQA ``[q | k | v]``,
    multi-query, ``[gate | up]``) and GPT-2's ``Conv1D`` ``c_attn`` get a per-part layout with
    the parts read from the config, weight and bias alike, with no warning; a head-major fused
    qkv that the model's own plan declares colwise (GPT-NeoX) stays a contiguous split; an
    ``nn.Linear`` of 3 x in features whose order nothing declares warns."""
    phi3 = _llama("Phi3ForCausalLM", "Phi3Config", pad_token_id=0)  # 4 heads of 8, 2 kv heads
    plan, got = _plan_warnings(phi3, ["*.qkv_proj", "*.gate_up_proj", "lm_head"])
    assert not got, got
    assert plan["*.qkv_proj.weight"] == fs.Parts(fs.P("tp", None), 0, (32, 16, 16))
    assert plan["*.gate_up_proj.weight"] == fs.Parts(fs.P("tp", None), 0, (64, 64))
    assert plan["lm_head.weight"] == fs.P("tp", None)
    torch.manual_seed(0)
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=SEQ))  # fmt: skip
    plan, got = _plan_warnings(neox, ["*.query_key_value", "*.dense_h_to_4h", "lm_head"])
    assert not got and plan["*.query_key_value.weight"] == fs.P("tp", None)
    assert plan["*.query_key_value.bias"] == fs.P("tp")
    falcon = transformers.FalconForCausalLM(transformers.FalconConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=VOCAB,
        multi_query=True))  # fmt: skip
    plan, got = _plan_warnings(falcon, ["*.query_key_value"])
    assert not got and plan["*.query_key_value.weight"] == fs.Parts(fs.P("tp", None), 0, (32, 8, 8))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ))  # fmt: skip
    plan, got = _plan_warnings(gpt2, ["*.attn.c_attn"])
    assert not got
    assert plan["*.attn.c_attn.weight"] == fs.Parts(fs.P(None, "tp"), 1, (32, 32, 32))
    assert plan["*.attn.c_attn.bias"] == fs.Parts(fs.P("tp"), 0, (32, 32, 32))
    llama = _llama()
    _, got = _plan_warnings(llama, ["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "lm_head"])
    assert not got, got
    moe = _llama("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=4, moe_intermediate_size=16,
                 shared_expert_intermediate_size=32)  # fmt: skip
    _, got = _plan_warnings(moe, ["*.shared_expert.gate_proj", "*.shared_expert.up_proj"])
    assert not got, got
    qkv = torch.nn.Sequential(torch.nn.Linear(8, 24))  # 3 x in, no config: order unknown
    plan, got = _plan_warnings(qkv, ["0"])
    assert len(got) == 1 and "head-major" in got[0] and "fs.Parts" in got[0], got
    assert plan["0.weight"] == fs.P("tp", None)


def test_conv_layers_split_on_channels():
    """Issue 21 item 7: nn.Conv1d/2d are column-parallel on out-channels (weight dim 0, bias)
    and row-parallel on in-channels (weight dim 1, output reduced after); grouped convs and
    transposed convs are refused with the fix."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.Conv2d(8, 4, 1), torch.nn.Conv1d(4, 4, 2, groups=2)
    )
    plan = fs.nn.megatron_plan(column=["0"], row=["1"], model=net)
    assert plan == {
        "0.weight": fs.P("tp", None), "0.bias": fs.P("tp"), "1.weight": fs.P(None, "tp"),
        "1": fs.nn.Output(fs.P()),
    }  # fmt: skip
    with pytest.raises(TypeError, match="groups=2.*by hand"):
        fs.nn.megatron_plan(column=["2"], model=net)
    with pytest.raises(TypeError, match="ConvTranspose2d"):
        fs.nn.megatron_plan(row=["0"], model=torch.nn.Sequential(torch.nn.ConvTranspose2d(2, 2, 1)))
