"""The bf16 model's routed experts through the grouped ``echo::moe_bf16`` (model/moe.py), against
the former every-expert-on-every-token form it replaced, and the op's kernel (interpreter) against
its reference with the 16-bit rounding of the projections."""

from __future__ import annotations

import pytest
import torch
from test_loader import last_logits

from custom_ops import awq as ops
from custom_ops import awq_kernels as K
from model.checkpoint import resolve_model
from model.loader import load_model
from model.moe import Experts


def _experts(e: int, d: int, inter: int, gen: torch.Generator) -> Experts:
    m = Experts(e, d, inter)
    with torch.no_grad():
        m.w13_weight.copy_(torch.randn(e, 2 * inter, d, generator=gen) * 0.05)
        m.w2_weight.copy_(torch.randn(e, d, inter, generator=gen) * 0.05)
    return m


def _route(t: int, e: int, k: int, gen: torch.Generator):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=gen)


@pytest.mark.parametrize("t", [1, 5, 33])
def test_grouped_experts_equal_all_experts_form(t):
    g = torch.Generator().manual_seed(t)
    m = _experts(8, 256, 128, g)
    assert m.grouped
    x = torch.randn(t, 256, generator=g).bfloat16()
    ids, w = _route(t, 8, 2, g)
    y = m(x, ids, w)
    ref = m.forward_all_experts(x, ids, w)
    assert y.dtype == torch.float32 and y.shape == (t, 256)
    # Same 16-bit roundings of the same products; only the fp32 order of the k-sum (and a BLAS
    # blocking difference flipping a rare bf16 rounding) may differ.
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-3)
    # and the routing matters: other experts give another answer
    assert (m(x, (ids + 1) % 8, w) - ref).abs().max() > 1e-2


def test_experts_not_tiled_by_128_use_the_all_experts_form():
    g = torch.Generator().manual_seed(3)
    m = _experts(4, 96, 64, g)
    assert not m.grouped
    x = torch.randn(3, 96, generator=g).bfloat16()
    ids, w = _route(3, 4, 2, g)
    assert torch.equal(m(x, ids, w), m.forward_all_experts(x, ids, w))


def test_tiny_model_logits_grouped_vs_all_experts():
    model, _ = load_model(resolve_model("tiny"))
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(m.grouped for m in experts)
    prompts = ([0, 44, 73, 341, 83], list(range(2, 60)))
    grouped = [last_logits(model, p) for p in prompts]
    for m in experts:
        m.grouped = False
    dense = [last_logits(model, p) for p in prompts]
    for a, b in zip(grouped, dense, strict=True):
        # measured: bit-equal on CPU (fp32 logits of magnitude ~3); the bound allows BLAS order
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_bf16_kernel_rounds_like_the_reference(dtype):
    g = torch.Generator().manual_seed(11)
    t, e, k, d, inter = 7, 4, 2, 128, 128
    x = torch.randn(t, d, generator=g).to(dtype)
    ids, w = _route(t, e, k, g)
    w13 = (torch.randn(e, 2 * inter, d, generator=g) * 0.05).to(dtype)
    w2 = (torch.randn(e, d, inter, generator=g) * 0.05).to(dtype)
    cfg = dict(BM=16, BN=32, BK=64, num_warps=4, num_stages=1)
    y = K.moe_bf16_triton(x, ids, w, w13, w2, config=cfg)
    ref = ops.moe_bf16_ref(x, ids, w, w13, w2)
    # fp32 sums in another order may flip a 16-bit rounding of an intermediate now and then
    assert ((y - ref).norm() / ref.norm()).item() < 2e-3
    close = (y - ref).abs() <= 1e-5 * ref.abs().max()
    assert close.float().mean() > 0.9  # most outputs agree to fp32 summation noise


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 16, 128])
def test_grouped_experts_on_gpu_at_v32_shapes(t):
    """The Triton path of the model's experts (16 experts of V3.2's shapes) vs the former form."""
    g = torch.Generator("cuda").manual_seed(t)
    e, d, inter = 16, 7168, 2048
    with torch.device("cuda"):
        m = Experts(e, d, inter)
    with torch.no_grad():
        m.w13_weight.copy_(torch.randn(e, 2 * inter, d, device="cuda", generator=g) * 0.02)
        m.w2_weight.copy_(torch.randn(e, d, inter, device="cuda", generator=g) * 0.02)
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    ids = torch.rand(t, e, device="cuda", generator=g).topk(8, dim=-1).indices
    w = torch.rand(t, 8, device="cuda", generator=g)
    y, ref = m(x, ids, w), m.forward_all_experts(x, ids, w)
    assert ((y - ref).norm() / ref.norm()).item() < 5e-3  # cuBLAS vs Triton summation order
