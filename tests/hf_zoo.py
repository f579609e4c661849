"""The transformers zoo (issue 37): every architecture of the installed ``transformers`` whose
config builds offline at a tiny size, for its main task head, generated from transformers' own
registry (``transformers.models.auto``), not a hand-picked list.

:func:`architectures` lists them, :func:`tiny_config` shrinks an architecture's default config
(hidden size, layers, heads, vocabulary, experts, images, audio; dropout off), :func:`build`
builds the seeded model, :func:`inputs` its batch. ``tools/zoo.py`` runs each architecture in
dp, tp and fsdp against dense (``tests/test_hf.py``'s training loop) and writes the table;
``tests/test_zoo.py`` runs a fixed sample.
"""

from __future__ import annotations

import inspect
import warnings

import torch

#: (task, transformers' auto-mapping of that head), in the order an architecture's main task
#: is chosen: the first mapping that lists it
TASKS = (
    ("causal", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("mlm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("image", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("audio", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
)

VOCAB, SEQ, BATCH, LABELS = 128, 8, 4, 5
IMAGE, AUDIO = 32, 1600  # image side; audio samples (wav2vec-like convolutions stride 320)

#: config attribute -> tiny value (set where the default config has the attribute)
_SIZES = {
    # widths
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "model_dim"), 32),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "d_ff",
            "n_inner",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "hidden_dim",
            "ffn_hidden_size",
            "mlp_dim",
        ),
        64,
    ),  # fmt: skip
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    "head_dim": 8,
    "d_kv": 8,
    "kv_channels": 8,
    # depth
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "n_layer",
            "num_layers",
            "n_layers",
            "num_decoder_layers",
            "encoder_layers",
            "decoder_layers",
        ),
        2,
    ),  # fmt: skip
    # heads
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "num_heads",
            "n_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
        ),
        4,
    ),  # fmt: skip
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads"), 2),
    # vocabulary and positions
    "vocab_size": VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len"), 64),
    # experts
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k"), 2),
    # multi-head latent attention, rotary sub-dims, low-rank projections
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rotary_dim"), 8),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("n_words", "vocab_size_per_layer_input"), VOCAB),
    "entity_vocab_size": 16,
    # images
    "image_size": IMAGE,
}

#: float config attributes containing these are set to 0: randomness in training (dropout,
#: layer drop, router jitter, stochastic masking) would differ between the runs compared
_ZERO = (
    "dropout", "pdrop", "_drop", "layerdrop", "drop_path", "jitter", "mask_time_prob",
    "mask_feature_prob",
)  # fmt: skip

#: a tiny model has at most this many parameters (a config whose sizes the attributes above
#: do not reach is not tiny: "not buildable")
MAX_PARAMS = 3_000_000


def architectures() -> dict[str, tuple[str, str]]:
    """``{model_type: (task, head class name)}`` of every architecture transformers' auto
    mappings give a head of one of :data:`TASKS`, the first such task each.

    Example:
        >>> archs = architectures()
        >>> archs["llama"], archs["albert"][0], archs["vit"][0]
        (('causal', 'LlamaForCausalLM'), 'mlm', 'image')
    """
    from transformers.models.auto import modeling_auto

    out: dict[str, tuple[str, str]] = {}
    for task, mapping in TASKS:
        for arch, cls in getattr(modeling_auto, mapping).items():
            if isinstance(cls, (tuple, list)):
                cls = cls[0]
            out.setdefault(arch, (task, cls))
    return dict(sorted(out.items()))


def _shrink(cfg, depth: int = 0) -> None:
    for key, value in list(vars(cfg).items()):
        if isinstance(value, bool):
            continue
        if hasattr(value, "to_dict") and hasattr(value, "model_type") and depth < 3:
            _shrink(value, depth + 1)  # text_config, vision_config, ...
        elif key in _SIZES and isinstance(value, int):
            setattr(cfg, key, _SIZES[key])
        elif any(z in key for z in _ZERO) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    for key in ("layer_types", "mlp_layer_types"):  # per-layer lists follow the depth
        value = getattr(cfg, key, None)
        n = getattr(cfg, "num_hidden_layers", None)
        if isinstance(value, list) and isinstance(n, int) and len(value) > n:
            setattr(cfg, key, value[:n])


