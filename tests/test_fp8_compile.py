"""The FP8 linear kernel compiles for an H200 (sm_90) without a GPU, in both product forms: the
interpreter that runs its CPU tests multiplies in fp32, so only the compiler shows which MMA a
configuration gets. SWAP (the weight tile as the MMA's M operand; the decode rule's 8 warps and
4 stages, on the 128- and 64-row tiles) must reach Hopper's wgmma, the other form (x's 16-row
tile as M) the mma.sync path, x's 64- and 128-row tiles of M = 33-128 (x quantised first) wgmma
again, and all pipeline their weight loads (cp.async; with TMA, bulk tensor copies)."""

from __future__ import annotations

from sm90_utils import run_script

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from custom_ops import fp8_linear_kernels as FK

ARGS = [("x_ptr", "*bf16"), ("w_ptr", "*fp8e4nv"), ("ws_ptr", "*fp32"), ("out_ptr", "*fp32"),
        ("xs_ptr", "*bf16"), ("y_ptr", "*bf16"), ("cnt_ptr", "*i32"), ("x_desc", "constexpr"),
        ("w_desc", "constexpr"), ("M", "i32"), ("N", "i32"),
        ("K", "i32"), ("stride_xm", "i32"), ("stride_os", "i32"), ("stride_om", "i32"),
        ("SPLIT_K", "i32"), ("stride_xs_m", "i32"), ("stride_xs_kb", "i32")]
ALIGNED = {"N", "K", "stride_xm", "stride_os", "stride_om"}  # as the launch specialises them
CONFIGS = ((False, 16, 128, 8, False, False), (True, 16, 128, 8, False, False),
           (True, 16, 64, 8, False, False), (True, 32, 128, 8, False, False),
           (False, 64, 64, 4, True, False), (False, 128, 64, 8, True, False),
           (True, 16, 128, 8, False, True), (False, 64, 64, 4, True, True),
           (False, 128, 64, 8, True, True))  # the served M = 65-128 tile
for swap, bm, bn, warps, pre, tma in CONFIGS:
    consts = dict(BM=bm, BN=bn, UE8M0=True, INTERPRET=False, PREQUANT=pre, FUSED=True,
                  SWAP=swap, TMA=tma)
    sig = {a: t for a, t in ARGS}
    if pre:  # x already e4m3, its scales fp32 (act_quant_dg)
        sig.update(x_ptr="*fp8e4nv", xs_ptr="*fp32")
    if tma:  # x and the weight by tensor descriptors
        sig.update(x_desc=f"tensordesc<{'fp8e4nv' if pre else 'bf16'}[{bm}, 128]>",
                   w_desc=f"tensordesc<fp8e4nv[{bn}, 128]>")
    else:
        consts.update(x_desc=None, w_desc=None)
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (a, t) in enumerate(ARGS)
             if t[0] == "*" or a in ALIGNED}
    ptx = triton.compile(ASTSource(fn=FK.fp8_linear_kernel, signature=sig, constexprs=consts,
                                   attrs=attrs),
                         target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": warps,
                                  "num_stages": 4 if swap or pre else 3}).asm["ptx"]
    print(f"swap={swap} BM={bm} BN={bn} wgmma={'wgmma.mma_async' in ptx} "
          f"mma.sync={'mma.sync' in ptx} cp.async={'cp.async.cg' in ptx} "
          f"tma={tma} bulk={'cp.async.bulk.tensor' in ptx}")
"""


def test_fp8_linear_kernel_compiles_for_sm90_in_both_product_forms():
    out = run_script(SCRIPT)
    lines = [ln for ln in out.splitlines() if ln.startswith("swap=")]
    assert len(lines) == 9, out[-3000:]
    for ln in lines:
        # wgmma where the MMA's M operand has 64 rows or more: the weight tile (SWAP) or x's
        # 64- and 128-row tiles (M = 33-128, x quantised first)
        wide = ln.startswith("swap=True") or " BM=64 " in ln or " BM=128 " in ln
        assert f"wgmma={wide}" in ln and f"mma.sync={not wide}" in ln, ln
        # the loads pipelined: cp.async, or with TMA bulk tensor copies only (x's and w's)
        tma = "tma=True" in ln
        assert f"cp.async={not tma}" in ln and f"bulk={tma}" in ln, ln
