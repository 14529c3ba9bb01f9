"""The pair layout (custom_ops/awq_format.py), ``echo::w4a16_linear_p`` and ``echo::moe_w4a16_p``:
references against the AutoAWQ ones, the Triton kernels under the interpreter against them, and
(marked ``cuda``) the inline-PTX mode against the Triton-ops mode bit for bit, at V3.2 shapes."""

from __future__ import annotations

import pytest
import torch
from test_awq import _awq_weights, _moe_inputs

from custom_ops import awq as ops
from custom_ops import awq_pairs as P
from custom_ops import awq_pairs_kernels as PK
from custom_ops import awq_pairs_moe as PM


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def test_pair_layout_matches_its_spec():
    """Word p of (group g, column n) holds q[128 g + 32 s + 2 p + h, n] at bit 4 s + 16 h:
    checked element by element against the AutoAWQ values, with Python ints."""
    qw, qz, s = _awq_weights(256, 16, torch.Generator().manual_seed(1))
    q = ops.awq_unpack(qw).tolist()  # [K][N]
    qw_p, zs = P.pair_awq(qw, qz, s)
    assert qw_p.shape == (2, 16, 16) and qw_p.dtype == torch.int32 and (qw_p < 0).any()
    words = qw_p.tolist()
    for g in range(2):
        for col in range(16):
            for p in range(16):
                w = words[g][col][p] & 0xFFFFFFFF
                for s_ in range(4):
                    for h in range(2):
                        assert (w >> (4 * s_ + 16 * h)) & 0xF == q[128 * g + 32 * s_ + 2 * p + h][
                            col
                        ]
    z, sc = P.unpack_zs(zs)  # one word per (group, column): z in bits 0..7, fp16 s in 16..31
    assert zs.dtype == torch.int32 and zs.shape == (2, 16)
    assert torch.equal(z, ops.awq_unpack(qz)) and torch.equal(sc, s.half())
    assert torch.equal(zs & 0xFF, z) and torch.equal(zs >> 16, sc.view(torch.int16).int())


