"""fs.hf_checkpoint (issue 39 items 2-4): sharded params out as a Hugging Face safetensors
directory that transformers' ``from_pretrained`` loads unchanged, and ``save_pretrained``
directories read straight into tp / fsdp / 2-D / per-part layouts; a load that no rank could
hold whole; bad directories refused before anything is loaded.

Oracles: the dense model in the test process (transformers' own loader and forward), exact
tensors (``torch.equal``), the layouts of ``like``."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import fshard as fs

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 128, 8


def _config(kind: str):
    transformers.logging.set_verbosity_error()
    if kind == "gpt2":
        return transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
        tie_word_embeddings=kind == "llama-tied",
    )  # fmt: skip


def _model(kind: str, seed: int):
    torch.manual_seed(seed)
    cfg = _config(kind)
    cls = transformers.GPT2LMHeadModel if kind == "gpt2" else transformers.LlamaForCausalLM
    return cls(cfg).eval()


def _ids():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))


def _tp_plan(kind, model):
    if kind == "gpt2":  # the fused c_attn [q|k|v] gets a per-part (fs.Parts) layout
        return fs.nn.megatron_plan(
            column=["*.attn.c_attn", "*.mlp.c_fc"], row=["*.mlp.c_proj", "*.attn.c_proj"],
            vocab=["transformer.wte"], model=model,
        )  # fmt: skip
    return fs.nn.megatron_plan(
        column=["*.q_proj", "*.k_proj", "*.v_proj", "*.gate_proj", "*.up_proj", "lm_head"],
        row=["*.o_proj", "*.down_proj"], vocab=["model.embed_tokens"], model=model,
    )  # fmt: skip


# -- out: trained under tp / fsdp, exported, loaded by transformers ----------------------------


def train_and_export(kind, mode, path):
    """Two SGD steps of ``mode`` on the tiny model, exported sharded; returns the trained
    values gathered (the oracle; gathered only here, after the export) and the layouts."""
    model = _model(kind, 0)
    axis = "tp" if mode == "tp" else "dp"
    mesh = fs.Mesh.create((2,), (axis,))
    plan = _tp_plan(kind, model) if mode == "tp" else fs.nn.fsdp_plan(model, mesh)
    params = fs.nn.shard_params(model, mesh, plan)
    ids = _ids()

    if mode == "tp":
        x = fs.shard(ids, mesh, fs.P())

        def loss_fn(ps):
            logits = fs.nn.functional_call(model, ps, (x,), {"use_cache": False}).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
            return fs.gather(loss)

    else:
        local = fs.shard(ids, mesh, fs.P("dp")).local

        def loss_fn(ps):
            out = fs.nn.fsdp_call(model, ps, (local,), {"use_cache": False}, mesh=mesh)
            loss = F.cross_entropy(
                out.logits[:, :-1].reshape(-1, VOCAB), local[:, 1:].reshape(-1), reduction="sum"
            )
            return fs.lax.psum(loss, "dp", mesh=mesh)

    tx = fs.optim.sgd(0.5)
    state = tx.init(params)
    for _ in range(2):
        _, grads = fs.value_and_grad(loss_fn)(params)
        params, state = fs.optim.step(tx, grads, state, params)
    fs.hf_checkpoint.save(
        path, fs.nn.state_dict(model, params), max_shard_size=20_000, config=model.config
    )
    kinds = sorted({type(v.layout).__name__ for v in params.values()})
    return {k: fs.gather(v) for k, v in params.items()}, kinds


@pytest.mark.parametrize("kind, mode", [("llama", "tp"), ("llama-tied", "fsdp"), ("gpt2", "tp")])
def test_trained_sharded_export_loads_in_transformers(world2, tmp_path, kind, mode):
    path = str(tmp_path / "hf")
    (trained, kinds), _ = world2.run(train_and_export, kind, mode, path)
    if kind == "gpt2":
        assert "PartsLayout" in kinds, kinds  # the fused qkv: two blocks per rank
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1, files
    assert sorted(os.listdir(path)) == sorted(
        [*files, "model.safetensors.index.json", "config.json"]
    )
    untrained = _model(kind, 0)
    model = type(untrained).from_pretrained(path).eval()
    got = dict(model.named_parameters())
    assert set(got) == set(trained), set(got) ^ set(trained)
    for k, v in trained.items():
        assert (
            not torch.equal(v, dict(untrained.named_parameters())[k])
            or "norm" in k
            or "ln" in k
            or "bias" in k
        )
        assert torch.equal(got[k].detach(), v), k  # bit-exact
    if kind == "llama-tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert "lm_head.weight" not in index["weight_map"]
    dense = _model(kind, 0)
    with torch.no_grad():
        want = torch.func.functional_call(dense, trained, (_ids(),)).logits
        logits = model(_ids()).logits
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-6)


# -- in: a save_pretrained directory into tp / fsdp / 2-D / per-part layouts ---------------------


def _like(kind, plan_kind, mesh, model):
    if plan_kind == "tp":
        params = fs.nn.shard_params(model, mesh, _tp_plan(kind, model))
    elif plan_kind == "fsdp":
        params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
    else:  # 2-D: tp over "tp" and the other dim over "dp"; gate_proj per part
        layouts = {}
        for k, p in model.named_parameters():
            spec = fs.P("dp", "tp") if p.ndim == 2 else fs.P("tp")
            if k.endswith("gate_proj.weight"):
                spec = fs.Parts(fs.P(("dp", "tp"), None), 0, (24, p.shape[0] - 24))
            layouts[k] = fs.Layout.of(mesh, spec, tuple(p.shape), p.dtype)
        return layouts
    return {k: v.layout for k, v in params.items()}


def load_pretrained(kind, plan_kind, path):
    world = torch.distributed.get_world_size()
    shape, names = (
        ((2, 2), ("dp", "tp")) if world == 4 else ((2,), ("tp" if plan_kind == "tp" else "dp",))
    )
    mesh = fs.Mesh.create(shape, names)
    model = _model(kind, 1)  # other weights than the saved ones: the load must replace them
    like = _like(kind, plan_kind, mesh, model)
    out = fs.hf_checkpoint.load(path, like)
    assert {k: v.layout for k, v in out.items()} == like
    values = {k: fs.gather(v) for k, v in out.items()}
    if kind == "llama-tied":  # like from fs.nn.state_dict: the head under its own name too
        params = fs.nn.shard_params(model, mesh, fs.nn.fsdp_plan(model, mesh))
        tied = fs.hf_checkpoint.load(path, fs.nn.state_dict(model, params))
        assert tied["lm_head.weight"] is tied["model.embed_tokens.weight"]
        assert fs.gather(tied["lm_head.weight"]).equal(values["model.embed_tokens.weight"])
    logits = None
    if plan_kind == "tp":
        x = fs.shard(_ids(), mesh, fs.P())
        with torch.no_grad():
            logits = fs.gather(fs.nn.functional_call(model, out, (x,), {"use_cache": False}).logits)
    return values, logits


@pytest.mark.parametrize("plan_kind", ["tp", "fsdp", "2d"])
def test_save_pretrained_checkpoint_loads_into_plans(world2, world4, tmp_path, plan_kind):
    kind = "llama-tied" if plan_kind == "fsdp" else "llama"
    dense = _model(kind, 0)
    dense.save_pretrained(str(tmp_path / "hf"), max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    world = world4 if plan_kind == "2d" else world2
    want = dict(dense.named_parameters())
    for values, logits in world.run(load_pretrained, kind, plan_kind, str(tmp_path / "hf")):
        assert set(values) == set(want)
        for k, v in values.items():
            assert torch.equal(v, want[k].detach()), k
        if logits is not None:
            with torch.no_grad():
                torch.testing.assert_close(logits, dense(_ids()).logits, rtol=1e-5, atol=1e-6)


# -- bad input: a clear error naming the file and the parameter, nothing half-way --------------


def save_small(path, value, die_on_rank=None):
    mesh = fs.Mesh.create((2,), ("x",))
    params = {
        f"layers.{i}.weight": fs.shard(torch.full((4, 6), float(value + i)), mesh, fs.P(None, "x"))
        for i in range(3)
    }
    if die_on_rank is not None:

        def hook(stage):
            if stage == "written" and torch.distributed.get_rank() == die_on_rank:
                os._exit(17)

        fs.checkpoint._test_hook = hook
    try:
        fs.hf_checkpoint.save(path, params, max_shard_size=100)  # one file per parameter
    finally:
        fs.checkpoint._test_hook = None


def load_small(path, like_kind=None):
    mesh = fs.Mesh.create((2,), ("x",))
    like = {f"layers.{i}.weight": fs.Layout(mesh, fs.P("x"), (4, 6)) for i in range(3)}
    if like_kind == "shape":
        like["layers.1.weight"] = fs.Layout(mesh, fs.P("x"), (4, 7))
    elif like_kind == "dtype":
        like["layers.2.weight"] = fs.Layout(mesh, fs.P("x"), (4, 6), torch.bfloat16)
    elif like_kind == "extra":
        like["layers.3.weight"] = fs.Layout(mesh, fs.P("x"), (4, 6))
    try:
        out = fs.hf_checkpoint.load(path, like)
    except fs.checkpoint.CheckpointError as e:
        return str(e)
    return {k: fs.gather(v) for k, v in out.items()}


FILE1 = "model-00002-of-00003.safetensors"  # holds layers.1.weight


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("missing_file", f"parameter 'layers.1.weight': file '{FILE1}' is missing"),
        (
            "not_in_index",
            "parameter 'layers.2.weight' is missing from model.safetensors.index.json",
        ),
        (
            "not_in_file",
            f"parameter 'layers.0.weight': model.safetensors.index.json names file '{FILE1}', which does not hold it",
        ),
        (
            "shape",
            f"parameter 'layers.1.weight' in file '{FILE1}': shape (4, 6) dtype torch.float32, but the plan expects shape (4, 7) dtype torch.float32",
        ),
        (
            "dtype",
            "parameter 'layers.2.weight' in file 'model-00003-of-00003.safetensors': shape (4, 6) dtype torch.float32, but the plan expects shape (4, 6) dtype torch.bfloat16",
        ),
        ("truncated", f"parameter 'layers.1.weight': file '{FILE1}' is truncated"),
        ("garbage", f"parameter 'layers.1.weight': file '{FILE1}' is not a valid safetensors file"),
        ("no_index", "holds neither model.safetensors.index.json nor model.safetensors"),
        ("extra", "parameter 'layers.3.weight' is missing from model.safetensors.index.json"),
    ],
)
def test_bad_directory_clear_error_before_loading(world2, tmp_path, damage, needle):
    path = str(tmp_path / "hf")
    world2.run(save_small, path, 1)
    index_file = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    if damage == "missing_file":
        os.remove(os.path.join(path, FILE1))
    elif damage == "not_in_index":
        del index["weight_map"]["layers.2.weight"]
    elif damage == "not_in_file":
        index["weight_map"]["layers.0.weight"] = FILE1
    elif damage == "truncated":  # an interrupted write (by another tool: ours never commits one)
        full = os.path.join(path, FILE1)
        os.truncate(full, os.path.getsize(full) - 10)
    elif damage == "garbage":
        (tmp_path / "hf" / FILE1).write_bytes(b"\xff" * 64)
    elif damage == "no_index":
        os.remove(index_file)
    index_file.exists() and index_file.write_text(json.dumps(index))
    kind = damage if damage in ("shape", "dtype", "extra") else None
    errors = world2.run(load_small, path, kind)
    assert isinstance(errors[0], str) and needle in errors[0], errors[0]
    assert errors[0] == errors[1]


def test_interrupted_export_keeps_the_previous_one(world2, tmp_path):
    path = str(tmp_path / "hf")
    world2.run(save_small, path, 1)
    before = sorted(os.listdir(path))
    with pytest.raises(fs.launch.RankError) as info:
        world2.run(save_small, path, 5, 1)  # rank 1 dies after writing its blocks
    assert (info.value.rank, info.value.exit_code) == (1, 17), str(info.value)
    assert sorted(os.listdir(path)) == before
    for out in world2.run(load_small, path):
        for i in range(3):
            assert torch.equal(out[f"layers.{i}.weight"], torch.full((4, 6), 1.0 + i))
    world2.run(save_small, path, 5)  # the next export cleans up and replaces it
    assert sorted(os.listdir(tmp_path)) == ["hf"]
    for out in world2.run(load_small, path):
        assert torch.equal(out["layers.2.weight"], torch.full((4, 6), 7.0))


def test_export_refuses_a_directory_that_is_not_a_checkpoint(world2, tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    with pytest.raises(
        fs.launch.RankError, match="is a non-empty directory that is not a checkpoint"
    ):
        world2.run(save_small, str(tmp_path / "hf"), 1)
    assert os.listdir(tmp_path / "hf") == ["notes.txt"]


def test_write_runs_place_every_block():
    """The pwrite runs of any block of a 3-D tensor put its bytes where the whole has them
    (one-process: a file written block by block equals the tensor's bytes)."""
    import tempfile

    from fshard.hf_checkpoint import _write_block

    whole = torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6)
    boxes = [((0, 0, 0), (2, 5, 6)), ((2, 0, 0), (2, 2, 3)), ((2, 0, 3), (2, 2, 3)),
             ((2, 2, 0), (2, 3, 6))]  # fmt: skip
    with tempfile.TemporaryFile() as f:
        f.truncate(8 + whole.numel() * 4)
        for offsets, sizes in boxes:
            piece = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            _write_block(f.fileno(), 8, whole.shape, offsets, sizes, piece)
        f.seek(8)
        got = torch.frombuffer(bytearray(f.read()), dtype=torch.float32).reshape(4, 5, 6)
    assert torch.equal(got, whole)


