"""Built-in model configurations: ``tiny`` (CPU tests, the demo) and ``bench`` (real V3.2 attention
and indexer dimensions with a chosen number of layers and experts, for GPU measurements)."""

from __future__ import annotations

from typing import Any

from model.config import ModelConfig

_YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def tiny_config_dict() -> dict[str, Any]:
    """A small DeepSeek-V3.2: real cache formats (kv_lora 512, rope 64, index_head_dim 128), the
    rest shrunk. index_topk=32 is far below the demo's contexts, so selection is really sparse."""
    return {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_nextn_predict_layers": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 128,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 64,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": dict(_YARN),
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_topk": 32,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def bench_config_dict(num_layers: int = 4, n_experts: int = 16) -> dict[str, Any]:
    """The real V3.2 attention/indexer/vocab dimensions with ``num_layers`` layers (the first
    dense) and ``n_experts`` routed experts (8 groups, 4 chosen, 8 experts per token)."""
    if n_experts % 8 or n_experts < 16:
        raise ValueError(
            f"n_experts must be a multiple of 8 and >= 16 in the bench preset, got {n_experts}"
        )
    d = tiny_config_dict()
    d.update(
        {
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": num_layers,
            "first_k_dense_replace": 1,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
            "n_routed_experts": n_experts,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "index_n_heads": 64,
            "index_topk": 2048,
        }
    )
    return d


def preset_config(name: str, **kw: Any) -> ModelConfig:
    if name == "tiny":
        return ModelConfig.from_dict(tiny_config_dict())
    if name == "bench":
        return ModelConfig.from_dict(bench_config_dict(**kw))
    raise ValueError(f"unknown preset {name!r}: expected 'tiny' or 'bench'")
