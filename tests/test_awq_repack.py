"""The repacked W4A16 layout (custom_ops/awq_format.py), ``echo::w4a16_linear_r`` (reference and
Triton kernel under the interpreter), the tinygemm mapping of AWQ's zeros, and the module's
load-time repack with its small-M dispatch."""

from __future__ import annotations

import pytest
import torch
from test_awq import _awq_weights
from test_loader import last_logits
from torch import nn

from custom_ops import awq as ops
from custom_ops import awq_repack as R
from custom_ops import awq_repack_kernels as RK
from model.awq import AWQLinear, repack_awq_model
from model.checkpoint import resolve_model
from model.loader import load_model


def test_repacked_layout_matches_its_spec():
    """Word j of (group g, column n), nibble i, is q[128 g + 16 i + j, n]: checked element by
    element against the AutoAWQ values, with Python ints."""
    g = torch.Generator().manual_seed(1)
    k, n = 256, 16
    qw, qz, s = _awq_weights(k, n, g)
    q = ops.awq_unpack(qw).tolist()  # [K][N]
    qw_r, z_r, s_r = R.repack_awq(qw, qz, s)
    assert qw_r.shape == (2, n, 16) and qw_r.dtype == torch.int32 and (qw_r < 0).any()
    words = qw_r.tolist()
    for gi in range(2):
        for col in range(n):
            for j in range(16):
                w = words[gi][col][j] & 0xFFFFFFFF
                for i in range(8):
                    assert (w >> (4 * i)) & 0xF == q[128 * gi + 16 * i + j][col]
    assert z_r.dtype == torch.uint8 and torch.equal(z_r.int(), ops.awq_unpack(qz))
    assert torch.equal(s_r, s)


def test_repack_round_trip_and_same_dequantisation():
    g = torch.Generator().manual_seed(2)
    qw, qz, s = _awq_weights(384, 40, g, torch.bfloat16)
    qw_r, z_r, s_r = R.repack_awq(qw, qz, s)
    assert torch.equal(R.unpack_repacked(qw_r), ops.awq_unpack(qw))
    assert torch.equal(R.dequantize_repacked_t(qw_r, z_r, s_r), ops.awq_dequantize_t(qw, qz, s))
    x = torch.randn(3, 384, generator=g).bfloat16()
    # the same fp32 weights and the same matmul: the two references agree bit for bit
    assert torch.equal(R.w4a16_linear_r_ref(x, qw_r, z_r, s_r), ops.w4a16_linear_ref(x, qw, qz, s))


def test_opcheck_and_bad_inputs():
    g = torch.Generator().manual_seed(3)
    r = R.repack_awq(*_awq_weights(256, 32, g))
    x = torch.randn(5, 256, generator=g).bfloat16()
    torch.library.opcheck(torch.ops.echo.w4a16_linear_r, (x, *r))
    with pytest.raises(ValueError, match="K=128"):
        torch.ops.echo.w4a16_linear_r(x[:, :128].contiguous(), *r)
    with pytest.raises(ValueError, match="zeros_r must be"):
        torch.ops.echo.w4a16_linear_r(x, r[0], r[1].int(), r[2])
    with pytest.raises(ValueError, match="scales_r must have shape"):
        torch.ops.echo.w4a16_linear_r(x, r[0], r[1], r[2][:, :16])
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        RK.w4a16_linear_r_triton(x.float(), *r)
    with pytest.raises(ValueError, match="bad config"):
        RK.w4a16_linear_r_triton(x, *r, config=dict(BM=8, BN=32, SPLIT_K=1, DOT=True))


