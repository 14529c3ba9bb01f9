"""Every cache kernel, in each configuration its launcher uses (and the benchmark's variants),
compiles for an H200 (sm_90) without a GPU. The interpreter that runs the kernel tests on CPU does
not type-check what the compiler does (e.g. the same name bound to tensors of two shapes in the
two branches of an ``if``), so a kernel can pass every CPU test and still fail to compile; this
catches that before the GPU run. It also checks that the row copy moves 16-byte vectors."""

from __future__ import annotations

from sm90_utils import assert_compiles

# Run in a fresh interpreter: the test session sets TRITON_INTERPRET=1, which swaps the kernels
# for interpreted functions at import.
SCRIPT = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from custom_ops import cache_kernels as K  # the launch configuration
from custom_ops import cache_list_kernels as LS
from custom_ops import cache_pool_kernels as PS
from custom_ops import cache_release_kernels as RL

TARGET = GPUTarget("cuda", 90, 32)


def compile_(kern, args, consts, name):
    # Every constexpr must be given, defaults included (PDL, SKIP_CLEAN, STAGED: as their defaults).
    names = kern.arg_names
    consts = {**{k: v for k, v in (("PDL", False), ("SKIP_CLEAN", True), ("STAGED", False))
                 if k in names},
              **consts}
    sig = {a: t for a, t in args}
    sig.update({k: "constexpr" for k in consts})
    # Pointers 16-byte aligned, as the launchers pass them (and Triton specialises at run time).
    attrs = {(i,): [["tt.divisibility", 16]] for i, (_, t) in enumerate(args) if t[0] == "*"}
    try:
        c = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                           target=TARGET)
    except Exception as e:
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[-600:]}")
        return ""
    print(f"OK {name}")
    return c.asm["ptx"]


I32, I64 = "*i32", "*i64"
EP = [("prio", I32), ("ring", I32), ("g2h", I32), ("h2g", I32), ("indices", I32),
      ("meta", I32), ("hist", I32), ("stats", I64), ("want_ptr", I32), ("want_host", I32),
      ("n_g", "i32"), ("cap", "i32"), ("reserve", "i32")]
base = dict(BLOCK=K.SCAN_BLOCK, PAD=K.PAD_BLOCK)
for name, place in (("recall", True), ("free", False)):
    compile_(PS._evict_place_kernel, EP, {**base, "PLACE": place}, f"evict_place[{name}]")
AK = [("ring", I32), ("prio", I32), ("g2h", I32), ("h2g", I32), ("indices", I32),
      ("meta", I32), ("want_host", I32), ("want_ptr", I32), ("n_g", "i32"), ("cap", "i32"),
      ("want_len", "i32")]
compile_(PS._allocate_kernel, AK, dict(BLOCK=K.ALLOC_BLOCK, PAD=K.PAD_BLOCK), "allocate")
# Programmatic dependent launch (LAUNCH_PDL): the kernels of free's and recall's chains start
# with griddepcontrol (launch_dependents, then wait) in the PTX.
ptx = compile_(PS._evict_place_kernel, EP, {**base, "PLACE": True, "PDL": True},
               "evict_place[recall, pdl]")  # fmt: skip
