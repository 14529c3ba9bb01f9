"""AWQLinear's load-time repack and its dispatch (custom_ops/awq_repack.py): the tinygemm mapping
of AWQ's zeros, tinygemm for small M and the pair layout (or the former kernel) above, the
compiled and graph-captured module, a repacked tiny model's logits, and bench_awq's helpers. The
pair layout and its kernels themselves: tests/test_awq_pairs.py."""

from __future__ import annotations

import pytest
import torch
from test_awq import _awq_weights
from test_loader import last_logits
from torch import nn

from custom_ops import awq as ops
from custom_ops import awq_repack as R
from model.awq import AWQExperts, AWQLinear
from model.awq_convert import repack_awq_model
from model.checkpoint import resolve_model
from model.loader import load_model


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


@pytest.mark.parametrize("large_m", ["pairs", "former"])
def test_module_repack_and_dispatch(large_m):
    lin = _linear(256, 64, 5)
    x1 = torch.randn(2, 256).bfloat16()
    x9 = torch.randn(3, 3, 256).bfloat16()
    before1, before9 = lin(x1), lin(x9)
    w_before = lin.dequantized_weight()
    lin.repack(tinygemm_max_m=4, large_m=large_m)
    names = {n for n, _ in lin.named_parameters()}
    kept = {
        "pairs": {"qweight_p", "zs_p"},
        "former": {"qweight", "qzeros", "scales"},
    }
    assert names == kept[large_m] | {"tg_weight", "tg_scale_zero"}
    assert lin.large_m == large_m and torch.equal(lin.dequantized_weight(), w_before)
    assert torch.equal(lin(x9), before9)  # M = 9 > 4: the Triton path (its reference on CPU)
    y1 = lin(x1)  # M = 2 <= 4: tinygemm
    assert not torch.equal(y1, before1) and _rel(y1, before1) < 1e-2
    with pytest.raises(ValueError, match="already"):
        lin.repack()
    plain = _linear(256, 64, 5)
    plain.repack(large_m=large_m)  # no tinygemm copy
    assert not hasattr(plain, "tg_weight") and torch.equal(plain(x1), before1)


def test_served_dispatch_takes_the_pair_layout_above_tinygemm():
    """The measured dispatch (R.LARGE_M_PATH = "pairs"): tinygemm up to TINYGEMM_MAX_M, the pair
    kernel on the pair layout above, the AutoAWQ tensors dropped; "former" keeps them."""
    assert R.LARGE_M_PATH == "pairs" and R.TINYGEMM_MAX_M == 1
    # by size: tinygemm's M = 1 copy only for linears below 2^24 weights (V3.2: 7168 x 2048)
    assert R.tinygemm_max_m(7168, 2048) == 1 and R.tinygemm_max_m(7168, 4096) == -1
    lin = _linear(256, 64, 7)
    x1, x2 = torch.randn(1, 256).bfloat16(), torch.randn(2, 256).bfloat16()
    before1, before2 = lin(x1), lin(x2)
    repack_awq_model(nn.Sequential(lin), tinygemm_max_m=1)  # the default large-M path
    names = {n for n, _ in lin.named_parameters()}
    assert names == {"qweight_p", "zs_p", "tg_weight", "tg_scale_zero"}
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
    for gone in ("tinygemm", "repacked"):  # "repacked": the k-major layout, removed
        with pytest.raises(ValueError, match="large-M path must be one of pairs, former"):
            _linear(256, 64, 7).repack(large_m=gone)


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
    """The repacked model (pair layout) computes the same logits bit for bit (the pair op's
    reference is the same fp32 matmul); with tinygemm on every call within the bf16 rounding of
    its scales."""
    awq, _ = load_model(resolve_model("tiny-awq"))
    prompts = ([0, 44, 73, 341, 83], [0, 264, 499, 315, 432, 18])
    before = [last_logits(awq, p) for p in prompts]
    assert len(repack_awq_model(awq, tinygemm_max_m=-1, large_m="pairs")) >= 10
    assert all(torch.equal(last_logits(awq, p), b) for p, b in zip(prompts, before, strict=True))
    tg, _ = load_model(resolve_model("tiny-awq"))
    repack_awq_model(tg, tinygemm_max_m=1 << 20)
    for p, b in zip(prompts, before, strict=True):
        assert _rel(last_logits(tg, p), b) < 5e-2  # as test_awq_model's bound for bf16 rounding


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
        f"{p}_{s}" for p in ("w13", "w2") for s in ("qweight_p", "zs_p")
    }
    assert torch.equal(mod(x, ids, w), before)
    assert all(torch.equal(a, b) for a, b in zip(mod.dequantized_weights(), dense, strict=True))


