"""How the programs of the cache-manager kernels coordinate: programmatic dependent launch
(``_pdl_start``), the last program of a launch (``_last_program``), and the phases of a
one-launch op (``_signal`` / ``_wait``: release / acquire atomics on counters in ``meta``,
cache_fused_kernels.py)."""

from __future__ import annotations

import triton
import triton.language as tl

try:  # grid dependency control (Triton >= 3.3); without it PDL stays off (PDL_AVAILABLE)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    PDL_AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton: the launchers never set PDL
    PDL_AVAILABLE = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


from custom_ops.cache_constexpr import M_DONE


@triton.jit
def _pdl_start():
    """Programmatic dependent launch (cache_kernels.LAUNCH_PDL, sm_90): let the next launch of
    the op start now (its programs wait in their own gdc_wait), then wait until the previous
    launch has finished and its writes are visible. So every read of this kernel sees the whole
    previous launch, as without PDL; only the launch latency overlaps. Not for the interpreter."""
    gdc_launch_dependents()
    gdc_wait()


@triton.jit
def _last_program(meta, nprog):
    """True in the last of ``nprog`` programs to get here; each of them must call it once."""
    tl.debug_barrier()  # all threads' stores of this program are issued before the release
    done = tl.atomic_add(meta + M_DONE, 1, sem="acq_rel")
    return done == nprog - 1


@triton.jit
def _signal(ctr):
    """A phase of a one-launch op is done in this program: its writes are released to the
    programs that _wait on ``ctr`` (cache_fused_kernels.py)."""
    tl.debug_barrier()  # all threads' stores of this program are issued before the release
    tl.atomic_add(ctr, 1, sem="release")


@triton.jit
def _wait(ctr, target, SLEEP_NS: tl.constexpr = 0):
    """Spin until ``target`` programs have _signal-ed ``ctr``; then their writes are visible to
    every thread of this program. Only ever called on counters of lower-numbered programs.
    SLEEP_NS > 0 (CUDA only): nanosleep between polls, so hundreds of waiting programs do not
    keep the counter's L2 line busy."""
    c = tl.atomic_add(ctr, 0, sem="acquire")
    while c < target:
        if SLEEP_NS > 0:
            c = tl.inline_asm_elementwise(
                f"nanosleep.u32 {SLEEP_NS}; mov.b32 $0, $1;", "=r,r", [c], dtype=tl.int32,
                is_pure=False, pack=1,
            )  # fmt: skip
        c = tl.atomic_add(ctr, 0, sem="acquire")
    tl.debug_barrier()  # the other threads' reads follow thread 0's acquire