# -- loading more than a rank holds (issue 39 item 3) -------------------------------------------

N_BIG, ROWS, COLS = 16, 1024, 2048  # 16 params of 8 MiB: 128 MiB in all, 64 MiB per rank


def _big_block(i: int, rank: int) -> torch.Tensor:
    rows = ROWS // 2
    start = rank * rows * COLS
    return (torch.arange(start, start + rows * COLS, dtype=torch.float32) + i).reshape(rows, COLS)


def save_big(dcp_path, hf_path, tiny_dcp, tiny_hf):
    """Each rank builds only its rows; both formats written sharded (and tiny ones for the
    loader's warm-up)."""
    mesh = fs.Mesh.create((2,), ("dp",))
    rank = torch.distributed.get_rank()
    params = {
        f"w{i}": fs.from_local(_big_block(i, rank), mesh, fs.P("dp"), (ROWS, COLS))
        for i in range(N_BIG)
    }
    fs.checkpoint.save(dcp_path, params)
    fs.hf_checkpoint.save(hf_path, params, max_shard_size=32 << 20)
    tiny = {"t": fs.shard(torch.ones(4, 4), mesh, fs.P("dp"))}
    fs.checkpoint.save(tiny_dcp, tiny)
    fs.hf_checkpoint.save(tiny_hf, tiny)


