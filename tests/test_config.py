import json
from dataclasses import replace

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
        # another model class than V3.2's (was loaded as V3.2 without a word), or not a list
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "architectures"),
        ({"architectures": "DeepseekV32ForCausalLM"}, "architectures"),
        ({"architectures": [["DeepseekV32ForCausalLM"]]}, "architectures"),
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
        # a field of the wrong JSON type: its name, not a traceback or a silent misread
        ({"rope_scaling": "yarn"}, "rope_scaling"),
        ({"rope_scaling": {"type": "yarn", "factor": "40"}}, "rope_scaling.factor"),
        ({"quantization_config": ["fp8"]}, "quantization_config"),
        (
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}},
            "quantization_config.weight_block_size",
        ),
        (
            {
                "quantization_config": {
                    "quant_method": "awq",
                    "bits": 4,
                    "group_size": 128,
                    "modules_to_not_convert": "indexer",
                }
            },
            "quantization_config.modules_to_not_convert",
        ),
        # an FP8 field the engine cannot honour: named, not served with other numerics
        (
            {"quantization_config": {"quant_method": "fp8", "scale_fmt": "UE8M0"}},
            "quantization_config.scale_fmt",
        ),
        (
            {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
            "quantization_config.activation_scheme",
        ),
        ({"eos_token_id": []}, "eos_token_id"),
        ({"eos_token_id": "1"}, "eos_token_id"),
        ({"eos_token_id": [True]}, "eos_token_id"),
        ({"eos_token_id": [1, "2"]}, "eos_token_id"),
        ({"bos_token_id": 0.5}, "bos_token_id"),
        # ids outside the vocabulary: an OverflowError in the tokenizer (-1), an EOS id that
        # fails decode steps (512 = vocab_size): named
        ({"bos_token_id": -1}, "bos_token_id"),
        ({"eos_token_id": 512}, "eos_token_id"),
        ({"eos_token_id": [1, -1]}, "eos_token_id"),
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),  # was read as 0
        ({"rope_scaling": {"type": "yarn", "mscale": float("inf")}}, "rope_scaling.mscale"),
        # YaRN values its formulas cannot take (a bare "math domain error", or one at model
        # build), a factor below 1 (transformers scales nothing), and an mscale the unit-magnitude
        # cos/sin would serve silently unlike transformers / vLLM: named
        ({"rope_scaling": {"type": "yarn", "factor": 0}}, "rope_scaling.factor"),
        ({"rope_scaling": {"type": "yarn", "factor": 0.5}}, "rope_scaling.factor"),
        (
            {"rope_scaling": {"type": "yarn", "original_max_position_embeddings": 0}},
            "rope_scaling.original_max_position_embeddings",
        ),
        ({"rope_scaling": {"type": "yarn", "beta_fast": 0}}, "rope_scaling.beta_fast"),
        ({"rope_scaling": {"type": "yarn", "mscale": 0.707}}, "rope_scaling.mscale"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": -2}}, "rope_parameters.factor"),
        ({"norm_topk_prob": "false"}, "norm_topk_prob"),
        ({"tie_word_embeddings": 0}, "tie_word_embeddings"),
        ({"moe_layer_freq": True}, "moe_layer_freq"),
        ({"topk_method": 1}, "topk_method"),
    ],
)
def test_bad_config_names_the_field(change, field):
    d = tiny_config_dict()
    d.update(change)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig.from_dict(d)


def test_awq_zero_point_names_what_it_found():
    """zero_point false (symmetric AWQ) or of the wrong type: the message shows the stored value
    (it said only what was supported)."""
    d = tiny_config_dict()
    for bad in (False, "true"):
        d["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128,
                                    "zero_point": bad}  # fmt: skip
        with pytest.raises(ValueError, match=rf"zero_point: only .* got {bad!r}$"):
            ModelConfig.from_dict(d)


def test_awq_bits_and_group_of_the_wrong_type_are_shown_as_stored():
    """``"bits": "4"`` was reported as "only 4-bit AWQ is supported, got 4"."""
    d = tiny_config_dict()
    d["quantization_config"] = {"quant_method": "awq", "bits": "4", "group_size": 128}
    with pytest.raises(ValueError, match=r"quantization_config\.bits: .*got '4'"):
        ModelConfig.from_dict(d)
    d["quantization_config"].update(bits=4, group_size="128")
    with pytest.raises(ValueError, match=r"quantization_config\.group_size: .*got '128'"):
        ModelConfig.from_dict(d)


