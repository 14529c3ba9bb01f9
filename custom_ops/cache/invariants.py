"""Invariants of a layer's GPU pool, checked by tests and by ``GpuPool(debug=True)``.

Between ops (docs/cache_ops.md, "Invariants"):
- gpu_to_host and host_to_gpu are inverse bijections on the occupied slots;
- free <=> priority == -1 <=> gpu_to_host == -1, and meta[NFREE] counts the free slots;
- the ring gpu_free[(HEAD + i) % N_G], i < NFREE, lists each free slot exactly once, and
  meta[HEAD] is in [0, N_G);
- no slot is handed out twice (the bijection, and no slot twice in ``indices``);
- the scratch (kernel counters, histogram) is zero and no host slot is left PENDING;
- after a recall, every selected host slot is on the GPU, stamped with that step's clock, and the
  returned GPU slots are host_to_gpu of the selection, in its order;
- optionally, every occupied GPU row equals its host row (nothing is ever written back, so a
  difference means a lost or misplaced copy).

``fill_random`` builds a valid random state for tests and benchmarks. These helpers synchronise.
"""

from __future__ import annotations

import torch

from custom_ops import cache_layout as C


class CacheInvariantError(AssertionError):
    """A GPU-pool invariant does not hold (the message says which)."""


def _fail(msg: str) -> None:
    raise CacheInvariantError(msg)


def check_pool(
    pool,
    selected: torch.Tensor | None = None,
    gpu_slots: torch.Tensor | None = None,
    host_kv: torch.Tensor | None = None,
    allow_overflow: bool = False,
) -> None:
    """Raise CacheInvariantError unless ``pool`` (a GpuPool or anything with its buffers) is
    consistent. ``selected``/``gpu_slots``: the input/output of the recall just made."""
    ring_buf, prio = pool.gpu_free.long(), pool.gpu_priority.long()
    g2h, h2g = pool.gpu_to_host.long(), pool.host_to_gpu.long()
    indices, meta = pool.indices.long(), [int(x) for x in pool.meta.tolist()]
    n_g, n_h, cap = g2h.numel(), h2g.numel(), indices.numel()

    if pool.gpu_free.dtype != torch.int32 or pool.gpu_free.shape != (n_g,):
        _fail(f"gpu_free must be the int32 [N_G] ring of free slots, got {pool.gpu_free.dtype}")
    is_free = prio == -1
    head, nfree = meta[C.HEAD], meta[C.NFREE]
    if not 0 <= head < n_g:
        _fail(f"meta[HEAD] = {head} outside [0, N_G = {n_g})")
    if not 0 <= nfree <= n_g:
        _fail(f"meta[NFREE] = {nfree} outside [0, N_G = {n_g}]")
    ring = ring_buf[(head + torch.arange(nfree, device=ring_buf.device)) % n_g]
    if bool(((ring < 0) | (ring >= n_g)).any()):
        _fail("the ring of free slots holds a value outside [0, N_G)")
    if torch.unique(ring).numel() != nfree:
        _fail("the ring of free slots lists a slot twice")
    if nfree and not bool(is_free[ring].all()):
        _fail(f"the ring lists occupied slots {ring[~is_free[ring]][:8].tolist()}")
    if not bool(torch.equal(is_free, g2h == -1)):
        _fail("free <=> gpu_to_host == -1 broken at slots "
              f"{torch.nonzero(is_free != (g2h == -1)).flatten()[:8].tolist()}")
    occ = torch.nonzero(~is_free).flatten()
    if occ.numel() and not bool(((prio[occ] >= 0) & (prio[occ] <= C.CLOCK_MASK)).all()):
        _fail("an occupied slot's priority is outside [0, CLOCK_MASK]")
    if occ.numel() and not bool(((g2h[occ] >= 0) & (g2h[occ] < n_h)).all()):
        _fail("gpu_to_host points outside the host pool")
    if bool((h2g == C.PENDING).any()):
        _fail("a host slot is left PENDING (a recall did not finish its claim)")
    if not bool(((h2g >= -1) & (h2g < n_g)).all()):
        _fail("host_to_gpu holds a value outside [-1, N_G)")
    # Inverse bijection: host_to_gpu[gpu_to_host[g]] == g on occupied g, and nothing else mapped.
    if occ.numel() and not bool(torch.equal(h2g[g2h[occ]], occ)):
        bad = occ[h2g[g2h[occ]] != occ][:8].tolist()
        _fail(f"host_to_gpu[gpu_to_host[g]] != g at slots {bad} (double allocation or lost map)")
    if int((h2g >= 0).sum()) != occ.numel():
        _fail(f"{int((h2g >= 0).sum())} host slots map to the GPU but {occ.numel()} slots are "
              "occupied")

    if nfree != int(is_free.sum()):  # with the checks above: the ring is exactly the free set
        _fail(f"meta[NFREE] = {nfree} but {int(is_free.sum())} slots are free")
    if not 0 <= meta[C.CLOCK] <= C.CLOCK_MASK:
        _fail(f"clock {meta[C.CLOCK]} outside [0, CLOCK_MASK]")
    for i in C.SCRATCH:
        if meta[i]:
            _fail(f"scratch counter meta[{i}] = {meta[i]} was not reset")
    if not allow_overflow and meta[C.OVERFLOW]:
        _fail(f"meta[OVERFLOW] = {meta[C.OVERFLOW]}: a request could not be met")
    if bool(pool.hist.any()):
        _fail("the free histogram was not reset")
    hw = meta[C.IDX_HW]
    if not 0 <= hw <= cap or bool((indices[hw:] != -1).any()):
        _fail(f"indices beyond the high-water mark {hw} are not -1")
    listed = indices[:hw]
    if bool(((listed < 0) | (listed >= n_g)).any()) or torch.unique(listed).numel() != hw:
        _fail("indices[:IDX_HW] holds an invalid or repeated slot")
    totals = pool.totals.tolist()
    if min(totals) < 0 or totals[C.RECALLED] > totals[C.SELECTED]:
        _fail(f"running totals are inconsistent: {totals}")

    if selected is not None:
        sel = selected.long()
        valid = sel >= 0
        where = torch.where(valid, h2g[sel.clamp(min=0)], -1)
        if bool((valid & (where < 0)).any()):
            _fail("a selected host slot is not on the GPU after recall")
        if valid.any():
            stamp = (meta[C.CLOCK] - 1) & C.CLOCK_MASK
            if not bool((prio[where[valid]] == stamp).all()):
                _fail("a selected slot is not stamped with the step's clock (unprotected)")
        if gpu_slots is not None and not bool(torch.equal(gpu_slots.long(), where)):
            _fail("recall's GPU slots are not host_to_gpu of the selection, in order")
    if host_kv is not None and occ.numel():
        rows = pool.gpu_kv[occ.to(pool.gpu_kv.device)]
        want = host_kv[g2h[occ].to(host_kv.device)].to(rows.device)
        if not bool(torch.equal(rows, want)):
            _fail("an occupied GPU row differs from its host row")