def _memory() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def _fresh_peak():
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS: an honest baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return _memory()["VmRSS"]


def load_big(dcp_path, hf_path, tiny_dcp, tiny_hf):
    """Peak resident bytes added by each load (VmHWM after minus VmRSS before), in a fresh
    process that never held the model; the loaded blocks checked against the formula."""
    mesh = fs.Mesh.create((2,), ("dp",))
    rank = torch.distributed.get_rank()
    tiny = {"t": fs.Layout(mesh, fs.P("dp"), (4, 4))}
    fs.checkpoint.load(tiny_dcp, tiny)  # imports and first-call caches, outside the measure
    fs.hf_checkpoint.load(tiny_hf, tiny)
    like = {f"w{i}": fs.Layout(mesh, fs.P("dp"), (ROWS, COLS)) for i in range(N_BIG)}
    peaks = {}
    for name, fn, path in (
        ("dcp", fs.checkpoint.load, dcp_path),
        ("safetensors", fs.hf_checkpoint.load, hf_path),
    ):
        base = _fresh_peak()
        out = fn(path, like)
        peaks[name] = _memory()["VmHWM"] - base
        for i in range(N_BIG):
            assert torch.equal(out[f"w{i}"].local, _big_block(i, rank)), (name, i)
        del out
    return peaks


