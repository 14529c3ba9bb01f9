"""The safetensors loader (model/loader.py) against generated tiny checkpoints."""

import json
import logging
import re
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from model import checkpoint as ck
from model.checkpoint_meta import read_checkpoint_meta
from model.fp8_weights import weight_dequant_fp8
from model.loader import load_model, load_weights
from model.parallel import TPGroup
from model.presets import preset_config
from model.shard_loader import load_sharded_model

TINY = preset_config("tiny")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ck.make_checkpoint(tmp_path_factory.mktemp("ck") / "tiny")


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    return ck.make_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-fp8", fp8=True)


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(tiny)


def expected_params(config, seed=0):
    """Parameter name -> value, from the generator's bf16 tensors and CONTRACTS.md's stacking."""
    specs = ck.checkpoint_tensor_specs(config)
    t = {n: ck.init_tensor(n, s, config, seed) for n, s in specs.items()}
    out = {}
    for n, v in t.items():
        layer = re.match(r"model\.layers\.(\d+)\.", n)
        if layer and int(layer.group(1)) >= config.num_hidden_layers:
            continue  # MTP
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", n)
        if m is None:
            out[n] = v
            continue
        prefix, e = m.group(1), int(m.group(2))
        if m.group(3) == "gate":
            out[f"{prefix}.w13_weight", e] = torch.cat([v, t[f"{prefix}.{e}.up_proj.weight"]])
        elif m.group(3) == "down":
            out[f"{prefix}.w2_weight", e] = v
    stacked = {}
    for k in [k for k in out if isinstance(k, tuple)]:
        stacked.setdefault(k[0], {})[k[1]] = out.pop(k)
    for name, per_e in stacked.items():
        out[name] = torch.stack([per_e[e] for e in range(len(per_e))])
    return out


# ---- round trips -------------------------------------------------------------------------------
def test_tiny_loads_back_identical(loaded, tiny):
    model, extras = loaded
    params = dict(model.named_parameters())
    want = expected_params(TINY)
    assert set(params) == set(want)
    for name, p in params.items():
        assert p.device.type == "cpu" and not p.requires_grad
        assert torch.equal(p, want[name].to(p.dtype)), name
    # the model's fp32 parameters got the bf16 checkpoint values cast (CONTRACTS.md)
    assert params["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    assert params["model.layers.1.mlp.experts.w13_weight"].shape == (8, 256, 256)
    assert extras.config == TINY and extras.path == tiny
    assert read_checkpoint_meta(tiny)[2]["top_p"] == 0.95


def test_buffers_are_recomputed_not_garbage(loaded):
    from model.model import DeepseekV32ForCausalLM

    model, _ = loaded
    fresh = DeepseekV32ForCausalLM(TINY)  # built directly on the CPU
    fresh.init_buffers()
    bufs = dict(model.named_buffers())
    assert bufs, "the model has rope / Hadamard buffers"
    for name, b in fresh.named_buffers():
        assert torch.equal(bufs[name], b), name


def test_mtp_layer_is_kept_aside(loaded, tiny):
    model, extras = loaded
    mtp = "model.layers.4."
    assert set(extras.mtp) == {k for k in ck.checkpoint_tensor_specs(TINY) if k.startswith(mtp)}
    assert not any(n.startswith(mtp) for n in model.state_dict())
    w = extras.mtp[mtp + "eh_proj.weight"]
    assert w.shape == (256, 512) and w.dtype == torch.bfloat16
    spec = ck.checkpoint_tensor_specs(TINY)[mtp + "eh_proj.weight"]
    assert torch.equal(w, ck.init_tensor(mtp + "eh_proj.weight", spec, TINY))
    _, skipped = load_model(tiny, keep_mtp=False)
    assert skipped.mtp == {}


def test_fp8_checkpoint_loads_dequantised(loaded, tiny_fp8):
    model_bf16, _ = loaded
    model, extras = load_model(tiny_fp8, fp8_weights="bf16")
    assert extras.config.quantization.method == "fp8"
    ref = dict(model_bf16.named_parameters())
    n_diff = 0
    for name, p in model.named_parameters():
        r = ref[name].float()
        if torch.equal(p, ref[name]):
            continue
        n_diff += 1
        module = name.rsplit(".", 1)[0]
        assert ck.is_quantized_linear(module) or name.endswith(("w13_weight", "w2_weight")), name
        # e4m3 rounds a value to <= 2^-4 relative (subnormals: 2^-10 of the block scale, at most
        # 2 amax / 448 once rounded up to a power of two by ue8m0), then the fp32 result is
        # rounded to the bf16 parameter (<= 2^-9 relative)
        bound = (2**-4 + 2**-8) * r.abs() + 2**-10 * 2 * r.abs().max() / 448
        assert ((p.float() - r).abs() <= bound).all(), name
        assert (p.float() - r).norm() / r.norm() > 1e-3, name  # really went through FP8
    # all FP8 linears of the 4 built layers: 7 attention + (3 dense | 2 stacked + 3 shared)
    assert n_diff == 4 * 7 + 3 + 3 * 5
    # the ragged kv_a block: dequantised with the scale of its own 64 rows
    name = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
    q = load_file(tiny_fp8 / shard_of(tiny_fp8, name))
    dq = weight_dequant_fp8(q[name], q[name + "_scale_inv"]).to(torch.bfloat16)
    assert torch.equal(dict(model.named_parameters())[name], dq)


def test_fp8_config_without_scales_is_refused_for_fp8_weights(tiny, tiny_fp8, tmp_path, caplog):
    """A bf16 checkpoint whose config.json still declares FP8 (DeepSeek's fp8_cast_bf16.py leaves
    it as it was): an explicit 'fp8' names the missing scales and the flag that loads it; the
    default 'auto' serves what the checkpoint holds, bf16 (LLM says so), as 'bf16' does."""
    from model.parallel import TPGroup
    from model.shard_loader import load_sharded_model

    path = tmp_path / "cast"
    shutil.copytree(tiny, path)
    fp8_config = json.loads((tiny_fp8 / "config.json").read_text())["quantization_config"]
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": fp8_config}))
    for load in (
        lambda: load_model(path, fp8_weights="fp8"),
        lambda: load_sharded_model(path, TPGroup(0, 1, "", gather=False), fp8_weights="fp8"),
    ):
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))} has no weight_scale_inv"
                                             r".*--fp8-weights bf16"):
            load()
    for fp8_weights in ("bf16", "auto"):
        model, extras = load_model(path, fp8_weights=fp8_weights)
        assert extras.config.quantization.method == "fp8"
        assert model.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
    model, _ = load_sharded_model(path, TPGroup(0, 1, "", gather=False))
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
    from echo_compile.llm import LLM

    caplog.set_level(logging.INFO, logger="echo_compile.llm")
    LLM(str(path), device="cpu", compile=False, progress=False)
    assert "FP8 checkpoint: weights bf16 as stored" in caplog.text