CASES = [  # (M, K, N, x dtype, scales dtype, config)
    (1, 128, 32, torch.bfloat16, torch.float16, dict(BM=16, BN=32, SPLIT_K=1, DOT=True)),
    (5, 384, 96, torch.bfloat16, torch.bfloat16, dict(BM=16, BN=64, SPLIT_K=2, DOT=True)),
    (20, 256, 48, torch.float16, torch.float16, dict(BM=16, BN=32, SPLIT_K=1, DOT=True)),
    (3, 512, 40, torch.bfloat16, torch.float16, dict(BM=4, BN=16, SPLIT_K=3, DOT=False)),
    (2, 256, 64, torch.float16, torch.bfloat16, dict(BM=2, BN=64, SPLIT_K=1, DOT=False)),
    (9, 512, 96, torch.bfloat16, torch.float16, None),  # the launcher's own heuristic
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(case):
    m, k, n, dtype, sdtype, cfg = CASES[case]
    g = torch.Generator().manual_seed(100 + case)
    x = torch.randn(m, 2 * k, generator=g).to(dtype)[:, ::2]  # strided: the launcher copes
    r = R.repack_awq(*_awq_weights(k, n, g, sdtype))
    if cfg is not None:
        cfg = {**cfg, "num_warps": 4, "num_stages": 1}
    y = RK.w4a16_linear_r_triton(x, *r, config=cfg)
    ref = R.w4a16_linear_r_ref(x.contiguous(), *r)
    assert y.dtype == dtype and y.shape == (m, n) and not y.isnan().any()
    # same fp32 products, another summation order: at most about one rounding of the output
    atol = 1e-3 * ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=atol)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_tinygemm_maps_awq_zeros_exactly_up_to_bf16():
    """zero = (8 - z) * s: tinygemm's ``(q - 8) * scale + zero`` is AWQ's ``(q - z) * s``."""
    g = torch.Generator().manual_seed(4)
    qw, qz, s = _awq_weights(256, 64, g)
    x = torch.randn(6, 256, generator=g).bfloat16()
    packed, sz = R.tinygemm_pack(qw, qz, s)
    assert sz.shape == (2, 64, 2) and sz.dtype == torch.bfloat16
    # the pair is exact before the bf16 rounding
    z = ops.awq_unpack(qz).float()
    assert torch.equal(sz[..., 1], ((8 - z) * s.float()).bfloat16())
    y = R.tinygemm_linear(x, packed, sz)
    ref = ops.w4a16_linear_ref(x, qw, qz, s)
    assert y.shape == (6, 64) and y.dtype == torch.bfloat16
    # bf16 scales/zeros (2^-9 relative each) and a bf16 output: ~1% of the output norm at most
    assert _rel(y, ref) < 1e-2
    with pytest.raises(ValueError, match="bfloat16"):
        R.tinygemm_linear(x.half(), packed, sz)


def _linear(k: int, n: int, seed: int) -> AWQLinear:
    g = torch.Generator().manual_seed(seed)
    dense = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    return AWQLinear.from_linear(dense)


def test_module_repack_and_dispatch():
    lin = _linear(256, 64, 5)
    x1 = torch.randn(2, 256).bfloat16()
    x9 = torch.randn(3, 3, 256).bfloat16()
    before1, before9 = lin(x1), lin(x9)
    w_before = lin.dequantized_weight()
    lin.repack(tinygemm_max_m=4, large_m="repacked")
    names = {n for n, _ in lin.named_parameters()}
    assert names == {"qweight_r", "zeros_r", "scales_r", "tg_weight", "tg_scale_zero"}
    assert torch.equal(lin.dequantized_weight(), w_before)
    assert torch.equal(lin(x9), before9)  # M = 9 > 4: the Triton path (its reference on CPU)
    y1 = lin(x1)  # M = 2 <= 4: tinygemm
    assert not torch.equal(y1, before1) and _rel(y1, before1) < 1e-2
    with pytest.raises(ValueError, match="already"):
        lin.repack()
    plain = _linear(256, 64, 5)
    plain.repack(large_m="repacked")  # no tinygemm copy
    assert not hasattr(plain, "tg_weight") and torch.equal(plain(x1), before1)


