"""The tiny checkpoint generator (model/checkpoint.py), its tokenizer and the FP8 block weights."""

import hashlib
import json
import math
import os
import re
import stat

import jinja2
import pytest
import torch
from safetensors import safe_open

from model import checkpoint as ck
from model.config import ModelConfig
from model.fp8_weights import scale_shape, weight_dequant_fp8, weight_quant_fp8
from model.presets import preset_config

E4M3 = torch.float8_e4m3fn


def fp8_bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Largest |dequant - w| per element: e4m3 has 3 mantissa bits, so a normal value (|w/s| >=
    2^-6) rounds with relative error <= 2^-4; subnormals are spaced 2^-9, error <= 2^-10 * s."""
    s = scale.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
    return (2**-4 * w.abs() + 2**-10 * s) * (1 + 2**-20)


def read_all(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            for k in g.keys():
                out[k] = g.get_tensor(k)
    return out


def file_hashes(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return ck.make_checkpoint(tmp_path_factory.mktemp("ck") / "tiny")


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    return ck.make_checkpoint(tmp_path_factory.mktemp("ck") / "tiny-fp8", fp8=True)


# ---- inventory ---------------------------------------------------------------------------------
def test_specs_have_every_tensor_of_tiny_incl_mtp():
    c = preset_config("tiny")
    s = ck.checkpoint_tensor_specs(c)
    bf16 = torch.bfloat16
    assert s["model.embed_tokens.weight"] == ((512, 256), bf16)
    assert s["lm_head.weight"] == ((512, 256), bf16)
    assert s["model.layers.0.mlp.gate_proj.weight"] == ((512, 256), bf16)  # dense layer 0
    assert "model.layers.0.mlp.gate.weight" not in s
    a = "model.layers.2.self_attn."
    assert s[a + "q_b_proj.weight"] == ((4 * 128, 128), bf16)
    assert s[a + "kv_a_proj_with_mqa.weight"] == ((576, 256), bf16)
    assert s[a + "kv_b_proj.weight"] == ((4 * 128, 512), bf16)
    assert s[a + "o_proj.weight"] == ((256, 4 * 64), bf16)
    assert s[a + "indexer.wq_b.weight"] == ((4 * 128, 128), bf16)
    assert s[a + "indexer.k_norm.bias"] == ((128,), bf16)
    m = "model.layers.3.mlp."
    assert s[m + "gate.e_score_correction_bias"] == ((8,), torch.float32)
    assert s[m + "experts.7.down_proj.weight"] == ((256, 128), bf16)
    assert s[m + "shared_experts.up_proj.weight"] == ((128, 256), bf16)
    mtp = "model.layers.4."  # num_hidden_layers = 4, one MTP layer
    for k in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
              "shared_head.head.weight", "self_attn.indexer.weights_proj.weight",
              "mlp.experts.0.gate_proj.weight", "mlp.gate.weight"):
        assert mtp + k in s, k
    assert s[mtp + "eh_proj.weight"] == ((256, 512), bf16)
    assert not any(k.startswith("model.layers.5.") for k in s)
    per_moe_layer = sum(1 for k in s if k.startswith("model.layers.1."))
    # 14 attention/norm tensors + gate weight/bias + 8 experts x 3 + 3 shared
    assert per_moe_layer == 14 + 2 + 24 + 3
    # embed, norm, lm_head + dense layer 0 + MoE layers 1..3 + MTP (a MoE block + 6 tensors)
    assert len(s) == 3 + (14 + 3) + 3 * per_moe_layer + (per_moe_layer + 6)


def test_fp8_stored_specs_follow_the_reference_table():
    c = ck.with_quantization(preset_config("tiny"), fp8=True, awq=False)
    s = ck.stored_tensor_specs(c)
    fp8 = {k.removesuffix(".weight_scale_inv") for k in s if k.endswith("weight_scale_inv")}
    for k in fp8:
        assert s[k + ".weight"][1] == E4M3
    assert s["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == (
        (5, 2), torch.float32)  # 576 rows: ragged last block
    assert "model.layers.1.mlp.experts.3.up_proj" in fp8
    assert "model.layers.4.self_attn.q_a_proj" in fp8  # the MTP block is FP8 too
    for keep in ("model.layers.1.mlp.gate", "model.layers.1.self_attn.indexer.weights_proj",
                 "model.layers.4.eh_proj", "model.layers.4.shared_head.head", "lm_head",
                 "model.embed_tokens", "model.layers.1.self_attn.kv_a_layernorm"):
        assert keep not in fp8
        assert s[keep + ".weight"][1] == torch.bfloat16
    # 7 attention + 3 x (8 experts + shared) x 3 per MoE layer (4 incl. MTP) + 3 dense
    assert len(fp8) == 5 * 7 + 4 * 27 + 3


def test_awq_stored_specs_follow_quanttrio_exclusions_on_tiny():
    c = ck.with_quantization(preset_config("tiny"), fp8=False, awq=True)
    assert c.quantization.modules_to_not_convert == (
        "mlp.gate.", "indexer", "model.layers.0.", "model.layers.3.", "model.layers.4.")
    s = ck.stored_tensor_specs(c)
    q = {k.removesuffix(".qweight") for k in s if k.endswith(".qweight")}
    assert {int(k.split(".")[2]) for k in q} == {1, 2}
    assert s["model.layers.1.mlp.experts.0.down_proj.qweight"] == ((128, 32), torch.int32)
    assert s["model.layers.1.mlp.experts.0.down_proj.qzeros"] == ((1, 32), torch.int32)
    assert s["model.layers.1.mlp.experts.0.down_proj.scales"] == ((1, 256), torch.float16)
    assert s["model.layers.2.self_attn.kv_a_proj_with_mqa.qweight"] == ((256, 72), torch.int32)
    for keep in ("model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.indexer.wk.weight",
                 "model.layers.0.self_attn.q_a_proj.weight",
                 "model.layers.3.mlp.experts.0.up_proj.weight",
                 "model.layers.4.self_attn.o_proj.weight"):
        assert s[keep][1] == torch.bfloat16, keep
    assert len(q) == 2 * (5 + 27)


# ---- files -------------------------------------------------------------------------------------
def test_tiny_checkpoint_layout(tiny):
    shards = sorted(p.name for p in tiny.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3
    assert shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    c = ModelConfig.from_json(tiny)
    assert c == preset_config("tiny")
    specs = ck.stored_tensor_specs(c)
    assert set(index["weight_map"]) == set(specs)
    total = 0
    for shard in shards:
        with safe_open(str(tiny / shard), framework="pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == shard}
            for k in keys:
                t = f.get_tensor(k)
                assert (tuple(t.shape), t.dtype) == specs[k], k
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["do_sample"]) == (0, 1, True)
    assert (gen["temperature"], gen["top_p"]) == (1.0, 0.95)
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"] and "quantization_config" not in cfg


def test_weights_are_the_documented_init(tiny):
    t = read_all(tiny)
    c = preset_config("tiny")
    for name, spec in ck.checkpoint_tensor_specs(c).items():
        assert torch.equal(t[name], ck.init_tensor(name, spec, c)), name
    assert torch.equal(t["model.layers.4.embed_tokens.weight"], t["model.embed_tokens.weight"])
    assert torch.equal(t["model.layers.4.shared_head.head.weight"], t["lm_head.weight"])
    assert torch.equal(t["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    assert torch.equal(t["model.layers.2.self_attn.indexer.k_norm.bias"],
                       torch.zeros(128, dtype=torch.bfloat16))
    w = t["model.layers.2.self_attn.q_a_proj.weight"].float()
    assert 0.018 < w.std().item() < 0.022 and abs(w.mean().item()) < 1e-3
    bias = t["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and 0 < bias.abs().max().item() < 0.05
    # distinct tensors get distinct draws
    assert not torch.equal(t["model.layers.1.mlp.experts.0.up_proj.weight"],
                           t["model.layers.1.mlp.experts.1.up_proj.weight"])


def test_make_checkpoint_is_deterministic(tiny, tmp_path):
    again = ck.make_checkpoint(tmp_path / "again")
    assert file_hashes(again) == file_hashes(tiny)
    other = ck.make_checkpoint(tmp_path / "other", seed=1)
    h0, h1 = file_hashes(tiny), file_hashes(other)
    assert h0["config.json"] == h1["config.json"] and h0["tokenizer.json"] == h1["tokenizer.json"]
    assert all(h0[k] != h1[k] for k in h0 if k.endswith(".safetensors"))


def test_fp8_checkpoint_dequantises_to_the_bf16_weights(tiny, tiny_fp8):
    ref, q = read_all(tiny), read_all(tiny_fp8)
    cfg = json.loads((tiny_fp8 / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    assert ModelConfig.from_json(tiny_fp8).quantization.method == "fp8"
    n_fp8 = 0
    for name, t in q.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype != E4M3:
            assert torch.equal(t, ref[name]), name  # unquantised tensors are the bf16 ones
            continue
        n_fp8 += 1
        s = q[name + "_scale_inv"]
        w = ref[name].float()
        dq = weight_dequant_fp8(t, s)
        assert ((dq - w).abs() <= fp8_bound(w, s)).all(), name
        # the bound is tight enough to mean something: typical error ~2^-5 relative
        rel = ((dq - w).norm() / w.norm()).item()
        assert 1e-3 < rel < 2**-4, (name, rel)
    assert n_fp8 == 5 * 7 + 4 * 27 + 3
    # the ragged block of kv_a_proj_with_mqa (rows 512..575): scale from its 64 real rows only,
    # rounded up to a power of two as config.json's scale_fmt ue8m0 declares
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    name = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
    s = q[name + "_scale_inv"]
    assert s.shape == (5, 2)
    w = ref[name].float()
    for blk, got in ((w[512:, 128:], s[4, 1]), (w[:128, :128], s[0, 0])):
        exact = (blk.abs().max() / 448).item()
        assert got.item() == 2.0 ** math.ceil(math.log2(exact)) and got.item() > exact


def test_fp8_checkpoint_scales_are_what_its_config_declares(tiny, tiny_fp8):
    """scale_fmt ue8m0: every weight_scale_inv is the smallest power of two >= its block's
    amax / 448 (the bf16 weights are the ones the FP8 flavour was quantised from)."""
    ref, q = read_all(tiny), read_all(tiny_fp8)
    names = [k.removesuffix("_scale_inv") for k in q if k.endswith("weight_scale_inv")]
    assert len(names) == 5 * 7 + 4 * 27 + 3
    for name in names:
        s = q[name + "_scale_inv"].double()
        assert torch.equal(torch.exp2(torch.log2(s).round()), s), name
        w = ref[name].double()
        ob, ib = s.shape
        wp = torch.zeros(ob * 128, ib * 128, dtype=torch.float64)
        wp[: w.shape[0], : w.shape[1]] = w.abs()
        exact = wp.view(ob, 128, ib, 128).amax(dim=(1, 3)) / 448
        assert (s >= exact).all() and (s / 2 < exact).all(), name


def test_make_checkpoint_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="at most one"):
        ck.make_checkpoint(tmp_path / "a", fp8=True, awq=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        ck.make_checkpoint(tmp_path / "full")
    with pytest.raises(ValueError, match="tiny preset takes no options"):
        ck.make_checkpoint(tmp_path / "b", n_experts=16)
    with pytest.raises(ValueError, match="unknown preset"):
        ck.make_checkpoint(tmp_path / "c", preset="huge")


def test_awq_checkpoint_matches_its_specs(tmp_path):
    from custom_ops.awq import awq_dequantize_t

    ref = read_all(ck.make_checkpoint(tmp_path / "bf16"))
    path = ck.make_checkpoint(tmp_path / "awq", awq=True)
    c = ModelConfig.from_json(path)
    assert c.quantization.method == "awq"
    t = read_all(path)
    assert {k: (tuple(v.shape), v.dtype) for k, v in t.items()} == ck.stored_tensor_specs(c)
    name = "model.layers.1.mlp.experts.5.gate_proj"
    w = ref[name + ".weight"].float()
    wt = awq_dequantize_t(t[name + ".qweight"], t[name + ".qzeros"], t[name + ".scales"])
    # 4-bit asymmetric per group of 128 inputs: error <= half a step (scale/2) per element
    step = t[name + ".scales"].float().repeat_interleave(128, 0)
    assert ((wt - w.T).abs() <= step / 2 + 1e-3 * step + 2**-10 * w.abs().T).all()


# ---- FP8 block weights -------------------------------------------------------------------------
def reference_block_quant(w: torch.Tensor):
    """Block by block, straight from the format's definition."""
    ob, ib = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    w8 = torch.empty(w.shape, dtype=E4M3)
    s = torch.empty(ob, ib)
    for i in range(ob):
        for j in range(ib):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float()
            amax = blk.abs().max()
            s[i, j] = amax / 448 if amax > 0 else 1.0
            w8[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / s[i, j]).to(E4M3)
    return w8, s


