"""The staging epochs of the lossless prefetch (docs/prefetch.md, "Staging epochs"): staged slots
carry a tag ``epoch << 32 | h`` and nothing is cleared after the recall, so an entry left from an
earlier step must never be read. At the op level, a hand-made staging state with a live entry,
one of an earlier epoch, one whose slot was restaged for another row and one out of range: only
the live one is read from staging (the reference and the Triton recall, in each way it runs).
Over several steps whose host rows are rewritten in between (as a released page's reuse does):
the Triton staging + recall against the reference semantics on the same scores, bit for bit
(selection, slots, pool, staging state with its tags, statistics), the attended rows always the
host's."""

from __future__ import annotations

import pytest
import torch

from custom_ops import indexer_kernels as ik
from custom_ops import prefetch_kernels as pk
from custom_ops import prefetch_layout as pl
from custom_ops import prefetch_ref as pr
from custom_ops import prefetch_scores as ps
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.invariants import check_pool
from custom_ops.cache.kv_cache import KVCache
from tests.test_decode_kernels import _gen, make_indexer_inputs
from tests.test_prefetch import (  # noqa: F401  (staged_mode: the fixture)
    SMALL,
    _fill,
    _recall_staged_args,
    _selected_layer,
    staged_mode,
)

TOPK = 32


def test_stale_staging_entries_are_read_from_the_host_reference():
    _stale_entries_are_not_read("ref")


@pytest.mark.usefixtures("staged_mode")  # each way the staged recall runs
def test_stale_staging_entries_are_read_from_the_host_triton():
    _stale_entries_are_not_read("triton")


def _stale_entries_are_not_read(impl: str):
    """Four misses with staging entries, every staged row unlike its host row (so the source
    shows): live (this epoch's tag for it: read from staging), an earlier epoch's (its host row
    may have been rewritten since), its slot restaged for another host slot this epoch (the slot
    holds that row now), its slot out of range. Only the live one is read from staging and
    counted as promoted; the others hold their host rows."""
    layer, sel = _selected_layer(16, [300, 200, 370])
    s, p = layer.staging, layer.pool
    h_sel = torch.unique(sel[sel >= 0].long())
    missed = h_sel[p.host_to_gpu[h_sel] < 0]
    m = missed[:4]
    other = next(h for h in range(1280) if h not in set(h_sel.tolist()))  # not selected
    S = s.stage_host.shape[0]
    s.stage_host.fill_(-1)
    s.host_stage.fill_(-1)
    e = int(s.stage_ctr[-1])
    assert e == 1  # one staging call so far
    s.stage_host[0] = int(pl.stage_tag(e, m[0]))  # live
    s.stage_host[1] = int(pl.stage_tag(e - 1, m[1]))  # an earlier step's
    s.stage_host[2] = int(pl.stage_tag(e, torch.tensor(other)))  # restaged for another row
    s.host_stage[m[:3]] = torch.tensor([0, 1, 2], dtype=torch.int32)
    s.host_stage[m[3]] = S + 5  # no slot
    s.stage_kv[:3] = ~layer.host_kv[m[:3]]
    s.totals.zero_()
    fn = pr.recall_staged_ref if impl == "ref" else pk.recall_staged_cuda
    fn(*_recall_staged_args(layer, sel))
    rows = p.gpu_kv[p.host_to_gpu[m].long()]
    assert torch.equal(rows[0], s.stage_kv[0])  # the live entry: from staging
    for i in (1, 2, 3):
        assert torch.equal(rows[i], layer.host_kv[m[i]]), f"miss {i}: a stale entry was read"
    assert int(s.totals[pl.PF_PROMOTED]) == 1
    check_pool(p, selected=sel)


def _cache(mode: str) -> KVCache:
    """A pool that holds every step's misses (no eviction: the Triton recall then places exactly
    where the reference does), a per-request cap or a global budget that binds."""
    return KVCache(CacheConfig(num_layers=1, host_tokens=64 * 20, gpu_tokens=512, topk=TOPK,
                               fmt="bf16", max_batch=3, prefetch=mode, prefetch_cap=64,
                               prefetch_ratio=0.2), "cpu")  # fmt: skip


# each step's thresholds: every off-GPU token a candidate (the caps bind), none (the epoch moves
# on and every entry is stale), the EMA's own
THRESHOLDS = (float("-inf"), float("inf"), None, float("inf"))