# ---- corrupt checkpoints -----------------------------------------------------------------------
def copy_ckpt(src, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


def edit(path, fn):
    """Apply ``fn(tensors: dict, shard: str)`` to every shard, keeping the index in step."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    wm = {}
    for shard in sorted({v for v in index["weight_map"].values()}):
        t = load_file(path / shard)
        fn(t, shard)
        save_file(t, str(path / shard), metadata={"format": "pt"})
        wm.update({k: shard for k in t})
    index["weight_map"] = wm
    index_file.write_text(json.dumps(index))


def shard_of(path, name):
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def test_missing_shard_is_named(tiny, tmp_path):
    path = copy_ckpt(tiny, tmp_path)
    shard = shard_of(path, "model.layers.2.self_attn.o_proj.weight")
    (path / shard).unlink()
    with pytest.raises(ValueError, match=rf"names shard '{shard}' .* does not exist"):
        load_model(path)


def test_wrong_shape_names_tensor_and_file(tiny, tmp_path):
    path = copy_ckpt(tiny, tmp_path)
    name = "model.layers.1.self_attn.q_a_proj.weight"

    def transpose(t, shard):
        if name in t:
            t[name] = t[name].t().contiguous()

    edit(path, transpose)
    msg = rf"'{re.escape(name)}' in .*{shard_of(path, name)}: shape \[256, 128\].* \[128, 256\]"
    with pytest.raises(ValueError, match=msg):
        load_model(path)


def test_unexpected_tensor_is_named(tiny, tmp_path):
    path = copy_ckpt(tiny, tmp_path)

    def add(t, shard):
        if "model.norm.weight" in t:
            t["model.layers.1.self_attn.rotary.weight"] = torch.ones(4)

    edit(path, add)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.1\.self_attn\.rotary"
                                         r"\.weight' in .*model-0000\d-of-0000\d"):
        load_model(path)


def test_tensor_not_in_index_is_unexpected(tiny, tmp_path):
    path = copy_ckpt(tiny, tmp_path)
    shard = shard_of(path, "lm_head.weight")
    t = load_file(path / shard)
    t["extra.weight"] = torch.zeros(2)
    save_file(t, str(path / shard))
    with pytest.raises(ValueError, match=rf"unexpected tensor 'extra\.weight' in .*{shard}: not "
                                         "listed"):
        load_model(path)


def test_expert_beyond_the_model_is_unexpected(tiny, tmp_path):
    path = copy_ckpt(tiny, tmp_path)

    def add(t, shard):
        if "model.layers.1.mlp.experts.7.up_proj.weight" in t:
            t["model.layers.1.mlp.experts.8.up_proj.weight"] = torch.zeros(128, 256)

    edit(path, add)
    with pytest.raises(ValueError, match=r"experts\.8\.up_proj\.weight' in .*: expert 8 but .* "
                                         "holds 8 experts"):
        load_model(path)


def set_config(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("strip_mtp", [False, True], ids=["with-mtp", "mtp-stripped"])
def test_num_hidden_layers_short_of_the_checkpoint_is_named(tiny, tmp_path, strip_mtp):
    """config.json counting one decoder layer fewer than the checkpoint holds: the last decoder
    layer was kept aside as the MTP layer and the model served one layer short, silently (with
    the MTP layer stripped, as quantised uploads do, nothing at all was left over). Named from
    the names alone, by the MTP layer's own eh_proj; the sharded load checks the same."""
    path = copy_ckpt(tiny, tmp_path)
    n = TINY.num_hidden_layers
    set_config(path, num_hidden_layers=n - 1)
    if strip_mtp:
        mtp = f"model.layers.{n}."
        edit(path, lambda t, shard: [t.pop(k) for k in list(t) if k.startswith(mtp)])
    msg = (rf"config\.json field 'num_hidden_layers' is {n - 1}, but the checkpoint has a "
           rf"decoder layer {n - 1} \(e\.g\. tensor 'model\.layers\.{n - 1}\..*' in .*model-0000\d"
           r"-of-0000\d\.safetensors; it has no eh_proj")
    with pytest.raises(ValueError, match=msg):
        load_model(path, keep_mtp=False)
    with pytest.raises(ValueError, match=msg):
        load_sharded_model(path, TPGroup(0, 2, "", gather=True))


def test_num_hidden_layers_past_the_checkpoint_is_named(tiny, tmp_path):
    """One decoder layer too many in config.json: the MTP layer taken for a decoder layer was an
    "unexpected tensor 'model.layers.4.embed_tokens.weight'" that named no config field."""
    path = copy_ckpt(tiny, tmp_path)
    n = TINY.num_hidden_layers
    set_config(path, num_hidden_layers=n + 1)
    with pytest.raises(ValueError, match=rf"config\.json field 'num_hidden_layers' is {n + 1}, but "
                                         rf"layer {n} of the checkpoint is an MTP layer \(tensor "
                                         rf"'model\.layers\.{n}\.eh_proj\.weight' in "):
        load_model(path)


def test_missing_tensor_is_named(tiny, tmp_path):
    path = copy_ckpt(tiny, tmp_path)
    gone = ("model.layers.2.mlp.experts.5.up_proj.weight", "model.layers.0.input_layernorm.weight")
    edit(path, lambda t, shard: [t.pop(n) for n in gone if n in t])
    with pytest.raises(ValueError, match=r"missing tensor\(s\) in .*model\.safetensors\.index\.json"
                                         r": model\.layers\.0\.input_layernorm\.weight, "
                                         r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight "):
        load_model(path)


def test_index_entry_missing_from_its_file(tiny, tmp_path):
    path = copy_ckpt(tiny, tmp_path)
    name = "model.layers.3.mlp.gate.weight"
    shard = shard_of(path, name)
    t = load_file(path / shard)
    del t[name]
    save_file(t, str(path / shard))
    with pytest.raises(ValueError, match=rf"missing tensor '{re.escape(name)}': .* places it in "
                                         rf".*{shard}, which does not contain it"):
        load_model(path)


def test_bad_shards_are_found_before_any_tensor_is_read(tiny, tmp_path, monkeypatch):
    """Every shard's header is checked against the index first: an unreadable last shard, or
    one that lacks a tensor, fails before the shards before it are read (minutes on V3.2)."""
    import model.weight_placer

    reads = []
    placer = model.weight_placer.WeightPlacer
    monkeypatch.setattr(placer, "add", lambda self, name, *a: reads.append(name))
    path = copy_ckpt(tiny, tmp_path / "a")
    last = sorted({shard_of(path, n) for n in json.loads(
        (path / "model.safetensors.index.json").read_text())["weight_map"]})[-1]  # fmt: skip
    (path / last).write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match=rf"{last}: not a readable safetensors file"):
        load_model(path)
    path = copy_ckpt(tiny, tmp_path / "b")
    t = load_file(path / last)
    del t[sorted(t)[0]]
    save_file(t, str(path / last))
    with pytest.raises(ValueError, match=rf"places it in .*{last}, which does not contain it"):
        load_model(path)
    assert reads == []


def test_an_unreadable_single_file_checkpoint_is_named(tiny, tmp_path):
    """A model.safetensors with no index (the single-file layout) that safetensors cannot read
    fails naming the file, as a shard of an indexed checkpoint does (it was safetensors' own
    error, naming no file)."""
    path = copy_ckpt(tiny, tmp_path)
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    (path / "model.safetensors").write_bytes(b"version https://git-lfs.github.com/spec/v1\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path / 'model.safetensors'))}: not a "
                                         r"readable safetensors file \("):
        load_model(path)


@pytest.mark.parametrize("fp8_weights", ["bf16", "fp8"])
def test_missing_tensors_are_found_before_any_tensor_is_read(
    tiny, tiny_fp8, tmp_path, monkeypatch, fp8_weights
):
    """A tensor the checkpoint lacks (index and shard agreeing: a partial conversion), a scale
    without its FP8 weight or an FP8 weight without its scale: named from the shards' headers,
    before any tensor is read, not after all of them (minutes on V3.2)."""
    import model.weight_placer

    reads = []
    placer = model.weight_placer.WeightPlacer
    monkeypatch.setattr(placer, "add", lambda self, name, *a: reads.append(name))
    scale = "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"
    weight = scale.removesuffix("_scale_inv")
    routed = "model.layers.1.mlp.experts.3.down_proj.weight"  # rank 0's under ep = 2
    for src, gone, msg in [
        (tiny, routed, rf"missing tensor\(s\) in .*: {re.escape(routed)}"),
        (tiny_fp8, scale, rf"missing tensor '{re.escape(scale)}' \(its FP8 weight is in "),
        (tiny_fp8, weight, rf"missing tensor '{re.escape(weight)}' \(its weight_scale_inv is "),
        (tiny, "model.layers.2.self_attn.o_proj.weight", r"missing tensor\(s\) in .*: model\."
                                                         r"layers\.2\.self_attn\.o_proj\.weight"),
    ]:
        if src is tiny and fp8_weights == "fp8":
            continue
        path = copy_ckpt(src, tmp_path / gone)
        edit(path, lambda t, shard, gone=gone: t.pop(gone, None))
        with pytest.raises(ValueError, match=msg):
            load_model(path, fp8_weights=fp8_weights)
        # one rank's shard of a tp / ep model too (the tiny FP8 model's 128 shared-expert
        # features are one scale block, which two ranks cannot split)
        for ep in (False, True) if src is tiny else ():
            with pytest.raises(ValueError, match=msg):
                load_sharded_model(path, TPGroup(0, 2, "", gather=True), ep=ep,
                                   fp8_weights=fp8_weights)
    assert reads == []


def test_wrong_dtype_class_is_named(tiny, tmp_path):
    path = copy_ckpt(tiny, tmp_path)
    name = "model.layers.1.post_attention_layernorm.weight"

    def to_int(t, shard):
        if name in t:
            t[name] = t[name].to(torch.int32)

    edit(path, to_int)
    with pytest.raises(ValueError, match=rf"'{re.escape(name)}' in .*: dtype torch\.int32 cannot"):
        load_model(path)


def test_norms_in_fp16_and_fp32_are_accepted(tiny, tmp_path):
    path = copy_ckpt(tiny, tmp_path)

    def recast(t, shard):
        for k in t:
            if k.endswith("layernorm.weight"):
                t[k] = t[k].to(torch.float16 if "q_a" in k else torch.float32)

    edit(path, recast)
    model, _ = load_model(path)
    assert torch.equal(model.model.layers[1].input_layernorm.weight, torch.ones(256))


def test_fp8_scale_problems_are_named(tiny_fp8, tmp_path):
    path = copy_ckpt(tiny_fp8, tmp_path)
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    edit(path, lambda t, shard: t.pop(name, None))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.kv_a_proj"
                                         r"_with_mqa\.weight_scale_inv' \(its FP8 weight is in "):
        load_model(path, fp8_weights="bf16")

    path = copy_ckpt(tiny_fp8, tmp_path / "b")

    def crop(t, shard):
        if name in t:
            t[name] = t[name][:4].contiguous()  # drops the ragged block's scale

    edit(path, crop)
    with pytest.raises(ValueError, match=rf"'{re.escape(name)}' in .*needs scale_inv of shape "
                                         r"\(5, 2\), got \(4, 2\)"):
        load_model(path, fp8_weights="bf16")

    path = copy_ckpt(tiny_fp8, tmp_path / "c")
    weight = name.removesuffix("_scale_inv")

    def unquantize(t, shard):
        if weight in t:
            t[weight] = t[weight].to(torch.bfloat16)

    edit(path, unquantize)
    with pytest.raises(ValueError, match=rf"unexpected tensor '{re.escape(name)}' in .*: "
                                         rf"'{re.escape(weight)}' is not FP8"):
        load_model(path, fp8_weights="bf16")


