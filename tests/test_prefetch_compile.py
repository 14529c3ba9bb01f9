"""The fused indexer-scores + prefetch kernels (custom_ops/prefetch_scores.py), every variant,
per-request cap and global budget, and the threshold update that ends a staging step
(prefetch_kernels._ema_kernel, with and without the epoch's advance), compile for an H200
(sm_90) without a GPU: the interpreter that runs their CPU tests does not lower what the compiler
lowers (the "post" kernel's bits of the tiles above the threshold are unpacked by a broadcast and
a reshape; the staging tags are int64)."""

from __future__ import annotations

from sm90_utils import assert_compiles

# A fresh interpreter: the test session sets TRITON_INTERPRET=1, which swaps the kernels for
# interpreted functions at import.
SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from custom_ops import prefetch_scores as PS
from custom_ops.indexer_kernels import IndexerConfig

cfg = IndexerConfig()
U8, F32, I32, I64 = "*u8", "*fp32", "*i32", "*i64"
ARGS = [("q_ptr", U8), ("w_ptr", F32), ("kv_ptr", U8), ("ks_ptr", F32), ("bt_ptr", I32),
        ("sl_ptr", I32), ("score_ptr", F32), ("ema_ptr", F32), ("h2g_ptr", I32),
        ("hstage_ptr", I32), ("shost_ptr", I64), ("ctr_ptr", I32), ("epoch_ptr", I32),
        ("pfs_ptr", I64),
        ("src_ptr", I32), ("dst_ptr", I32), ("n_heads", "i32"), ("bt_stride", "i32"),
        ("L", "i32"), ("B", "i32"), ("cap", "i32"), ("n_stage", "i32"), ("ratio", "fp32")]
POST = PS._scores_prefetch_post_kernel
for name, kern, own in (("post", POST, dict(EARLY=False)), ("early", POST, dict(EARLY=True)),
                        ("tile", PS._scores_prefetch_kernel, {})):
    for glob in (False, True):
        # bf16 rows (288 words) and fp8 rows (164), the launcher's constexprs at 64 index heads
        for row_w in (288, 164):
            consts = dict(HP=64, BT=cfg.score_block, TPP=cfg.score_tokens, STAGES=cfg.score_stages,
                          GLOBAL=glob, BP=16, ROWS=8, ROW_W=row_w,
                          ROW_WP=triton.next_power_of_2(row_w), **own)
            sig = {a: t for a, t in ARGS}
            sig.update({k: "constexpr" for k in consts})
            attrs = {(i,): [["tt.divisibility", 16]] for i, (_, t) in enumerate(ARGS)
                     if t[0] == "*"}
            tag = f"{name}[global={glob}, row_w={row_w}]"
            try:
                triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": cfg.score_warps})
            except Exception as e:
                print(f"FAIL {tag}: {type(e).__name__}: {str(e)[-600:]}")
                continue
            print(f"OK {tag}")
from custom_ops import prefetch_kernels as PK
EK = [("ema_ptr", F32), ("kth_ptr", F32), ("sl_ptr", I32), ("bt_ptr", I32), ("bt_stride", "i32"),
      ("B", "i32"), ("n_ema", "i32"), ("margin", "fp32"), ("ctr_ptr", I32), ("n_ctr", "i32"),
      ("pfs_ptr", I64)]
for end in (False, True):
    consts = dict(BP=16, END_STAGING=end, CTR_BLOCK=128)
    sig = {a: t for a, t in EK}
    sig.update({k: "constexpr" for k in consts})
    try:
        triton.compile(ASTSource(fn=PK._ema_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    except Exception as e:
        print(f"FAIL ema[end_staging={end}]: {type(e).__name__}: {str(e)[-600:]}")
        continue
    print(f"OK ema[end_staging={end}]")
"""


def test_prefetch_scores_kernels_compile_for_sm90():
    assert_compiles(SCRIPT, 14)
