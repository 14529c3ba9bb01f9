"""The pair-layout W4A16 kernels compile for an H200 (sm_90) without a GPU, in the configurations
the launchers and the benchmark use (and the linear's loop waits for its MMAs once a group with
GROUP_DOT, once a slice without; with TMA its words come by bulk tensor copies): the
interpreter that runs their CPU tests takes the fp32
MODE and never builds the inline PTX or the 16-bit dot operands, so this catches what only the
compiler sees (as ``test_cache_compile.py`` does for the cache kernels); the MoE's passes too."""

from __future__ import annotations

from sm90_utils import assert_compiles

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from custom_ops import awq_pairs_kernels as PK
from custom_ops import awq_pairs_moe as PM

TARGET = GPUTarget("cuda", 90, 32)


def compile_(kern, args, consts, name, warps=4, stages=3):
    sig = {a: t for a, t in args}
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (_, t) in enumerate(args) if t[0] == "*"}
    try:
        c = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                           target=TARGET, options={"num_warps": warps, "num_stages": stages})
    except Exception as e:
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[-1500:]}")
        return ""
    print(f"OK {name}")
    return c.asm["ptx"]


def check_mul(ptx, mode, scaled, name):
    # the inline PTX's scale multiply is there exactly when SCALED
    op = "f16x2" if "fp16" in name else "bf16x2"
    if ptx and mode == PK.MODE_ASM and (f"mul.rn.{op}" in ptx) != scaled:
        print(f"FAIL {name}: mul.rn.{op} in the PTX: {not scaled}")


for x in ("bf16", "fp16"):
    fp16 = x == "fp16"
    for mode in (PK.MODE_ASM, PK.MODE_OPS):
        for scaled, bn, bt, warps, gd, tma in ((False, 64, 16, 4, False, False),
                                               (True, 128, 32, 8, False, False),
                                               (False, 128, 64, 8, False, False),
                                               (True, 128, 128, 8, False, False),
                                               (True, 256, 64, 8, False, False),
                                               (False, 128, 16, 4, True, False),
                                               (True, 128, 128, 8, True, False),
                                               (False, 128, 16, 4, True, 7),
                                               (False, 64, 128, 4, False, 3),
                                               (False, 128, 16, 4, True, 1),
                                               (False, 64, 128, 4, True, 7),  # served, M = 128
                                               (True, 256, 128, 8, True, 7)):  # a sweep's
            args = [("x_ptr", "*" + x), ("qw_ptr", "*i32"), ("zs_ptr", "*i32"),
                    ("out_ptr", "*fp32"), ("y_ptr", "*" + x), ("cnt_ptr", "*i32"),
                    ("qw_desc", f"tensordesc<i32[{bn}, 16]>" if tma & 1 else "constexpr"),
                    ("zs_desc", f"tensordesc<i32[1, {bn}]>" if tma & 2 else "constexpr"),
                    ("x_desc", f"tensordesc<{x}[{bt}, 128]>" if tma & 4 and gd else "constexpr"),
                    ("M", "i32"), ("N", "i32"), ("G", "i32"),
                    ("stride_xm", "i32"), ("stride_os", "i32"), ("stride_om", "i32"),
                    ("SPLIT_K", "i32")]
            consts = dict(BN=bn, BT=bt, FP16=fp16, MODE=mode, FUSED=not scaled, INTERPRET=False,
                          SCALED=scaled, GROUP_DOT=gd, TMA=tma)
            consts.update({d: None for d, t in args if d.endswith("_desc") and t == "constexpr"})
            name = f"linear[{x}, mode {mode}, scaled {scaled}, {bn}x{bt}, gd {gd}, tma {tma}]"
            ptx = compile_(PK.w4a16_p_kernel, args, consts, name, warps)
            check_mul(ptx, mode, scaled, f"linear[{x}, scaled {scaled}]")
            waits = ptx.count("wgmma.wait_group.sync.aligned 0;")  # the loop's full waits
            if ptx and waits != (1 if gd else 4):  # GROUP_DOT: one a group, else one a slice
                print(f"FAIL linear[{x}, gd {gd}]: {waits} full wgmma waits")
            # TMA: the words come by bulk tensor copies, the pointer path's never; with
            # GROUP_DOT x too, so no cp.async is left
            if ptx and ("cp.async.bulk.tensor" in ptx) != bool(tma):
                print(f"FAIL {name}: bulk tensor copies in the PTX: {not tma}")
            if ptx and tma == 7 and gd and "cp.async.cg" in ptx:
                print(f"FAIL {name}: cp.async left with x by TMA")
        for scaled, gated, bn, bt, warps, gd in ((False, True, 64, 16, 4, False),
                                                 (True, True, 128, 128, 8, False),
                                                 (True, False, 64, 64, 4, False),
                                                 (False, True, 64, 16, 4, True)):
            args = [("a_ptr", "*" + x), ("w_ptr", "*i32"), ("zs_ptr", "*i32"),
                    ("out_ptr", "*" + x if gated else "*fp32"), ("sorted_ids_ptr", "*i32"),
                    ("block_expert_ptr", "*i32"), ("topk_w_ptr", "*fp32"), ("ws_ptr", "*fp32"),
                    ("cnt_ptr", "*i32"), ("topk_ids_ptr", "*i32"), ("sum_ptr", "*fp32"),
                    ("num_pairs", "i32"), ("N", "i32"), ("G", "i32"), ("E", "i32"),
                    ("stride_am", "i32"), ("stride_om", "i32"), ("SPLIT_K", "i32")]
            consts = dict(A_ROW_DIV=8 if gated else 1, GATED=gated, MUL_WEIGHT=not gated, BN=bn,
                          BT=bt, FP16=fp16, MODE=mode, SPLIT=False, SUM_K=False, TOPK=8,
                          INTERPRET=False, SCALED=scaled, GROUP_DOT=gd)
            name = f"moe[{x}, mode {mode}, scaled {scaled}, gated {gated}, {bn}x{bt}, gd {gd}]"
            ptx = compile_(PM.moe_p_kernel, args, consts, name, warps)
            check_mul(ptx, mode, scaled, f"moe[{x}, scaled {scaled}, gated {gated}]")
        args = [("qw_ptr", "*i32"), ("zs_ptr", "*i32"), ("w_ptr", "*" + x),
                ("N", "i32"), ("K", "i32")]
        consts = dict(BN=64, FP16=fp16, MODE=mode, INTERPRET=False)
        ptx = compile_(PK.dequant_p_kernel, args, consts, f"dequant[{x}, mode {mode}]")
        check_mul(ptx, mode, True, f"dequant[{x}]")
"""


def test_pair_kernels_compile_for_sm90():
    assert_compiles(SCRIPT, 68)