#: what :func:`tiny_config`'s ``dropout`` sets: the dropout probabilities and a router's jitter
#: (not layer drop, drop path or masking: those draw plain per-layer scalars)
_DRAWN = ("dropout", "pdrop", "jitter")


def _with_dropout(cfg, p: float, depth: int = 0) -> None:
    for key, value in list(vars(cfg).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type") and depth < 3:
            _with_dropout(value, p, depth + 1)
        elif isinstance(value, float) and any(d in key for d in _DRAWN) and "layer" not in key:
            setattr(cfg, key, p)


def tiny_config(arch: str, dropout: float = 0.0):
    """The default config of ``arch`` shrunk to a tiny size (no download), or raise;
    ``dropout``: its dropout probabilities and router jitter set to it (else off).

    Example:
        >>> cfg = tiny_config("llama")
        >>> cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
        (32, 2, 128)
    """
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[arch]()
    _shrink(cfg)
    if dropout:
        _with_dropout(cfg, dropout)
    cfg.use_cache = False
    cfg.num_labels = LABELS
    if hasattr(cfg, "pad_token_id") and cfg.pad_token_id is not None:
        cfg.pad_token_id = min(cfg.pad_token_id, VOCAB - 1)
    return cfg


def build(arch: str, dropout: float = 0.0) -> torch.nn.Module:
    """The seeded tiny model of ``arch``'s main task head (every rank builds the same);
    ``dropout``: see :func:`tiny_config`."""
    import transformers

    task, cls = architectures()[arch]
    cfg = tiny_config(arch, dropout)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = getattr(transformers, cls)(cfg)
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"not tiny: {n} parameters at the shrunk config (> {MAX_PARAMS})")
    return model


