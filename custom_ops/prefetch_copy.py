"""The ``"side"`` prefetch variant's row copy: a kernel of its own, beside the scoring.

In the other variants a scoring program copies its candidates' rows host -> staging itself, after
its scoring loop, so it holds its SM slot through PCIe round trips; the programs of a wave reach
their tails together, and while they wait nothing scores. Here the scoring kernel only claims and
tags (``prefetch_scores.index_scores_prefetch_side``), and this kernel, on a side stream, copies
the rows while the scoring and the exact top-k run; the op joins the side stream before the
threshold update, which ends the step's staging as in the other variants.

The protocol, on ``stage_ctr`` (``[claims..., global, ..., DONE, EPOCH]``, E the epoch word):
- the scoring kernel claims slots through the claim counters, tags each staged slot
  ``stage_tag(E + 1, h) | PENDING`` (prefetch_layout.PENDING_BIT), and every program adds 1 to
  DONE at its end (release, after a barrier, so its claim and tags come first);
- this kernel's programs walk the staging slots in chunks of COPY_ROWS: a chunk is copied once it
  is wholly claimed (or DONE says every scoring program has finished: no more claims come) and
  each of its claimed slots carries this epoch's pending tag (the host slot is the tag's low
  word); then its tags are rewritten without the bit. The recall, after the op's join, trusts
  exact tags only: a row whose tag is still pending is read from the host.

So the attended set and every byte read never depend on this kernel: it may copy all, some or
none of the rows. That is what makes its waits safe. It waits only for the scoring kernel, and
only for WAIT_NS from its start: CUDA does not promise that two kernels of two streams run at
once (a CUDA graph may run its branches one after the other; a lazy module load may wait for the
kernels running), and a copy kernel run before the scoring could otherwise wait forever. The op
launches it after the scoring kernel when it runs eagerly, and first while a CUDA graph is
captured, so that in the graph its programs can be resident before the scoring's fill the SMs.
Under the interpreter (no streams) it runs after the scoring kernel: every wait is then met.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.prefetch_layout import EPOCH_SHIFT, HOST_MASK, PENDING_BIT
from custom_ops.prefetch_scores import claim_space

_SHIFT = tl.constexpr(EPOCH_SHIFT)
_HOST_MASK = tl.constexpr(HOST_MASK)
_PENDING_HI = tl.constexpr(1 << (PENDING_BIT - EPOCH_SHIFT))  # the pending bit in tag >> 32
COPY_ROWS = 8  # rows a chunk (one round trip of host reads per chunk)
COPY_SM_SHARE = 2  # one program per this many SMs
SLEEP_NS = 256  # between polls of a chunk that is not ready
# A program stops waiting this long after its start (%globaltimer): the chunks it has not copied
# keep their pending tags, and the recall reads those rows from the host. Far above a scoring
# kernel's time (~120 us at 16 x 128K tokens); it bounds what a copy kernel run without the
# scoring beside it costs (CUDA does not promise that kernels of two streams run concurrently).
WAIT_NS = 5_000_000


@triton.jit
def _sleep(x, SLEEP: tl.constexpr):
    """nanosleep (CUDA only; the interpreter never waits), passing ``x`` through."""
    if SLEEP > 0:
        x = tl.inline_asm_elementwise(
            f"nanosleep.u32 {SLEEP}; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip
    return x


@triton.jit
def _now(x):
    """The GPU's global nanosecond timer (CUDA only), ``x`` only giving the shape."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _scored(ptr, n_score):
    """Whether every scoring program has counted itself done in DONE (at ``ptr``). Polled
    relaxed (an acquire on every poll would invalidate the SM's L1 under the scoring programs
    beside it); once it has, read again with acquire, so the claim counters and tags read after
    it are final."""
    s = tl.atomic_add(ptr, 0, sem="relaxed")
    if s == n_score:
        s = tl.atomic_add(ptr, 0, sem="acquire")
    return s == n_score