def test_bf16_scales_are_stored_as_fp16_exactly_or_refused():
    """The pair layout keeps fp16 scales: a bf16 checkpoint's scales convert exactly (fp16 has
    more mantissa bits) within fp16's normal range; outside it, a clear error at load time."""
    z = torch.tensor([[3, 15]], dtype=torch.uint8)
    s = torch.tensor([[1.5e-3, 3.0e2]], dtype=torch.bfloat16)
    assert torch.equal(P.unpack_zs(P.pack_zs(z, s))[1].to(torch.bfloat16), s)
    with pytest.raises(ValueError, match="bf16 scales that fp16 cannot represent exactly"):
        P.pack_zs(z, torch.tensor([[1.0e-7, 1.0]], dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="scales must be float16 or bfloat16"):
        P.pack_zs(z, s.float())


def test_round_trip_and_references_equal_the_autoawq_ones():
    g = torch.Generator().manual_seed(2)
    qw, qz, s = _awq_weights(384, 40, g, torch.bfloat16)
    pw = P.pair_awq(qw, qz, s)
    assert torch.equal(P.unpack_pairs(pw[0]), ops.awq_unpack(qw))
    assert torch.equal(P.dequantize_pairs_t(*pw), ops.awq_dequantize_t(qw, qz, s))
    x = torch.randn(3, 384, generator=g).bfloat16()
    assert torch.equal(torch.ops.echo.w4a16_linear_p(x, *pw), ops.w4a16_linear_ref(x, qw, qz, s))
    torch.library.opcheck(torch.ops.echo.w4a16_linear_p, (x, *pw))
    x, ids, w, w13, w2 = _moe_inputs(5, 4, 2, 256, 128, g, torch.bfloat16)
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    ref = ops.moe_w4a16_ref(x, ids, w, *w13, *w2)
    assert torch.equal(torch.ops.echo.moe_w4a16_p(x, ids, w, *p13, *p2), ref)
    torch.library.opcheck(torch.ops.echo.moe_w4a16_p, (x, ids, w, *p13, *p2))


def test_bad_inputs_name_the_problem():
    g = torch.Generator().manual_seed(3)
    pw = P.pair_awq(*_awq_weights(256, 64, g))
    x = torch.randn(5, 256, generator=g).bfloat16()
    with pytest.raises(ValueError, match="K=128"):
        torch.ops.echo.w4a16_linear_p(x[:, :128].contiguous(), *pw)
    with pytest.raises(ValueError, match="zs_p must be torch.int32"):
        torch.ops.echo.w4a16_linear_p(x, pw[0], pw[1].long())
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        torch.ops.echo.w4a16_linear_p(x.float(), *pw)
    with pytest.raises(ValueError, match="BN a multiple of 64"):
        PK.w4a16_linear_p_triton(x, *pw, config={"BN": 32, "BT": 16, "SPLIT_K": 1})
    with pytest.raises(ValueError, match="qweight must be"):
        P.pair_awq_experts(*_awq_weights(256, 64, g))
    x, ids, w, w13, w2 = _moe_inputs(2, 4, 2, 256, 128, g)
    e13, e2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    with pytest.raises(ValueError, match="SPLIT_K must be an int >= 1"):
        PM.moe_w4a16_p_triton(x, ids, w, *e13, *e2, config={**PM.moe_p_config(4, 4), "SPLIT_K": 0})
    with pytest.raises(ValueError, match="counter tiles .split-K or k-sum. in one launch"):
        PK._counters(torch.device("cpu"), PK.COUNTERS + 1)


@pytest.mark.parametrize(
    "k,n,m,dtype,cfg",
    [
        (256, 64, 1, torch.bfloat16, None),  # the launcher's rule
        (384, 128, 5, torch.bfloat16, {"BN": 64, "BT": 16, "SPLIT_K": 2}),  # uneven split
        (512, 192, 20, torch.float16, {"BN": 64, "BT": 32, "SPLIT_K": 3}),
        (256, 96, 3, torch.bfloat16, {"BN": 64, "BT": 16, "SPLIT_K": 4}),  # N % BN, empty split
        (256, 128, 40, torch.bfloat16, {"BN": 128, "BT": 16, "SPLIT_K": 1}),  # several T tiles
    ],
)
def test_linear_kernel_matches_reference(k, n, m, dtype, cfg):
    g = torch.Generator().manual_seed(k + n + m)
    qw, qz, s = _awq_weights(k, n, g, dtype)
    pw = P.pair_awq(qw, qz, s)
    x = torch.randn(m, k, generator=g).to(dtype)
    if cfg is not None:
        cfg = {**cfg, "num_warps": 4, "num_stages": 1}
    y = PK.w4a16_linear_p_triton(x, *pw, config=cfg)
    ref = P.w4a16_linear_p_ref(x, *pw)
    assert y.dtype == dtype and y.shape == (m, n)
    assert _rel(y, ref) < 4e-3  # fp32 in another order, then the output rounding
    assert torch.equal(PK.w4a16_linear_p_triton(x, *pw, config=cfg), y)  # same bits again
    if cfg is not None and cfg["SPLIT_K"] > 1:  # the fused reduction sums in the same order
        assert torch.equal(PK.w4a16_linear_p_triton(x, *pw, config={**cfg, "FUSED": True}), y)


@pytest.mark.parametrize(
    "k,n,m,dtype,cfg",
    [
        (256, 64, 3, torch.bfloat16, {"BN": 64, "BT": 16, "SPLIT_K": 1}),
        (384, 128, 40, torch.bfloat16, {"BN": 128, "BT": 32, "SPLIT_K": 2}),  # uneven split
        (256, 96, 20, torch.float16, {"BN": 64, "BT": 32, "SPLIT_K": 1}),  # N % BN
    ],
)
def test_scaled_kernel_and_dequant_match_the_rounded_weights(k, n, m, dtype, cfg):
    """SCALED and ``dequant_p`` compute with ``(q - z) * s`` rounded to x's dtype: the dequantised
    weight equals the rounded reference bit for bit; the scaled product is within fp32 order of
    it (measured <= 1e-6; the exact-weight kernel is 3e-4 (fp16) to 3e-3 (bf16) away, so the
    bound tells the two apart); the rounding moves the result well within the AWQ tolerance of
    the exact-weight one. The launcher takes the dequantised path by itself from DEQUANT_MIN_M."""
    g = torch.Generator().manual_seed(7 * k + n + m)
    qw, qz, s = _awq_weights(k, n, g, torch.float16)  # fp16 scales: rounded for bf16 x
    pw = P.pair_awq(qw, qz, s)
    w16 = P.dequantize_pairs_t(*pw, dtype=dtype)  # [K, N] fp32 of dtype values
    assert not torch.equal(w16, P.dequantize_pairs_t(*pw)) or dtype == torch.float16
    assert torch.equal(PK.dequant_p_triton(*pw, dtype), w16.t().to(dtype))
    x = torch.randn(m, k, generator=g).to(dtype)
    y = PK.w4a16_linear_p_triton(x, *pw, config={**cfg, "SCALED": True, "num_warps": 4,
                                                 "num_stages": 1})  # fmt: skip
    ref = (x.float() @ w16).to(dtype)
    assert y.dtype == dtype and _rel(y, ref) < 5e-5
    assert _rel(y, P.w4a16_linear_p_ref(x, *pw)) < 1e-2
    big = PK.w4a16_linear_p_triton(x, *pw, config={"DEQUANT": True})
    assert torch.equal(big, torch.nn.functional.linear(x, w16.t().contiguous().to(dtype)))
    xs = torch.randn(PK.DEQUANT_MIN_M, k, generator=g).to(dtype)  # the rule, no config given
    want = torch.nn.functional.linear(xs, w16.t().contiguous().to(dtype))
    assert torch.equal(PK.w4a16_linear_p_triton(xs, *pw), want)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        PK.dequant_p_triton(*pw, torch.float32)
    with pytest.raises(ValueError, match="zs_p must have shape"):
        PK.dequant_p_triton(pw[0], pw[1][:, :8].contiguous(), dtype)


@pytest.mark.parametrize(
    "k,n,m,dtype,cfg",
    [
        (256, 64, 3, torch.bfloat16, {"BN": 64, "BT": 16, "SPLIT_K": 1}),
        (384, 128, 70, torch.bfloat16, {"BN": 64, "BT": 64, "SPLIT_K": 2}),  # uneven split
        (256, 96, 20, torch.float16, {"BN": 64, "BT": 32, "SPLIT_K": 1}),  # N % BN
    ],
)
def test_group_dot_matches_the_four_slices(k, n, m, dtype, cfg):
    """GROUP_DOT (one MMA over the group's 128 K rows, ``_group_tile``) computes what the four
    32-row MMAs compute: within fp32 order of them, exact weights and SCALED, the linear and the
    MoE."""
    g = torch.Generator().manual_seed(5 * k + n + m)
    qw, qz, s = _awq_weights(k, n, g, torch.float16)
    pw = P.pair_awq(qw, qz, s)
    x = torch.randn(m, k, generator=g).to(dtype)
    for scaled in (False, True):
        c = {**cfg, "SCALED": scaled, "num_warps": 4, "num_stages": 1}
        a = PK.w4a16_linear_p_triton(x, *pw, config=c)
        b = PK.w4a16_linear_p_triton(x, *pw, config={**c, "GROUP_DOT": True})
        assert _rel(b, a) < 1e-5 and _rel(b, P.w4a16_linear_p_ref(x, *pw)) < 1e-2
    x, ids, tw, w13, w2 = _moe_inputs(4, 4, 2, 256, 128, g, dtype)
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    c = {"BN": 64, "BT": 16, "num_warps": 4, "num_stages": 1}
    a = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config=c)
    b = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config={**c, "GROUP_DOT": True})
    assert _rel(b, a) < 1e-5


