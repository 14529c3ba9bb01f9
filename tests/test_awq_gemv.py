"""``echo::w4a16_gemv`` (custom_ops/awq_gemv.py): the small-M split-K GEMV over the repacked W4
layout, its Triton kernel under the interpreter against the AutoAWQ dequantise-then-matmul
reference (fresh random weights, several shapes, M, configs), its launch configurations, its
checks and its dispatch switch."""

from __future__ import annotations

import pytest
import torch
from test_awq import _awq_weights

from custom_ops import awq as ops
from custom_ops import awq_gemv as G
from custom_ops import awq_gemv_kernels as GK
from custom_ops import awq_repack as R

CASES = [  # (M, K, N, x dtype, scales dtype, config overrides)
    (1, 256, 48, torch.bfloat16, torch.float16, dict(BM=1, BN=32, SPLIT_K=1, DOT=False)),
    (3, 640, 64, torch.bfloat16, torch.bfloat16, dict(BM=4, BN=32, SPLIT_K=3, DOT=False, DEPTH=2)),
    (8, 384, 40, torch.float16, torch.float16, dict(BM=8, BN=16, SPLIT_K=2, DOT=False)),
    (5, 512, 96, torch.bfloat16, torch.float16, dict(BM=16, BN=64, SPLIT_K=2, DOT=True)),
    (16, 384, 32, torch.float16, torch.bfloat16, dict(BM=16, BN=32, SPLIT_K=1, DOT=True, DEPTH=2)),
    (2, 768, 80, torch.bfloat16, torch.float16, None),  # the launcher's own config
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_awq_reference(case):
    m, k, n, dtype, sdtype, cfg = CASES[case]
    g = torch.Generator().manual_seed(1700 + case)
    qw, qz, s = _awq_weights(k, n, g, sdtype)
    r = R.repack_awq(qw, qz, s)
    x = torch.randn(m, 2 * k, generator=g).to(dtype)[:, ::2]  # strided: the launcher copes
    if cfg is not None:
        cfg = {"DEPTH": 1, "num_warps": 4, "num_stages": 1, **cfg}
    y = GK.w4a16_gemv_triton(x, *r, config=cfg)
    ref = ops.w4a16_linear_ref(x.contiguous(), qw, qz, s)  # AutoAWQ: dequantise, then matmul
    assert y.dtype == dtype and y.shape == (m, n) and not y.isnan().any()
    # the same exact fp32 weights, another summation order: about one rounding of the output
    atol = 1e-3 * ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=atol)
    # deterministic: a second call gives the same bits
    assert torch.equal(GK.w4a16_gemv_triton(x, *r, config=cfg), y)


def test_split_k_partials_cover_every_group_once():
    """Splits that do not divide the groups (5 groups, 3 splits: 2 + 2 + 1) and splits past the
    last group (4 splits of 2: the last is empty) both give the single-split result."""
    g = torch.Generator().manual_seed(1710)
    r = R.repack_awq(*_awq_weights(640, 32, g))
    x = torch.randn(2, 640, generator=g).bfloat16()
    base = dict(BM=2, BN=32, DOT=False, DEPTH=1, num_warps=4, num_stages=1)
    one = GK.w4a16_gemv_triton(x, *r, config={**base, "SPLIT_K": 1})
    ref = R.w4a16_linear_r_ref(x, *r)
    for split in (3, 4):
        y = GK.w4a16_gemv_triton(x, *r, config={**base, "SPLIT_K": split})
        torch.testing.assert_close(y.float(), one.float(), rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-3)


