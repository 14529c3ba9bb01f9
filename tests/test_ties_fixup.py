"""The tie fix-up's kernel variants (custom_ops/backends/ties_config.py) on CPU, under the Triton
interpreter: every named variant, and each with small blocks so that a row spans several chunks
and blocks (ties split inside a block, blocks that select nothing, rows shorter than k, an empty
row), selects exactly the stable-sort set and returns its k-th value, from a library top-k that
breaks ties at random. The GPU run of the same check: benchmarks/bench_topk_fixup.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from custom_ops.backends import ties, ties_kernels
from custom_ops.backends.ties_config import DEFAULT_FIXUP, FIXUP_VARIANTS, FixupConfig, fixup_config
from custom_ops.kv_format import PAGE
from tests.test_backends import _kth_from_any_topk
from tests.test_decode_kernels import _gen, _tie_scores

B, P, TOPK = 5, 4, 48
W = P * PAGE + 64  # wider than the block table, as DeepGEMM's padded rows
LENS = torch.tensor([0, 30, 48, 200, P * PAGE], dtype=torch.int32)


def _case(kind: str, seed: int, width: int = W):
    bt = torch.randperm(40, generator=_gen(seed))[: B * P].view(B, P).int()
    s = _tie_scores(B, width, _gen(seed + 1), kind).contiguous()
    want = ties.stable_select_ref(s, bt, LENS, TOPK)
    _, raw = _kth_from_any_topk(s, LENS, TOPK, seed=seed + 2)
    return s, bt, raw.contiguous(), want


@pytest.mark.parametrize("name", sorted(FIXUP_VARIANTS))
def test_every_variant_selects_the_stable_sort_set(name):
    s, bt, raw, (want_host, want_kth) = _case("ties", 20)
    assert (want_host[4] >= 0).sum() == TOPK and (want_host[0] == -1).all()
    cfg = FIXUP_VARIANTS[name]
    for c in (cfg, dataclasses.replace(cfg, block=64, chunk=128)):  # several chunks and blocks
        host, kth = ties_kernels.fixup(s, bt, LENS, raw, TOPK, c)
        assert torch.equal(host, want_host), (name, c)
        assert torch.equal(kth, want_kth), (name, c)


@pytest.mark.parametrize("kind", ["equal", "near"])
@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("mode", ["v2", "v2_1d", "v3"])
def test_variants_on_other_tie_patterns(kind, fold, mode):
    """ "equal": every live score ties, the first k are taken, the cut inside a block and the later
    blocks selecting nothing (the skipped scans); "near": no ties at all. A row width that is
    not a multiple of 16 (the vector loads' mask)."""
    s, bt, raw, (want_host, want_kth) = _case(kind, 30, width=P * PAGE + 37)
    cfg = fixup_config(mode)
    cfg = dataclasses.replace(cfg, block=32 if mode == "v2_1d" else 64, chunk=64, fold_kth=fold)
    host, kth = ties_kernels.fixup(s, bt, LENS, raw, TOPK, cfg)
    assert torch.equal(host, want_host) and torch.equal(kth, want_kth)
    # from a given kth (threshold_select): the same set
    got = ties_kernels.threshold_select(s, bt, LENS, want_kth, TOPK, cfg)
    assert torch.equal(got, want_host)


def test_v3_lists_and_re_reads_with_many_ties():
    """A row with far more ties than k before its two scores above kth, in one chunk (it takes
    ties: the re-read) and in four (the later chunks copy their lists); and a kth that is no
    live score (a NaN among a library's scores): fewer selected, the rest -1."""
    s = torch.zeros(2, 256)
    s[0, 200] = s[0, 250] = 1.0
    s[1, :5] = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0])
    lens = torch.tensor([256, 5], dtype=torch.int32)
    bt = torch.tensor([[3, 2, 1, 0], [4, 5, 6, 7]], dtype=torch.int32)
    kth = torch.tensor([0.0, 3.5])
    want = ties.threshold_select_ref(s, bt, lens, kth, 8)
    assert want[0].tolist() == [192, 193, 194, 195, 196, 197, 8, 58]  # 6 ties, then 200 and 250
    assert want[1].tolist() == [256, 258] + [-1] * 6
    for chunk in (256, 64):
        cfg = FixupConfig(variant="v3", block=64, chunk=chunk)
        assert torch.equal(ties_kernels.threshold_select(s, bt, lens, kth, 8, cfg), want)


def test_bad_configs_and_inputs_are_named():
    s, bt, raw, _ = _case("ties", 40)
    for cfg, what in (
        (FixupConfig(variant="v9"), "variant"),
        (FixupConfig(block=48), "block"),
        (FixupConfig(block=32768), "block"),
        (FixupConfig(block=64, chunk=96), "chunk"),
        (FixupConfig(block=32), "whole pages"),
    ):
        with pytest.raises(ValueError, match=what):
            ties_kernels.fixup(s, bt, LENS, raw, TOPK, cfg)
    with pytest.raises(ValueError, match="raw"):
        ties_kernels.fixup(s, bt, LENS, raw.long(), TOPK)
    with pytest.raises(ValueError, match="unknown fix-up variant"):
        fixup_config("fastest")
    kth = torch.zeros(s.shape[0])
    for bad in (kth.double(), kth[:, None], torch.zeros(2 * s.shape[0])[::2]):
        with pytest.raises(ValueError, match="kth"):
            ties_kernels.threshold_select(s, bt, LENS, bad, TOPK)


def test_bench_topk_fixup_dry_run(tmp_path):
    """The GPU benchmark's code path at toy sizes on CPU: every check recorded and passing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "fixup.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_topk_fixup", "--dry-run", "--variants", "v1,v2"]
    root = Path(__file__).resolve().parents[1]
    subprocess.run([*cmd, "--out", str(out)], cwd=root, check=True, capture_output=True)
    res = json.loads(out.read_text())
    assert res["all_pass"] and res["default_variant"] == DEFAULT_FIXUP
    fixup_checks = [c for c in res["checks"] if c["path"] == "fixup"]
    assert {c["variant"] for c in fixup_checks} == {"v1", "v2"} and len(fixup_checks) == 6
    assert {r["kind"] for r in res["timings"]} == {"randn", "zeros"}


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["ties", "equal"])
def test_every_variant_on_gpu_at_full_length(kind):
    """Each variant's compiled kernels at 100K with its own block sizes (several chunks per row),
    inside a CUDA graph as the decode step runs them, against the reference."""
    dev = "cuda"
    Bg, L, k = 4, 100_032, 2048
    s = _tie_scores(Bg, L, _gen(50), kind).to(dev).contiguous()
    Pg = L // PAGE
    bt = torch.randperm(Bg * Pg, generator=_gen(51))[: Bg * Pg].view(Bg, Pg).int().to(dev)
    sl = torch.tensor([L, 70_000, 1000, 0], dtype=torch.int32, device=dev)
    _, raw = _kth_from_any_topk(s.cpu(), sl.cpu(), k, seed=52)
    raw = raw.to(dev).contiguous()
    kth_ref = ties.kth_from_indices_ref(s, raw)
    want = ties.threshold_select_ref(s, bt, sl, kth_ref, k)
    assert torch.equal(want, ties.stable_select_ref(s, bt, sl, k)[0])
    for name, cfg in FIXUP_VARIANTS.items():
        ties_kernels.fixup(s, bt, sl, raw, k, cfg)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            host, kth = ties_kernels.fixup(s, bt, sl, raw, k, cfg)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(host, want), name
        assert torch.equal(kth, kth_ref), name
