"""The small-M FP8 kernel (``custom_ops/fp8_gemv_kernels.py``) against ``fp8_linear_ref``: the
Triton interpreter on CPU, many sizes and fresh inputs; on the GPU at V3.2's shapes."""

from __future__ import annotations

import pytest
import torch

from custom_ops import fp8_gemv_kernels as GV
from custom_ops import fp8_linear as F8
from custom_ops import fp8_linear_kernels as FK
from model.fp8_weights import weight_quant_fp8


def _weights(n, k, gen, ue8m0=True, device="cpu"):
    w = torch.randn(n, k, generator=gen, device=device) * 0.05
    return weight_quant_fp8(w, scale_fmt="ue8m0" if ue8m0 else None)


def _close(y, ref):
    # the same e4m3 operands, fp32 sums in another order, one rounding to 16 bits
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-3 * ref.abs().max())


CASES = [  # (M, K, N, ue8m0, dtype, config)
    (1, 128, 64, True, torch.bfloat16, dict(BN=32, SPLIT_K=1)),
    (2, 384, 200, True, torch.bfloat16, dict(BN=64, SPLIT_K=2)),  # ragged N, uneven splits
    (3, 512, 96, False, torch.bfloat16, dict(BN=16, SPLIT_K=4)),  # true division scales
    (5, 256, 130, True, torch.float16, dict(BN=128, SPLIT_K=1)),
    (8, 640, 48, True, torch.bfloat16, None),  # the launcher's heuristic
    (1, 1024, 576, True, torch.float32, dict(BN=32, SPLIT_K=8)),  # fp32 x -> bf16 out
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_gemv_matches_reference(case):
    m, k, n, ue8m0, dtype, cfg = CASES[case]
    g = torch.Generator().manual_seed(40 + case)
    w8, ws = _weights(n, k, g, ue8m0)
    x = (torch.randn(m, 2 * k, generator=g) * torch.logspace(-2, 1, 2 * k)).to(dtype)[:, ::2]
    if cfg is not None:
        cfg = {**cfg, "num_warps": 4, "num_stages": 1}
    y = GV.fp8_gemv_triton(x, w8, ws, ue8m0, config=cfg)
    ref = F8.fp8_linear_ref(x.contiguous(), w8, ws, ue8m0)
    assert y.dtype == ref.dtype and y.shape == (m, n)
    _close(y, ref)


def test_gemv_fresh_inputs_and_the_mma_kernel_agree():
    """Random sizes with fresh inputs; the two Triton kernels quantise x identically, so they
    differ only in their fp32 summation order."""
    g = torch.Generator().manual_seed(7)
    for _ in range(4):
        m = int(torch.randint(1, GV.GEMV_MAX_M + 1, (1,), generator=g))
        k = 128 * int(torch.randint(1, 6, (1,), generator=g))
        n = int(torch.randint(1, 300, (1,), generator=g))
        w8, ws = _weights(n, k, g)
        x = (torch.randn(m, k, generator=g) * 4).bfloat16()
        ref = F8.fp8_linear_ref(x, w8, ws, True)
        _close(GV.fp8_gemv_triton(x, w8, ws, True), ref)
        _close(FK.fp8_linear_triton(x, w8, ws, True), ref)


def test_gemv_bad_inputs():
    g = torch.Generator().manual_seed(8)
    w8, ws = _weights(64, 256, g)
    with pytest.raises(ValueError, match="M must be 1..8"):
        GV.fp8_gemv_triton(torch.randn(9, 256).bfloat16(), w8, ws, True)
    with pytest.raises(ValueError, match="bad config"):
        GV.fp8_gemv_triton(torch.randn(2, 256).bfloat16(), w8, ws, True,
                           config=dict(BN=48, SPLIT_K=1))  # fmt: skip
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        GV.fp8_gemv_triton(torch.randn(2, 256).bfloat16(), w8.float(), ws, True)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_gemv_on_gpu_at_v32_shapes(m):
    gen = torch.Generator("cuda").manual_seed(m)
    for k, n in ((7168, 4096), (16384, 7168), (7168, 576), (2048, 7168)):
        w8, ws = _weights(n, k, gen, device="cuda")
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        _close(GV.fp8_gemv_triton(x, w8, ws, True), F8.fp8_linear_ref(x, w8, ws, True))
