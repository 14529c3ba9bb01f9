import json

import pytest

from model.config import ModelConfig
from model.presets import bench_config_dict, preset_config, tiny_config_dict


def test_presets_parse_and_round_trip():
    for d in (tiny_config_dict(), bench_config_dict()):
        c = ModelConfig.from_dict(d)
        assert ModelConfig.from_dict(c.to_dict()) == c


def test_bench_softmax_scale_matches_reference():
    # 192**-0.5 * (0.1 * ln 40 + 1)**2 (docs/model_notes.md, MLA)
    assert preset_config("bench").softmax_scale == pytest.approx(0.1352338, rel=1e-6)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"n_routed_experts": 9}, "n_routed_experts"),
        ({"kv_lora_rank": 256}, "kv_lora_rank"),
        ({"hidden_size": 200}, "hidden_size"),
        ({"index_topk": "many"}, "index_topk"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling.type"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
        (
            {"quantization_config": {"quant_method": "awq", "bits": 8, "group_size": 128}},
            "quantization_config.bits",
        ),
        (
            {
                "quantization_config": {
                    "quant_method": "awq",
                    "bits": 4,
                    "group_size": 128,
                    "version": "gemv",
                }
            },
            "quantization_config.version",
        ),
    ],
)
def test_bad_config_names_the_field(change, field):
    d = tiny_config_dict()
    d.update(change)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict(d)


def test_missing_field_is_named(tmp_path):
    d = tiny_config_dict()
    del d["q_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelConfig.from_json(tmp_path)


def test_quantization_configs_recognised():
    d = tiny_config_dict()
    d["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    assert ModelConfig.from_dict(d).quantization.method == "fp8"
    d["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "version": "gemm",
        "zero_point": True,
        "modules_to_not_convert": ["indexer", "model.layers.0."],
    }
    q = ModelConfig.from_dict(d).quantization
    assert q.awq_skips("model.layers.0.mlp.gate_proj") and not q.awq_skips("model.layers.10.mlp")