@triton.jit
def _copy_staged_kernel(
    sl_ptr, ctr_ptr, n_ctr, shost_ptr, src_ptr, dst_ptr, B, cap, n_stage, ratio, n_prog, n_score,
    GLOBAL: tl.constexpr, BP: tl.constexpr, ROWS: tl.constexpr, UPR: tl.constexpr,
    UNITS_P: tl.constexpr, SLEEP: tl.constexpr, WAIT: tl.constexpr,
):  # fmt: skip
    """Program p copies chunks p, p + n_prog, ... (module docstring). A chunk is ROWS slots of
    one claim range: GLOBAL, [c ROWS, c ROWS + ROWS) of the budget; else request c // per_req's
    range, rows (c % per_req) ROWS on. Rows are UPR 16-byte units; a chunk's units are one
    [UNITS_P, 4] int32 tile (one load, one store); then its tags lose the pending bit. WAIT > 0:
    after WAIT ns a program copies no more chunks (their rows stay pending: the host's)."""
    pid = tl.program_id(0)
    want = tl.load(ctr_ptr + n_ctr - 1) + 1  # this call's tags
    pending = want | _PENDING_HI  # a claimed slot's tag >> 32 until its row is copied
    if WAIT > 0:
        t0 = _now(pid)
    done_ptr = ctr_ptr + n_ctr - 2
    per_req = tl.cdiv(cap, ROWS)
    limit, ctr, slot0 = claim_space(0, sl_ptr, ctr_ptr, B, cap, n_stage, ratio, GLOBAL, BP)
    n_chunks = tl.cdiv(limit, ROWS) if GLOBAL else B * per_req
    u = tl.arange(0, UNITS_P)
    row = u // UPR
    w4 = tl.arange(0, 4)
    rr = tl.arange(0, ROWS)
    for c in range(pid, n_chunks, n_prog):
        b = 0 if GLOBAL else c // per_req
        first = c * ROWS if GLOBAL else (c % per_req) * ROWS
        limit, ctr, slot0 = claim_space(b, sl_ptr, ctr_ptr, B, cap, n_stage, ratio, GLOBAL, BP)
        end = first * 0
        ready = first * 0
        late = first * 0  # 1: given up
        while (ready == 0) & (late == 0):
            scored = _scored(done_ptr, n_score)
            claimed = tl.minimum(tl.atomic_add(ctr, 0, sem="relaxed"), limit)
            end = tl.minimum(first + ROWS, claimed)
            if scored | (claimed >= first + ROWS):  # nothing more will be claimed in it
                rm = first + rr < end
                tag = tl.load(shost_ptr + slot0 + first + rr, mask=rm, other=0, volatile=True)
                n_late = tl.sum((rm & ((tag >> _SHIFT) != pending)).to(tl.int32), 0)
                ready = (n_late == 0).to(tl.int32)
            if ready == 0:
                if WAIT > 0:
                    late = (_now(pid) - t0 > WAIT).to(tl.int32)
                end = _sleep(end, SLEEP)
        if (ready != 0) & (end > first):
            tl.debug_barrier()  # every thread's view of the tags follows the poll's
            um = (u < ROWS * UPR) & (first + row < end)
            slot = (slot0 + first + row).to(tl.int64)
            tag = tl.load(shost_ptr + slot, mask=um, other=0, volatile=True)
            h = tag & _HOST_MASK
            word = (u - row * UPR) * 4
            m2 = um[:, None]
            v = tl.load(src_ptr + (h * (UPR * 4) + word)[:, None] + w4[None, :], mask=m2)
            tl.store(dst_ptr + (slot * (UPR * 4) + word)[:, None] + w4[None, :], v, mask=m2)
            # the row is there: its exact tag (the recall reads after the op's join)
            rm = first + rr < end
            tag = tl.load(shost_ptr + slot0 + first + rr, mask=rm, other=0, volatile=True)
            tl.store(shost_ptr + slot0 + first + rr, (want.to(tl.int64) << _SHIFT) |
                     (tag & _HOST_MASK), mask=rm)  # fmt: skip


def copy_staged_cuda(seq_lens, stage_ctr, stage_host, host_words, stage_words, cap: int,
                     ratio: float, n_score: int) -> None:  # fmt: skip
    """Launch ``_copy_staged_kernel`` on the current stream (the op puts it on a side stream);
    ``n_score``: the scoring kernel's program count, which DONE reaches when it has finished."""
    row_w = host_words.shape[1]
    if row_w % 4:
        raise ValueError(f"the side staging copy moves 16-byte units: rows of {row_w * 4} B")
    B = seq_lens.shape[0]
    n_stage = stage_words.shape[0]
    upr = row_w // 4
    n_chunks = triton.cdiv(n_stage, COPY_ROWS) if ratio > 0 else B * triton.cdiv(cap, COPY_ROWS)
    dev = seq_lens.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
    n_prog = max(1, min(sms // COPY_SM_SHARE, n_chunks))
    units = triton.next_power_of_2(COPY_ROWS * upr)
    k = _copy_staged_kernel[(n_prog,)](
        seq_lens, stage_ctr, stage_ctr.shape[0], stage_host, host_words, stage_words, B, cap,
        n_stage, float(ratio), n_prog, n_score, GLOBAL=ratio > 0,
        BP=max(2, triton.next_power_of_2(B)), ROWS=COPY_ROWS, UPR=upr, UNITS_P=units,
        SLEEP=SLEEP_NS if dev.type == "cuda" else 0, WAIT=WAIT_NS if dev.type == "cuda" else 0,
        num_warps=max(4, min(8, units // 64)),
    )  # fmt: skip
    if dev.type == "cuda" and COPY_CARVEOUT is not None:
        _prefer_shared(k.function, COPY_CARVEOUT)


# The copy kernel's preferred shared-memory carveout (percent of the SM's L1/shared, CUDA's
# CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT). It needs almost no shared memory, so by
# default an SM that runs it first may be set to a small shared size, on which the scoring
# kernel's programs (26 KB each) do not fit until it exits; the largest carveout leaves room
# for them. None: the default.
COPY_CARVEOUT: int | None = 100
_CARVED: set[int] = set()


def _prefer_shared(function: int, percent: int) -> None:
    """Set a compiled kernel's preferred carveout once (through the driver API)."""
    if function in _CARVED:
        return
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    rc = lib.cuFuncSetAttribute(ctypes.c_void_p(function), 9, ctypes.c_int(percent))
    if rc != 0:
        raise RuntimeError(f"cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT) failed: {rc}")
    _CARVED.add(function)


_SIDE: dict[int, torch.cuda.Stream] = {}


def side_stream(dev: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the copy, at the highest priority (eagerly, its programs
    are then dispatched ahead of the scoring kernel's waiting ones); created once, so CUDA graphs
    capture the same fork and join every time."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SIDE:
        _SIDE[idx] = torch.cuda.Stream(device=idx, priority=-100)
    return _SIDE[idx]