def test_served_dispatch_takes_the_pair_layout_above_tinygemm():
    """The measured dispatch (R.LARGE_M_PATH = "pairs"): tinygemm up to TINYGEMM_MAX_M, the pair
    kernel on the pair layout above, the AutoAWQ tensors dropped; "former" keeps them."""
    assert R.LARGE_M_PATH == "pairs" and R.TINYGEMM_MAX_M == 1
    lin = _linear(256, 64, 7)
    x1, x2 = torch.randn(1, 256).bfloat16(), torch.randn(2, 256).bfloat16()
    before1, before2 = lin(x1), lin(x2)
    repack_awq_model(nn.Sequential(lin), tinygemm_max_m=1)  # the default large-M path
    names = {n for n, _ in lin.named_parameters()}
    assert names == {"qweight_p", "zeros_p", "scales_p", "tg_weight", "tg_scale_zero"}
    assert lin.large_m == "pairs"
    assert torch.equal(lin(x2), before2)  # M = 2 > 1: the pair op (its reference on CPU)
    y1 = lin(x1)  # M = 1: tinygemm (bf16 pairs): close, not equal
    assert not torch.equal(y1, before1) and _rel(y1, before1) < 1e-2
    former = _linear(256, 64, 7)
    former.repack(tinygemm_max_m=1, large_m="former")
    names = {n for n, _ in former.named_parameters()}
    assert names == {"qweight", "qzeros", "scales", "tg_weight", "tg_scale_zero"}
    xh = x1.half()  # not bf16: tinygemm cannot take it, the former op does
    want = torch.ops.echo.w4a16_linear(xh, former.qweight, former.qzeros, former.scales)
    assert torch.equal(former(xh), want)
    with pytest.raises(ValueError, match="large-M path must be"):
        _linear(256, 64, 7).repack(large_m="tinygemm")


def test_repacked_module_compiles_fullgraph():
    lin = _linear(256, 64, 6)
    lin.repack(tinygemm_max_m=2)

    def f(a, b):
        return lin(a).float().sum(0) + lin(b).float().sum(0)  # tinygemm and Triton-layout calls

    a, b = torch.randn(2, 256).bfloat16(), torch.randn(8, 256).bfloat16()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(a, b), f(a, b))


def test_tiny_awq_repacked_logits():
    """The repacked model computes the same logits bit for bit (the Triton path's reference is the
    same fp32 matmul); with tinygemm on every call within the bf16 rounding of its scales."""
    awq, _ = load_model(resolve_model("tiny-awq"))
    prompts = ([0, 44, 73, 341, 83], [0, 264, 499, 315, 432, 18])
    before = [last_logits(awq, p) for p in prompts]
    assert len(repack_awq_model(awq, tinygemm_max_m=-1, large_m="repacked")) >= 10
    assert all(torch.equal(last_logits(awq, p), b) for p, b in zip(prompts, before, strict=True))
    tg, _ = load_model(resolve_model("tiny-awq"))
    repack_awq_model(tg, tinygemm_max_m=1 << 20)
    for p, b in zip(prompts, before, strict=True):
        assert _rel(last_logits(tg, p), b) < 5e-2  # as test_awq_model's bound for bf16 rounding


# ---- MoE over repacked experts -----------------------------------------------------------------


def _moe(t, e, topk, d, inter, gen, dtype=torch.bfloat16):
    from test_awq import _moe_inputs

    x, ids, w, w13, w2 = _moe_inputs(t, e, topk, d, inter, gen, dtype)
    return x, ids, w, w13, w2, R.repack_awq_experts(*w13), R.repack_awq_experts(*w2)


def test_moe_repacked_reference_equals_the_autoawq_one_and_opcheck():
    g = torch.Generator().manual_seed(20)
    x, ids, w, w13, w2, r13, r2 = _moe(5, 4, 2, 256, 128, g)
    assert r13[0].shape == (4, 2, 256, 16) and r2[0].shape == (4, 1, 256, 16)
    for e in range(4):
        assert torch.equal(R.dequantize_repacked_t(r13[0][e], r13[1][e], r13[2][e]),
                           ops.awq_dequantize_t(w13[0][e], w13[1][e], w13[2][e]))  # fmt: skip
    ref = ops.moe_w4a16_ref(x, ids, w, *w13, *w2)
    assert torch.equal(torch.ops.echo.moe_w4a16_r(x, ids, w, *r13, *r2), ref)
    torch.library.opcheck(torch.ops.echo.moe_w4a16_r, (x, ids, w, *r13, *r2))
    with pytest.raises(ValueError, match="expert counts"):
        RK.moe_w4a16_r_triton(x, ids, w, r13[0], r13[1][:2], r13[2], *r2)


