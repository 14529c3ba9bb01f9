"""The bench's locality model (model/locality.py) and its calibration (benchmarks/
calibrate_locality.py): λ = 0 is the old random weights bit for bit, λ > 0 changes only the planted
entries and protects its channel, the overlap metric on hand-made selections, and a measured rise
of the real indexer's deep-layer overlap with λ (tiny preset, eager, CPU)."""

from __future__ import annotations

import json
import zlib
from types import SimpleNamespace

import pytest
import torch

from benchmarks import calibrate_locality as cal
from echo_compile.bench.harness import System
from echo_compile.bench.locality import OverlapProbe
from echo_compile.bench.model_builder import build_model
from echo_compile.bench.workload import Workload
from model.locality import FIRST_LOCAL_LAYER, plant_locality
from model.model import DeepseekV32ForCausalLM
from model.presets import preset_config


def _tiny(locality: float = 0.0) -> DeepseekV32ForCausalLM:
    return DeepseekV32ForCausalLM(preset_config("tiny")).random_init_(0, locality=locality)


def test_locality_zero_is_the_old_random_init_bit_for_bit() -> None:
    # the rule random_init_ documents, redrawn here independently of it
    m = _tiny(0.0)
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            want = torch.ones_like(p)
        elif name.endswith("norm.bias"):
            want = torch.zeros_like(p)
        else:
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            s = 0.01 if name.endswith("e_score_correction_bias") else 0.02
            want = torch.empty_like(p).normal_(0.0, s, generator=g)
        assert torch.equal(p, want), name


def test_planting_changes_only_the_planted_entries_and_protects_the_channel() -> None:
    old, new = _tiny(0.0), _tiny(0.9)
    d = old.config.hidden_size
    ch = d - 1
    olds = dict(old.named_parameters())
    for name, p in new.named_parameters():
        q = olds[name]
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if name.endswith("q_b_proj.weight") and layer >= FIRST_LOCAL_LAYER:
            continue  # f projected out (checked below)
        changed = p != q
        if name == "model.embed_tokens.weight":
            assert (p[:, ch] == torch.tensor(0.02, dtype=p.dtype)).all()
            changed[:, ch] = False
        elif p.dim() >= 2 and p.shape[-1] == d and "o_proj" not in name and "w2" not in name:
            planted = layer >= FIRST_LOCAL_LAYER and ("q_a_proj" in name or "weights_proj" in name)
            if not planted:  # readers: the channel's column is zero
                assert (p[..., ch] == 0).all(), name
            changed[..., ch] = False
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert (p[ch] == 0).all(), name
            changed[ch] = False
        if name.endswith("w2_weight"):
            assert (p[:, ch] == 0).all(), name
            changed[:, ch] = False
        assert not changed.any(), f"{name}: entries changed outside the planted ones"
    for i, block in enumerate(new.model.layers):
        wp = block.self_attn.indexer.weights_proj.weight[:, ch]
        qa = block.self_attn.q_a_proj.weight[:, ch].float()
        if i < FIRST_LOCAL_LAYER:
            assert (wp == 0).all() and (qa == 0).all()
            continue
        assert (wp > 0).all() and (wp == wp[0]).all()  # one positive head weighting
        f = qa / qa.norm()
        mla = block.self_attn.q_b_proj.weight.float() @ f  # MLA no longer reads f
        assert mla.abs().max() < 1e-2 * qa.abs().max()
    # nothing random writes the channel: every writer's output is 0 there
    x = torch.randn(3, d).bfloat16()
    for block in new.model.layers:
        assert (block.mlp(x)[:, ch] == 0).all()
        o = torch.randn(3, block.self_attn.o_proj.in_features).bfloat16()
        assert (block.self_attn.o_proj(o)[:, ch] == 0).all()


@pytest.mark.parametrize("bad", [1.0, -0.1, float("nan"), "0.5"])
def test_bad_locality_is_a_value_error(bad) -> None:
    m = DeepseekV32ForCausalLM(preset_config("tiny"))
    with pytest.raises(ValueError, match="locality must be a number in \\[0, 1\\)"):
        m.random_init_(0, locality=bad)
    with pytest.raises(ValueError, match="locality"):
        plant_locality(m, bad)


