"""Helpers of benchmarks/bench_cache_ops.py: the GPU correctness stage that runs before any timing
(every cache kernel against its pure-torch reference at the benchmark's sizes, PASS/FAIL into the
results, never aborting), the kernel generations the benchmark times side by side (the current
kernels, with programmatic dependent launch, and the frozen pre-issue-18 copy), and the
per-launch breakdown of a captured graph.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable

import torch

from benchmarks import cache_kernels_before
from custom_ops import cache_kernels
from custom_ops import cache_layout as C
from custom_ops import cache_ops as ref
from custom_ops.cache.invariants import check_pool


def state(pool) -> tuple[torch.Tensor, ...]:
    return pool.gpu_free, pool.gpu_priority, pool.gpu_to_host, pool.host_to_gpu


class Kernels:
    """The three pool ops of one kernel generation, called on a GpuPool's buffers (the launchers
    directly: in a CUDA graph that is what the custom ops replay). ``prepare`` (before a run, in
    place, so also before each graph replay) and ``settle`` (after it, before checking the pool)
    are for generations with state of their own (``Flagged``)."""

    def __init__(self, mod, reserve: bool):
        self.mod = mod
        self.reserve = reserve  # whether its evictions take the reserve (cache_ops.evict_target)

    def state(self, pool) -> tuple[torch.Tensor, ...]:
        return state(pool)

    def prepare(self, pool) -> None:
        pass

    def settle(self, pool) -> None:
        pass

    def allocate(self, pool, want: torch.Tensor, n: torch.Tensor) -> None:
        self.mod.allocate_cuda(*self.state(pool), pool.indices, pool.meta, want, n)

    def free(self, pool, protect: torch.Tensor, n: torch.Tensor) -> None:
        self.mod.free_cuda(
            *self.state(pool), pool.indices, pool.meta, pool.hist, pool.totals, protect, n
        )

    def recall(self, pool, host: torch.Tensor, hs: torch.Tensor) -> torch.Tensor:
        return self.mod.recall_cuda(
            host, pool.gpu_kv, *self.state(pool), pool.indices, pool.miss_host, pool.meta,
            pool.hist, pool.totals, hs,
        )  # fmt: skip

    def evicts(self, needed: int, n_g: int, cap: int) -> int:
        """Slots an eviction that needs ``needed`` takes (given enough evictable slots)."""
        return ref.evict_target(needed, n_g, cap) if self.reserve else max(needed, 0)


class Flagged(Kernels):
    """The frozen pre-issue-18 kernels keep the free slots as an int8 flag array (1 = free), not
    the ring: they get a flag array of their own per pool, set from the pool (free <=> priority
    -1) by ``prepare``; ``settle`` rebuilds the ring from the result (HEAD 0, slot order)."""

    def __init__(self, mod):
        super().__init__(mod, reserve=False)
        self._flags: dict[int, torch.Tensor] = {}

    def state(self, pool) -> tuple[torch.Tensor, ...]:
        f = self._flags.get(id(pool))
        if f is None or f.shape != pool.gpu_priority.shape or f.device != pool.gpu_free.device:
            f = self._flags[id(pool)] = torch.empty_like(pool.gpu_priority, dtype=torch.int8)
        return (f, *state(pool)[1:])

    def prepare(self, pool) -> None:
        self.state(pool)[0].copy_(pool.gpu_priority == -1)

    def settle(self, pool) -> None:
        free = torch.nonzero(pool.gpu_priority == -1).flatten()
        pool.gpu_free[: free.numel()] = free.int()
        pool.meta[C.HEAD] = 0


class Switched(Kernels):
    """A generation's kernels with some of its module switches set during each call (a CUDA
    graph keeps the launches the switches chose when it was captured)."""

    def __init__(self, mod, reserve: bool, switches: dict):
        super().__init__(mod, reserve)
        self.switches = switches

    def _run(self, fn: Callable, *args):
        saved = {k: getattr(self.mod, k) for k in self.switches}
        for k, v in self.switches.items():
            setattr(self.mod, k, v)
        try:
            return fn(*args)
        finally:
            for k, v in saved.items():
                setattr(self.mod, k, v)

    def allocate(self, pool, want, n) -> None:
        self._run(super().allocate, pool, want, n)

    def free(self, pool, protect, n) -> None:
        self._run(super().free, pool, protect, n)

    def recall(self, pool, host, hs) -> torch.Tensor:
        return self._run(super().recall, pool, host, hs)


NEW = Kernels(cache_kernels, reserve=True)
BEFORE = Flagged(cache_kernels_before)
# NEW with free and recall as a launch per phase (cache_kernels.FUSED off: the previous default).
LAUNCHES = Switched(cache_kernels, reserve=True, switches={"FUSED": False})
# LAUNCHES with programmatic dependent launch (cache_kernels.LAUNCH_PDL; off: measured mixed).
PDL = Switched(cache_kernels, reserve=True, switches={"FUSED": False, "LAUNCH_PDL": True})
# The one-launch recall with the copy programs copying every row (cache_kernels.LOOKUP_COPY_ROWS
# 0; by default each lookup program copies some of the rows it places).
COPY_PROGRAMS = Switched(cache_kernels, reserve=True, switches={"LOOKUP_COPY_ROWS": 0})


def _stamps(p) -> torch.Tensor:
    h2g = p.host_to_gpu.long()
    out = torch.full_like(h2g, -1)
    on = h2g >= 0
    out[on] = p.gpu_priority.long()[h2g[on]]
    return out


def same_up_to_ties(before, r, k) -> list[str]:
    """What differs between the reference's result ``r`` and the kernel's ``k`` from the state
    ``before``, beyond the choices either may make (which slots of the threshold age bucket are
    evicted, which free slots take which rows). Empty: they agree."""
    bad = []
    sb, sr, sk = _stamps(before), _stamps(r), _stamps(k)
    inb, inr, ink = sb >= 0, sr >= 0, sk >= 0
    bucket = C.age_bucket((int(before.meta[C.CLOCK]) - sb) & C.CLOCK_MASK)
    ev_r, ev_k = inb & ~inr, inb & ~ink
    if not torch.equal(bucket[ev_r].sort().values, bucket[ev_k].sort().values):
        bad.append(f"evicted age buckets differ ({int(ev_r.sum())} vs {int(ev_k.sum())} slots)")
    if not torch.equal(inr & ~inb, ink & ~inb):
        bad.append("different host slots placed")
    both = inr & ink
    if not torch.equal(sr[both], sk[both]):
        bad.append("stamps differ")
    keep = [C.CLOCK, C.NFREE, C.OVERFLOW, C.IDX_HW, C.LAST_EVICT, C.LAST_ALLOC, C.HEAD]
    if r.meta[keep].tolist() != k.meta[keep].tolist():
        bad.append(f"meta {r.meta[keep].tolist()} vs {k.meta[keep].tolist()}")
    if r.totals.tolist() != k.totals.tolist():
        bad.append(f"totals {r.totals.tolist()} vs {k.totals.tolist()}")
    return bad


def _outcome(name: str, fn: Callable[[], list[str]]) -> dict:
    try:
        bad = fn()
    except Exception as e:  # a check must never abort the timings that follow
        bad = [f"{type(e).__name__}: {e}"]
    verdict = "PASS" if not bad else "FAIL"
    print(f"check {name}: {verdict}" + (f" ({'; '.join(bad)})" if bad else ""), flush=True)
    return {"verdict": verdict, "problems": bad}


def kernels_vs_reference(pool, host, hs, protect, want, n_free: int, impl=None) -> dict:
    """recall(hs), then free(protect, n_free), then allocate(want[:n]) on the state each left:
    the kernels (custom ops' CUDA path; ``impl``, default NEW) against the references,
    invariants and rows included."""
    impl = impl or NEW
    out: dict = {}
    n = torch.tensor([min(want.numel(), n_free)], dtype=torch.int32, device=hs.device)
    nf = torch.tensor([n_free], dtype=torch.int32, device=hs.device)

    def recall() -> list[str]:
        r, k = copy.deepcopy(pool), copy.deepcopy(pool)
        o_r = ref.recall_ref(host, r.gpu_kv, *state(r), r.indices, r.miss_host, r.meta,
                             r.totals, hs)  # fmt: skip
        o_k = impl.recall(k, host, hs)
        check_pool(k, selected=hs, gpu_slots=o_k, host_kv=host)
        bad = same_up_to_ties(pool, r, k)
        valid = hs >= 0
        if not torch.equal(k.gpu_kv[o_k[valid].long()], r.gpu_kv[o_r[valid].long()]):
            bad.append("recalled rows differ")
        for name, b in k.named_buffers():
            getattr(pool, name).copy_(b)
        return bad

    def free() -> list[str]:
        r, k = copy.deepcopy(pool), copy.deepcopy(pool)
        ref.free_ref(*state(r), r.indices, r.meta, r.totals, protect, nf)
        impl.free(k, protect, nf)
        check_pool(k)
        bad = same_up_to_ties(pool, r, k)
        for name, b in k.named_buffers():
            getattr(pool, name).copy_(b)
        return bad

    def allocate() -> list[str]:  # leaves the pool as it was (recall_steady runs next)
        w = want[torch.isin(want, torch.nonzero(pool.host_to_gpu < 0).flatten().int())]
        r, k = copy.deepcopy(pool), copy.deepcopy(pool)
        ref.allocate_ref(*state(r), r.indices, r.meta, w, n)
        impl.allocate(k, w, n)
        check_pool(k, allow_overflow=True)
        bad = same_up_to_ties(pool, r, k)
        if not torch.equal(r.gpu_to_host, k.gpu_to_host):  # one program: exact placement
            bad.append("allocate placed rows elsewhere than the reference (the ring's head)")
        kk = int(k.meta[C.LAST_ALLOC])
        if not torch.equal(k.indices[:kk], k.host_to_gpu[w[:kk].long()]):
            bad.append("allocate's indices are not the placed slots in want order")
        return bad

    def recall_steady() -> list[str]:
        # A step that evicts nothing with few misses: the placement pass's handoff (pops from
        # the ring's head, no eviction, no DONE protocol; the copy launch finalises).
        non = torch.nonzero(pool.host_to_gpu < 0).flatten()
        n_miss = min(37, non.numel(), int(pool.meta[C.NFREE]))
        hits = protect.reshape(-1).long()
        hits = hits[pool.host_to_gpu[hits] >= 0]  # the first recall may have evicted some
        sel = torch.cat([hits, non[::997][:n_miss]])
        sel = sel.int().view(1, -1)
        r, k = copy.deepcopy(pool), copy.deepcopy(pool)
        o_r = ref.recall_ref(host, r.gpu_kv, *state(r), r.indices, r.miss_host, r.meta,
                             r.totals, sel)  # fmt: skip
        o_k = impl.recall(k, host, sel)
        check_pool(k, selected=sel, gpu_slots=o_k, host_kv=host)
        bad = same_up_to_ties(pool, r, k)
        if int(k.meta[C.LAST_EVICT]) != 0:
            bad.append("the steady recall evicted")
        if not torch.equal(k.gpu_kv[o_k.reshape(-1).long()], r.gpu_kv[o_r.reshape(-1).long()]):
            bad.append("recalled rows differ")
        return bad

    out["recall"] = _outcome("recall", recall)
    out["free"] = _outcome("free", free)
    out["allocate"] = _outcome("allocate", allocate)
    out["recall_steady"] = _outcome("recall_steady", recall_steady)
    return out


def launch_breakdown(replay: Callable[[], None], before: Callable[[], None], calls: int) -> dict:
    """Kernel launches of one graph replay, by kernel name: launches per call and mean device
    time per launch (us), from the CUDA profiler. Gaps between launches are not in these times:
    the op's median minus their sum is the launch overhead."""
    from torch.profiler import ProfilerActivity, profile

    before()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    per: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name:
            per[e.name].append(e.time_range.elapsed_us())  # a kernel event: its duration
    return {
        name: {"launches_per_call": len(t) / calls, "us_per_launch": sum(t) / len(t)}
        for name, t in per.items()
    }