MOE_CASES = [  # (T, E, k, D, I, dtype, config)
    (1, 4, 2, 128, 128, torch.bfloat16, dict(BM=16, BN=32)),
    (6, 8, 3, 128, 128, torch.float16, dict(BM=16, BN=64)),
    (20, 4, 2, 128, 128, torch.bfloat16, dict(BM=32, BN=32)),
    (9, 4, 2, 256, 128, torch.bfloat16, None),  # the launcher's own heuristic
]


@pytest.mark.parametrize("case", range(len(MOE_CASES)))
def test_moe_kernel_matches_reference(case):
    t, e, topk, d, inter, dtype, cfg = MOE_CASES[case]
    g = torch.Generator().manual_seed(300 + case)
    x, ids, w, _, _, r13, r2 = _moe(t, e, topk, d, inter, g, dtype)
    if cfg is not None:
        cfg = {**cfg, "num_warps": 4, "num_stages": 1}
    y = RK.moe_w4a16_r_triton(x, ids, w, *r13, *r2, config=cfg)
    ref = R.moe_w4a16_r_ref(x, ids, w, *r13, *r2)
    assert y.dtype == torch.float32 and y.shape == (t, d) and not y.isnan().any()
    # fp32 summation order, then bf16 rounding flips of the intermediate h
    assert _rel(y, ref) < 2e-3


def test_experts_module_repack():
    from model.awq import AWQExperts

    g = torch.Generator().manual_seed(21)
    e, d, inter = 4, 256, 128
    w13 = (torch.randn(e, 2 * inter, d, generator=g) * 0.05).bfloat16()
    mod = AWQExperts.from_dense(w13, (torch.randn(e, d, inter, generator=g) * 0.05).bfloat16())
    x = torch.randn(7, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(7)])
    w = torch.rand(7, 2, generator=g)
    before, dense = mod(x, ids, w), mod.dequantized_weights()
    mod.repack()  # the pair layout (echo::moe_w4a16_p)
    assert {n for n, _ in mod.named_parameters()} == {
        f"{p}_{s}" for p in ("w13", "w2") for s in ("qweight_p", "zeros_p", "scales_p")
    }
    assert torch.equal(mod(x, ids, w), before)
    assert all(torch.equal(a, b) for a, b in zip(mod.dequantized_weights(), dense, strict=True))


# ---- GPU -------------------------------------------------------------------------------------

