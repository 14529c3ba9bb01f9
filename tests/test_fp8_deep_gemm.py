"""DeepGEMM's FP8 GEMMs behind ``echo::dg_fp8_linear`` / ``echo::dg_moe_fp8``: on CPU the layouts
(scales written where DeepGEMM reads them), the quantising Triton kernel under the interpreter, the
device-side pair ranking and the whole MoE pipeline with a torch stand-in of the masked grouped
GEMM, each against ``echo::fp8_linear`` / ``echo::moe_fp8``'s references; on the GPU the library
itself against them."""

from __future__ import annotations

import pytest
import torch

from custom_ops import fp8_linear as F8
from custom_ops.backends import deep_gemm_gemm as DG
from custom_ops.backends import deep_gemm_gemm_kernels as DK
from model.fp8_weights import weight_quant_fp8


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _experts(e, n, k, gen, device="cpu"):
    ws = [weight_quant_fp8(torch.randn(n, k, generator=gen, device=device) * 0.05,
                           scale_fmt="ue8m0") for _ in range(e)]  # fmt: skip
    return torch.stack([w for w, _ in ws]), torch.stack([s for _, s in ws])


def test_scale_layouts_are_deep_gemms():
    """sfa: MN-major with the row count padded to 4 fp32 (16 bytes), what DeepGEMM's
    get_mn_major_tma_aligned_tensor returns unchanged; sfb: the checkpoint's tensor itself."""
    s = torch.randn(5, 3)
    a = DG.sfa_layout(s)
    assert a.shape == (5, 3) and a.stride() == (1, 8) and torch.equal(a, s)
    g = DG.sfa_layout(torch.randn(2, 6, 3))
    assert g.stride() == (24, 1, 8)
    ws = torch.rand(4, 3)
    assert DG.weight_sf_layout(ws) is ws
    with pytest.raises(ValueError, match="contiguous fp32"):
        DG.weight_sf_layout(ws.t())


@pytest.mark.parametrize("m", [1, 5, 12])
def test_quant_kernel_matches_act_quant(m):
    gen = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 256, generator=gen) * torch.rand(m, 1, generator=gen) * 8).bfloat16()
    x8, sf = DK.act_quant_dg(x, True)
    r8, rs = DG.act_quant_dg_ref(x, True)
    assert sf.stride() == rs.stride() == (1, DG.align_up(m, 4))
    assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(sf, rs)


def test_moe_pipeline_skips_foreign_experts_picks():
    """EP's skip id (one past the rank's experts) contributes nothing: equal to the reference
    with those picks' weights zeroed (any local expert id in their place)."""
    t, e, k, d, inter = 6, 4, 3, 128, 128
    g = torch.Generator().manual_seed(11)
    w13, s13 = _experts(e, 2 * inter, d, g)
    w2, s2 = _experts(e, d, inter, g)
    x = torch.randn(t, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e + 2, generator=g)[:k] for _ in range(t)]).clamp(max=e)
    assert (ids == e).any() and (ids < e).any()
    w = torch.rand(t, k, generator=g)
    y = DG.moe_pipeline(x, ids, w, w13, s13, w2, s2, True, DG.masked_gemm_ref, DG.align_up(t, 4))
    skip = ids == e
    ref = F8.moe_fp8_ref(x, ids.masked_fill(skip, 0), w.masked_fill(skip, 0.0), w13, s13, w2, s2,
                         True)  # fmt: skip
    assert torch.isfinite(y).all() and _rel(y, ref) < 2e-3