@pytest.mark.parametrize(
    "k,n,m,dtype,cfg",
    [
        (256, 64, 3, torch.bfloat16, {"BN": 64, "BT": 16, "SPLIT_K": 2, "FUSED": True}),
        (384, 128, 70, torch.bfloat16, {"BN": 64, "BT": 64, "SPLIT_K": 2}),  # uneven split
        (256, 96, 20, torch.float16, {"BN": 64, "BT": 32, "SPLIT_K": 1}),  # N % BN
        (512, 40, 5, torch.bfloat16, {"BN": 64, "BT": 16, "SPLIT_K": 3}),  # N < BN
    ],
)
def test_tma_loads_equal_pointer_loads(k, n, m, dtype, cfg):
    """TMA (the words, the zero-point / scale words and, with GROUP_DOT, x by tensor
    descriptors) computes the same bits as the pointer loads: exact weights and SCALED, four
    slices and GROUP_DOT, x with rows off 16 bytes (copied first); the rows it reads past N (the
    next group's columns, or zeros) never reach the output."""
    g = torch.Generator().manual_seed(11 * k + n + m)
    qw, qz, s = _awq_weights(k, n, g, torch.float16)
    pw = P.pair_awq(qw, qz, s)
    x = torch.randn(m, k, generator=g).to(dtype)
    for scaled in (False, True):
        for gd in (False, True):
            c = {**cfg, "SCALED": scaled, "GROUP_DOT": gd, "num_warps": 4, "num_stages": 1}
            a = PK.w4a16_linear_p_triton(x, *pw, config=c)
            for tma in (PK.TMA_W, PK.TMA_ZS, PK.TMA_X, 7) if gd else (PK.TMA_W, PK.TMA_ZS):
                b = PK.w4a16_linear_p_triton(x, *pw, config={**c, "TMA": tma})
                assert torch.equal(b, a), (scaled, gd, tma)
    assert _rel(b, P.w4a16_linear_p_ref(x, *pw)) < 1e-2
    xs = torch.cat([torch.zeros(m, 1, dtype=dtype), x], 1)[:, 1:]  # rows 2 bytes off 16
    c = {**cfg, "GROUP_DOT": True, "num_warps": 4, "num_stages": 1}
    want = PK.w4a16_linear_p_triton(x, *pw, config=c)
    assert torch.equal(PK.w4a16_linear_p_triton(xs, *pw, config={**c, "TMA": 7}), want)
    bad = [torch.zeros(k // 128, 6, *w, dtype=torch.int32) for w in ((16,), ())]
    with pytest.raises(ValueError, match="w4a16_linear_p: TMA needs a 16-byte aligned"):
        PK.w4a16_linear_p_triton(x, *bad, config={**cfg, "TMA": PK.TMA_ZS})


@pytest.mark.parametrize(
    "t,e,topk,d,inter,dtype,cfg",
    [
        (1, 4, 2, 128, 128, torch.bfloat16, {"BN": 64, "BT": 16}),
        (6, 8, 3, 256, 128, torch.float16, {"BN": 64, "BT": 16}),
        (20, 4, 2, 128, 384, torch.bfloat16, {"BN": 256, "BT": 32}),  # I, D % BN
        (9, 4, 2, 256, 128, torch.bfloat16, None),  # the launcher's rule
    ],
)
def test_moe_kernel_matches_reference(t, e, topk, d, inter, dtype, cfg):
    g = torch.Generator().manual_seed(400 + t)
    x, ids, w, w13, w2 = _moe_inputs(t, e, topk, d, inter, g, dtype)
    ids[0, -1] = e  # expert parallelism's skip id: another rank's expert, no contribution
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    if cfg is not None:
        cfg = {**cfg, "num_warps": 4, "num_stages": 1}
    y = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config=cfg)
    ref = P.moe_w4a16_p_ref(x, ids, w, *p13, *p2)
    assert y.dtype == torch.float32 and y.shape == (t, d) and not y.isnan().any()
    assert _rel(y, ref) < 2e-3  # fp32 order, then bf16 flips of the intermediate h
    if cfg is not None and d >= 256:  # the gate/up pass split over D, summed by the last split
        ys = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config={**cfg, "SPLIT_K": 2})
        assert _rel(ys, ref) < 2e-3 and not PK._COUNTERS[x.device].any()
    # the down pass's own sum over the k experts (SUM_K, the rule's choice at one token) against
    # the separate torch sum: the same rows summed in another order; the counters reset
    cfg = cfg or PM.moe_p_config(t * topk, e)
    unfused = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config={**cfg, "SUM_K": False})
    fused = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config={**cfg, "SUM_K": True})
    assert torch.equal(fused if t <= PM.SUM_K_MAX_TOKENS else unfused, y)
    assert _rel(fused, unfused) < 1e-6
    assert not PK._COUNTERS[x.device].any()


