"""A hypothesis state machine drives random offload / recall / release sequences through a small
KVCache and checks it against a plain Python model after every step: which host slots each
layer's GPU pool holds, their stamps, the clock, the running totals, the rows, and every
invariant of custom_ops/cache/invariants.py.

The model cannot know which slots of the threshold age bucket an eviction picks (the kernel's
choice depends on its atomics), so it checks that the choice is legal (exactly
evict_target(max(misses - free, 0)) slots, the reserve included, as far as unselected residents
allow; none selected in this step; none younger than a survivor's bucket) and then adopts it.

Two backends: the ops (the CPU references, what the CPU engine runs) and the Triton kernels
(TRITON_INTERPRET=1 on CPU; real kernels when CUDA is present).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from custom_ops import cache_kernels as K
from custom_ops import cache_layout as C
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.invariants import check_pool
from custom_ops.cache.kv_cache import KVCache
from custom_ops.cache_ops import evict_target
from custom_ops.kv_format import INDEX_ROW_BYTES, PAGE
from runtime.host_slots import HostSlotAllocator

N_H, N_G, TOPK, MAX_B, LAYERS = 1024, 96, 16, 4, 2  # B * k = 64 <= N_G
CAP = min(MAX_B * TOPK, N_G)
AGE_EXACT = C.AGE_EXACT


def bucket(age: int) -> int:
    return int(C.age_bucket(torch.tensor(age)))


def resident(pool) -> dict[int, int]:
    h2g = pool.host_to_gpu.long().cpu()
    h = torch.nonzero(h2g >= 0).flatten()
    return dict(zip(h.tolist(), pool.gpu_priority.long().cpu()[h2g[h]].tolist(), strict=True))


class CacheMachine(RuleBasedStateMachine):
    KERNELS = False

    @initialize(near_wrap=st.booleans(), fmt=st.sampled_from(["bf16", "fp8"]))
    def setup(self, near_wrap: bool, fmt: str) -> None:
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        cfg = CacheConfig(LAYERS, N_H, N_G, TOPK, fmt=fmt, max_batch=MAX_B)
        self.cache = KVCache(cfg, self.dev)
        self.pages = HostSlotAllocator(N_H // PAGE)
        self.gen = torch.Generator().manual_seed(0)
        self.requests: dict[int, tuple[list[int], int]] = {}  # id -> (pages, tokens)
        self.next_id = 0
        self.evictions = 0  # recalls (per layer) that evicted
        self.clock = C.CLOCK_MASK - 3 if near_wrap else 0  # exercise the clock wrap
        self.res: list[dict[int, int]] = [{} for _ in range(LAYERS)]  # host slot -> stamp
        self.totals = [[0, 0, 0] for _ in range(LAYERS)]  # selected, recalled, steps
        for layer in self.cache.layers:
            layer.pool.meta[C.CLOCK] = self.clock

    # ---- helpers ------------------------------------------------------------------------------
    def _slots(self, rid: int) -> list[int]:
        pages, n = self.requests[rid]
        return HostSlotAllocator.slots_of(pages)[:n]

    def _write(self, slots: list[int]) -> None:
        """Offload new tokens' rows (different random rows per layer) to the host pool."""
        s = torch.tensor(slots, dtype=torch.int64, device=self.dev)
        for layer in self.cache.layers:
            row = layer.host_kv.shape[1]
            rows = torch.randint(0, 256, (len(slots), row), dtype=torch.uint8, generator=self.gen)
            irows = torch.randint(
                0, 256, (len(slots), INDEX_ROW_BYTES), dtype=torch.uint8, generator=self.gen
            )
            rows, irows = rows.to(self.dev), irows.to(self.dev)
            if self.KERNELS:
                K.offload_cuda(layer.host_kv, layer.index_k, rows, irows, s)
            else:
                layer.store(rows, irows, s)
            assert torch.equal(layer.host_kv[s], rows)

    # ---- rules --------------------------------------------------------------------------------
    @rule(n=st.integers(1, 200))
    def new_request(self, n: int) -> None:
        need = -(-n // PAGE)
        pages = self.pages.alloc(need)
        if pages is None:
            assert self.pages.num_free < need
            return
        rid, self.next_id = self.next_id, self.next_id + 1
        self.requests[rid] = (pages, n)
        self._write(self._slots(rid))

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), k=st.integers(1, 70))
    def extend(self, data, k: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        pages, n = self.requests[rid]
        more = -(-(n + k) // PAGE) - len(pages)
        extra = self.pages.alloc(more) if more > 0 else []
        if extra is None:
            return
        self.requests[rid] = (pages + extra, n + k)
        self._write(self._slots(rid)[n:])

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def recall(self, data) -> None:
        rids = data.draw(
            st.lists(
                st.sampled_from(sorted(self.requests)), min_size=1, max_size=MAX_B, unique=True
            )
        )
        b = data.draw(st.integers(len(rids), MAX_B))  # padded batch rows carry nothing
        share = data.draw(st.booleans())  # a padded row repeats row 0 (dedupe)
        for li, layer in enumerate(self.cache.layers):
            hs = torch.full((b, TOPK), -1, dtype=torch.int32)
            for r, rid in enumerate(rids):
                toks = torch.tensor(self._slots(rid))
                pick = torch.randperm(toks.numel(), generator=self.gen)[:TOPK]
                pick = toks[pick.sort().values]
                hs[r, : pick.numel()] = pick.int()
            if share and b > len(rids):
                hs[-1] = hs[0]
            self._recall_layer(li, layer, hs.to(self.dev))
        self.clock = (self.clock + 1) & C.CLOCK_MASK

    def _recall_layer(self, li: int, layer, hs: torch.Tensor) -> None:
        pool = layer.pool
        if self.KERNELS:
            out = K.recall_cuda(
                layer.host_kv,
                pool.gpu_kv,
                pool.gpu_free,
                pool.gpu_priority,
                pool.gpu_to_host,
                pool.host_to_gpu,
                pool.indices,
                pool.miss_host,
                pool.meta,
                pool.hist,
                pool.totals,
                hs,
            )
            kv = pool.gpu_kv
        else:
            kv, out = layer.fetch(hs)
        valid = hs >= 0
        assert torch.equal(out >= 0, valid)  # -1 stays -1, order kept
        assert torch.equal(kv[out[valid].long()], layer.host_kv[hs[valid].long()])
        check_pool(pool, selected=hs, gpu_slots=out, host_kv=layer.host_kv)

        before, after = self.res[li], resident(pool)
        sel = set(hs[valid].tolist())
        misses = sel - before.keys()
        evicted = before.keys() - after.keys()
        # max(misses - free, 0) needed; a needed eviction also frees the reserve (N_G >> 6 more
        # of the oldest, cache_ops.evict_target), as far as unselected residents allow.
        needed = max(len(misses) - (N_G - len(before)), 0)
        assert len(evicted) == min(evict_target(needed, N_G, CAP), len(before.keys() - sel))
        assert len(evicted) >= needed
        self.evictions += bool(evicted)
        assert not evicted & sel  # selected slots are never evicted
        assert after.keys() == (before.keys() - evicted) | sel
        age = {h: (self.clock - s) & C.CLOCK_MASK for h, s in before.items()}
        survivors = (before.keys() - evicted) - sel
        if evicted and survivors:
            assert min(bucket(age[h]) for h in evicted) >= max(bucket(age[h]) for h in survivors)
        for h in sel:
            assert after[h] == self.clock
        for h in survivors:
            assert after[h] == before[h]
        self.res[li] = after
        t = self.totals[li]
        t[0], t[1], t[2] = t[0] + int(valid.sum()), t[1] + len(misses), t[2] + 1
        assert pool.totals[:3].tolist() == t

    # Steps that pass without selecting anything resident: ages then cross into the 32-step buckets
    # (age >= 128), several stamps share one bucket, and an eviction may take only part of it.
    # Plain 15-step runs never get past age 15; the steps are steered to the bucket edges.
    @rule(steps=st.one_of(
        st.sampled_from([AGE_EXACT - 2, AGE_EXACT - 1, AGE_EXACT, 31, 32, 33, 4190, 4200, 70000]),
        st.integers(1, 5000),
    ))  # fmt: skip
    def idle(self, steps: int) -> None:
        self.clock = (self.clock + steps) & C.CLOCK_MASK
        for layer in self.cache.layers:
            layer.pool.meta[C.CLOCK] = self.clock

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def release(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        pages, _ = self.requests.pop(rid)
        slots = torch.tensor(HostSlotAllocator.slots_of(pages), device=self.dev)
        if self.KERNELS:
            for layer in self.cache.layers:
                p = layer.pool
                K.release_cuda(
                    p.gpu_free, p.gpu_priority, p.gpu_to_host, p.host_to_gpu, p.meta, slots
                )
        else:
            self.cache.release(slots)
        self.pages.free(pages)  # after release: the pages may now be handed out again
        gone = set(slots.tolist())
        for li in range(LAYERS):
            self.res[li] = {h: s for h, s in self.res[li].items() if h not in gone}

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def pools_match_model(self) -> None:
        if not hasattr(self, "cache"):
            return
        for li, layer in enumerate(self.cache.layers):
            check_pool(layer.pool, host_kv=layer.host_kv)
            assert resident(layer.pool) == self.res[li]
            assert int(layer.pool.meta[C.CLOCK]) == self.clock
        used = sum(len(p) for p, _ in self.requests.values())
        assert self.pages.num_used == used


class KernelCacheMachine(CacheMachine):
    KERNELS = True


_fast = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestCacheReference = CacheMachine.TestCase
TestCacheReference.settings = settings(max_examples=25, stateful_step_count=15, **_fast)
TestCacheKernels = KernelCacheMachine.TestCase
TestCacheKernels.settings = settings(max_examples=10, stateful_step_count=10, **_fast)


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "kernel"])
def test_eviction_partly_empties_an_age_bucket(kernels: bool) -> None:
    """Residents stamped at clocks 0, 10, 20, 25; at clock 200 their ages 200 / 190 / 180 / 175 fall
    in buckets 130 / 129 / 129 / 129. Three misses in a full pool of 8 evict the two of bucket 130
    and exactly one of the six in bucket 129 (any one: the order inside a bucket is free)."""
    cfg = CacheConfig(1, N_H, 8, 4, max_batch=2)
    cache = KVCache(cfg, "cpu")
    layer = cache.layers[0]
    pool = layer.pool
    layer.store(
        torch.randint(0, 256, (16, layer.host_kv.shape[1]), dtype=torch.uint8),
        torch.zeros(16, INDEX_ROW_BYTES, dtype=torch.uint8),
        torch.arange(16),
    )

    def recall(clock: int, slots: list[int]) -> None:
        pool.meta[C.CLOCK] = clock
        hs = torch.full((2, 4), -1, dtype=torch.int32)
        hs[0, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        if kernels:
            out = K.recall_cuda(layer.host_kv, pool.gpu_kv, pool.gpu_free, pool.gpu_priority,
                                pool.gpu_to_host, pool.host_to_gpu, pool.indices, pool.miss_host,
                                pool.meta, pool.hist, pool.totals, hs)  # fmt: skip
        else:
            out = layer.fetch(hs)[1]
        check_pool(pool, selected=hs, gpu_slots=out, host_kv=layer.host_kv)

    for clock, slots in [(0, [0, 1]), (10, [2, 3]), (20, [4, 5]), (25, [6, 7])]:
        recall(clock, slots)
    assert set(resident(pool)) == set(range(8))
    assert [bucket(200 - c) for c in (0, 10, 20, 25)] == [130, 129, 129, 129]
    recall(200, [8, 9, 10])
    after = set(resident(pool))
    evicted = set(range(8)) - after
    assert after >= {8, 9, 10} and len(after) == 8
    assert {0, 1} <= evicted and len(evicted & set(range(2, 8))) == 1