# ---- GPU -------------------------------------------------------------------------------------

V32 = [(7168, 4096), (16384, 7168), (7168, 2048), (2048, 7168)]  # (K, N)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 8, 16, 64, 128])
def test_tinygemm_on_gpu_at_v32_shapes(m):
    gen = torch.Generator("cuda").manual_seed(m)
    for k, n in V32[:2]:
        qw = torch.randint(-(2**31), 2**31, (k, n // 8), device="cuda", generator=gen,
                           dtype=torch.int64).to(torch.int32)  # fmt: skip
        qz = torch.randint(-(2**31), 2**31, (k // 128, n // 8), device="cuda", generator=gen,
                           dtype=torch.int64).to(torch.int32)  # fmt: skip
        s = (torch.rand(k // 128, n, device="cuda", generator=gen) * 2e-3 + 1e-4).half()
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        ref = ops.w4a16_linear_ref(x, qw, qz, s)
        assert _rel(R.tinygemm_linear(x, *R.tinygemm_pack(qw, qz, s)), ref) < 2e-2


@pytest.mark.cuda
def test_repacked_linear_captures_in_cuda_graph():
    lin = _linear(7168, 2048, 7).cuda()
    lin.repack(tinygemm_max_m=4, large_m="pairs")
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
        {"in": 7168, "out": 4096, "M": m, "tinygemm_us": tg, "pairs_us": pa, "former_us": fo}
        for m, tg, pa, fo in (
            (1, 10.0, 12.0, 30.0),
            (8, 20.0, 21.0, 19.0),
            (16, 40.0, 22.0, 30.0),
            (32, 70.0, 25.0, 24.0),
        )  # fmt: skip
    ]
    assert B.dispatch_table(rows) == {"7168x4096": 1}  # at M = 8 the former kernel won
    rows[0]["fbgemm_us"] = 9.0
    assert B.best_by_m(rows) == {"7168x4096": {1: "fbgemm", 8: "former", 16: "pairs",
                                               32: "former"}}  # fmt: skip
    # every large-M path the module can take is a timed column, so awq_us can look it up
    assert set(R.LINEAR_PATHS) <= set(B.CANDIDATES)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_awq", "--help"], cwd=root,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "--sweep" in out and "--out" in out and "--configs" not in out


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


def test_refused_scale_names_the_module_and_leaves_it_as_it_was():
    """A bf16 scale that fp16 cannot hold exactly stops the repack with the module's name, and a
    block of experts whose w2 is refused keeps its AutoAWQ tensors (w13 is not half-converted)."""
    exp = AWQExperts.from_dense(torch.randn(2, 256, 128) * 0.02, torch.randn(2, 128, 128) * 0.02,
                                torch.bfloat16)  # fmt: skip
    with torch.no_grad():
        exp.w2_scales[0, 0, 0] = 1e-7  # bf16 holds it, fp16 does not
    model = nn.Sequential(nn.Sequential(exp))
    with pytest.raises(ValueError, match=r"repack_awq_model: 0\.0: pack_zs: bf16 scales"):
        repack_awq_model(model, tinygemm_max_m=-1)
    assert not exp.repacked and hasattr(exp, "w13_qweight") and not hasattr(exp, "w13_qweight_p")