V32 = [(7168, 4096), (16384, 7168), (7168, 2048), (2048, 7168)]  # (K, N)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 8, 16, 64, 128])
def test_kernel_and_tinygemm_on_gpu_at_v32_shapes(m):
    gen = torch.Generator("cuda").manual_seed(m)
    for k, n in V32[:2]:
        qw = torch.randint(-(2**31), 2**31, (k, n // 8), device="cuda", generator=gen,
                           dtype=torch.int64).to(torch.int32)  # fmt: skip
        qz = torch.randint(-(2**31), 2**31, (k // 128, n // 8), device="cuda", generator=gen,
                           dtype=torch.int64).to(torch.int32)  # fmt: skip
        s = (torch.rand(k // 128, n, device="cuda", generator=gen) * 2e-3 + 1e-4).half()
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        ref = ops.w4a16_linear_ref(x, qw, qz, s)
        r = R.repack_awq(qw, qz, s)
        assert _rel(torch.ops.echo.w4a16_linear_r(x, *r), ref) < 1e-2
        if m <= 4:  # the CUDA-core variant, for a few rows
            fma = {**RK.r_config(m, n, k, 132), "DOT": False, "BM": 4}
            assert _rel(RK.w4a16_linear_r_triton(x, *r, config=fma), ref) < 1e-2
        assert _rel(R.tinygemm_linear(x, *R.tinygemm_pack(qw, qz, s)), ref) < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 4, 16])  # 64 tokens touch ~220 experts: the reference's
def test_moe_repacked_on_gpu_256_experts(t):  # dequantised copy of them ran out of memory
    gen = torch.Generator("cuda").manual_seed(t)
    e, d, inter = 256, 7168, 2048

    def words(*shape):
        return torch.randint(-(2**31), 2**31, shape, device="cuda", generator=gen,
                             dtype=torch.int64).to(torch.int32)  # fmt: skip

    def awq(k, n):
        s = (torch.rand(e, k // 128, n, device="cuda", generator=gen) * 2e-3 + 1e-4).half()
        return words(e, k, n // 8), words(e, k // 128, n // 8), s

    w13, w2 = awq(d, 2 * inter), awq(inter, d)
    x = torch.randn(t, d, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(8, dim=-1).indices
    w = torch.rand(t, 8, device="cuda", generator=gen)
    r13, r2 = R.repack_awq_experts(*w13), R.repack_awq_experts(*w2)
    y = torch.ops.echo.moe_w4a16_r(x, ids, w, *r13, *r2)
    # the reference on the touched experts only (dequantising 256 experts would take long)
    used = torch.unique(ids)
    remap = torch.full((e,), -1, dtype=torch.long, device="cuda")
    remap[used] = torch.arange(used.numel(), device="cuda")
    sub = [tuple(t_[used] for t_ in part) for part in (w13, w2)]
    ref = ops.moe_w4a16_ref(x, remap[ids], w, *sub[0], *sub[1])
    assert _rel(y, ref) < 5e-3


@pytest.mark.cuda
def test_repacked_linear_captures_in_cuda_graph():
    lin = _linear(7168, 2048, 7).cuda()
    lin.repack(tinygemm_max_m=4, large_m="repacked")
    xs = [torch.randn(m, 7168, device="cuda").bfloat16() for m in (2, 32)]
    want = [lin(x).clone() for x in xs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x in xs:
            lin(x)
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        outs = [lin(x) for x in xs]
    gr.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))


# ---- the benchmark, on CPU -------------------------------------------------------------------


def test_bench_awq_helpers_and_help():
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks import bench_awq as B

    rows = [
        {"in": 7168, "out": 4096, "M": m, "tinygemm_us": tg, "repacked_us": rp, "former_us": fo}
        for m, tg, rp, fo in (
            (1, 10.0, 12.0, 30.0),
            (8, 20.0, 21.0, 19.0),
            (16, 40.0, 22.0, 30.0),
            (32, 70.0, 25.0, 24.0),
        )  # fmt: skip
    ]
    assert B.dispatch_table(rows) == {"7168x4096": 1}  # at M = 8 the former kernel won
    rows[0]["fbgemm_us"] = 9.0
    assert B.best_by_m(rows) == {"7168x4096": {1: "fbgemm", 8: "former", 16: "repacked",
                                               32: "former"}}  # fmt: skip
    cands = B.repacked_candidates(2, 4096, 7168, 132)
    assert cands[0] == RK.r_config(2, 4096, 7168, 132) and any(not c["DOT"] for c in cands)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_awq", "--help"], cwd=root,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "--configs" in out and "--out" in out


def test_fbgemm_format_maps_awq_exactly():
    """fbgemm's signed-nibble format (before its shuffle): q' * scale + zero == (q - z) * s,
    exactly in fp32, from the same AutoAWQ tensors."""
    from custom_ops import awq_fbgemm as FB

    qw, qz, s = _awq_weights(256, 64, torch.Generator().manual_seed(11))
    packed, scale, zero = FB.fbgemm_pack_unshuffled(qw, qz, s)
    assert packed.dtype == torch.int8 and packed.shape == (64, 128)
    want = ops.awq_dequantize_t(qw, qz, s)
    assert torch.equal(FB.fbgemm_unpacked_weight_t(packed, scale, zero), want)
    assert not torch.equal(FB.fbgemm_unpacked_weight_t(packed, scale, zero * 0), want)