@pytest.mark.parametrize("t,bt,dtype", [(9, 16, torch.bfloat16), (20, 32, torch.float16)])
def test_scaled_moe_matches_the_rounded_weights(t, bt, dtype):
    """The MoE's SCALED passes compute with ``(q - z) * s`` rounded to x's dtype: within fp32
    order (and h's rounding) of the reference on those weights, within the AWQ tolerance of the
    exact-weight one."""
    g = torch.Generator().manual_seed(500 + t)
    x, ids, w, w13, w2 = _moe_inputs(t, 4, 2, 256, 128, g, dtype)
    for wt in (w13, w2):
        wt[2].copy_(wt[2].half().to(wt[2].dtype))  # fp16-exact scales either way
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    cfg = {"BN": 64, "BT": bt, "num_warps": 4, "num_stages": 1, "SCALED": True}
    y = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config=cfg)
    w13_t = P.dequantize_pairs_experts_t(*p13, dtype=dtype)
    w2_t = P.dequantize_pairs_experts_t(*p2, dtype=dtype)
    assert _rel(y, ops._moe_ref(x, ids, w, w13_t, w2_t)) < 5e-5  # exact weights: >= 4e-4 away
    assert _rel(y, P.moe_w4a16_p_ref(x, ids, w, *p13, *p2)) < 1e-2


def test_moe_kernel_sums_tokens_with_skipped_pairs():
    """SUM_K when some tokens have fewer pairs on this rank (expert parallelism's skip id E) and
    one has none: that token's row is zero, the others equal the separate sum's."""
    g = torch.Generator().manual_seed(77)
    t, e, topk = 5, 4, 3
    x, ids, w, w13, w2 = _moe_inputs(t, e, topk, 128, 128, g)
    ids[1, :] = e  # every pair of token 1 on another rank
    ids[3, 0] = e
    ids[4, 1:] = e
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    cfg = {"BN": 64, "BT": 16, "num_warps": 4, "num_stages": 1}
    fused = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config={**cfg, "SUM_K": True})
    unfused = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config={**cfg, "SUM_K": False})
    ref = P.moe_w4a16_p_ref(x, ids, w, *p13, *p2)
    assert torch.equal(fused[1], torch.zeros(128)) and fused[0].abs().sum() > 0
    assert _rel(fused, unfused) < 1e-6 and _rel(fused, ref) < 2e-3
    assert not PK._COUNTERS[x.device].any()


