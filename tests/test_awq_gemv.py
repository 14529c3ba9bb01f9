"""The few-token W4A16 kernel over the pair layout (custom_ops/awq_gemv_kernels.py) against the
reference of ``echo::w4a16_linear_p`` over sizes, steps and tails (interpreter), its launch
configuration and bad configurations, its compile for an H200 (sm_90) without a GPU, and the
V3.2 shapes on the GPU."""

from __future__ import annotations

import pytest
import torch
from sm90_utils import assert_compiles
from test_awq import _awq_weights
from test_awq_pairs import _rand_awq_cuda, _rel

from custom_ops import awq as ops
from custom_ops import awq_gemv_kernels as GK
from custom_ops import awq_pairs as P
from custom_ops import awq_pairs_kernels as PK

CASES = [  # (K, N, M, dtype, config over w4a16_gemv_config's)
    (256, 64, 1, torch.bfloat16, {}),
    (384, 128, 3, torch.float16, dict(GEMV_MP=2, GEMV_BN=16, GEMV_CG=2)),  # groups past a step
    (512, 96, 5, torch.bfloat16, dict(GEMV_MP=4, GEMV_BN=64, GEMV_CG=4)),  # two token blocks
    (256, 40, 2, torch.bfloat16, dict(GEMV_BN=32, GEMV_CG=1)),  # N past the last full block
    (640, 24, 9, torch.float16, dict(GEMV_MP=8, GEMV_BN=8, GEMV_CG=8)),  # one step past K
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_gemv_matches_reference(case):
    k, n, m, dtype, cfg = CASES[case]
    g = torch.Generator().manual_seed(60 + case)
    qw, qz, s = _awq_weights(k, n, g, dtype)
    pw = P.pair_awq(qw, qz, s)
    x = torch.randn(m, 2 * k, generator=g).to(dtype)[:, ::2]  # strided: the launcher copes
    y = PK.w4a16_linear_p_triton(x, *pw, config={"GEMV": True, **cfg})
    ref = P.w4a16_linear_p_ref(x.contiguous(), *pw)
    assert y.dtype == dtype and y.shape == (m, n)
    assert _rel(y, ref) < 4e-3  # the exact weights, fp32 sums in another order, then the rounding


def test_gemv_config():
    c = GK.w4a16_gemv_config(1, 576, 7168, 132)  # 64 bytes a column and group, ~8 KB a step
    assert (c["GEMV_MP"], c["GEMV_BN"], c["GEMV_CG"]) == (1, 4, 32)
    c = GK.w4a16_gemv_config(1, 7168, 2048, 132)
    assert (c["GEMV_MP"], c["GEMV_BN"], c["GEMV_CG"]) == (1, 32, 4)
    c = GK.w4a16_gemv_config(8, 4096, 7168, 132, waves=2)
    assert (c["GEMV_MP"], c["GEMV_BN"], c["GEMV_CG"]) == (4, 16, 8)
    assert GK.w4a16_gemv_config(1, 64, 256, 132)["GEMV_CG"] == 2  # never past K's groups


def test_gemv_bad_config():
    qw, qz, s = _awq_weights(256, 64, torch.Generator().manual_seed(0), torch.bfloat16)
    x = torch.randn(1, 256).bfloat16()
    with pytest.raises(ValueError, match="GEMV_CG must be a power of two"):
        PK.w4a16_linear_p_triton(x, *P.pair_awq(qw, qz, s), config={"GEMV": True, "GEMV_CG": 6})


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_gemv_on_gpu_at_v32_shapes(m):
    gen = torch.Generator("cuda").manual_seed(m)
    for k, n in ((7168, 4096), (16384, 7168), (7168, 2048), (2048, 7168), (7168, 576)):
        w = _rand_awq_cuda(k, n, gen)
        pw = P.pair_awq(*w)
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        ref = ops.w4a16_linear_ref(x, *w)
        for extra in ({}, {"GEMV_MP": 8}, {"GEMV_WAVES": 2}):
            y = PK.w4a16_linear_p_triton(x, *pw, config={"GEMV": True, **extra})
            assert _rel(y, ref) < 1e-2, (k, n, extra)


SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from custom_ops import awq_gemv_kernels as GK

ARGS = [("x_ptr", "*bf16"), ("qw_ptr", "*i32"), ("zs_ptr", "*i32"), ("y_ptr", "*bf16"),
        ("M", "i32"), ("N", "i32"), ("G", "i32"), ("stride_xm", "i32"), ("stride_ym", "i32")]
for n, k, m in ((576, 7168, 1), (7168, 2048, 1), (2048, 7168, 4), (4096, 7168, 16)):
    c = GK.w4a16_gemv_config(m, n, k, 132)
    consts = dict(MP=c["GEMV_MP"], BN=c["GEMV_BN"], CG=c["GEMV_CG"], INTERPRET=False)
    sig = {a: t for a, t in ARGS}
    sig.update({key: "constexpr" for key in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (_, t) in enumerate(ARGS) if t[0] == "*"}
    try:
        triton.compile(ASTSource(fn=GK.w4a16_gemv_kernel, signature=sig, constexprs=consts,
                                 attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": c["num_warps"]})
    except Exception as e:
        print(f"FAIL gemv{consts}: {type(e).__name__}: {str(e)[-800:]}")
        continue
    print(f"OK gemv{consts}")
"""


def test_gemv_compiles_for_sm90():
    assert_compiles(SCRIPT, 4)
