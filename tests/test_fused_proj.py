"""model/fused_proj.py: one linear for several over the same input, in each weights format."""

import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from benchmarks import bench_fused_proj as B
from model.awq import AWQLinear
from model.awq_convert import repack_awq_model
from model.fp8_weights import FP8Linear
from model.fused_proj import fusable, fuse_linears


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


def test_bench_cli_help():
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_fused_proj", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "--variants" in r.stdout