def _step(layer, q, w, bt, lens, impl: str, variant: str):
    """One decode step's prefetch on ``layer``: the staging call, then the staged recall. Triton:
    the op's kernels (interpreter). Reference: prefetch_ref's staging semantics over the Triton
    scores (the reference's own scores may differ in the last bit) with the Triton top-k, then
    the reference recall. Returns the selection, its slots, and how many of its misses had a
    stale staging entry (a slot in host_stage whose tag is not theirs in this epoch)."""
    st, p = layer.staging, layer.pool
    args = (q, w, layer.index_k, bt, lens)
    if impl == "triton":
        sel, _ = pk.indexer_topk_prefetch_cuda(
            *args, TOPK, layer.host_kv, p.host_to_gpu, st.stage_kv, st.stage_host,
            st.host_stage, st.stage_ctr, st.ema, st.totals, st.cap, st.ratio, 0.0, cfg=SMALL,
            rows_per_block=64, variant=variant,
        )  # fmt: skip
        recall = pk.recall_staged_cuda
    else:
        score = ik.index_scores(*args, SMALL)
        pr.stage_ref(score, pr.index_scores_ref(*args)[1], lens, layer.host_kv, p.host_to_gpu,
                     st.stage_kv, st.stage_host, st.host_stage, st.stage_ctr, st.ema, st.totals,
                     st.cap, st.ratio)  # fmt: skip
        sel, kth = ik.indexer_topk_cuda(*args, TOPK, SMALL)
        pl.update_ema(st.ema, kth, lens, bt, 0.0)
        pr.end_staging(st.stage_ctr, st.totals)
        recall = pr.recall_staged_ref
    h = sel[sel >= 0].long()
    miss = h[p.host_to_gpu[h] < 0]
    live = pl.staged_source(miss, st.host_stage, st.stage_host, st.stage_ctr[-1])[0]
    stale = int(((st.host_stage[miss] >= 0) & ~live).sum())
    return sel, recall(*_recall_staged_args(layer, sel)), stale


@pytest.mark.parametrize("variant", sorted(ps.SCORES_VARIANTS))
@pytest.mark.parametrize("mode", ["request", "global"])
def test_staging_epochs_match_reference_over_steps(mode, variant):
    """4 steps of staging + staged recall (thresholds: ``THRESHOLDS``), the host rows off the GPU
    rewritten after each (stale entries then hold old bytes): the Triton path equals the
    reference bit for bit (selection, slots, pool, staging state with its tags, statistics), the
    attended rows are the host's although misses with stale entries were met, and the statistics
    count each step: the staged rows, 4 steps."""
    layers = {}
    for impl in ("ref", "triton"):
        c = _cache(mode)
        _fill(c, _gen(40, "cpu"), "bf16")
        layers[impl] = c.layers[0]
    g = _gen(41, "cpu")
    bt = torch.arange(18, dtype=torch.int32).view(3, 6)
    lens = torch.tensor([300, 200, 370], dtype=torch.int32)
    base = make_indexer_inputs(3, 6, 8, [1, 1, 1], g)
    n_staged = n_stale = 0
    for step, thr in enumerate(THRESHOLDS):
        for layer in layers.values():
            if thr is not None:
                layer.staging.ema[pl.EMA_THR].fill_(thr)
        noise = make_indexer_inputs(3, 6, 8, [1, 1, 1], g)["q_fp8"]
        q = torch.where(torch.rand(3, 8, 128, generator=g) < 0.7, base["q_fp8"], noise)
        out = {}
        for impl, layer in layers.items():
            sel, slots, stale = _step(layer, q, base["weights"], bt, lens + step, impl, variant)
            live = sel >= 0
            rows = layer.pool.gpu_kv[slots[live].long()]
            assert torch.equal(rows, layer.host_kv[sel[live].long()]), (impl, step)  # lossless
            st, p = layer.staging, layer.pool
            out[impl] = [sel, slots, st.stage_host, st.host_stage, st.stage_ctr, st.stage_kv,
                         st.ema, st.totals, p.gpu_kv, p.host_to_gpu, p.gpu_to_host,
                         p.gpu_priority, p.meta, p.totals]  # fmt: skip
        for i, (a, b) in enumerate(zip(out["ref"], out["triton"])):
            assert torch.equal(a, b), (step, i)
        n_stale += stale
        st = layers["ref"].staging
        assert int(st.stage_ctr[-1]) == step + 1 and not st.stage_ctr[:-1].any()
        n_staged += int(pl.live_staged(st.stage_host, st.stage_ctr).sum())
        # the host rows off the GPU get new bytes (a released page reused): identical in both
        new = torch.randint(0, 256, layers["ref"].host_kv.shape, dtype=torch.uint8, generator=g)
        off = layers["ref"].pool.host_to_gpu < 0
        for layer in layers.values():
            layer.host_kv[off] = new[off]
    t = layers["ref"].staging.totals
    assert t[pl.PF_STEPS] == 4 and t[pl.PF_STAGED] == n_staged > 0 and t[pl.PF_PROMOTED] > 0
    assert n_stale > 0  # stale entries were met (and, per the equalities above, not read)