def test_config_rules():
    # the H200 sweep's winners (awq_pairs_zs_sweep_h200.json), as the rule returns them
    want = {"BN": 128, "BT": 16, "num_warps": 4, "num_stages": 4, "SPLIT_K": 8, "FUSED": True,
            "SCALED": False, "GROUP_DOT": True}  # fmt: skip
    assert PK.p_config(1, 4096, 7168, 132) == want
    assert PK.p_config(16, 2048, 7168, 132) == {**want, "BN": 64}  # N < 4096: 64 columns
    assert PK.p_config(8, 7168, 2048, 132)["SPLIT_K"] == 4  # G / 4
    assert not PK.p_config(1, 7168, 16384, 132)["GROUP_DOT"]  # 2^26 weights: four slices
    want = {**want, "BT": 32, "FUSED": False, "GROUP_DOT": False}
    assert PK.p_config(32, 4096, 7168, 132) == want
    assert PK.p_config(32, 7168, 16384, 132)["SPLIT_K"] == 4  # about 2 programs per SM
    want = {**want, "BT": 64, "num_stages": 3}
    assert PK.p_config(64, 4096, 7168, 132) == want
    want = {"BN": 128, "BT": 128, "num_warps": 8, "num_stages": 3, "SPLIT_K": 4, "FUSED": False,
            "SCALED": True, "GROUP_DOT": False}  # fmt: skip
    assert PK.p_config(96, 7168, 16384, 132) == want  # 2^26 weights or more: SCALED below 128
    assert PK.p_config(127, 7168, 16384, 132) == want
    assert PK.p_config(128, 7168, 16384, 132) == {  # a full tile: exact, GROUP_DOT, TMA
        "BN": 64, "BT": 128, "num_warps": 4, "num_stages": 3, "SPLIT_K": 2, "FUSED": False,
        "SCALED": False, "GROUP_DOT": True, "TMA": 7}  # fmt: skip
    # smaller: the exact kernel on 64 columns; a full tile: every load by TMA
    assert PK.p_config(128, 2048, 7168, 132) == {
        "BN": 64, "BT": 128, "num_warps": 4, "num_stages": 3, "SPLIT_K": 8, "FUSED": False,
        "SCALED": False, "GROUP_DOT": True, "TMA": 7}  # fmt: skip
    assert "TMA" not in PK.p_config(96, 2048, 7168, 132)  # a part-filled tile: pointer loads
    assert not any("TMA" in PK.p_config(m, 2048, 7168, 132) for m in (1, 16, 32, 64))
    # two token tiles: the exact kernel on 64 columns, on every shape, four slices
    assert PK.p_config(200, 7168, 16384, 132) == {**PK.p_config(96, 2048, 7168, 132),
                                                   "SPLIT_K": 1, "GROUP_DOT": False}  # fmt: skip
    assert PK.p_config(300, 4096, 128, 132)["SPLIT_K"] == 1  # one group: no split
    assert not PK.uses_dequant(256) and PK.uses_dequant(257)
    assert [PK.tokens_tile(m) for m in (1, 16, 17, 64, 65, 500)] == [16, 16, 32, 64, 128, 128]
    assert PM.moe_p_config(8, 256) == {"BN": 64, "BT": 16, "num_warps": 4, "num_stages": 3}
    assert PM.moe_p_config(64, 256) == {"BN": 128, "BT": 16, "num_warps": 4, "num_stages": 4}
    want = {"BN": 128, "BT": 64, "num_warps": 8, "num_stages": 3, "SCALED": True}
    assert PM.moe_p_config(64 * 40, 64) == want  # prefill: 40 pairs per expert
    assert PM.moe_p_config(64 * 32, 64)["BT"] == 32 and "SCALED" not in PM.moe_p_config(2048, 64)
    assert PM.gate_up_split(256, 56, target=1024) == 4 and PM.gate_up_split(256, 56, 0) == 1
    assert PM.gate_up_split(8, 56, target=1024) == 8  # at most 8 splits (7 groups each)
    assert PM.gate_up_split(8, 12, target=1024) == 2  # at least 4 groups a split


# ---- GPU -------------------------------------------------------------------------------------


