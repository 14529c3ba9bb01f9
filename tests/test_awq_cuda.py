"""AWQ Triton kernels on the GPU at DeepSeek-V3.2 shapes (run: python -m pytest -q -m cuda)."""

from __future__ import annotations

import pytest
import torch

from custom_ops import awq as ops
from custom_ops import awq_kernels as K

pytestmark = pytest.mark.cuda

D, I_MOE = 7168, 2048  # hidden, moe_intermediate_size
LINEARS = {  # name: (in, out), V3.2's sizes
    "q_a": (7168, 1536), "q_b": (1536, 24576), "kv_a": (7168, 576), "kv_b": (512, 32768),
    "o": (16384, 7168), "expert_gate": (7168, 2048), "expert_down": (2048, 7168),
}


def _awq(k: int, n: int, lead=(), sdtype=torch.float16, gen=None):
    qw = torch.randint(-(2**31), 2**31, (*lead, k, n // 8), dtype=torch.int64, device="cuda",
                       generator=gen).to(torch.int32)
    qz = torch.randint(-(2**31), 2**31, (*lead, k // 128, n // 8), dtype=torch.int64,
                       device="cuda", generator=gen).to(torch.int32)
    s = (torch.rand((*lead, k // 128, n), device="cuda", generator=gen) * 2e-3 + 1e-4).to(sdtype)
    return qw, qz, s


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("name", list(LINEARS))
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_w4a16_linear_real_shapes(name, m):
    k, n = LINEARS[name]
    gen = torch.Generator("cuda").manual_seed(list(LINEARS).index(name) * 1000 + m)
    dtype = torch.bfloat16 if m != 7 else torch.float16
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    w = _awq(k, n, sdtype=torch.bfloat16 if m == 64 else torch.float16, gen=gen)
    y = torch.ops.echo.w4a16_linear(x, *w)
    ref = ops.w4a16_linear_ref(x, *w)  # fp32 dequant + fp32 matmul
    assert y.shape == (m, n) and y.dtype == dtype and torch.isfinite(y).all()
    assert _rel(y, ref) < 4e-3  # one rounding of the output to 16 bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("magic", [True, False])
def test_dequant_modes_real_shapes(magic, dtype):
    """Both dequantisation modes (magic-number 16-bit / int->float) at expert shapes."""
    gen = torch.Generator("cuda").manual_seed(int(magic) + 2 * (dtype == torch.float16))
    for m in (1, 96):
        x = torch.randn(m, D, device="cuda", generator=gen).to(dtype)
        w = _awq(D, 2048, gen=gen)
        cfg = {**K.linear_config(m, 2048, D, 132), "MAGIC": magic}
        y = K.w4a16_linear_triton(x, *w, config=cfg)
        assert _rel(y, ops.w4a16_linear_ref(x, *w)) < 4e-3
    x, ids, tw = _moe_case(24, 16, 8, gen, dtype)
    w13, w2 = _awq(D, 2 * I_MOE, (16,), gen=gen), _awq(I_MOE, D, (16,), gen=gen)
    cfg = {**K.moe_config(24 * 8, 16), "MAGIC": magic}
    y = K.moe_w4a16_triton(x, ids, tw, *w13, *w2, config=cfg)
    assert _rel(y, ops.moe_w4a16_ref(x, ids, tw, *w13, *w2)) < 4e-3


def _moe_case(t, e, topk, gen, dtype=torch.bfloat16):
    x = torch.randn(t, D, device="cuda", generator=gen).to(dtype)
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(topk, dim=-1).indices.int()
    w = torch.rand(t, topk, device="cuda", generator=gen)
    return x, ids, w


@pytest.mark.parametrize("t", [1, 5, 64, 200])
def test_moe_w4a16_real_shapes_16_experts(t):
    gen = torch.Generator("cuda").manual_seed(t)
    x, ids, w = _moe_case(t, 16, 8, gen, torch.float16 if t == 5 else torch.bfloat16)
    w13, w2 = _awq(D, 2 * I_MOE, (16,), gen=gen), _awq(I_MOE, D, (16,), gen=gen)
    y = torch.ops.echo.moe_w4a16(x, ids, w, *w13, *w2)
    ref = ops.moe_w4a16_ref(x, ids, w, *w13, *w2)
    assert y.shape == (t, D) and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert _rel(y, ref) < 4e-3  # rounding of the intermediate h to 16 bits


def test_moe_w4a16_256_experts_against_touched_experts():
    gen = torch.Generator("cuda").manual_seed(256)
    x, ids, w = _moe_case(4, 256, 8, gen)  # <= 32 touched experts: the fp32 reference fits
    w13, w2 = _awq(D, 2 * I_MOE, (256,), gen=gen), _awq(I_MOE, D, (256,), gen=gen)
    y = torch.ops.echo.moe_w4a16(x, ids, w, *w13, *w2)
    used, local = torch.unique(ids, return_inverse=True)  # reference over the touched experts only
    ref = ops.moe_w4a16_ref(x, local, w, *(t[used] for t in w13), *(t[used] for t in w2))
    assert _rel(y, ref) < 4e-3


def test_moe_bf16_real_shapes():
    gen = torch.Generator("cuda").manual_seed(3)
    x, ids, w = _moe_case(33, 16, 8, gen)
    w13 = torch.randn(16, 2 * I_MOE, D, device="cuda", generator=gen).bfloat16() * 0.02
    w2 = torch.randn(16, D, I_MOE, device="cuda", generator=gen).bfloat16() * 0.02
    y = torch.ops.echo.moe_bf16(x, ids.long(), w, w13, w2)
    assert _rel(y, ops.moe_bf16_ref(x, ids, w, w13, w2)) < 4e-3


def test_ops_capture_in_cuda_graph_without_syncs():
    """Both ops replay from a CUDA graph with new inputs (capture fails on a host sync)."""
    gen = torch.Generator("cuda").manual_seed(4)
    x, ids, w = _moe_case(16, 16, 8, gen)
    w13, w2 = _awq(D, 2 * I_MOE, (16,), gen=gen), _awq(I_MOE, D, (16,), gen=gen)
    lin = _awq(D, 2048, gen=gen)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (Triton compilation) outside the capture
        torch.ops.echo.moe_w4a16(x, ids, w, *w13, *w2)
        torch.ops.echo.w4a16_linear(x, *lin)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_moe = torch.ops.echo.moe_w4a16(x, ids, w, *w13, *w2)
        y_lin = torch.ops.echo.w4a16_linear(x, *lin)
    x2, ids2, w_2 = _moe_case(16, 16, 8, gen)
    x.copy_(x2)
    ids.copy_(ids2)
    w.copy_(w_2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_moe, torch.ops.echo.moe_w4a16(x2, ids2, w_2, *w13, *w2))
    assert torch.equal(y_lin, torch.ops.echo.w4a16_linear(x2, *lin))


def test_opcheck_on_cuda():
    gen = torch.Generator("cuda").manual_seed(5)
    x = torch.randn(3, 256, device="cuda", generator=gen).bfloat16()
    torch.library.opcheck(torch.ops.echo.w4a16_linear, (x, *_awq(256, 128, gen=gen)))
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]], device="cuda", dtype=torch.int32)
    w = torch.rand(3, 2, device="cuda", generator=gen)
    args = (x, ids, w, *_awq(256, 256, (4,), gen=gen), *_awq(128, 256, (4,), gen=gen))
    torch.library.opcheck(torch.ops.echo.moe_w4a16, args)


def test_awq_modules_in_compiled_graph():
    """AWQLinear + AWQExperts under torch.compile(mode="reduce-overhead", fullgraph=True)."""
    from model.awq import AWQExperts, AWQLinear

    gen = torch.Generator("cuda").manual_seed(6)
    lin = AWQLinear(512, 256, device="cuda")
    exp = AWQExperts(8, 512, 256, device="cuda")
    with torch.no_grad():
        for mod in (lin, exp):
            for p in mod.parameters():
                if p.dtype == torch.int32:
                    p.copy_(torch.randint(-(2**31), 2**31, p.shape, dtype=torch.int64,
                                          device="cuda", generator=gen).to(torch.int32))
                else:
                    p.copy_(torch.rand(p.shape, device="cuda", generator=gen) * 1e-2)

    def step(x, ids, w):
        return exp(x, ids, w) + lin(x).float().sum(-1, keepdim=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        x, ids, w = (torch.randn(4, 512, device="cuda", generator=gen).bfloat16(),
                     torch.rand(4, 8, device="cuda", generator=gen).topk(2, -1).indices,
                     torch.rand(4, 2, device="cuda", generator=gen))
        torch.testing.assert_close(compiled(x, ids, w), step(x, ids, w), rtol=1e-5, atol=1e-5)