@pytest.mark.parametrize("case", [(1, 4, 2, 128, 128), (6, 8, 3, 256, 128)])
def test_moe_pipeline_matches_reference(case):
    """The DeepGEMM MoE's steps (ranking, scatter + quantisation, masked GEMMs, fused silu +
    quantisation, weighted gather) with the torch stand-in GEMM: against moe_fp8's reference."""
    t, e, k, d, inter = case
    g = torch.Generator().manual_seed(t)
    w13, s13 = _experts(e, 2 * inter, d, g)
    w2, s2 = _experts(e, d, inter, g)
    x = torch.randn(t, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    mg = DG.align_up(t, 4)
    y = DG.moe_pipeline(x, ids, w, w13, s13, w2, s2, True, DG.masked_gemm_ref, mg)
    ref = F8.moe_fp8_ref(x, ids, w, w13, s13, w2, s2, True)
    assert y.shape == (t, d) and y.dtype == torch.float32
    assert _rel(y, ref) < 2e-3  # the same operands; silu's fp32 order may flip a rounding of h
    if t == 1:  # the op: default kernel = the reference, its fake agrees
        assert torch.equal(DG.dg_moe_fp8(x, ids, w, w13, s13, w2, s2, True), ref)
        utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
        torch.library.opcheck(torch.ops.echo.dg_moe_fp8, (x, ids, w, w13, s13, w2, s2, True),
                              test_utils=utils)  # fmt: skip


def test_ops_default_to_references_and_fakes():
    g = torch.Generator().manual_seed(3)
    w8, ws = weight_quant_fp8(torch.randn(128, 256, generator=g) * 0.05, scale_fmt="ue8m0")
    x = torch.randn(3, 256, generator=g).bfloat16()
    assert torch.equal(DG.dg_fp8_linear(x, w8, ws, True), F8.fp8_linear_ref(x, w8, ws, True))
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.echo.dg_fp8_linear, (x, w8, ws, True), test_utils=utils)
    with pytest.raises(ValueError, match="w_scale must be"):
        DG.dg_fp8_linear(x, w8, ws[:, :1].contiguous(), True)
    assert DG.linear_suits(1, 4096, 7168, torch.bfloat16)
    assert not DG.linear_suits(1, 4096, 7168, torch.float16)
    assert not DG.moe_suits(DG.MOE_MAX_TOKENS + 1, 7168, 2048, torch.bfloat16)
    with pytest.raises(ValueError, match="fp8 backend must be"):
        F8.set_fp8_backend("cublas")


def _need_deep_gemm():
    if not DG.available(0):
        pytest.skip("DeepGEMM not installed or not SM90")  # reported, not a failure: optional


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16, 128])
def test_dg_linear_on_gpu_at_v32_shapes(m):
    _need_deep_gemm()
    gen = torch.Generator("cuda").manual_seed(m)
    for k, n in ((7168, 4096), (16384, 7168), (2048, 7168), (7168, 576)):
        w8, ws = weight_quant_fp8(torch.randn(n, k, device="cuda", generator=gen) * 0.02,
                                  scale_fmt="ue8m0")  # fmt: skip
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        x8, sf = DK.act_quant_dg(x, True)
        r8, rs = DG.act_quant_dg_ref(x, True)
        assert torch.equal(x8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(sf, rs)
        y = torch.ops.echo.dg_fp8_linear(x, w8, ws, True)
        assert _rel(y, F8.fp8_linear_ref(x, w8, ws, True)) < 5e-3  # fp8 MMA accumulation


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 16])
def test_dg_moe_on_gpu_256_experts(t):
    _need_deep_gemm()
    gen = torch.Generator("cuda").manual_seed(t)
    e, d, inter = 256, 7168, 2048
    w13, s13 = _experts(e, 2 * inter, d, gen, "cuda")
    w2, s2 = _experts(e, d, inter, gen, "cuda")
    x = torch.randn(t, d, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(8, dim=-1).indices
    w = torch.rand(t, 8, device="cuda", generator=gen)
    y = torch.ops.echo.dg_moe_fp8(x, ids, w, w13, s13, w2, s2, True)
    # the GEMM's ~7e-4 flips ~1% of the e4m3 h between the GEMMs: ~5e-3 on the output
    # (docs/quantization.md, "FP8 on the H200"); a misrouted row is an error of order 1
    assert _rel(y, F8.moe_fp8_ref(x, ids, w, w13, s13, w2, s2, True)) < 1e-2
    # graph-safe: captured and replayed with new routings in place, still the reference
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        yg = torch.ops.echo.dg_moe_fp8(x, ids, w, w13, s13, w2, s2, True)
    ids.copy_(torch.rand(t, e, device="cuda", generator=gen).topk(8, dim=-1).indices)
    g.replay()
    assert _rel(yg, F8.moe_fp8_ref(x, ids, w, w13, s13, w2, s2, True)) < 1e-2


def test_a_failing_deep_gemm_shape_warns_once_then_triton_serves_it():
    calls = []

    def bad():
        calls.append(1)
        raise RuntimeError("no kernel for this shape")

    key = ("linear", 1, 576, 7168, "test")
    with pytest.warns(UserWarning, match="Triton serves it"):
        assert F8._try_dg(key, bad) is None
    assert F8._try_dg(key, bad) is None and len(calls) == 1  # not retried
    assert F8._try_dg(("other",), lambda: 7) == 7
    F8._dg_failed.discard(key)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB"),
        AttributeError("module 'deep_gemm' has no attribute 'x'"),
    ],  # fmt: skip
)
def test_a_cuda_error_or_a_programming_error_is_not_served_by_triton(exc):
    """Only a refusal falls back: a dead CUDA context or a missing name propagates, unrecorded."""

    def bad():
        raise exc

    key = ("linear", 2, 576, 7168, "test-propagates")
    with pytest.raises(type(exc)):
        F8._try_dg(key, bad)
    assert key not in F8._dg_failed