def inputs(model: torch.nn.Module, task: str, batch: int = BATCH):
    """``(kwargs, labels)``: a padded batch of ids (causal, masked, seq2seq: a left-padded first
    row and a right-padded last row, labels -100 there), images or audio, for ``model``'s
    forward (arguments it does not take are left out)."""
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    accepted = set(inspect.signature(model.forward).parameters)
    if task in ("image", "audio"):
        name = getattr(model, "main_input_name", "pixel_values")
        if task == "image":
            vision = getattr(cfg, "vision_config", cfg)
            ch = getattr(vision, "num_channels", 3)
            x = torch.randn(batch, ch, IMAGE, IMAGE, generator=g)
        elif name == "input_features":
            bins = getattr(cfg, "num_mel_bins", 80)
            frames = 2 * getattr(cfg, "max_source_positions", 16)
            x = torch.randn(batch, bins, frames, generator=g)
        else:
            x = torch.randn(batch, AUDIO, generator=g)
        return {name: x}, torch.randint(0, LABELS, (batch,), generator=g)
    vocab = min(VOCAB, getattr(cfg, "vocab_size", VOCAB) or VOCAB)
    ids = torch.randint(2, vocab, (batch, SEQ), generator=g)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[0, :3] = 0
    mask[-1, -2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    kwargs = {"input_ids": ids, "attention_mask": mask}
    if task == "mlm":
        labels = labels.masked_fill(torch.arange(SEQ) % 3 != 0, -100)
    if task == "seq2seq":
        kwargs["decoder_input_ids"] = torch.randint(2, vocab, (batch, SEQ), generator=g)
        labels = torch.randint(2, vocab, (batch, SEQ), generator=g)
    kwargs = {k: v for k, v in kwargs.items() if k in accepted or k == "input_ids"}
    return kwargs, labels


#: module names a Megatron plan takes as column- and row-parallel when the model ships none
_COLUMN = (
    "q_proj", "k_proj", "v_proj", "query", "key", "value", "q", "k", "v", "gate_proj",
    "up_proj", "fc1", "wi", "wi_0", "wi_1", "w1", "w3", "c_fc", "dense_h_to_4h", "fc_in", "wqkv",
    "wq", "c_attn", "q_lin", "k_lin", "v_lin", "lin1", "Wq", "Wk", "Wv", "query_proj", "key_proj",
    "value_proj",
)  # fmt: skip
_ROW = (
    "o_proj", "out_proj", "o", "down_proj", "fc2", "wo", "w2", "dense_4h_to_h", "fc_out",
    "c_proj", "out_lin", "lin2",
)  # fmt: skip


def tp_plan(model: torch.nn.Module) -> tuple[dict, str]:
    """``(plan, which)``: the tensor-parallel plan ``model`` ships (``fs.nn.hf_tp_plan``,
    styles with no fshard equivalent replicated: ``unsupported="replicate"``), else a
    ``fs.nn.megatron_plan`` over its ``nn.Linear`` modules with the usual column / row names;
    ``which`` is ``"shipped"`` or ``"megatron"`` (``"none"``: no module has those names)."""
    import fshard as fs

    try:
        return fs.nn.hf_tp_plan(model, unsupported="replicate"), "shipped"
    except ValueError as e:
        if "ships no tensor-parallel plan" not in str(e):
            raise
    plan = tp_plan_by_names(model)
    return plan, "megatron" if plan else "none"


def tp_plan_by_names(model: torch.nn.Module) -> dict:
    """A ``fs.nn.megatron_plan`` over the ``nn.Linear`` modules of ``model`` whose names are
    the usual column (q/k/v, fc1, gate/up) and row (out-projection, fc2, down) names; ``{}``
    when none is."""
    import fshard as fs

    def linear_only(name: str) -> bool:  # megatron_plan refuses a glob matching mixed kinds
        mods = [m for n, m in model.named_modules() if n.rpartition(".")[2] == name]
        kinds = {"Conv1D" if type(m).__name__ == "Conv1D" else isinstance(m, torch.nn.Linear)
                 for m in mods}  # fmt: skip
        return kinds in ({True}, {"Conv1D"})

    column = [f"*.{n}" for n in _COLUMN if linear_only(n)]
    row = [f"*.{n}" for n in _ROW if linear_only(n)]
    if not column and not row:
        return {}
    return fs.nn.megatron_plan(column=column, row=row, model=model)


def _outcome(e: BaseException) -> tuple[str, str]:
    """``("wrong", ...)`` for a value or layout that differs from dense (an AssertionError of
    the comparison), else ``("refused", the error's type and first line, where it was raised)``."""
    import traceback

    if isinstance(e, AssertionError):
        return "wrong", str(e).splitlines()[0][:300] if str(e) else "AssertionError"
    frames = traceback.extract_tb(e.__traceback__)
    where = frames[-1].filename if frames else "?"
    if "/fshard/" in where:
        where = "fshard"
    elif "site-packages/" in where:
        where = where.rpartition("site-packages/")[2]
    else:  # the zoo's own checks
        where = where.rpartition("/")[2]
    first = (str(e).splitlines() or [""])[0][:300]
    return "refused", f"{type(e).__name__}: {first} [{where}]"


_MODELS: dict = {}


def zoo_rank_fn(arch: str, modes=("dp", "tp", "fsdp")) -> dict:
    """``{mode: (outcome, detail)}`` of ``arch`` on this rank (outcomes: ``equal``,
    ``refused``, ``wrong``; ``not buildable`` for every mode when the tiny model or its dense
    step fails). Each mode is ``tests/test_hf.py``'s ``train_like_dense``: 3 AdamW steps
    against dense."""
    import transformers

    from tests.test_hf import train_like_dense

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    task = architectures()[arch][0]
    try:
        model = build(arch)
        # BatchNorm's training statistics update buffers in place, which torch.func refuses
        # for the dense loop too (issue 37 item 8): those models train in eval mode
        norms = torch.nn.modules.batchnorm._BatchNorm
        model.train(not any(isinstance(m, norms) for m in model.modules()))
        kwargs, labels = inputs(model, task)
        import torch.nn.functional as F

        out = model(**kwargs).logits  # the dense step itself must run
        if task == "causal":
            out, want = out[:, :-1], labels[:, 1:]
        else:
            want = labels
        F.cross_entropy(out.reshape(-1, out.shape[-1]), want.reshape(-1)).backward()
        model.zero_grad(set_to_none=True)
    except Exception as e:
        return dict.fromkeys(modes, ("not buildable", _outcome(e)[1]))
    try:
        _dense_functorch_step(model, task, kwargs, labels)
    except Exception as e:  # fshard differentiates with torch.func: the dense loop compared
        # against is torch.func's, and a model torch.func refuses cannot run in any mode
        why = f"torch.func refuses the dense step: {_outcome(e)[1]}"
        return dict.fromkeys(modes, ("not buildable", why))
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    result = {}
    for mode in modes:
        import fshard as fs

        try:
            if mode == "tp":
                plan, which = tp_plan(model)
                if which == "none":
                    result[mode] = ("refused", "no tp plan: ships none, no usual Linear names")
                    continue
            else:
                plan, which = {}, ""
            train_like_dense(model, task, lambda m, plan=plan: plan, mode, kwargs, labels)
            result[mode] = ("equal", which)
        except Exception as e:
            result[mode] = _outcome(e)
        finally:
            fs.nn.load_params(model, initial)
        if result[mode][0] == "wrong":  # a wrong value shows in float64 too; rounding does not
            result[mode] = _in_float64(model, task, mode, plan, kwargs, labels, result[mode][1])
            fs.nn.load_params(model, initial)
            model.float()
    return result


def dropout_rank_fn(arch: str, modes=("dp", "tp"), p: float = 0.2) -> dict:
    """``{mode: (outcome, detail)}`` of ``arch`` in train mode with its dropouts and router
    jitter at ``p`` (:func:`tiny_config`): one fs.value_and_grad step in each mode (dp: the
    batch split, tp: :func:`tp_plan`) against dense torch.func on the same weights, each drawn
    from one seed (torch's, numpy's, Python's): fshard's draws are the dense ones whatever the
    layout (``fshard/ops/random.py``), so the loss and every gradient must agree. The batch
    is unpadded (a padded row's masked scores meet the attention's dropout: NaN in dense too);
    a dense forward runs first, as a model building modules in its first forward (BigBird) draws
    their initialisation there. ``equal``, ``wrong`` (relative differences), ``refused``."""
    import random

    import numpy as np
    import transformers

    import fshard as fs
    from tests.test_hf import _arch_loss

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    task = architectures()[arch][0]

    def seeded():
        torch.manual_seed(5)
        np.random.seed(5)
        random.seed(5)

    try:
        model = build(arch, dropout=p).train()
        kwargs, labels = inputs(model, task)
        if "attention_mask" in kwargs:
            kwargs["attention_mask"] = torch.ones_like(kwargs["attention_mask"])
        count = int((labels[:, 1:] if task == "causal" else labels).ne(-100).sum())
        dense = {k: v.detach().clone() for k, v in model.named_parameters()}

        def dense_loss(ps):
            out = torch.func.functional_call(model, ps, (), kwargs)
            return _arch_loss(task, out, labels, count)

        dense_loss(dense)
        seeded()
        want, want_value = torch.func.grad_and_value(dense_loss)(dense)
    except Exception as e:
        return dict.fromkeys(modes, ("not buildable", _outcome(e)[1]))
    result = {}
    for mode in modes:
        try:
            plan, which = tp_plan(model) if mode == "tp" else ({}, "")
            if which == "none":
                result[mode] = ("refused", "no tp plan: ships none, no usual Linear names")
                continue
            mesh = fs.Mesh.create((2,), ("tp" if mode == "tp" else "dp",))
            params = fs.nn.shard_params(model, mesh, plan)
            spec = fs.P() if mode == "tp" else fs.P("dp")
            sharded = {k: fs.shard(v, mesh, spec) for k, v in kwargs.items()}
            ys = fs.shard(labels, mesh, spec)

            def loss_fn(ps, sharded=sharded, ys=ys):
                out = fs.nn.functional_call(model, ps, (), sharded)
                return fs.gather(_arch_loss(task, out, ys, count))

            seeded()
            value, grads = fs.value_and_grad(loss_fn)(params)
            loss_diff = abs(float(value) - float(want_value)) / (abs(float(want_value)) + 1e-6)
            worst = max(
                float((fs.gather(grads[k]) - want[k]).abs().max())
                / (float(want[k].abs().max()) + 1e-6)
                for k in want
            )
            ok = loss_diff < 1e-4 and worst < 1e-3
            result[mode] = (
                ("equal", "") if ok else ("wrong", f"loss {loss_diff:.1e} grad {worst:.1e}")
            )
        except Exception as e:
            result[mode] = _outcome(e)
        finally:
            fs.nn.load_params(model, dense)
    return result


def _dense_functorch_step(model, task: str, kwargs: dict, labels) -> None:
    """The dense loss and gradient by ``torch.func`` (``tests/test_hf.py``'s dense loop):
    raises where torch.func refuses the model (an old-style ``autograd.Function``, which has no
    ``setup_context``; ``requires_grad_()`` or ``.data =`` inside the forward)."""
    from tests.test_hf import _arch_loss

    count = int((labels[:, 1:] if task == "causal" else labels).ne(-100).sum())
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(ps):
        out = torch.func.functional_call(model, ps, (), kwargs)
        return _arch_loss(task, out, labels, count)

    torch.func.grad(loss)(params)


def _in_float64(model, task, mode, plan, kwargs, labels, differs: str) -> tuple[str, str]:
    """The outcome of ``mode`` with the model and its floating inputs in float64: ``equal``
    (the float32 difference ``differs`` was rounding, which the detail says) or ``wrong``."""
    from tests.test_hf import train_like_dense

    model.double()
    wide = {k: v.double() if v.is_floating_point() else v for k, v in kwargs.items()}
    try:
        train_like_dense(model, task, lambda m: plan, mode, wide, labels)
    except AssertionError as e:
        return "wrong", f"{_outcome(e)[1]} (in float64; in float32: {differs})"
    except Exception as e:
        return "wrong", f"{differs} (float64 run: {_outcome(e)[1]})"
    return "equal", f"in float64; float32 rounding: {differs}"


#: ``tools/zoo.py --parallelize``'s configurations (4 ranks): every causal LM, and the MoE ones
#: (transformers experts modules) with ep too
PARALLELIZE_CONFIGS = (
    {"tp": 2, "dp_shard": 2},
    {"tp": 2, "pp": 2},
    {"tp": 2, "cp": 2},
    {"dp_shard": 2, "pp": 2},
    {"dp_shard": 2, "cp": 2},
)
PARALLELIZE_MOE_CONFIGS = ({"ep": 2, "tp": 2}, {"ep": 2, "dp_shard": 2})


def config_name(degrees: dict) -> str:
    """``{"tp": 2, "pp": 2}`` -> ``"tp2 pp2"``."""
    return " ".join(f"{k}{v}" for k, v in degrees.items())


def is_moe(model: torch.nn.Module) -> bool:
    """Whether ``model`` has transformers' experts modules (``fs.parallel.moe_experts``'s)."""
    from fshard.parallel.expert import _experts_modules

    return bool(_experts_modules(model))


def parallelize_refusals(arch: str, degrees: dict) -> list[tuple[str, str, int]]:
    """``(outcome, detail, collectives)`` of ``arch`` under ``degrees`` on each rank of the
    mesh, simulated in this process (``Mesh.simulate``: no ranks): :func:`parallelize_rank_fn`'s
    outcome with the same model and dense step (once: every rank builds the same), parallelize
    called on each rank's simulated mesh, and the collectives it issued before it refused
    (``fs.debug.comm_log``; a refusal must come before any). A configuration parallelize does
    not refuse does not come out ``refused`` here: its step runs on meta tensors and fails."""
    import transformers

    import fshard as fs

    transformers.logging.set_verbosity_error()
    dense = _dense_reference(arch)
    if isinstance(dense[0], str):
        return [(*dense, 0)]
    model, ids, want, want_value = dense
    out = []
    for rank in range(fs.parallel.ParallelDims(**degrees).world_size):
        with fs.debug.comm_log() as log:
            worst = _parallelize_worst(model, degrees, ids, want, want_value, simulate=rank)
        outcome, detail = worst if isinstance(worst, tuple) else ("ran", f"{worst:.1e}")
        out.append((outcome, detail, len(log)))
    return out


def _dense_reference(arch: str) -> tuple:
    """``(model, ids, dense gradients, dense loss)`` of ``arch``'s tiny causal LM (torch.func on
    its weights), or ``("not buildable", why)``."""
    try:
        model = build(arch)
        vocab = min(VOCAB, getattr(model.config, "vocab_size", VOCAB) or VOCAB)
        ids = torch.randint(2, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        dense = {k: p.detach() for k, p in model.named_parameters()}

        def dense_loss(ps):
            kwargs = {"labels": ids, "use_cache": False}
            return torch.func.functional_call(model, ps, (ids,), kwargs).loss

        want, want_value = torch.func.grad_and_value(dense_loss)(dense)
    except Exception as e:
        return "not buildable", _outcome(e)[1]
    return model, ids, want, want_value


def parallelize_rank_fn(arch: str, degrees: dict | None) -> tuple[str, str]:
    """``(outcome, detail)`` of ``fs.parallel.parallelize(model, mesh, ParallelDims(**degrees))``
    of ``arch``'s tiny causal LM on this rank: one fs.value_and_grad step against dense
    torch.func on the same weights (the loss and every gradient, relative to its largest
    entry; a difference over 1e-4 rerun in float64: ``wrong`` only there). ``equal``,
    ``refused`` (a ValueError / NotImplementedError fshard raises naming why), ``error`` (any
    other exception), ``wrong``; ``not buildable`` when the dense step fails. ``degrees=None``:
    ``("moe", "")`` or ``("dense", "")``, whether the model has experts (no run)."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    if degrees is None:
        try:
            return ("moe" if is_moe(build(arch)) else "dense"), ""
        except Exception as e:
            return "not buildable", _outcome(e)[1]
    dense = _dense_reference(arch)
    if isinstance(dense[0], str):
        return dense
    model, ids, want, want_value = dense

    def dense_loss(ps):
        kwargs = {"labels": ids, "use_cache": False}
        return torch.func.functional_call(model, ps, (ids,), kwargs).loss

    worst = _parallelize_worst(model, degrees, ids, want, want_value)
    if isinstance(worst, tuple):
        return worst
    if worst < 1e-4:
        return "equal", f"{worst:.1e}"
    try:
        model.double()
        # transformers' loss upcasts the logits with .float(): in float64 that rounds the loss
        # and every gradient to float32 (DiffLlama's tp x FSDP read 1.2e-7 "wrong" so; Llama's
        # reads 1e-7 as well); a float64 cross entropy for both sides
        model.loss_function = _cross_entropy
        dense = {k: p.detach() for k, p in model.named_parameters()}
        want, want_value = torch.func.grad_and_value(dense_loss)(dense)
    except Exception as e:  # grouped_mm has no float64: the float32 difference stands
        return "wrong", f"{worst:.1e} in float32 (no float64 dense step: {_outcome(e)[1]})"
    wide = _parallelize_worst(model, degrees, ids, want, want_value)
    if isinstance(wide, tuple):
        return "wrong", f"{worst:.1e} (float64 run: {wide[1]})"
    if wide < 1e-9:
        return "equal", f"in float64 {wide:.1e}; float32 rounding {worst:.1e}"
    return "wrong", f"{wide:.1e} in float64 ({worst:.1e} in float32)"


def _cross_entropy(logits, labels, vocab_size=None, **kwargs):
    """transformers' causal-LM loss (shifted labels, mean, -100 ignored) in the logits' dtype."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100
    )


def _parallelize_worst(model, degrees, ids, want, want_value, simulate: int | None = None):
    """The worst relative difference of parallelize's step from dense, or ``(outcome,
    detail)`` where it raised; ``simulate``: on that rank's simulated mesh (no ranks)."""
    import fshard as fs
    from tests.test_composition import _by_name

    try:
        dims = fs.parallel.ParallelDims(**degrees)
        mesh = dims.mesh() if simulate is None else dims.abstract_mesh().simulate(simulate)
        params, loss = fs.parallel.parallelize(model, mesh, dims)
        value, grads = fs.value_and_grad(loss)(params, {"input_ids": ids})
        stacked = [k for k, v in grads.items() if isinstance(v, dict)]  # pp: the layers
        got = _by_name(grads, dims, *stacked[:1])
    except (ValueError, NotImplementedError) as e:
        detail = _outcome(e)[1]  # fshard's own validation names the model and why
        return ("refused" if detail.endswith("[fshard]") else "error"), detail
    except Exception as e:
        return "error", _outcome(e)[1]
    worst = abs(float(value) - float(want_value)) / (abs(float(want_value)) + 1e-6)
    missing = set(want) ^ set(got)
    if missing:
        return "wrong", f"gradients named differently: {sorted(missing)[:3]}"
    for k, g in got.items():
        scale = float(want[k].abs().max()) + 1e-6
        worst = max(worst, float((g.to(want[k].dtype) - want[k]).abs().max()) / scale)
    return worst