def _rand_awq_cuda(k, n, gen, lead=()):
    def words(*shape):
        return torch.randint(-(2**31), 2**31, shape, device="cuda", generator=gen,
                             dtype=torch.int64).to(torch.int32)  # fmt: skip

    s = (torch.rand((*lead, k // 128, n), device="cuda", generator=gen) * 2e-3 + 1e-4).half()
    return words(*lead, k, n // 8), words(*lead, k // 128, n // 8), s


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 3, 16, 20, 32, 33, 64, 128, 200, 300])
def test_linear_on_gpu_at_v32_shapes(m):
    gen = torch.Generator("cuda").manual_seed(m)
    for k, n in ((7168, 4096), (2048, 7168), (1536, 576 * 4)):
        w = _rand_awq_cuda(k, n, gen)
        pw = P.pair_awq(*w)
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
            a = PK.w4a16_linear_p_triton(x, *pw, mode=PK.MODE_ASM)
            b = PK.w4a16_linear_p_triton(x, *pw, mode=PK.MODE_OPS)
            assert torch.equal(a, b)  # the inline PTX forms the same (q - z) values
            assert torch.equal(torch.ops.echo.w4a16_linear_p(x, *pw), a)  # deterministic
            assert _rel(a, ops.w4a16_linear_ref(x, *w)) < 1e-2


@pytest.mark.cuda
def test_scaled_kernel_and_dequant_on_gpu():
    """The rounded-weight paths at V3.2 shapes: ``dequant_p`` bit for bit the rounded reference
    (PTX and Triton ops, bf16 and fp16); the SCALED kernel's PTX == ops, within fp32 order of
    those weights, on wide tiles, split or not."""
    gen = torch.Generator("cuda").manual_seed(17)
    for k, n in ((7168, 4096), (2048, 7168)):
        pw = P.pair_awq(*_rand_awq_cuda(k, n, gen))
        for dtype in (torch.bfloat16, torch.float16):
            w16 = P.dequantize_pairs_t(*pw, dtype=dtype)
            for mode in (PK.MODE_ASM, PK.MODE_OPS):
                assert torch.equal(PK.dequant_p_triton(*pw, dtype, mode), w16.t().to(dtype))
            # the H200 bench measured <= 2e-4 (bf16) against the rounded weights; the exact-weight
            # kernel is ~3e-3 (bf16) / ~3e-4 (fp16) away, so the bounds tell the two apart
            bound = 1e-3 if dtype == torch.bfloat16 else 1e-4
            for m in (20, 32, 33, 128, 300):
                x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
                for bn, split in ((128, 2), (256, 1)):
                    cfg = {"BN": bn, "BT": PK.tokens_tile(m), "SPLIT_K": split, "num_warps": 8,
                           "num_stages": 3, "SCALED": True}  # fmt: skip
                    a = PK.w4a16_linear_p_triton(x, *pw, config=cfg, mode=PK.MODE_ASM)
                    b = PK.w4a16_linear_p_triton(x, *pw, config=cfg, mode=PK.MODE_OPS)
                    assert torch.equal(a, b)
                    assert _rel(a, (x.float() @ w16).to(dtype)) < bound


@pytest.mark.cuda
def test_tma_on_gpu():
    """TMA at V3.2 shapes (16384 x 7168 too), decode to 256 tokens, the served configuration with
    the pointer loads against the words alone and every load by TMA: the same bits, exact and
    SCALED, four slices and GROUP_DOT, the fused split-K sum on 3 calls each."""
    gen = torch.Generator("cuda").manual_seed(31)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for k, n in ((7168, 4096), (2048, 7168), (16384, 7168)):
        pw = P.pair_awq(*_rand_awq_cuda(k, n, gen))
        for m in (1, 5, 16, 64, 128, 200):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            cfg = PK.p_config(m, n, k, sms)
            for scaled in (False, True):
                for gd in (False, True):
                    c = {**cfg, "SCALED": scaled, "GROUP_DOT": gd, "TMA": 0}
                    a = PK.w4a16_linear_p_triton(x, *pw, config=c)
                    for tma in (PK.TMA_W, 7):
                        for _ in range(3):
                            b = PK.w4a16_linear_p_triton(x, *pw, config={**c, "TMA": tma})
                            assert torch.equal(a, b), (k, n, m, scaled, gd, tma)
    assert not PK._COUNTERS[x.device].any()


@pytest.mark.cuda
def test_group_dot_on_gpu():
    """GROUP_DOT at V3.2 shapes, decode to 128 tokens: PTX == Triton ops bit for bit, within
    fp32 order of the four-slice kernel (exact and SCALED, bf16 and fp16), the fused split-K sum
    equal to the two-launch one on 20 calls; the MoE's PTX == ops and within fp32 order too."""
    gen = torch.Generator("cuda").manual_seed(29)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for k, n in ((7168, 4096), (2048, 7168)):
        pw = P.pair_awq(*_rand_awq_cuda(k, n, gen))
        for dtype in (torch.bfloat16, torch.float16):
            for m in (1, 16, 64, 128):
                x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
                cfg = {**PK.p_config(m, n, k, sms), "FUSED": False}
                for scaled in (False, True):
                    c = {**cfg, "SCALED": scaled, "GROUP_DOT": True}
                    a = PK.w4a16_linear_p_triton(x, *pw, config=c, mode=PK.MODE_ASM)
                    assert torch.equal(a, PK.w4a16_linear_p_triton(x, *pw, config=c,
                                                                   mode=PK.MODE_OPS))  # fmt: skip
                    four = PK.w4a16_linear_p_triton(x, *pw, config={**c, "GROUP_DOT": False})
                    assert _rel(a, four) < 2e-3  # fp32 in another order, then the rounding
                    if c["SPLIT_K"] > 1:
                        fused = {**c, "FUSED": True}
                        for _ in range(20):
                            assert torch.equal(PK.w4a16_linear_p_triton(x, *pw, config=fused), a)
    assert not PK._COUNTERS[x.device].any()
    e = 16
    w13 = _rand_awq_cuda(7168, 2 * 2048, gen, (e,))
    w2 = _rand_awq_cuda(2048, 7168, gen, (e,))
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    for t in (1, 8, 64):
        x = torch.randn(t, 7168, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(t, e, device="cuda", generator=gen).topk(8, dim=-1).indices
        tw = torch.rand(t, 8, device="cuda", generator=gen)
        c = {**PM.moe_p_config(t * 8, e), "GROUP_DOT": True}
        a = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config=c, mode=PK.MODE_ASM)
        b = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config=c, mode=PK.MODE_OPS)
        assert torch.equal(a, b)
        four = PM.moe_w4a16_p_triton(x, ids, tw, *p13, *p2, config={**c, "GROUP_DOT": False})
        assert _rel(a, four) < 2e-3


@pytest.mark.cuda
def test_fused_split_k_reduction_is_the_same_bits_on_gpu():
    """The tile's last split sums the partials in split order: bit for bit the two-launch sum,
    on every one of many calls (a missed partial or a stale read would show), counters back at 0."""
    gen = torch.Generator("cuda").manual_seed(9)
    for k, n, m in ((7168, 4096, 1), (2048, 7168, 16), (7168, 2048, 128)):
        pw = P.pair_awq(*_rand_awq_cuda(k, n, gen))
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        cfg = PK.p_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
        assert cfg["SPLIT_K"] > 1
        want = PK.w4a16_linear_p_triton(x, *pw, config={**cfg, "FUSED": False})
        for _ in range(50):
            assert torch.equal(
                PK.w4a16_linear_p_triton(x, *pw, config={**cfg, "FUSED": True}), want
            )
    assert not PK._COUNTERS[x.device].any()


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 8, 16])  # 64 tokens touch ~220 experts: the reference's
def test_moe_on_gpu_256_experts(t):  # dequantised fp32 copy of them ran out of memory
    gen = torch.Generator("cuda").manual_seed(t)
    e, d, inter = 256, 7168, 2048
    w13, w2 = _rand_awq_cuda(d, 2 * inter, gen, (e,)), _rand_awq_cuda(inter, d, gen, (e,))
    x = torch.randn(t, d, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(8, dim=-1).indices
    w = torch.rand(t, 8, device="cuda", generator=gen)
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    y = torch.ops.echo.moe_w4a16_p(x, ids, w, *p13, *p2)
    b = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, mode=PK.MODE_OPS)
    assert torch.equal(y, b)
    # the reference on the touched experts only (256 dequantised experts do not fit)
    used = torch.unique(ids)
    remap = torch.full((e,), -1, dtype=torch.long, device="cuda")
    remap[used] = torch.arange(used.numel(), device="cuda")
    sub = [tuple(t_[used] for t_ in part) for part in (w13, w2)]
    assert _rel(y, ops.moe_w4a16_ref(x, remap[ids], w, *sub[0], *sub[1])) < 5e-3