@pytest.mark.parametrize("shape", [(576, 256), (300, 200), (128, 128), (5, 130)])
def test_weight_quant_round_trip_matches_the_formula(shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    w[:128, :128] *= 100  # blocks with very different scales
    if shape[0] > 128 and shape[1] > 128:
        w[128:256, 128:256] = 0  # an all-zero block
    w8, s = weight_quant_fp8(w)
    r8, rs = reference_block_quant(w)
    assert s.shape == scale_shape(shape) and s.dtype == torch.float32 and w8.dtype == E4M3
    assert torch.equal(s, rs)
    assert torch.equal(w8.view(torch.uint8), r8.view(torch.uint8))
    dq = weight_dequant_fp8(w8, s)
    assert torch.equal(dq, w8.float() * s.repeat_interleave(128, 0)[: shape[0]]
                       .repeat_interleave(128, 1)[:, : shape[1]])
    assert ((dq - w.float()).abs() <= fp8_bound(w.float(), s)).all()
    assert weight_dequant_fp8(w8, s, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_weight_quant_ue8m0_scales_are_powers_of_two():
    w = torch.randn(256, 384) * 0.02
    w8, s = weight_quant_fp8(w, scale_fmt="ue8m0")
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert (w.abs().amax() / s.max() <= 448).all()
    assert ((weight_dequant_fp8(w8, s) - w).abs() <= fp8_bound(w, s)).all()


def test_fp8_weight_helpers_reject_bad_input():
    w8, s = weight_quant_fp8(torch.randn(200, 300))
    with pytest.raises(ValueError, match=r"scale_inv of shape \(2, 3\)"):
        weight_dequant_fp8(w8, s[:, :2])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        weight_dequant_fp8(w8.float(), s)
    with pytest.raises(ValueError, match="2-d"):
        weight_quant_fp8(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="scale_fmt"):
        weight_quant_fp8(torch.randn(4, 4), scale_fmt="e8m0")


# ---- tokenizer ---------------------------------------------------------------------------------
def test_tokenizer_is_deterministic_and_round_trips(tiny):
    from tokenizers import Tokenizer

    a, b = ck.train_tokenizer(512), ck.train_tokenizer(512)
    assert a.to_str() == b.to_str()
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert tok.to_str() == a.to_str()
    assert tok.get_vocab_size() == 512
    assert tok.token_to_id(ck.BOS) == 0 and tok.token_to_id(ck.EOS) == 1
    for text in ("The cache grows very large.", "  spaces\tand\nnewlines  ", "naïve café 東京 🙂",
                 "def f(x):\n    return x ** 2  # 12345"):
        ids = tok.encode(text).ids
        assert ids[0] == 0 and 0 not in ids[1:]  # bos prepended, like V3.2's tokenizer
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    # the training text's words are single tokens or close: merges were learned
    assert len(tok.encode(" the cache", add_special_tokens=False).ids) == 2


def test_tokenizer_config_and_chat_template(tiny):
    from tokenizers import Tokenizer

    cfg = json.loads((tiny / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (cfg["bos_token"], cfg["eos_token"]) == (ck.BOS, ck.EOS)
    prompt = jinja2.Template(cfg["chat_template"]).render(
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Bye"}],
        add_generation_prompt=True, bos_token=cfg["bos_token"], eos_token=cfg["eos_token"])
    assert prompt == (f"{ck.BOS}Be brief.{ck.USER}Hi{ck.ASSISTANT}Hello.{ck.EOS}"
                      f"{ck.USER}Bye{ck.ASSISTANT}")
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == 0 and ids[-1] == tok.token_to_id(ck.ASSISTANT) == 4
    assert ids.count(1) == 1 and ids.count(3) == 2


# ---- resolve_model -----------------------------------------------------------------------------
def test_resolve_model_generates_once_into_the_cache(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("ECHO_COMPILE_CACHE", str(tmp_path / "cache"))
    path = ck.resolve_model("tiny")
    assert path == tmp_path / "cache" / f"tiny-v{ck.CHECKPOINT_VERSION}"
    assert file_hashes(path) == file_hashes(tiny)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no temp dir left

    def boom(*a, **k):
        raise AssertionError("regenerated")

    monkeypatch.setattr(ck, "make_checkpoint", boom)
    assert ck.resolve_model("tiny") == path
    assert ck.resolve_model(str(tiny)) == tiny
    assert ck.resolve_model(tiny) == tiny


def test_resolve_model_cache_honours_the_umask(tmp_path, monkeypatch):
    """Like any cache: dirs 0777 & ~umask, files 0666 & ~umask (was 0700 / 0600: mkdtemp and
    safetensors both create private paths)."""
    monkeypatch.setenv("ECHO_COMPILE_CACHE", str(tmp_path / "cache"))
    old = os.umask(0o027)  # a umask that is not the default, so the modes are its doing
    try:
        path = ck.resolve_model("tiny")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o750
    files = sorted(path.iterdir())
    assert any(f.suffix == ".safetensors" for f in files)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: 0o640 for f in files}


def test_resolve_model_losing_a_race_keeps_the_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHO_COMPILE_CACHE", str(tmp_path))
    final = tmp_path / f"tiny-fp8-v{ck.CHECKPOINT_VERSION}"

    def racing(out, preset, fp8, awq):
        assert (preset, fp8, awq) == ("tiny", True, False)
        (out / "mine").write_text("loser")
        final.mkdir()  # another process finished first
        (final / "theirs").write_text("winner")

    monkeypatch.setattr(ck, "make_checkpoint", racing)
    assert ck.resolve_model("tiny-fp8") == final
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]
    assert [p.name for p in final.iterdir()] == ["theirs"]


def test_resolve_model_rejects_unknown_names(tmp_path):
    with pytest.raises(ValueError, match=re.escape("expected one of ['tiny', 'tiny-awq'")):
        ck.resolve_model("small")
    with pytest.raises(ValueError, match="existing checkpoint directory"):
        ck.resolve_model(tmp_path / "nope")
