"""The few-token FP8 kernel (custom_ops/fp8_gemv_kernels.py) against the reference of
``echo::fp8_linear`` over sizes, steps and tails (interpreter), its launch configuration, its
bad configurations, and its compile for an H200 (sm_90) without a GPU."""

from __future__ import annotations

import pytest
import torch
from sm90_utils import assert_compiles
from test_fp8_linear import _rel, _weights

from custom_ops import fp8_gemv_kernels as GK
from custom_ops import fp8_linear_kernels as FK
from custom_ops import fp8_linear_ref as F8
from model.fp8_weights import weight_quant_fp8

CASES = [  # (M, K, N, ue8m0, config over fp8_gemv_config's)
    (1, 128, 64, True, {}),
    (3, 384, 200, True, dict(GEMV_MP=2, GEMV_BN=8, GEMV_CB=2)),  # K blocks not a step multiple
    (5, 512, 96, False, dict(GEMV_MP=4, GEMV_BN=32, GEMV_CB=4)),  # two token blocks
    (1, 256, 130, True, dict(GEMV_BN=128, GEMV_CB=1)),  # N past the last full row block
    (2, 640, 72, False, dict(GEMV_BN=2, GEMV_CB=8)),  # one step past K
    (9, 256, 40, True, dict(GEMV_MP=8, GEMV_BN=4)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_gemv_matches_reference(case):
    m, k, n, ue8m0, cfg = CASES[case]
    g = torch.Generator().manual_seed(40 + case)
    w8, ws = _weights(n, k, g, ue8m0)
    x = (torch.randn(m, 2 * k, generator=g) * 3).bfloat16()[:, ::2]  # strided: the launcher copes
    y = FK.fp8_linear_triton(x, w8, ws, ue8m0, config={"GEMV": True, **cfg})
    ref = F8.fp8_linear_ref(x.contiguous(), w8, ws, ue8m0)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # the same e4m3 operands and per-block fp32 dots, the blocks summed in another order
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-3 * ref.abs().max())


def test_gemv_config():
    # one program a row block per SM at least, two chunks of ~8 KB in flight a program
    c = GK.fp8_gemv_config(1, 576, 7168, 132)
    assert (c["GEMV_MP"], c["GEMV_BN"], c["GEMV_CB"]) == (1, 4, 16)
    c = GK.fp8_gemv_config(1, 7168, 2048, 132)
    assert (c["GEMV_MP"], c["GEMV_BN"], c["GEMV_CB"]) == (1, 32, 2)
    c = GK.fp8_gemv_config(3, 2048, 7168, 132, waves=2)
    assert (c["GEMV_MP"], c["GEMV_BN"], c["GEMV_CB"]) == (4, 4, 16)
    assert GK.fp8_gemv_config(1, 64, 256, 132)["GEMV_CB"] == 2  # never past K's blocks


def test_gemv_bad_config():
    w8, ws = _weights(64, 256, torch.Generator().manual_seed(0), True)
    x = torch.randn(1, 256).bfloat16()
    with pytest.raises(ValueError, match="GEMV_BN must be a power of two"):
        FK.fp8_linear_triton(x, w8, ws, True, config={"GEMV": True, "GEMV_BN": 3})


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_gemv_on_gpu_at_v32_shapes(m):
    gen = torch.Generator("cuda").manual_seed(m)
    for k, n in ((7168, 4096), (16384, 7168), (7168, 2048), (2048, 7168), (7168, 576)):
        w8, ws = weight_quant_fp8(torch.randn(n, k, device="cuda", generator=gen) * 0.02,
                                  scale_fmt="ue8m0")  # fmt: skip
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        ref = F8.fp8_linear_ref(x, w8, ws, True)
        for extra in ({}, {"GEMV_MP": 8}, {"GEMV_WAVES": 2}):
            y = FK.fp8_linear_triton(x, w8, ws, True, config={"GEMV": True, **extra})
            assert _rel(y, ref) < 1e-3, (k, n, extra)


SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from custom_ops import fp8_gemv_kernels as GK

ARGS = [("x_ptr", "*bf16"), ("w_ptr", "*fp8e4nv"), ("ws_ptr", "*fp32"), ("y_ptr", "*bf16"),
        ("M", "i32"), ("N", "i32"), ("K", "i32"), ("stride_xm", "i32"), ("stride_ym", "i32")]
for n, k, m in ((576, 7168, 1), (7168, 2048, 1), (2048, 7168, 4), (4096, 7168, 16)):
    c = GK.fp8_gemv_config(m, n, k, 132)
    consts = dict(MP=c["GEMV_MP"], BN=c["GEMV_BN"], CB=c["GEMV_CB"], UE8M0=True, INTERPRET=False)
    sig = {a: t for a, t in ARGS}
    sig.update({key: "constexpr" for key in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (_, t) in enumerate(ARGS) if t[0] == "*"}
    try:
        triton.compile(ASTSource(fn=GK.fp8_gemv_kernel, signature=sig, constexprs=consts,
                                 attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": c["num_warps"]})
    except Exception as e:
        print(f"FAIL gemv{consts}: {type(e).__name__}: {str(e)[-800:]}")
        continue
    print(f"OK gemv{consts}")
"""


def test_gemv_compiles_for_sm90():
    assert_compiles(SCRIPT, 4)