def test_load_a_model_larger_than_the_cap(world2, tmp_path):
    """The model (128 MiB) is larger than the cap (3/4 of it, 96 MiB) each rank may add while
    loading; each rank holds 64 MiB after the load. The peak each load adds stays near the
    rank's shard, from DCP and from safetensors (mapped pages of the files included)."""
    paths = [str(tmp_path / n) for n in ("dcp", "hf", "tiny_dcp", "tiny_hf")]
    world2.run(save_big, *paths)
    full = N_BIG * ROWS * COLS * 4
    shard, cap = full // 2, 3 * full // 4
    for peaks in fs.launch.run(load_big, 2, tuple(paths), timeout=300):
        for name, peak in peaks.items():
            assert shard <= peak <= cap, (name, peak / 2**20, shard / 2**20, cap / 2**20)


def test_dcp_reads_the_metadata_fshard_built(tmp_path, monkeypatch):
    """fs.hf_checkpoint.load checks the safetensors headers itself and hands DCP the metadata
    built from them through its ``HuggingFaceStorageReader`` subclass's ``read_metadata``. On
    the running torch, DCP's load must take the metadata from that method (one process)."""
    from fshard import hf_checkpoint

    save_file = pytest.importorskip("safetensors.torch").save_file  # the hf extra, as the load

    path = tmp_path / "hf"
    path.mkdir()
    w = torch.arange(6.0).reshape(2, 3)
    save_file({"w": w}, str(path / "model.safetensors"))
    calls = []
    make = hf_checkpoint._reader

    def reader(*args):
        r = make(*args)
        built = r.read_metadata

        def spy(*a, **k):
            calls.append(1)
            return built(*a, **k)

        r.read_metadata = spy
        return r

    monkeypatch.setattr(hf_checkpoint, "_reader", reader)
    got = fs.hf_checkpoint.load(str(path), {"w": torch.zeros(2, 3)})
    assert calls and torch.equal(got["w"], w)