@pytest.mark.parametrize("fp8_weights", ["bf16", "fp8"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5])
def test_fp8_scales_that_are_not_finite_and_non_negative_are_refused(
    tiny_fp8, tmp_path, value, fp8_weights
):
    """A NaN, infinite or negative weight_scale_inv loaded silently (a NaN model, or weights of
    the wrong sign); it is named with its file, index and value, in either weights format (a
    zero scale, an all-zero block's, is accepted)."""
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"

    def spoil(t, shard):
        if name in t:
            t[name][1, 0] = value

    path = copy_ckpt(tiny_fp8, tmp_path)
    edit(path, spoil)
    want = rf"'{re.escape(name)}' in .*: 1 of its \d+ scales are not finite and >= 0 \(e\.g\. "
    with pytest.raises(ValueError, match=want + rf"{re.escape(repr(value))} at \[1, 0\]\)"):
        load_model(path, fp8_weights=fp8_weights)


def test_ue8m0_scales_that_are_not_powers_of_two_are_reported(tiny_fp8, tmp_path):
    name = "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"

    def perturb(t, shard):
        if name in t:
            t[name][0, 1] *= 1.5  # 2^k * 1.5: a valid fp32 scale, not a UE8M0 one

    path = copy_ckpt(tiny_fp8, tmp_path)
    edit(path, perturb)
    with pytest.warns(UserWarning, match=rf"scale_fmt 'ue8m0' .*1 weight_scale_inv .*"
                                         rf"'{re.escape(name)}' in .*1 of its 2 scales are not "
                                         r"powers of two .* at \[0, 1\]"):
        load_model(path, fp8_weights="bf16")
    # the same scales load silently where the config declares no scale format
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"].pop("scale_fmt") == "ue8m0"
    (path / "config.json").write_text(json.dumps(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, extras = load_model(path, fp8_weights="bf16")
    assert extras.config.quantization.scale_fmt is None


def test_missing_or_bad_metadata_files(tiny, tmp_path):
    path = copy_ckpt(tiny, tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_model(path)
    path = copy_ckpt(tiny, tmp_path / "b")
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(path)
    path = copy_ckpt(tiny, tmp_path / "c")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        load_model(path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json: expected a JSON object, not list"):
        load_model(path)
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["n_group"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="n_routed_experts"):
        load_model(path)
    path = copy_ckpt(tiny, tmp_path / "d")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="expected a 'weight_map'"):
        load_model(path)
    path = copy_ckpt(tiny, tmp_path / "e")
    shard = shard_of(path, "lm_head.weight")
    (path / shard).write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=rf"{shard}: not a readable safetensors file"):
        load_model(path)
    with pytest.raises(ValueError, match="expected one of"):
        load_model(tmp_path / "nowhere")


@pytest.mark.parametrize("text", [b"{ bad json", b"null", b"\xff{}"], ids=["bad", "null", "utf8"])
def test_generation_config_none_gets_past_a_bad_generation_config(tiny, tmp_path, text):
    """A generation_config.json that is not a JSON object fails the engine's start with
    generation_config "auto", naming the file and the way past it; with "none" the file is not
    read (the loader parsed it first: '{ bad json' failed whatever the mode)."""
    from runtime.engine import Engine, EngineConfig
    from runtime.sampling_params import SamplingParams

    path = copy_ckpt(tiny, tmp_path)
    (path / "generation_config.json").write_bytes(text)
    model, extras = load_model(path)
    cfg = EngineConfig(max_batch=1, host_tokens=64, gpu_tokens=64, max_model_len=64)
    engine = Engine.from_loaded(model, extras, cfg, generation_config="none")
    assert engine.sampling_defaults == SamplingParams()
    with pytest.raises(ValueError, match="generation_config.json.*--generation-config none"):
        Engine.from_loaded(model, extras, cfg)


def test_load_model_dtype_argument(tiny):
    model, _ = load_model(tiny, dtype=torch.float16)
    p = dict(model.named_parameters())
    assert p["lm_head.weight"].dtype == torch.float16
    assert p["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    with pytest.raises(ValueError, match="dtype must be"):
        load_model(tiny, dtype=torch.int8)


# ---- AWQ placement (a stand-in module: the names of CONTRACTS.md) ------------------------------
class _AWQLinear(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.qweight = nn.Parameter(torch.empty(k, n // 8, dtype=torch.int32), requires_grad=False)
        self.qzeros = nn.Parameter(torch.empty(k // 128, n // 8, dtype=torch.int32),
                                   requires_grad=False)
        self.scales = nn.Parameter(torch.empty(k // 128, n, dtype=torch.float16))


class _AWQExperts(nn.Module):
    def __init__(self, e, d, i):
        super().__init__()
        for w, k, n in (("w13", d, 2 * i), ("w2", i, d)):
            setattr(self, f"{w}_qweight", nn.Parameter(
                torch.empty(e, k, n // 8, dtype=torch.int32), requires_grad=False))
            setattr(self, f"{w}_qzeros", nn.Parameter(
                torch.empty(e, k // 128, n // 8, dtype=torch.int32), requires_grad=False))
            setattr(self, f"{w}_scales", nn.Parameter(torch.empty(e, k // 128, n,
                                                                  dtype=torch.float16)))


def awq_stand_in(e, d, i):
    """Layer 1 of a model whose q_a_proj and experts are AWQ modules (layer 0 empty)."""
    with torch.device("meta"):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.q_a_proj = _AWQLinear(d, 128)
        layer.mlp = nn.Module()
        layer.mlp.experts = _AWQExperts(e, d, i)
        model = nn.Module()
        model.model = nn.Module()
        model.model.layers = nn.ModuleList([nn.Module(), layer])
    return model


def test_awq_tensors_go_to_the_stacked_awq_params(tmp_path):
    e, d, i = 3, 256, 128
    model = awq_stand_in(e, d, i)
    g = torch.Generator().manual_seed(0)

    def awq(k, n):
        return {"qweight": torch.randint(-2**31, 2**31 - 1, (k, n // 8), generator=g,
                                         dtype=torch.int32),
                "qzeros": torch.randint(-2**31, 2**31 - 1, (k // 128, n // 8), generator=g,
                                        dtype=torch.int32),
                "scales": torch.rand(k // 128, n, generator=g).half()}

    t = {f"model.layers.1.self_attn.q_a_proj.{k}": v for k, v in awq(d, 128).items()}
    for x in range(e):
        for proj, (k, n) in (("gate_proj", (d, i)), ("up_proj", (d, i)), ("down_proj", (i, d))):
            for s, v in awq(k, n).items():
                t[f"model.layers.1.mlp.experts.{x}.{proj}.{s}"] = v
    save_file(t, str(tmp_path / "model.safetensors"))  # the single-file layout
    assert load_weights(model, tmp_path, TINY) == {}
    p = dict(model.named_parameters())
    for s in ("qweight", "qzeros", "scales"):
        assert torch.equal(p[f"model.layers.1.self_attn.q_a_proj.{s}"],
                           t[f"model.layers.1.self_attn.q_a_proj.{s}"])
        for x in range(e):
            w13, w2 = p[f"model.layers.1.mlp.experts.w13_{s}"][x], p[
                f"model.layers.1.mlp.experts.w2_{s}"][x]
            half = w13.shape[-1] // 2  # the output axis is the last one for AWQ
            assert torch.equal(w13[..., :half], t[f"model.layers.1.mlp.experts.{x}.gate_proj.{s}"])
            assert torch.equal(w13[..., half:], t[f"model.layers.1.mlp.experts.{x}.up_proj.{s}"])
            assert torch.equal(w2, t[f"model.layers.1.mlp.experts.{x}.down_proj.{s}"])
    # a 16-bit weight where the model expects AWQ tensors: named, with what the model holds
    t["model.layers.1.self_attn.q_a_proj.weight"] = torch.zeros(128, 256)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no parameter 'model\.layers\.1\.self_attn\.q_a_proj\."
                                         r"weight' \(the model holds .*q_a_proj\.qweight"):
        load_weights(awq_stand_in(e, d, i), tmp_path, TINY)


def test_awq_scales_fp16_would_change_are_refused(tmp_path):
    """AWQ scales load into fp16 parameters. From a bf16 or fp32 file, a scale outside fp16's
    normal range became inf or a subnormal without a word (a bf16 1e5 loaded as inf: a NaN
    model); a non-finite one is refused in any dtype. In range, bf16 loads exactly, fp32 rounded."""
    d, n = 256, 128
    a = "model.layers.1.self_attn.q_a_proj."
    g = torch.Generator().manual_seed(1)

    def load(scales):
        t = {a + "qweight": torch.randint(0, 2**31 - 1, (d, n // 8), generator=g,
                                          dtype=torch.int32),
             a + "qzeros": torch.zeros(d // 128, n // 8, dtype=torch.int32), a + "scales": scales}
        save_file(t, str(tmp_path / "model.safetensors"))
        model = awq_stand_in(1, d, 128)
        del model.model.layers[1].mlp  # only the linear
        load_weights(model, tmp_path, TINY)
        return dict(model.named_parameters())[a + "scales"]

    ok = torch.rand(d // 128, n, generator=g) * 0.1 + 1e-3
    assert torch.equal(load(ok.bfloat16()), ok.bfloat16().half())  # exact
    assert torch.equal(load(ok), ok.half())  # rounded to fp16
    for dtype, value in ((torch.bfloat16, 1e5), (torch.bfloat16, 1e-6), (torch.float32, 7e4),
                         (torch.float32, 3e-5), (torch.float16, float("nan")),
                         (torch.float32, float("inf"))):
        bad = ok.clone()
        bad[1, 7] = value
        with pytest.raises(ValueError, match=rf"q_a_proj\.scales' in .*: 1 of its {2 * n} "
                                             rf".*AWQ scales would change as fp16.* at \[1, 7\]"):
            load(bad.to(dtype))
    held = ok.clone()
    held[0, :3] = torch.tensor([0, 2**-15, -(2**-24)])  # fp16 holds them exactly (subnormals)
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(load(held.to(dtype))[0, :3].float(), held[0, :3])


def test_awq_checkpoint_loads_into_the_model(tmp_path, loaded):
    from model.awq_quant import awq_dequantize

    path = ck.make_checkpoint(tmp_path / "awq", awq=True)
    model, extras = load_model(path)
    assert extras.config.quantization.method == "awq"
    stored = {}
    for f in path.glob("*.safetensors"):
        stored.update(load_file(f))
    p = dict(model.named_parameters())
    ref = dict(loaded[0].named_parameters())
    a = "model.layers.1.self_attn."
    for s in ("qweight", "qzeros", "scales"):
        assert torch.equal(p[f"{a}q_b_proj.{s}"], stored[f"{a}q_b_proj.{s}"])
        w13 = p[f"model.layers.2.mlp.experts.w13_{s}"]
        half = w13.shape[-1] // 2
        assert torch.equal(w13[5, :, half:], stored[f"model.layers.2.mlp.experts.5.up_proj.{s}"])
    # kv_b_proj is AWQ in the file and dense in the model (densify_awq after loading)
    kv_b = awq_dequantize(*(stored[f"{a}kv_b_proj.{s}"] for s in ("qweight", "qzeros", "scales")))
    assert torch.equal(p[f"{a}kv_b_proj.weight"], kv_b.to(torch.bfloat16))
    # 16-bit where QuantTrio keeps it: indexer, router gate, dense layer 0, last layer, MTP
    for name in (f"{a}indexer.wq_b.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.0.self_attn.q_a_proj.weight",
                 "model.layers.3.mlp.experts.w2_weight"):
        assert torch.equal(p[name], ref[name]), name
    assert "model.layers.4.mlp.experts.0.up_proj.weight" in extras.mtp


# ---- the generated weights give a usable model -------------------------------------------------
def last_logits(model, ids):
    from custom_ops.cache.config import CacheConfig
    from custom_ops.cache.kv_cache import KVCache
    from model.forward_meta import ForwardMeta

    c, t = model.config, len(ids)
    dev = next(model.parameters()).device  # the model's device (CPU in most tests)
    cache = KVCache(CacheConfig(num_layers=c.num_hidden_layers, host_tokens=128, gpu_tokens=64,
                                topk=c.index_topk, offload=False), dev)
    meta = ForwardMeta(
        input_ids=torch.tensor(ids, device=dev), positions=torch.arange(t, device=dev),
        out_slots=torch.arange(t, device=dev),
        block_table=torch.arange(2, dtype=torch.int32, device=dev)[None],
        seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
        logits_indices=torch.tensor([t - 1], device=dev), is_decode=False)
    with torch.no_grad():
        return model(meta, cache)[0]


def test_generated_weights_give_sane_logits(loaded, tiny_fp8):
    model, _ = loaded
    prompts = ([0, 44, 73, 341, 83], [0, 264, 499, 315, 432, 18], [0, 7])
    logits = torch.stack([last_logits(model, p) for p in prompts])  # [3, V]
    assert torch.isfinite(logits).all()
    # lm_head std = hidden_size^-0.5: logits ~ unit scale, neither flat nor saturated
    assert ((logits.std(-1) > 0.5) & (logits.std(-1) < 2)).all()
    assert torch.corrcoef(logits).triu(1).abs().max() < 0.9  # the prompt matters
    fp8_model, _ = load_model(tiny_fp8, fp8_weights="bf16")
    fp8 = last_logits(fp8_model, prompts[0])
    assert torch.corrcoef(torch.stack([fp8, logits[0]]))[0, 1] > 0.98


def stored(path, keep=lambda name: True) -> tuple[int, int]:
    """(how many, their bytes) of the tensors in the shards at ``path`` that ``keep`` names."""
    ts = [t for shard in path.glob("*.safetensors") for n, t in load_file(shard).items() if keep(n)]
    return len(ts), sum(t.nbytes for t in ts)


def test_progress_counts_every_byte_read_once(tiny, tiny_fp8):
    """``progress(n, total)``, once per tensor read: the ``n`` sum to ``total``, the bytes of the
    tensors read as stored (the MTP layer's not, where it is not kept; sharded, one rank's part of
    each feed-forward tensor)."""
    mtp = re.compile(rf"model\.layers\.{TINY.num_hidden_layers}\.")
    calls = []
    for path, keep_mtp in ((tiny, True), (tiny, False), (tiny_fp8, True)):
        calls.clear()
        load_model(path, keep_mtp=keep_mtp, progress=lambda n, total: calls.append((n, total)))
        count, read = stored(path, lambda n, k=keep_mtp: k or not mtp.match(n))
        assert len(calls) == count
        assert sum(n for n, _ in calls) == read
        assert {t for _, t in calls} == {read}
    count, whole = stored(tiny, lambda n: not mtp.match(n))
    half = TINY.n_routed_experts // 2
    theirs = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
    rank1, _ = stored(tiny, lambda n: not mtp.match(n) and (m := theirs.match(n)) is not None
                      and int(m.group(1)) >= half)  # fmt: skip
    for ep in (False, True):
        calls.clear()
        load_sharded_model(tiny, TPGroup(0, 2, "", gather=True), ep=ep,
                           progress=lambda n, total: calls.append((n, total)))
        assert sum(n for n, _ in calls) == calls[0][1] < whole
        assert {t for _, t in calls} == {calls[0][1]}
        assert len(calls) == count - (rank1 if ep else 0)  # EP: rank 1's experts are not read


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e5m2fnuz])
def test_progress_counts_a_dtype_of_any_name_by_its_span_in_the_file(tiny, tmp_path, dtype):
    """A tensor's bytes are its span in the file (the header's ``data_offsets``), whatever its
    dtype: an MTP tensor (kept aside as stored, so the load takes any dtype) in a dtype that a
    table of bytes per safetensors dtype name lacked (C64, F8_E5M2FNUZ) counts in ``total`` and
    in its ``n`` as the other tensors do (counted 0, the bar's total fell short of the bytes
    read)."""
    path = copy_ckpt(tiny, tmp_path)
    name = f"model.layers.{TINY.num_hidden_layers}.shared_head.norm.weight"

    def recast(t, shard):
        if name in t:
            t[name] = torch.ones(t[name].shape).to(dtype)

    edit(path, recast)
    calls = []
    _, extras = load_model(path, progress=lambda n, total: calls.append((n, total)))
    assert extras.mtp[name].dtype == dtype
    count, read = stored(path)
    assert len(calls) == count
    assert sum(n for n, _ in calls) == read
    assert {t for _, t in calls} == {read}