def test_configs_and_split_rule():
    # V3.2's 7168 x 4096 on 132 SMs: 32 tiles of 128 columns, 56 groups -> 14 splits of 4
    cfg = GK.gemv_config(1, 4096, 7168, 132)
    assert cfg["BM"] == 1 and not cfg["DOT"] and cfg["BN"] == 128 and cfg["SPLIT_K"] == 14
    assert GK.gemv_config(3, 4096, 7168, 132, dot=False)["BM"] == 4
    assert GK.gemv_config(2, 4096, 7168, 132)["DOT"]  # CONFIG_BY_M: tl.dot from two rows
    assert (
        GK.gemv_config(5, 4096, 7168, 132)["DOT"] and GK.gemv_config(16, 64, 256, 132)["BM"] == 16
    )
    for name in GK.GEMV_CONFIGS:
        for m in (1, 4, 8, 16):
            for dot in (None, True) + ((False,) if m <= GK.FMA_MAX_M else ()):
                c = GK.gemv_config(m, 2048, 7168, 132, name, dot)
                GK.check_gemv_config(m, c)  # every named config is launchable at M <= 16
                groups = 7168 // 128
                per = -(-groups // c["SPLIT_K"])
                # no empty split, at least 2 groups per split
                assert (c["SPLIT_K"] - 1) * per < groups and per >= 2
    with pytest.raises(ValueError, match="unknown config"):
        GK.gemv_config(1, 64, 256, 132, "nope")
    with pytest.raises(ValueError, match="M <= 16"):
        GK.gemv_config(17, 64, 256, 132)
    # the dispatch table covers M = 1..16 in order, with launchable entries
    limits = [row[0] for row in GK.CONFIG_BY_M]
    assert limits == sorted(limits) and limits[-1] == GK.MAX_M
    for m in range(1, GK.MAX_M + 1):
        GK.check_gemv_config(m, GK.gemv_config(m, 4096, 7168, 132))


def test_bad_inputs():
    g = torch.Generator().manual_seed(1711)
    r = R.repack_awq(*_awq_weights(256, 32, g))
    x = torch.randn(4, 256, generator=g).bfloat16()
    torch.library.opcheck(torch.ops.echo.w4a16_gemv, (x, *r))
    with pytest.raises(ValueError, match="M <= 16"):
        torch.ops.echo.w4a16_gemv(torch.randn(17, 256).bfloat16(), *r)
    with pytest.raises(ValueError, match="M <= 16"):
        GK.w4a16_gemv_triton(torch.randn(17, 256).bfloat16(), *r)
    with pytest.raises(ValueError, match="K=128"):
        GK.w4a16_gemv_triton(x[:, :128].contiguous(), *r)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        GK.w4a16_gemv_triton(x.float(), *r)
    bad = dict(BM=2, BN=32, SPLIT_K=1, DOT=False)  # BM < M
    with pytest.raises(ValueError, match="bad config"):
        GK.w4a16_gemv_triton(x, *r, config=bad)
    with pytest.raises(ValueError, match="bad config"):
        GK.w4a16_gemv_triton(x, *r, config={**bad, "BM": 8, "DOT": True})  # MMA needs 16


def test_op_reference_and_dispatch_switch():
    g = torch.Generator().manual_seed(1712)
    qw, qz, s = _awq_weights(256, 24, g, torch.bfloat16)
    r = R.repack_awq(qw, qz, s)
    x = torch.randn(3, 256, generator=g).bfloat16()
    # the op's CPU kernel is the reference: bit for bit the AutoAWQ reference
    assert torch.equal(torch.ops.echo.w4a16_gemv(x, *r), ops.w4a16_linear_ref(x, qw, qz, s))
    assert not G.use_gemv(1, torch.bfloat16)  # GEMV_MAX_M = 0 until the H200 run decides
    assert G.use_gemv(16, torch.float16, max_m=16) and not G.use_gemv(17, torch.bfloat16, 16)
    assert not G.use_gemv(1, torch.float32, max_m=16)
    with pytest.raises(ValueError, match="max_m"):
        G.use_gemv(1, torch.bfloat16, max_m=32)


# ---- the benchmark, on CPU -------------------------------------------------------------------


def test_bench_helpers_and_help():
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks import bench_awq_gemv as B

    assert B.variants(1, ["default"]) == [("default", False)]
    assert B.variants(4, ["default"]) == [("default", False), ("default", True)]
    assert B.variants(16, ["a", "b"]) == [("a", True), ("b", True)]
    # FMA variants whose partial would spill are not timed (BN = 128, 4 warps: 128 registers)
    assert B.variants(8, ["default", "w8"]) == [("default", True), ("w8", False), ("w8", True)]
    assert GK.fma_partial_regs(4, "default") == 64 and GK.fma_partial_regs(8, "default") == 128
    assert B.weight_bytes("bf16", 256, 64) == 4 * B.weight_bytes("gemv", 256, 64) - 4 * 2 * 64 * 3

    def row(m, bf16, served, tg, gemv):
        return {"in": 7168, "out": 4096, "M": m, "bf16_us": bf16, "served_us": served,
                "tinygemm_us": tg, "gemv_best_frac_hbm": 0.5, **gemv}  # fmt: skip

    rows = [
        row(1, 20.0, 10.0, 10.0, {"gemv/default/fma_us": 8.0, "gemv/bn64/fma_us": 7.0}),
        row(4, 20.0, 15.0, 15.0, {"gemv/default/fma_us": 9.0, "gemv/default/dot_us": 12.0}),
        row(8, 20.0, 20.0, 20.0, {"gemv/default/dot_us": 25.0}),  # slower than served: stop
        row(16, 20.0, 30.0, 40.0, {"gemv/default/dot_us": 10.0}),
    ]
    s = B.summarize(rows)
    assert s["gemv_max_m"] == 4
    best = s["best_by_shape_m"]["7168x4096"]
    assert best[1]["config"] == "bn64/fma" and best[1]["x_bf16"] == 20.0 / 7.0
    assert best[4]["config"] == "default/fma" and best[16]["x_served"] == 3.0
    with pytest.raises(SystemExit):
        B.parse_args(["--out", "x.json", "--batches", "1,17"])
    assert B.parse_args(["--out", "x.json", "--configs", "bn64"]).configs == ["bn64"]
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_awq_gemv", "--help"], cwd=root,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "--configs" in out and "--out" in out


# ---- on the GPU ------------------------------------------------------------------------------


def _cuda_cases():
    """The bench's configs at M = 1 (FMA) and 16 (tl.dot); the default at M = 3 and 8, both
    paths: ~14 compiles (the bench's own GPU check covers every config it times)."""
    cases = [(name, 1, False) for name in GK.SWEPT_BY_DEFAULT]
    cases += [(name, 16, True) for name in GK.SWEPT_BY_DEFAULT]
    return cases + [("default", m, dot) for m in (3, 8) for dot in (False, True)]


@pytest.mark.cuda
def test_cuda_kernel_matches_reference_and_replays_in_a_graph():
    gen = torch.Generator("cuda").manual_seed(1720)
    for k, n in ((7168, 2048), (2048, 7168)):  # V3.2's expert gate and down projections
        qw = torch.randint(-(2**31), 2**31, (k, n // 8), dtype=torch.int64, device="cuda",
                           generator=gen).to(torch.int32)  # fmt: skip
        qz = torch.randint(-(2**31), 2**31, (k // 128, n // 8), dtype=torch.int64,
                           device="cuda", generator=gen).to(torch.int32)  # fmt: skip
        s = (torch.rand((k // 128, n), device="cuda", generator=gen) * 2e-3 + 1e-4).half()
        r = R.repack_awq(qw, qz, s)
        for name, m, dot in _cuda_cases():
            x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
            cfg = GK.gemv_config(m, n, k, GK._num_sms(x.device), name, dot)
            y = GK.w4a16_gemv_triton(x, *r, config=cfg)
            ref = ops.w4a16_linear_ref(x, qw, qz, s)
            atol = 1e-3 * ref.abs().max().item()
            torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=atol,
                                       msg=lambda e, c=cfg: f"{c}: {e}")  # fmt: skip
            assert torch.equal(GK.w4a16_gemv_triton(x, *r, config=cfg), y), cfg  # deterministic
        # the op's CUDA kernel is the Triton GEMV; captured in a CUDA graph, its replay gives
        # the same bits
        x = torch.randn(2, k, device="cuda", generator=gen).bfloat16()
        eager = torch.ops.echo.w4a16_gemv(x, *r)
        assert torch.equal(eager, GK.w4a16_gemv_triton(x, *r))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = torch.ops.echo.w4a16_gemv(x, *r)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