if ptx and not ("griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx):
    print("FAIL evict_place[recall, pdl]: no griddepcontrol in the PTX")
compile_(PS._allocate_kernel, AK, dict(BLOCK=K.ALLOC_BLOCK, PAD=K.PAD_BLOCK, PDL=True),
         "allocate[pdl]")  # fmt: skip
LK = [("host_slots", I32), ("h2g", I32), ("prio", I32), ("miss_host", I32), ("meta", I32),
      ("stats", I64), ("total", "i32"), ("cap", "i32")]
for misses in (True, False):
    compile_(LS._lookup_kernel, LK, dict(MISSES=misses, BLOCK=K.LIST_BLOCK), f"lookup[{misses}]")
compile_(LS._lookup_kernel, LK, dict(MISSES=True, BLOCK=K.LIST_BLOCK, SKIP_CLEAN=False, PDL=True),
         "lookup[claim in every block, pdl]")
HK = [("prio", I32), ("meta", I32), ("hist", I32), ("want_ptr", I32), ("n_g", "i32"),
      ("cap", "i32")]
for pdl in (False, True):
    compile_(PS._evict_hist_kernel, HK, dict(BLOCK=K.SCAN_BLOCK, PDL=pdl), f"hist[pdl={pdl}]")
CP = [("host_kv", I32), ("gpu_kv", I32), ("miss_host", I32), ("h2g", I32), ("host_slots", I32),
      ("out", I32), ("meta", I32), ("stats", I64), ("stage_kv", I32), ("hstage", I32),
      ("shost", I64), ("epoch_ptr", I32), ("pfs", I64), ("total", "i32"), ("n_copy", "i32"),
      ("cap", "i32"), ("n_stage", "i32")]
for upr in (41, 72):  # fp8 and bf16 rows
    for early, cache, own, units in ((True, "", True, K.COPY_UNITS), (False, ".cg", False, 1024)):
        ptx = compile_(LS._copy_out_kernel, CP, dict(UPR=upr, UNITS=units, BLOCK=K.LIST_BLOCK,
                       EARLY=early, CACHE=cache, OWN_FINAL=own), f"copy[{upr},{early},{cache}]")
        if ptx and not re.search(r"ld\.global(\.cg)?\.v4\.b32", ptx):
            print(f"FAIL copy[{upr},{early},{cache}]: no 16-byte loads in the PTX")
compile_(LS._copy_out_kernel, CP, dict(UPR=41, UNITS=512, BLOCK=K.LIST_BLOCK, EARLY=True,
         CACHE="", OWN_FINAL=True, PDL=True), "copy[41, 512 units, pdl]")  # fmt: skip
for upr in (41, 72):  # echo::recall_staged: staged misses read from staging, the rest from the host
    ptx = compile_(LS._copy_out_kernel, CP, dict(UPR=upr, UNITS=K.COPY_UNITS, BLOCK=K.LIST_BLOCK,
                   EARLY=True, CACHE="", OWN_FINAL=True, STAGED=True), f"copy[{upr}, staged]")
    if ptx and not re.search(r"ld\.global\.v4\.b32", ptx):
        print(f"FAIL copy[{upr}, staged]: no 16-byte loads in the PTX")
# free and recall in one launch (K.FUSED): the phases' bodies in one kernel, with spin waits
from custom_ops import cache_fused_kernels as FS
FK = [("protect", I32), ("h2g", I32), ("prio", I32), ("ring", I32), ("g2h", I32),
      ("indices", I32), ("meta", I32), ("hist", I32), ("stats", I64), ("want_ptr", I32),
      ("total", "i32"), ("n_g", "i32"), ("cap", "i32"), ("reserve", "i32"), ("n_look", "i32"),
      ("n_scan", "i32")]
compile_(FS._free_kernel, FK, dict(LIST_BLOCK=K.FREE_LIST_BLOCK, SCAN_BLOCK=K.FUSED_SCAN_BLOCK,
         PAD=K.PAD_BLOCK, SLEEP_NS=0), "free[one launch]")  # fmt: skip
RK = [("host_kv", I32), ("gpu_kv", I32), ("host_slots", I32), ("h2g", I32), ("prio", I32),
      ("ring", I32), ("g2h", I32), ("indices", I32), ("miss_host", I32), ("meta", I32),
      ("hist", I32), ("stats", I64), ("out", I32), ("stage_kv", I32), ("hstage", I32),
      ("shost", I64), ("epoch_ptr", I32), ("pfs", I64), ("total", "i32"), ("n_g", "i32"),
      ("cap", "i32"), ("reserve", "i32"), ("n_look", "i32"), ("n_scan", "i32"), ("n_copy", "i32"),
      ("n_out", "i32"), ("n_stage", "i32")]
# (claimed: cache_kernels.LOOKUP_COPY_ROWS, the lookup programs copy rows they placed, with
# 16-byte loads of their own beside the copy programs')
v4 = {}
for upr, staged, nap, claimed, early in (
        (41, False, 0, False, True), (72, False, 0, False, True), (41, True, 0, False, True),
        (41, False, 200, False, True), (41, False, 0, True, True), (72, False, 0, True, True),
        (41, True, 0, True, True), (41, False, 0, True, False)):  # fmt: skip
    ptx = compile_(FS._recall_kernel, RK, dict(UPR=upr, UNITS=K.COPY_UNITS,
                   LIST_BLOCK=K.LIST_BLOCK, SCAN_BLOCK=K.FUSED_SCAN_BLOCK, PAD=K.PAD_BLOCK,
                   SKIP_CLEAN=True, EARLY=True, CACHE="", STAGED=staged, SLEEP_NS=nap,
                   SELF_ROWS=32 if claimed else 0, LOOK_UNITS=K.LOOKUP_COPY_UNITS,
                   OUT_EARLY=early, STAMP=K.PROBE_LOOKUP_STAMPS),
                   f"recall[one launch, {upr}, staged={staged}, sleep={nap}, "
                   f"claimed={claimed}, out_early={early}]")  # fmt: skip
    if not early:  # (RECALL_OUT_EARLY off: compiles; the v4 counts below are the default's)
        continue
    if ptx and not re.search(r"ld\.global\.cg", ptx):  # _out_late's reload past the L1
        print(f"FAIL recall[one launch, {upr}]: no ld.global.cg (the output's late reload)")
    v4[upr, staged, claimed] = len(re.findall(r"ld\.global\.v4\.b32", ptx))
    if ptx and claimed and v4[upr, staged, claimed] <= v4[upr, staged, False]:
        print(f"FAIL recall[claimed, {upr}]: no 16-byte loads of the lookup's own copy")
    if ptx and nap and "nanosleep.u32" not in ptx:
        print("FAIL recall[one launch, sleep]: no nanosleep in the PTX")
    # the waits' acquire polls and the signals' release adds (Triton: ld.acquire / red.release)
    if ptx and not (re.search(r"(ld|atom)\.global\.gpu\.acquire", ptx)
                    and re.search(r"(red|atom)\.global\.gpu\.release", ptx)):
        print(f"FAIL recall[one launch, {upr}]: no acquire polls / release adds in the PTX")
compile_(RL._release_kernel, [("host_slots", I32), ("h2g", I32), ("g2h", I32), ("prio", I32),
                             ("ring", I32), ("meta", I32), ("total", "i32"), ("n_h", "i32"),
                             ("n_g", "i32")],
         dict(BLOCK=K.LIST_BLOCK), "release")
# every layer's release in one launch: the pool buffers' addresses from a table (int -> pointer)
for forget, slots in ((True, "*i64"), (False, "*i64"), (True, I32)):
    compile_(RL._release_layers_kernel, [("host_slots", slots), ("table", I64), ("total", "i32"),
                                         ("n_h", "i32"), ("n_g", "i32"), ("n_layers", "i32"),
                                         ("n_ema", "i32")],
             dict(FORGET=forget, EMA_ROWS=3, BLOCK=K.LIST_BLOCK),
             f"release_layers[forget={forget}, {slots}]")  # fmt: skip
compile_(RL._offload_kernel, [("host_kv", I32), ("index_k", I32), ("rows", I32),
                             ("index_rows", I32), ("slots", "*i64")],
         dict(ROW_W=164, ROW_WP=256), "offload")
"""


def test_every_cache_kernel_compiles_for_sm90():
    assert_compiles(SCRIPT, 31)