@pytest.mark.cuda
@pytest.mark.parametrize("t", [8, 64])
def test_scaled_moe_on_gpu(t):
    """The MoE's SCALED passes at V3.2 sizes (16 experts): PTX == Triton ops, within fp32 order
    of the reference on the rounded weights, on the rule's row block and a wide tile."""
    gen = torch.Generator("cuda").manual_seed(40 + t)
    e, d, inter = 16, 7168, 2048
    w13, w2 = _rand_awq_cuda(d, 2 * inter, gen, (e,)), _rand_awq_cuda(inter, d, gen, (e,))
    x = torch.randn(t, d, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(8, dim=-1).indices
    w = torch.rand(t, 8, device="cuda", generator=gen)
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    w13_t = P.dequantize_pairs_experts_t(*p13, dtype=torch.bfloat16)
    w2_t = P.dequantize_pairs_experts_t(*p2, dtype=torch.bfloat16)
    ref = ops._moe_ref(x, ids, w, w13_t, w2_t)
    bt = PM.moe_p_config(t * 8, e)["BT"]
    for bn, warps in ((64, 4), (128, 8)):
        cfg = {"BN": bn, "BT": bt, "num_warps": warps, "num_stages": 3, "SCALED": True}
        a = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config=cfg, mode=PK.MODE_ASM)
        b = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config=cfg, mode=PK.MODE_OPS)
        assert torch.equal(a, b)
        assert _rel(a, ref) < 1e-3  # the exact-weight passes are ~4.5e-3 away