def test_optional_fields_of_the_right_type_load():
    d = tiny_config_dict()
    d.update(eos_token_id=[1, 2], norm_topk_prob=False, num_nextn_predict_layers=None)
    d["rope_scaling"] = {"type": "yarn", "factor": 40, "mscale": None, "beta_fast": 32}
    c = ModelConfig.from_dict(d)
    assert (c.eos_token_id, c.norm_topk_prob, c.num_nextn_predict_layers) == (1, False, 0)
    assert c.eos_token_ids == (1, 2) and ModelConfig.from_dict(c.to_dict()) == c  # all kept
    assert c.rope_scaling is not None and (c.rope_scaling.factor, c.rope_scaling.mscale) == (40, 1)
    # factor 1 scales by 1 whatever the mscales say; above 1, an absent one is named as such
    d["rope_scaling"] = {"type": "yarn", "factor": 1, "mscale": 0.707}
    assert ModelConfig.from_dict(d).rope_scaling.mscale == 0.707
    d["rope_scaling"] = {"type": "yarn", "factor": 40, "mscale": 0.707}
    with pytest.raises(ValueError, match=r"mscale_all_dim' \(absent: the default 1.0\) differ"):
        ModelConfig.from_dict(d)
    d["rope_scaling"] = {"type": "yarn", "factor": 40}
    d.update(num_nextn_predict_layers=1.0, hidden_size=float(d["hidden_size"]))  # integral
    c = ModelConfig.from_dict(d)
    assert c.num_nextn_predict_layers == 1 and isinstance(c.hidden_size, int)
    for arch in (None, ["DeepseekV32ForCausalLM", "AnotherHead"]):  # model_type says it / named
        d["architectures"] = arch
        assert ModelConfig.from_dict(d) == c
    del d["architectures"]
    assert ModelConfig.from_dict(d) == c


def v5_rope(d, **rope_parameters):
    """``d`` in transformers v5's form: rope_theta and rope_scaling moved into rope_parameters."""
    d = dict(d)
    scaling = {k: v for k, v in d.pop("rope_scaling").items() if k != "type"}
    rp = {"rope_type": "yarn", "rope_theta": d.pop("rope_theta"), **scaling}
    return {**d, "rope_parameters": {**rp, **rope_parameters}}


def test_transformers_v5_rope_parameters_are_read():
    """v5 puts rope_theta and YaRN under rope_parameters (rope_type 'yarn'): the same model as
    v4's rope_scaling. A top-level rope_theta beside it had the model load without YaRN; without
    one, rope_theta was 'missing'."""
    d = tiny_config_dict()
    want = ModelConfig.from_dict(d)
    assert want.rope_scaling is not None
    v5 = v5_rope(d, rope_theta=50000.0)
    assert ModelConfig.from_dict(v5) == replace(want, rope_theta=50000.0)
    assert ModelConfig.from_dict({**v5, "rope_theta": 50000}) == replace(want, rope_theta=50000.0)
    assert ModelConfig.from_dict({**v5_rope(d), "rope_scaling": d["rope_scaling"]}) == want
    default = ModelConfig.from_dict(v5_rope(d, rope_type="default"))
    assert default == replace(want, rope_scaling=None)
    assert default.softmax_scale != want.softmax_scale  # (what the silent misread changed)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_theta": 20000}, r"'rope_theta' \(20000\) and 'rope_parameters.rope_theta'"),
        ({"rope_scaling": {"type": "yarn", "factor": 4}}, "'rope_scaling' and 'rope_parameters'"),
        ({"rope_scaling": {"type": "yarn"}, "rope_parameters": {"rope_type": "default"}},
         "'rope_scaling' and 'rope_parameters' disagree"),
        ({"rope_parameters": {"rope_type": "linear"}}, "rope_parameters.rope_type"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": "40"}}, "rope_parameters.factor"),
        ({"rope_parameters": {"rope_theta": "1e4"}}, "rope_parameters.rope_theta"),
        ({"rope_parameters": "yarn"}, "'rope_parameters'"),
    ],
)
def test_rope_parameters_that_disagree_or_are_bad_are_named(change, message):
    d = {**v5_rope(tiny_config_dict()), "rope_theta": 10000}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**d, **change})


def test_missing_field_is_named(tmp_path):
    d = tiny_config_dict()
    del d["q_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelConfig.from_json(tmp_path)


def test_config_json_not_an_object_is_named(tmp_path):
    """``[]`` was an AttributeError ('list' object has no attribute 'get'), through the CLI's
    plan --model too."""
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"config\.json: expected a JSON object, not list"):
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
