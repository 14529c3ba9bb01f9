"""Synthetic Hugging Face DeepSeek-V3.2 checkpoints: the tiny model the CPU tests and the demo run.

``make_checkpoint`` writes a directory laid out like the real hub repos (docs/model_notes.md):
``config.json``, ``generation_config.json``, sharded ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json``, ``tokenizer.json`` and ``tokenizer_config.json``. Three flavours:
bf16, official FP8 (128x128 block scales) and QuantTrio-style AWQ 4-bit. ``resolve_model`` turns the
names ``tiny``, ``tiny-fp8`` and ``tiny-awq`` into such a directory, generated once into a cache.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model.config import ModelConfig
from model.fp8_weights import scale_shape, weight_quant_fp8
from model.presets import preset_config
from model.quant_config import QuantConfig

# Bump whenever the generated files change (weights, tokenizer, layout): it names the cache dir.
CHECKPOINT_VERSION = 2  # 2: tiny-fp8 scales are ue8m0 (powers of two), as its config declares
BUILTIN_MODELS = {"tiny": "bf16", "tiny-fp8": "fp8", "tiny-awq": "awq"}
CACHE_ENV = "ECHO_COMPILE_CACHE"

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT)  # ids 0..4: bos 0, eos 1 as in V3.2

# DeepSeek-style chat template: system text first, then <｜User｜>... <｜Assistant｜>...<eos>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ m['content'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}" + USER + "{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' %}" + ASSISTANT + "{{ m['content'] }}{{ eos_token }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}" + ASSISTANT + "{%- endif %}"
)

GENERATION_CONFIG = {
    "_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1,
    "do_sample": True, "temperature": 1.0, "top_p": 0.95,
}

# Linears the official checkpoint stores in FP8 (docs/model_notes.md), by module-name suffix.
# NOT: the router gate (`mlp.gate`), `indexer.weights_proj`, `eh_proj`, embeddings, heads, norms.
QUANTIZED_LINEARS = (
    "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
    "self_attn.kv_b_proj", "self_attn.o_proj", "indexer.wq_b", "indexer.wk",
    "gate_proj", "up_proj", "down_proj",
)

INIT_STD = 0.02  # config initializer_range
MAX_SHARD_BYTES = 4 << 30
MIN_SHARDS = 3

Spec = tuple[tuple[int, ...], torch.dtype]


# ---- tensor inventory --------------------------------------------------------------------------
def _layer_specs(c: ModelConfig, layer: int) -> dict[str, Spec]:
    bf16, D = torch.bfloat16, c.hidden_size
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    H, nope, rope, v = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    s: dict[str, Spec] = {
        p + "input_layernorm.weight": ((D,), bf16),
        a + "q_a_proj.weight": ((c.q_lora_rank, D), bf16),
        a + "q_a_layernorm.weight": ((c.q_lora_rank,), bf16),
        a + "q_b_proj.weight": ((H * (nope + rope), c.q_lora_rank), bf16),
        a + "kv_a_proj_with_mqa.weight": ((c.kv_lora_rank + rope, D), bf16),
        a + "kv_a_layernorm.weight": ((c.kv_lora_rank,), bf16),
        a + "kv_b_proj.weight": ((H * (nope + v), c.kv_lora_rank), bf16),
        a + "o_proj.weight": ((D, H * v), bf16),
        a + "indexer.wq_b.weight": ((c.index_n_heads * c.index_head_dim, c.q_lora_rank), bf16),
        a + "indexer.wk.weight": ((c.index_head_dim, D), bf16),
        a + "indexer.k_norm.weight": ((c.index_head_dim,), bf16),
        a + "indexer.k_norm.bias": ((c.index_head_dim,), bf16),
        a + "indexer.weights_proj.weight": ((c.index_n_heads, D), bf16),
        p + "post_attention_layernorm.weight": ((D,), bf16),
    }
    m = p + "mlp."
    if not c.is_moe_layer(layer):
        for name, shape in (("gate_proj", (c.intermediate_size, D)),
                            ("up_proj", (c.intermediate_size, D)),
                            ("down_proj", (D, c.intermediate_size))):
            s[f"{m}{name}.weight"] = (shape, bf16)
        return s
    s[m + "gate.weight"] = ((c.n_routed_experts, D), bf16)
    s[m + "gate.e_score_correction_bias"] = ((c.n_routed_experts,), torch.float32)
    I = c.moe_intermediate_size
    for e in range(c.n_routed_experts):
        s[f"{m}experts.{e}.gate_proj.weight"] = ((I, D), bf16)
        s[f"{m}experts.{e}.up_proj.weight"] = ((I, D), bf16)
        s[f"{m}experts.{e}.down_proj.weight"] = ((D, I), bf16)
    if c.n_shared_experts:
        Is = I * c.n_shared_experts
        s[m + "shared_experts.gate_proj.weight"] = ((Is, D), bf16)
        s[m + "shared_experts.up_proj.weight"] = ((Is, D), bf16)
        s[m + "shared_experts.down_proj.weight"] = ((D, Is), bf16)
    return s


def checkpoint_tensor_specs(config: ModelConfig) -> dict[str, Spec]:
    """Every tensor of the bf16 HF checkpoint of ``config``, in file order: name -> (shape, dtype).

    Includes the MTP layers ``model.layers.{num_hidden_layers + k}.*`` (docs/model_notes.md).
    """
    c, bf16 = config, torch.bfloat16
    V, D = c.vocab_size, c.hidden_size
    s: dict[str, Spec] = {"model.embed_tokens.weight": ((V, D), bf16)}
    for layer in range(c.num_hidden_layers):
        s.update(_layer_specs(c, layer))
    for k in range(c.num_nextn_predict_layers):
        p = f"model.layers.{c.num_hidden_layers + k}."
        s[p + "embed_tokens.weight"] = ((V, D), bf16)
        s[p + "enorm.weight"] = ((D,), bf16)
        s[p + "hnorm.weight"] = ((D,), bf16)
        s[p + "eh_proj.weight"] = ((D, 2 * D), bf16)
        s.update(_layer_specs(c, c.num_hidden_layers + k))
        s[p + "shared_head.norm.weight"] = ((D,), bf16)
        s[p + "shared_head.head.weight"] = ((V, D), bf16)
    s["model.norm.weight"] = ((D,), bf16)
    s["lm_head.weight"] = ((V, D), bf16)
    return s


def is_quantized_linear(module: str) -> bool:
    """True for the linears that the FP8 (and AWQ) checkpoints quantise, e.g.
    ``model.layers.3.mlp.experts.7.down_proj``."""
    return module.startswith("model.layers.") and module.endswith(QUANTIZED_LINEARS)


def awq_modules_to_not_convert(config: ModelConfig) -> tuple[str, ...]:
    """QuantTrio's exclusions (docs/model_notes.md) adapted to ``config``: router gate, indexer, the
    dense layers, the last layer and the MTP layers stay 16-bit."""
    keep = list(range(config.first_k_dense_replace)) + [config.num_hidden_layers - 1]
    keep += [config.num_hidden_layers + k for k in range(config.num_nextn_predict_layers)]
    layers = [f"model.layers.{i}." for i in dict.fromkeys(keep)]
    return ("mlp.gate.", "indexer", *layers)


def _awq_quantized(module: str, q: QuantConfig) -> bool:
    # NOTE: matched on "module." so that "mlp.gate." excludes the router `mlp.gate` itself.
    return is_quantized_linear(module) and not q.awq_skips(module + ".")


def _stored_specs_of(name: str, spec: Spec, q: QuantConfig | None) -> dict[str, Spec]:
    """The stored tensors that the bf16 tensor ``name`` becomes under ``q``."""
    shape, dtype = spec
    module, leaf = name.rsplit(".", 1)
    if q is None or leaf != "weight" or not is_quantized_linear(module):
        return {name: spec}
    if q.method == "fp8":
        return {name: (shape, torch.float8_e4m3fn),
                module + ".weight_scale_inv": (scale_shape(shape), torch.float32)}
    if not _awq_quantized(module, q):
        return {name: spec}
    n, k = shape  # [out, in]
    g = q.group_size
    if k % g or n % 8:
        raise ValueError(f"{name}: AWQ needs in % {g} == 0 and out % 8 == 0, got {list(shape)}")
    return {module + ".qweight": ((k, n // 8), torch.int32),
            module + ".qzeros": ((k // g, n // 8), torch.int32),
            module + ".scales": ((k // g, n), torch.float16)}


def stored_tensor_specs(config: ModelConfig) -> dict[str, Spec]:
    """The tensors as written for ``config.quantization`` (None, fp8 or awq): quantised linears
    become ``weight`` e4m3 + ``weight_scale_inv`` fp32, or AWQ ``qweight/qzeros/scales``."""
    out: dict[str, Spec] = {}
    for name, spec in checkpoint_tensor_specs(config).items():
        out.update(_stored_specs_of(name, spec, config.quantization))
    return out


# ---- random weights ----------------------------------------------------------------------------
def _source_name(name: str) -> str:
    """MTP embed/head are copies of the main ones (V3W: "shares parameters")."""
    if re.fullmatch(r"model\.layers\.\d+\.embed_tokens\.weight", name):
        return "model.embed_tokens.weight"
    if re.fullmatch(r"model\.layers\.\d+\.shared_head\.head\.weight", name):
        return "lm_head.weight"
    return name


def init_tensor(name: str, spec: Spec, config: ModelConfig, seed: int = 0) -> torch.Tensor:
    """The bf16-flavour value of checkpoint tensor ``name``: depends on (name, seed, config) only,
    not on the order in which tensors are generated."""
    shape, dtype = spec
    name = _source_name(name)
    if name.endswith("norm.weight"):  # RMSNorm / LayerNorm weights (incl. enorm, hnorm)
        return torch.ones(shape, dtype=dtype)
    if name.endswith("k_norm.bias"):
        return torch.zeros(shape, dtype=dtype)
    std = INIT_STD
    if name.endswith("e_score_correction_bias"):
        std = 0.01
    elif name == "lm_head.weight":
        # logits ~ N(0, 1) for a unit-RMS final hidden state, whatever hidden_size is
        std = max(INIT_STD, config.hidden_size**-0.5)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    # Drawn in row chunks: the same numbers as one draw, without an fp32 copy of a huge tensor.
    rows = max(1, (1 << 24) // max(1, math.prod(shape[1:])))
    chunks = [
        (torch.randn((min(rows, shape[0] - r), *shape[1:]), generator=g) * std).to(dtype)
        for r in range(0, shape[0], rows)
    ]
    return torch.cat(chunks) if len(chunks) > 1 else chunks[0]


def _quantize(name: str, w: torch.Tensor, q: QuantConfig | None) -> dict[str, torch.Tensor]:
    """The stored tensors of bf16 checkpoint tensor ``name`` with value ``w`` under ``q``."""
    module, leaf = name.rsplit(".", 1)
    if q is None or leaf != "weight" or not is_quantized_linear(module):
        return {name: w}
    if q.method == "fp8":
        w8, s = weight_quant_fp8(w, scale_fmt=q.scale_fmt)  # write what config.json declares
        return {name: w8, module + ".weight_scale_inv": s}
    if not _awq_quantized(module, q):
        return {name: w}
    from model.awq_quant import awq_quantize  # NOTE: only the AWQ flavour needs model/awq_quant.py

    qweight, qzeros, scales = awq_quantize(w)
    return {module + ".qweight": qweight, module + ".qzeros": qzeros, module + ".scales": scales}


# ---- files -------------------------------------------------------------------------------------
def _nbytes(spec: Spec) -> int:
    shape, dtype = spec
    return math.prod(shape) * dtype.itemsize


def _shard_plan(config: ModelConfig) -> list[list[str]]:
    """bf16 tensor names per shard, in file order, by size: the stored tensors of one bf16 tensor
    (e.g. an FP8 weight and its scale) always land in the same shard."""
    q = config.quantization
    sizes = {
        name: sum(_nbytes(s) for s in _stored_specs_of(name, spec, q).values())
        for name, spec in checkpoint_tensor_specs(config).items()
    }
    total = sum(sizes.values())
    n = max(MIN_SHARDS, math.ceil(total / MAX_SHARD_BYTES))
    shards: list[list[str]] = [[] for _ in range(n)]
    done = 0
    for name, size in sizes.items():
        shards[min(n - 1, int((done + size / 2) * n / total))].append(name)
        done += size
    return [s for s in shards if s]


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``tokenizer_data.TRAINING_TEXT`` with
    the DeepSeek special tokens at ids 0.. (bos 0, eos 1); encoding prepends bos, like V3.2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from model.tokenizer_data import TRAINING_TEXT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    if tok.token_to_id(BOS) != 0 or tok.token_to_id(EOS) != 1:
        raise RuntimeError("tokenizer training did not put bos/eos at ids 0/1")
    if tok.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > vocab_size {vocab_size}")
    return tok


def tokenizer_config(config: ModelConfig) -> dict[str, Any]:
    return {
        "add_bos_token": True, "add_eos_token": False,
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "clean_up_tokenization_spaces": False, "legacy": True,
        "model_max_length": config.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
    }


def _umask() -> int:
    # NOTE: the only portable way to read the umask is to set it; set it straight back
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def with_quantization(config: ModelConfig, fp8: bool, awq: bool) -> ModelConfig:
    """``config`` with the quantization block a checkpoint of that format declares (the one
    place that says which modules an FP8 / AWQ checkpoint quantises; at most one of the two)."""
    if fp8 and awq:
        raise ValueError("make_checkpoint: choose at most one of fp8 and awq")
    if fp8:
        q = QuantConfig(method="fp8", scale_fmt="ue8m0")  # the official config's fields
    elif awq:
        q = QuantConfig(method="awq", modules_to_not_convert=awq_modules_to_not_convert(config))
    else:
        return config
    return dataclasses.replace(config, quantization=q)


def make_checkpoint(out_dir: str | Path, preset: str | ModelConfig = "tiny", fp8: bool = False,
                    awq: bool = False, seed: int = 0, **preset_kw: Any) -> Path:
    """Write a random-weight HF DeepSeek-V3.2 checkpoint of ``preset`` (a preset name or a
    ``ModelConfig``) into the empty or new directory ``out_dir`` (``~`` expanded); returns its
    path.

    The same arguments give byte-identical files. ``fp8``: official 128x128-block FP8 linears;
    ``awq``: AWQ 4-bit linears (via ``model.awq_quant``) outside ``awq_modules_to_not_convert``. The
    quantised flavours are computed from the bf16 flavour's weights of the same ``seed``.
    """
    if isinstance(preset, ModelConfig):
        if preset_kw:
            raise ValueError(f"make_checkpoint: {sorted(preset_kw)} only apply to a preset name")
        config = preset
    else:
        if preset == "tiny" and preset_kw:
            raise ValueError(f"make_checkpoint: the tiny preset takes no options, got {preset_kw}")
        config = preset_config(preset, **preset_kw)
    config = with_quantization(config, fp8, awq)
    out = Path(out_dir).expanduser()  # NOTE: the shell leaves `--out=~/x` as it is
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"make_checkpoint: {out} exists and is not an empty directory")
    out.mkdir(parents=True, exist_ok=True)

    specs = checkpoint_tensor_specs(config)
    plan = _shard_plan(config)
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(plan, 1):
        fname = f"model-{k:05d}-of-{len(plan):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            want = _stored_specs_of(name, specs[name], config.quantization)
            got = _quantize(name, init_tensor(name, specs[name], config, seed), config.quantization)
            for sname, t in got.items():
                if sname not in want or (tuple(t.shape), t.dtype) != want[sname]:
                    raise RuntimeError(
                        f"{sname}: produced {tuple(t.shape)} {t.dtype}, expected {want.get(sname)}"
                    )
                tensors[sname] = t.contiguous()
                weight_map[sname] = fname
                total += t.numel() * t.element_size()
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        # NOTE: safetensors creates its files 0600 whatever the umask; give them the mode any
        # other file gets (0644 under umask 022), so a shared cache or checkpoint is readable
        os.chmod(out / fname, 0o666 & ~_umask())
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})
    _write_json(out / "config.json", config.to_dict())
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    tok = train_tokenizer(config.vocab_size)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(out / "tokenizer_config.json", tokenizer_config(config))
    return out


# ---- built-in names ----------------------------------------------------------------------------
def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "echo-compile")


def resolve_model(name_or_path: str | Path) -> Path:
    """``tiny``/``tiny-fp8``/``tiny-awq`` -> their checkpoint dir, generated deterministically on
    first use into ``$ECHO_COMPILE_CACHE`` (default ``~/.cache/echo-compile``); an existing
    directory -> itself. Concurrent first uses are safe: each generates into its own temporary
    directory and renames it into place atomically; the loser of the race discards its copy."""
    name = str(name_or_path)
    if name in BUILTIN_MODELS:
        flavour = BUILTIN_MODELS[name]
        root = cache_dir()
        final = root / f"{name}-v{CHECKPOINT_VERSION}"
        if final.is_dir():
            return final
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; it becomes the cache entry
        try:
            make_checkpoint(tmp, "tiny", fp8=flavour == "fp8", awq=flavour == "awq")
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not final.is_dir():
                raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return final
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    raise ValueError(
        f"model {name!r}: expected one of {sorted(BUILTIN_MODELS)} or an existing checkpoint "
        "directory (with config.json, model.safetensors.index.json and tokenizer.json)"
    )