@pytest.mark.cuda
def test_moe_sum_k_is_the_same_bits_on_gpu():
    """The down pass's own k-sum (SUM_K): every one of many calls gives the same bits, within
    1e-6 of the separate torch sum, skipped pairs (id E) included, counters back at 0; at T = 1
    (served) and T = 8 (forced: many programs racing on the counters)."""
    gen = torch.Generator("cuda").manual_seed(11)
    e, d, inter = 256, 7168, 2048
    w13, w2 = _rand_awq_cuda(d, 2 * inter, gen, (e,)), _rand_awq_cuda(inter, d, gen, (e,))
    p13, p2 = P.pair_awq_experts(*w13), P.pair_awq_experts(*w2)
    for t in (1, 8):
        x = torch.randn(t, d, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(t, e, device="cuda", generator=gen).topk(8, dim=-1).indices
        ids[0, 3] = e  # another rank's expert
        w = torch.rand(t, 8, device="cuda", generator=gen)
        cfg = PM.moe_p_config(t * 8, e)
        sep = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config={**cfg, "SUM_K": False})
        want = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config={**cfg, "SUM_K": True})
        assert _rel(want, sep) < 1e-6
        for _ in range(50):
            got = PM.moe_w4a16_p_triton(x, ids, w, *p13, *p2, config={**cfg, "SUM_K": True})
            assert torch.equal(got, want)
    assert not PK._COUNTERS[x.device].any()


@pytest.mark.cuda
def test_pair_ops_capture_in_cuda_graph():
    gen = torch.Generator("cuda").manual_seed(5)
    pw = P.pair_awq(*_rand_awq_cuda(7168, 2048, gen))
    x16 = torch.randn(4, 128 * 16, device="cuda").bfloat16()
    e13 = P.pair_awq_experts(*_rand_awq_cuda(2048, 2 * 256, gen, (8,)))
    e2 = P.pair_awq_experts(*_rand_awq_cuda(256, 2048, gen, (8,)))
    ids = torch.randint(0, 8, (4, 2), device="cuda")
    tw = torch.rand(4, 2, device="cuda")
    xs = [torch.randn(m, 7168, device="cuda").bfloat16() for m in (2, 32, 128)]
    x1, ids1 = x16[:1], torch.tensor([[3, 8]], device="cuda")  # one token: SUM_K; 8: skipped

    def step():
        ys = [torch.ops.echo.w4a16_linear_p(x, *pw) for x in xs]
        return ys + [torch.ops.echo.moe_w4a16_p(x, i, tw[: x.shape[0]], *e13, *e2)
                     for x, i in ((x16, ids), (x1, ids1))]  # fmt: skip

    step()  # warm-up (the Triton compiles, the counters) outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        outs = step()
    for _ in range(3):  # fresh inputs each replay: a reduction that did not fire would show
        for x in xs:
            x.copy_(torch.randn_like(x))
        x16.copy_(torch.randn_like(x16))
        ids.copy_(torch.randint(0, 8, (4, 2), device="cuda"))
        ids1[0, 0] = int(torch.randint(0, 8, ()))
        gr.replay()
        torch.cuda.synchronize()
        want = step()
        assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))


@pytest.mark.cuda
def test_compiled_reduce_overhead_across_batch_sizes():
    """torch.compile(mode="reduce-overhead") over served AWQ linears, batch sizes alternating (one
    CUDA graph each, tinygemm at M = 1, the fused split-K reduction at 2 and 16): every replay
    with fresh inputs equals the eager module bit for bit (the counters made at load time stay
    outside the graphs' memory pool)."""
    from torch import nn

    from model.awq import AWQLinear
    from model.awq_convert import repack_awq_model

    torch.manual_seed(0)
    dense = [nn.Linear(7168, 2048, bias=False), nn.Linear(2048, 7168, bias=False)]
    model = nn.Sequential(*[AWQLinear.from_linear(d.cuda().bfloat16()) for d in dense])
    repack_awq_model(model)
    assert model[0].large_m == "pairs"
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):
            for m in (1, 2, 16):
                x = torch.randn(m, 7168, device="cuda").bfloat16()
                assert torch.equal(compiled(x).clone(), model(x))