@torch.no_grad()
def fill_random(
    pool,
    occupied: int,
    generator: torch.Generator,
    max_age: int = 6000,
    clock: int | None = None,
    host_kv: torch.Tensor | None = None,
    host_slots: torch.Tensor | None = None,
) -> None:
    """Overwrite ``pool`` with a valid state: ``occupied`` random slots holding distinct random
    host slots (from ``host_slots`` if given), ages in [1, max_age] (many ties; past ~4200 steps
    all ages share one bucket), a random clock (so stamps wrap around 2^30). Rows are copied from
    ``host_kv`` when given."""
    n_g, n_h = pool.gpu_to_host.numel(), pool.host_to_gpu.numel()
    if not 0 <= occupied <= n_g:
        raise ValueError(f"fill_random: occupied = {occupied} must be in [0, {n_g}]")
    dev = pool.gpu_to_host.device
    g = torch.randperm(n_g, generator=generator)[:occupied]
    if host_slots is None:
        h = torch.randperm(n_h, generator=generator)[:occupied]
    else:
        h = host_slots[torch.randperm(host_slots.numel(), generator=generator)[:occupied]].cpu()
    if clock is None:
        clock = int(torch.randint(0, C.CLOCK_MASK + 1, (1,), generator=generator))
    age = torch.randint(1, max_age + 1, (occupied,), generator=generator)
    # The ring: the free slots in random order from a random HEAD (so it may wrap round the end),
    # the other entries random (they are unspecified: nothing may read them).
    head = int(torch.randint(0, n_g, (1,), generator=generator))
    ring = torch.randint(0, n_g, (n_g,), generator=generator, dtype=torch.int32)
    left = torch.ones(n_g, dtype=torch.bool)
    left[g] = False
    free = torch.nonzero(left).flatten()  # the slots g leaves free, shuffled
    free = free[torch.randperm(free.numel(), generator=generator)]
    ring[(head + torch.arange(n_g - occupied)) % n_g] = free.int()
    g, h, age = g.to(dev), h.long().to(dev), age.to(dev)
    pool.gpu_free.copy_(ring)
    pool.gpu_priority.fill_(-1)
    pool.gpu_to_host.fill_(-1)
    pool.host_to_gpu.fill_(-1)
    pool.gpu_priority[g] = ((clock - age) & C.CLOCK_MASK).to(torch.int32)
    pool.gpu_to_host[g] = h.to(torch.int32)
    pool.host_to_gpu[h] = g.to(torch.int32)
    pool.indices.fill_(-1)
    pool.meta.zero_()
    pool.meta[C.CLOCK] = clock
    pool.meta[C.NFREE] = n_g - occupied
    pool.meta[C.HEAD] = head
    pool.hist.zero_()
    if host_kv is not None and occupied:
        pool.gpu_kv[g] = host_kv[h.to(host_kv.device)].to(pool.gpu_kv.device)
