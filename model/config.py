"""ModelConfig: a DeepSeek-V3.2 configuration parsed from a Hugging Face ``config.json``.

Every quirk of the HF format is handled in ``ModelConfig.from_dict`` and the two block parsers it
calls, nowhere else (docs/model_notes.md): the yarn ``rope_scaling`` block (key ``type`` or
``rope_type``) and transformers v5's ``rope_parameters`` (model/rope_scaling.py), the
``quantization_config`` for the official FP8 checkpoints and for AutoAWQ "gemm" checkpoints
(model/quant_config.py); here the fields themselves, their cross-checks and the derived constants
(YaRN softmax scale). Bad input raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from custom_ops.kv_format import INDEX_DIM, KV_LORA, ROPE
from model.config_fields import expect, typed
from model.quant_config import QuantConfig
from model.rope_scaling import RopeScaling, parse_rope_scaling, with_rope_parameters

SUPPORTED_MODEL_TYPES = ("deepseek_v32",)
ARCHITECTURE = "DeepseekV32ForCausalLM"  # config.json's architectures must name it, where given

# Cache formats are hard-wired to the latent, rope and indexer-key widths of custom_ops.kv_format
# (docs/model_notes.md, fixed dimensions): a config with others is refused below.
KV_LORA_RANK = KV_LORA
QK_ROPE_HEAD_DIM = ROPE
INDEX_HEAD_DIM = INDEX_DIM


# (field name, type) of every required config.json field, in V3.2's config.json order.
_REQUIRED: tuple[tuple[str, type], ...] = (
    ("vocab_size", int),
    ("hidden_size", int),
    ("intermediate_size", int),
    ("moe_intermediate_size", int),
    ("num_hidden_layers", int),
    ("first_k_dense_replace", int),
    ("num_attention_heads", int),
    ("q_lora_rank", int),
    ("kv_lora_rank", int),
    ("qk_nope_head_dim", int),
    ("qk_rope_head_dim", int),
    ("v_head_dim", int),
    ("n_routed_experts", int),
    ("n_shared_experts", int),
    ("num_experts_per_tok", int),
    ("n_group", int),
    ("topk_group", int),
    ("routed_scaling_factor", float),
    ("rms_norm_eps", float),
    ("max_position_embeddings", int),
    ("rope_theta", float),
    ("index_n_heads", int),
    ("index_head_dim", int),
    ("index_topk", int),
)
# the optional fields from_dict reads, by type (a JSON null keeps the default)
_OPTIONAL: dict[str, type] = {
    "num_nextn_predict_layers": int,
    "moe_layer_freq": int,
    "topk_method": str,
    "scoring_func": str,
    "norm_topk_prob": bool,
    "hidden_act": str,
    "tie_word_embeddings": bool,
    "bos_token_id": int,
    "eos_token_id": int,  # or a list of them: the first (all of them: eos_token_ids)
    "torch_dtype": str,
}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    num_nextn_predict_layers: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    # config.json's eos_token_id when it is a list: all of them, eos_token_id first (every one
    # ends a request: runtime.detokenize.eos_ids)
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    quantization: QuantConfig | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"config.json field {name!r}: {msg}")

        for name, _ in _REQUIRED:
            v = getattr(self, name)
            if name in ("routed_scaling_factor", "rms_norm_eps", "rope_theta"):
                need(v > 0, name, f"must be positive, got {v}")
            elif name not in ("first_k_dense_replace", "n_shared_experts"):
                need(v > 0, name, f"must be a positive integer, got {v}")
            else:
                need(v >= 0, name, f"must be >= 0, got {v}")
        need(
            self.kv_lora_rank == KV_LORA_RANK,
            "kv_lora_rank",
            f"the KV cache formats are built for {KV_LORA_RANK}, got {self.kv_lora_rank}",
        )
        need(
            self.qk_rope_head_dim == QK_ROPE_HEAD_DIM,
            "qk_rope_head_dim",
            f"the KV cache formats are built for {QK_ROPE_HEAD_DIM}, got {self.qk_rope_head_dim}",
        )
        need(
            self.index_head_dim == INDEX_HEAD_DIM,
            "index_head_dim",
            f"the indexer cache format is built for {INDEX_HEAD_DIM}, got {self.index_head_dim}",
        )
        need(
            self.hidden_size % 128 == 0,
            "hidden_size",
            f"must be a multiple of 128 (FP8 blocks, AWQ groups), got {self.hidden_size}",
        )
        need(
            self.n_routed_experts % self.n_group == 0,
            "n_routed_experts",
            f"{self.n_routed_experts} is not divisible by n_group={self.n_group}",
        )
        need(
            self.topk_group <= self.n_group,
            "topk_group",
            f"{self.topk_group} exceeds n_group={self.n_group}",
        )
        per_group = self.n_routed_experts // self.n_group
        need(
            self.num_experts_per_tok <= self.topk_group * per_group,
            "num_experts_per_tok",
            f"{self.num_experts_per_tok} exceeds the experts of "
            f"topk_group={self.topk_group} groups",
        )
        need(
            per_group >= 2,
            "n_group",
            "group scores sum the top-2 experts of a group: need >= 2 per group",
        )
        need(
            self.first_k_dense_replace <= self.num_hidden_layers,
            "first_k_dense_replace",
            f"{self.first_k_dense_replace} exceeds num_hidden_layers={self.num_hidden_layers}",
        )
        need(
            self.num_nextn_predict_layers >= 0,
            "num_nextn_predict_layers",
            f"must be >= 0, got {self.num_nextn_predict_layers}",
        )
        need(
            self.moe_layer_freq == 1,
            "moe_layer_freq",
            f"only 1 is supported, got {self.moe_layer_freq}",
        )
        need(
            self.topk_method == "noaux_tc",
            "topk_method",
            f"only 'noaux_tc' is supported, got {self.topk_method!r}",
        )
        need(
            self.scoring_func == "sigmoid",
            "scoring_func",
            f"only 'sigmoid' is supported, got {self.scoring_func!r}",
        )
        need(
            self.hidden_act == "silu",
            "hidden_act",
            f"only 'silu' is supported, got {self.hidden_act!r}",
        )
        need(
            not self.tie_word_embeddings,
            "tie_word_embeddings",
            "DeepSeek-V3.2 has a separate lm_head",
        )
        # (an EOS id past the vocabulary fails every decode step that masks EOS, min_tokens';
        # a negative one an OverflowError in the tokenizer: one error naming the field instead)
        for name, ids in (
            ("bos_token_id", (self.bos_token_id,)),
            ("eos_token_id", (self.eos_token_id, *self.eos_token_ids)),
        ):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            vocab = self.vocab_size
            need(not bad, name, f"{bad[:1]} is not a token id in [0, {vocab})")
        need(
            not self.eos_token_ids or self.eos_token_ids[0] == self.eos_token_id,
            "eos_token_id",
            f"eos_token_ids {self.eos_token_ids} must start with eos_token_id {self.eos_token_id}",
        )
        need(
            self.index_topk <= self.max_position_embeddings,
            "index_topk",
            f"{self.index_topk} exceeds max_position_embeddings={self.max_position_embeddings}",
        )

    # ---- derived constants -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale, ``qk_head_dim**-0.5 * mscale**2`` (YaRN; docs/model_notes.md)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and self.max_position_embeddings > rs.original_max_position_embeddings:
            mscale = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
            scale = scale * mscale * mscale
        return scale

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    # ---- (de)serialisation -------------------------------------------------------------------
    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelConfig:
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                "config.json field 'model_type': expected one of "
                f"{SUPPORTED_MODEL_TYPES}, got {mt!r}"
            )
        # NOTE: a config.json naming another model class (a V3 or Llama export given V3.2's
        # model_type) loaded as V3.2 without a word; vLLM picks the model by this field. Absent
        # or null is let be (model_type says it)
        arch = d.get("architectures")
        if arch is not None:
            ok = isinstance(arch, list) and all(isinstance(a, str) for a in arch)
            expect(ok, "architectures", "a list of model class names", arch)
            expect(ARCHITECTURE in arch, "architectures", f"a list naming {ARCHITECTURE!r}", arch)
        d = with_rope_parameters(d)
        kw: dict[str, Any] = {}
        for name, typ in _REQUIRED:
            if name not in d:
                raise ValueError(f"config.json field {name!r} is missing")
            kw[name] = typed(name, d[name], typ)
        kw["rope_scaling"] = parse_rope_scaling(d.get("rope_scaling"), "rope_scaling")
        for name, typ in _OPTIONAL.items():
            v = d.get(name)
            if v is None:
                continue
            if name == "eos_token_id" and isinstance(v, list):  # several: the first is the EOS
                expect(bool(v), name, "an integer or a non-empty list of them", v)
                kw["eos_token_ids"] = tuple(typed(name, t, typ) for t in v)
                v = v[0]
            kw[name] = typed(name, v, typ)
        q = d.get("quantization_config")
        if q is not None:
            expect(isinstance(q, dict), "quantization_config", "an object", q)
            kw["quantization"] = QuantConfig.from_dict(q)
        return ModelConfig(**kw)

    @staticmethod
    def from_json(path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ValueError(f"no config.json at {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(d, dict):  # (from_dict's d.get: an AttributeError)
            raise ValueError(f"{path}: expected a JSON object, not {type(d).__name__}")
        return ModelConfig.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` form (inverse of ``from_dict``)."""
        d: dict[str, Any] = {
            "architectures": [ARCHITECTURE],
            "model_type": "deepseek_v32",
        }
        for k, v in asdict(self).items():
            if k in ("rope_scaling", "quantization", "eos_token_ids"):
                continue
            d[k] = v
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids)
        d["num_key_value_heads"] = self.num_attention_heads
        d["attention_bias"] = False
        d["attention_dropout"] = 0.0
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", **asdict(self.rope_scaling)}
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_dict()
        return d
