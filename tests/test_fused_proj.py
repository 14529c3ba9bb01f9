"""model/fused_proj.py: one linear for several over the same input, in each weights format."""

import subprocess
import sys
import time

import pytest
import torch
from test_loader import last_logits
from torch import nn

from benchmarks import bench_fused_proj as B
from echo_compile.bench.model_builder import build_model
from model.awq import AWQLinear
from model.awq_convert import repack_awq_model
from model.fp8_weights import FP8Linear
from model.fused_proj import fusable, fuse_linears
from runtime.engine_config import EngineConfig
from runtime.model_runner import build_runner


def _parts(fmt, outs, d=256, seed=0):
    return B.make_parts(fmt, d, outs, torch.device("cpu"), torch.Generator().manual_seed(seed))


def _two(parts, x):
    return torch.cat([p(x) for p in parts], -1)


@pytest.mark.parametrize("outs", [(128, 64), (256, 72, 128)])
def test_bf16_weights_concatenated(outs):
    parts = _parts("bf16", outs)
    fused = fuse_linears(parts)
    assert type(fused) is nn.Linear and fused.out_features == sum(outs)
    assert torch.equal(fused.weight, torch.cat([p.weight for p in parts]))
    x = torch.randn(5, 256).bfloat16()
    torch.testing.assert_close(fused(x), _two(parts, x), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("outs", [(128, 64), (256, 72)])
def test_fp8_blocks_and_output(outs):
    parts = _parts("fp8", outs)
    fused = fuse_linears(parts)
    assert type(fused) is FP8Linear and fused.weight_scale_inv.shape == (
        sum(-(-n // 128) for n in outs),
        2,
    )
    # the fused module's weight, dequantised, is the parts' weights stacked: no block mixes two
    want = torch.cat([p.dequantized_weight(torch.float32) for p in parts])
    assert torch.equal(fused.dequantized_weight(torch.float32), want)
    x = torch.randn(3, 256).bfloat16()
    torch.testing.assert_close(fused(x), _two(parts, x), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("repack", [False, True])
def test_awq_words_concatenated(repack):
    parts = _parts("awq", (128, 64))
    fused = fuse_linears(parts)
    assert type(fused) is AWQLinear and fused.out_features == 192
    want = torch.cat([p.dequantized_weight(torch.float32) for p in parts])
    assert torch.equal(fused.dequantized_weight(torch.float32), want)
    if repack:  # the loader fuses first, then repacks (CPU: the pair layout)
        repack_awq_model(nn.ModuleList([*parts, fused]))
        assert torch.equal(fused.dequantized_weight(torch.float32), want)
    x = torch.randn(4, 256).bfloat16()
    torch.testing.assert_close(fused(x), _two(parts, x), rtol=1e-2, atol=1e-3)


def test_refusals_name_the_reason():
    bf, f8, awq = _parts("bf16", (128, 64)), _parts("fp8", (72, 128)), _parts("awq", (128, 64))
    cases = {
        "at least two": bf[:1],
        "mixed types": [bf[0], _parts("fp8", (128,))[0]],
        "not a multiple of 128": f8,
        "different in_features": [bf[0], nn.Linear(128, 64, bias=False)],
        "has a bias": [bf[0], nn.Linear(256, 64)],
        "is not nn.Linear": [nn.Identity(), nn.Identity()],
    }
    repack_awq_model(nn.ModuleList(awq[:1]))
    cases["already repacked"] = awq
    for why, parts in cases.items():
        assert not fusable(parts)
        with pytest.raises(ValueError, match=why):
            fuse_linears(parts)
    assert fusable(f8[::-1])  # the ragged part last is fine


class WallClock:
    """benchmarks.cuda_timer's Backend on the CPU: no graph, the calls run in a loop."""

    def warm(self, calls):
        for c in calls:
            c()

    def capture(self, calls):
        return None, lambda: [c() for c in calls]

    def time_ms(self, replay):
        t = time.perf_counter()
        replay()
        return (time.perf_counter() - t) * 1e3


@pytest.mark.parametrize("fmt", B.FORMATS)
def test_bench_runs_and_checks(fmt):
    rows = B.bench(fmt, [1, 3], 256, (128, 64), 2, torch.device("cpu"), WallClock(), copies=2)
    assert [r["M"] for r in rows] == [1, 3]
    assert all(r["pass"] and r["parts_us"] > 0 and r["fused_us"] > 0 for r in rows)


@pytest.mark.parametrize("weights", ["bf16", "fp8", "awq"])
def test_model_fused_gives_the_same_logits(weights):
    """``fuse_a_projections`` on the tiny model in each format: every layer's q_a and kv_a
    fuse, with the indexer's wk between them where it has their type (not AWQ's quantised
    layers, whose indexer stays 16-bit; their 16-bit first and last layers do), the parts are
    gone, and the logits stay those of the separate GEMMs within their rounding."""
    model = build_model("tiny", 0, 0, "cpu", 0.0, weights)
    prompt = [0, 44, 73, 341, 83]
    before = last_logits(model, prompt)
    wk_types = [type(b.self_attn.indexer.wk) for b in model.model.layers]
    q_types = [type(b.self_attn.q_a_proj) for b in model.model.layers]
    assert model.fuse_a_projections() == len(model.model.layers)
    assert model.fuse_a_projections() == 0  # once
    for block, wk_t, q_t in zip(model.model.layers, wk_types, q_types, strict=True):
        a = block.self_attn
        assert a.q_a_proj is None and a.kv_a_proj_with_mqa is None and a.qkv_a_proj is not None
        three = wk_t is q_t
        assert (a.indexer.wk is None) == three and len(a.a_splits) == (3 if three else 2)
    assert (weights == "awq") == any(b.self_attn.indexer.wk is not None for b in model.model.layers)
    after = last_logits(model, prompt)
    torch.testing.assert_close(after, before, rtol=0.0, atol=2e-2 * before.abs().max().item())
    assert torch.equal(after.argmax(), before.argmax())


def test_runner_fuses_the_model_it_serves():
    model = build_model("tiny", 0, 0, "cpu")
    assert model.model.layers[0].self_attn.qkv_a_proj is None
    build_runner(model, EngineConfig(device="cpu", max_model_len=256, host_tokens=1024))
    assert all(b.self_attn.qkv_a_proj is not None for b in model.model.layers)


def test_bench_cli_help():
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_fused_proj", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "--variants" in r.stdout


def test_awq_is_fused_at_load_before_its_cuda_repack(monkeypatch):
    """On CUDA the loader repacks AWQ modules, which cannot be fused after: it fuses MLA's two
    projections first (finish_loaded_model, run here on CPU tensors as if for CUDA; the tile
    counters it would reserve there are not needed). The fused, repacked model's logits stay the
    unfused AutoAWQ model's within rounding."""
    import custom_ops.tile_counters as tc
    from model.loader import finish_loaded_model

    model = build_model("tiny", 0, 0, "cpu", 0.0, "awq")
    prompt = [0, 44, 73, 341, 83]
    before = last_logits(model, prompt)
    monkeypatch.setattr(tc, "reserve_counters", lambda device: None)
    finish_loaded_model(model, model.config, "cuda", torch.bfloat16)
    attn = [b.self_attn for b in model.model.layers]
    assert all(a.qkv_a_proj is not None and a.q_a_proj is None for a in attn)
    assert any(isinstance(a.qkv_a_proj, AWQLinear) and a.qkv_a_proj.repacked for a in attn)
    after = last_logits(model, prompt)
    torch.testing.assert_close(after, before, rtol=0.0, atol=2e-2 * before.abs().max().item())