def _sel(*rows) -> torch.Tensor:
    return torch.tensor([list(r) + [-1] * (4 - len(r)) for r in rows], dtype=torch.int32)


def test_overlap_metric_on_hand_made_selections() -> None:
    calls, now = [], []

    def select(q, w, bt, sl):  # the layer's own select: returns this step's hand-made selection
        calls.append(1)
        return now[-1], None

    layer = SimpleNamespace(select=select)
    probe = OverlapProbe(SimpleNamespace(layers=[layer]))
    bt = torch.tensor([[5, 6], [9, 0]], dtype=torch.int32)  # requests keyed 5 and 9
    live, b_only = torch.tensor([10, 10]), torch.tensor([0, 10])
    steps = [
        (_sel([1, 2, 3, 4], [10, 11]), live),  # first sight: nothing counted
        (_sel([3, 4, 5, 6], [10, 11, 12]), live),  # 2/4 and 2/2
        (_sel([7, 8], [13, 14, 15, 16]), b_only),  # request 5 idle; 9: 0/3
    ]
    for sel, sl in steps:
        now.append(sel)
        layer.select(None, None, bt, sl)
    assert calls == [1, 1, 1]
    assert probe.overlap() == [pytest.approx((0.5 + 1.0 + 0.0) / 3)]
    probe.close()
    assert layer.select is select  # the original select is back


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_higher_locality_measurably_raises_the_indexers_overlap(device) -> None:
    # cuda: CUDA generators draw other weights, and the selections are the Triton kernels'
    model = build_model("tiny", 0, 0, device)
    topk, b, ctx = model.config.index_topk, 2, 1024
    n = cal.pool_rows(b, topk, 4.0)
    wl = Workload(requests=b, min_ctx=ctx, max_ctx=ctx, output_len=8)
    sut = System(model, "offload-eager", n, b * 1152, "fp8", 1152, b, (), device, 0.0, 0, False)
    got = {}
    for lam in (0.0, 0.93):  # increasing: planted in place
        plant_locality(model, lam)
        r = cal.run_knob([sut], wl, [2], 4, warm=2)
        got[lam] = cal.summarize(r["overlap"])
        assert len(r["hit_rate"][0]) == model.config.num_hidden_layers
    # deep layers: from the random baseline (~top-k/context = 3%) to near the published 35-50%
    assert got[0.0]["deep"] < 0.15 and got[0.93]["deep"] > got[0.0]["deep"] + 0.15
    assert got[0.93]["layers_0_1"] < 0.15  # layers 0-1 read nothing planted


def test_interpolated_knob() -> None:
    rows = [{"locality": lam, "summary": {"deep": o}} for lam, o in ((0.0, 0.04), (0.9, 0.3),
            (0.95, 0.5))]  # fmt: skip
    assert cal.interpolated_knob(rows) == pytest.approx(0.9 + 0.05 * 0.12 / 0.2)
    assert cal.best_knob(rows) == 0.95
    assert cal.interpolated_knob(rows[:2]) is None  # never reaches the target


def test_calibration_cli_smoke(tmp_path, capsys) -> None:
    out = tmp_path / "cal.json"
    argv = ["--dry-run", "--knobs", "0.5,0", "--ctx", "256", "--steps", "2", "--out", str(out)]
    assert cal.main(argv) == 0
    d = json.loads(out.read_text())
    assert [r["locality"] for r in d["results"]] == [0.0, 0.5]
    assert [round(p["rows_per_request"] / 32, 1) for p in d["pools"]] == [2.0, 4.0, 10.0]
    for r in d["results"]:
        assert len(r["hit_rate"]) == 3 and len(r["overlap"]) == 4
        assert all(0 < u <= 1 for us in r["gpu_pool_usage"] for u in us)
        assert all(0 <= h <= 1 for hr in r["hit_rate"] for h in hr)
    assert d["best_locality"] in (0.0, 0.5) and "best λ" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cal.main(["--dry-run", "--knobs", "1.0"])
