"""Lossless prefetch (custom_ops/prefetch.py, prefetch_ref.py): the reference ops, the fused
Triton indexer and the staged recall (TRITON_INTERPRET=1 on CPU, as they are on a GPU), and the
lossless property at the cache level: prefetch on (both caps, thresholds normal / forced too low /
too high) vs off vs GPU-only give the same selection and the same attended rows (torch.equal),
bf16 and fp8."""

from __future__ import annotations

import pytest
import torch

from custom_ops import indexer_kernels as ik
from custom_ops import prefetch as pf
from custom_ops import prefetch_kernels as pk
from custom_ops import prefetch_layout as pl
from custom_ops import prefetch_ref as pr
from custom_ops import prefetch_scores as ps
from custom_ops.cache.config import CacheConfig
from custom_ops.cache.invariants import check_pool
from custom_ops.cache.kv_cache import KVCache
from custom_ops.cache_layout import EVICTED, NFREE, reserve_slots
from custom_ops.indexer import indexer_topk_ref
from custom_ops.kv_format import ROW_BYTES
from tests.test_decode_kernels import _gen, make_indexer_inputs

SMALL = ik.IndexerConfig(score_block=64, score_tokens=128, sel_block=64, sel_chunk=64)


def _staging(B, n_h, row, cap, device):
    i32 = dict(dtype=torch.int32, device=device)
    return dict(
        stage_kv=torch.zeros(B * cap, row, dtype=torch.uint8, device=device),
        stage_host=torch.full((B * cap,), -1, dtype=torch.int64, device=device),
        host_stage=torch.full((n_h,), -1, **i32),
        stage_ctr=torch.zeros(B + 2, **i32),
        ema=torch.zeros(pl.EMA_ROWS, n_h // 64 + 1, dtype=torch.float32, device=device),
        pf_stats=torch.zeros(pl.PF_LEN, dtype=torch.int64, device=device),
    )


def _prefetch_case(seed, device, fmt="bf16", B=3, P=5, lens=(300, 17, 250), cap=16):
    g = _gen(seed, device)
    inp = make_indexer_inputs(B, P, 8, list(lens), g)
    n_h = inp["index_cache"].shape[0] * 64
    host_kv = torch.randint(0, 256, (n_h, ROW_BYTES[fmt]), dtype=torch.uint8, generator=g,
                            device=device)  # fmt: skip
    h2g = torch.full((n_h,), -1, dtype=torch.int32, device=device)
    h2g[torch.randperm(n_h, generator=g, device=device)[: n_h // 3]] = 7  # a third "on the GPU"
    st = _staging(B, n_h, ROW_BYTES[fmt], cap, device)
    return inp, host_kv, h2g, st


def _run(fn, inp, host_kv, h2g, st, topk, cap, ratio, margin=0.0, **kw):
    args = [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]
    return fn(*args, topk, host_kv, h2g, st["stage_kv"], st["stage_host"], st["host_stage"],
              st["stage_ctr"], st["ema"], st["pf_stats"], cap, ratio, margin, **kw)  # fmt: skip


def _candidates(score, slots, h2g, thr):
    """Independent statement of the candidate set, per request: host slots above thr, off-GPU."""
    return [set(slots[b][(score[b] > thr[b]) & (h2g[slots[b]] < 0)].tolist())
            for b in range(score.shape[0])]  # fmt: skip


def _live(stage_host, stage_ctr):
    """(staging slots live in the current epoch, their host slots) [n] int64 each."""
    live = pl.live_staged(stage_host, stage_ctr).nonzero().flatten()
    return live, stage_host[live] & pl.HOST_MASK


def _staged(st, B, cap, ratio):
    live = pl.live_staged(st["stage_host"], st["stage_ctr"])
    sh = torch.where(live, st["stage_host"] & pl.HOST_MASK, -1)
    if ratio > 0:
        return set(sh[sh >= 0].tolist())
    return [set(x[x >= 0].tolist()) for x in sh.view(B, cap)]


CASES = [(impl, thr, ratio) for impl in ("ref", *ps.SCORES_VARIANTS)
         for thr in ("normal", "low", "high")
         for ratio in (0.0, 0.05) if impl == "ref" or (thr == "low") == (ratio > 0)]  # fmt: skip


@pytest.mark.parametrize("impl,thr,ratio", CASES)
def test_prefetch_indexer(impl, thr, ratio, device):
    """impl: the reference, or a variant of the fused kernel (custom_ops/prefetch_scores.py)."""
    B, cap, topk = 3, 16, 32
    inp, host_kv, h2g, st = _prefetch_case(11, device)
    score, slots = pr.index_scores_ref(
        *[inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]
    )
    fill = {"normal": None, "low": float("-inf"), "high": float("inf")}[thr]
    # thresholds live at each request's first host page (the last entry: padded rows)
    keys = pl.ema_keys(inp["block_table"], inp["seq_lens"], st["ema"].shape[1])
    ema = st["ema"]
    if fill is None:  # a threshold inside the scores: the 40th best score of each request
        t = torch.sort(score, dim=1, descending=True).values[:, 39].clamp(min=-1e30)
        ema[pl.EMA_THR, keys] = ema[pl.EMA_LEVEL, keys] = t
    else:
        ema[pl.EMA_THR].fill_(fill)
        ema[pl.EMA_LEVEL].fill_(-fill)  # the kernel stages by the threshold row alone
    ema_all = ema.clone()
    ema0, level0 = ema_all[pl.EMA_THR, keys], ema_all[pl.EMA_LEVEL, keys]
    if impl == "ref":
        host, kth = _run(pr.indexer_topk_prefetch_ref, inp, host_kv, h2g, st, topk, cap, ratio)
        want = _candidates(score, slots, h2g, ema0)
    else:  # the fused kernel, many rows per block so only the caps bind
        host, kth = _run(pk.indexer_topk_prefetch_cuda, inp, host_kv, h2g, st, topk, cap, ratio,
                         cfg=SMALL, rows_per_block=64, variant=impl)  # fmt: skip
        s_k = ik.index_scores(
            *[inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")], SMALL
        )
        want = _candidates(s_k, slots, h2g, ema0)
        host_x, kth_x = ik.indexer_topk_cuda(
            *[inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")],
            topk,
            SMALL,
        )
        assert torch.equal(host, host_x) and torch.equal(kth, kth_x)  # the unfused kernel's
    if impl == "ref":
        host_r, kth_r = indexer_topk_ref(**inp, topk=topk)
        assert torch.equal(host, host_r) and torch.equal(kth, kth_r)
    n_cand = sum(len(w) for w in want)
    assert int(st["pf_stats"][pl.PF_CANDIDATES]) == n_cand
    got = _staged(st, B, cap, ratio)
    if thr == "high":
        assert n_cand == 0 and not (st["stage_host"] >= 0).any()
    if ratio > 0:
        limit = int(pr.stage_limit(inp["seq_lens"], B * cap, ratio))
        assert got <= set().union(*want) and len(got) == min(limit, n_cand)
    else:
        for b in range(B):
            assert got[b] <= want[b] and len(got[b]) == min(cap, len(want[b]))
    if thr == "low":
        assert n_cand > B * cap  # the cap was hit
    # staged rows are copies of their host rows; host_stage is the inverse map; every staged row
    # carries the first epoch's tag, and the staged count is the rows kept
    assert int(st["stage_ctr"][-1]) == 1 and not st["stage_ctr"][:-1].any()
    live, h = _live(st["stage_host"], st["stage_ctr"])
    assert torch.equal(st["stage_host"] >= 0, pl.live_staged(st["stage_host"], st["stage_ctr"]))
    assert torch.equal(st["stage_kv"][live], host_kv[h])
    assert torch.equal(st["host_stage"][h].long(), live)
    assert int((st["host_stage"] >= 0).sum()) == live.numel()
    assert st["pf_stats"][pl.PF_STAGED] == live.numel() and st["pf_stats"][pl.PF_STEPS] == 1
    # the level moved halfway to the k-th score and (margin 0) is the next threshold, for live
    # requests only
    live = inp["seq_lens"] > 0
    exp = torch.where(live, 0.5 * level0 + 0.5 * kth, level0)
    assert torch.equal(ema[pl.EMA_LEVEL, keys], exp)
    assert torch.equal(ema[pl.EMA_THR, keys], torch.where(live, exp, ema0))
    other = torch.ones_like(ema_all[0], dtype=torch.bool)
    other[keys] = False
    assert torch.equal(ema[:, other], ema_all[:, other])  # no other request's state moved


@pytest.mark.parametrize("variant", ["post", "early"])
def test_post_variant_bounds_and_chunks(device, variant):
    """The post kernel (both forms) with 2 rows per tile: a program claims at most 2 x TPP / BT
    rows and copies them 2 at a time (several copy iterations); the staged set is a subset of
    the candidates within the caps, every staged row a copy of its host row."""
    B, cap, topk, rows = 3, 16, 32, 2
    inp, host_kv, h2g, st = _prefetch_case(21, device)
    st["ema"][pl.EMA_THR].fill_(float("-inf"))  # every off-GPU live token is a candidate
    _run(pk.indexer_topk_prefetch_cuda, inp, host_kv, h2g, st, topk, cap, 0.0, cfg=SMALL,
         rows_per_block=rows, variant=variant)  # fmt: skip
    args = [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]
    score, slots = pr.index_scores_ref(*args)
    want = _candidates(score, slots, h2g, score.new_full((B,), float("-inf")))
    got = _staged(st, B, cap, 0.0)
    per_prog = rows * SMALL.score_tokens // SMALL.score_block
    for b in range(B):
        assert got[b] <= want[b]
        # each program stages at most per_prog of its own candidates; the request at most cap
        prog = torch.arange(slots.shape[1]) // SMALL.score_tokens
        is_cand = torch.tensor([int(h) in want[b] for h in slots[b].tolist()])
        is_cand &= torch.arange(slots.shape[1]) < int(inp["seq_lens"][b])
        per = torch.bincount(prog[is_cand], minlength=int(prog.max()) + 1)
        assert len(got[b]) == min(cap, int(per.clamp(max=per_prog).sum()))
    assert len(got[0]) > rows  # request 0 copied in several chunks
    live, h = _live(st["stage_host"], st["stage_ctr"])
    assert torch.equal(st["stage_kv"][live], host_kv[h])
    assert torch.equal(st["host_stage"][h].long(), live)
    assert int(st["pf_stats"][pl.PF_CANDIDATES]) == sum(len(w) for w in want)


@pytest.mark.parametrize("variant", ["post", "early"])
def test_post_variant_at_32_score_blocks_a_program(device, variant):
    """The post kernel's bits (both forms) at their widest: 32 score blocks a program (bit 31 is
    the int32's sign bit) and programs that start past token 0. With the threshold at -inf and
    room for every row, exactly the off-GPU live tokens are staged, each a copy of its host
    row."""
    B, cap = 3, 1024
    inp, host_kv, h2g, st = _prefetch_case(23, device, P=20, lens=(1100, 17, 700), cap=cap)
    st["ema"][pl.EMA_THR].fill_(float("-inf"))
    wide = ik.IndexerConfig(score_block=16, score_tokens=512, sel_block=64, sel_chunk=64)
    _run(pk.indexer_topk_prefetch_cuda, inp, host_kv, h2g, st, 32, cap, 0.0, cfg=wide,
         rows_per_block=64, variant=variant)  # fmt: skip
    args = [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]
    score, slots = pr.index_scores_ref(*args)
    want = _candidates(score, slots, h2g, score.new_full((B,), float("-inf")))
    assert len(want[0]) > 512  # request 0's candidates span two programs
    assert _staged(st, B, cap, 0.0) == want
    live, h = _live(st["stage_host"], st["stage_ctr"])
    assert torch.equal(st["stage_kv"][live], host_kv[h])


@pytest.mark.parametrize("variant", ["post", "early"])
def test_post_variant_refuses_more_than_32_score_blocks_a_program(device, variant):
    """The post kernel keeps one bit per score block of a program in an int32: a configuration
    with more blocks a program is an error naming them, not a wrong candidate set."""
    inp, host_kv, h2g, st = _prefetch_case(21, device)
    wide = ik.IndexerConfig(score_block=16, score_tokens=1024, sel_block=64, sel_chunk=64)
    with pytest.raises(ValueError, match="at most 32 score blocks a program.*= 64"):
        _run(pk.indexer_topk_prefetch_cuda, inp, host_kv, h2g, st, 32, 16, 0.0, cfg=wide,
             variant=variant)  # fmt: skip


@pytest.mark.parametrize("margin", [0.0, 2.0, 0.37])
def test_ema_kernel_matches_update_ema(device, margin):
    """The one-launch threshold update equals the torch expression bit for bit (padded rows,
    -inf levels and k-th scores, fresh all-0 columns included), other columns untouched; the
    threshold is level + margin x dev (the level alone at margin 0)."""
    g = torch.Generator().manual_seed(3)
    for B in (1, 5, 16):
        ema = torch.randn(pl.EMA_ROWS, 40, generator=g) * 10
        ema[pl.EMA_DEV] = ema[pl.EMA_DEV].abs()
        ema[pl.EMA_LEVEL, ::7] = float("-inf")
        ema[:, 2::5] = 0.0  # fresh requests (a new or released one's state)
        kth = torch.randn(B, generator=g) * 10
        kth[::3] = float("-inf")
        lens = torch.randint(0, 3, (B,), generator=g, dtype=torch.int32) * 50
        bt = torch.randperm(39, generator=g)[: 2 * B].view(B, 2).int()
        if B > 1:  # rows sharing a first page (an n > 1 group): the first live one writes it
            bt[1:3, 0] = bt[0, 0]
            lens[0] = 0 if B == 5 else lens[0]  # a padded first holder: the next live one wins
            lens[1] = 50
        ema, kth, lens, bt = (x.to(device) for x in (ema, kth, lens, bt))
        want, old = ema.clone(), ema.clone()
        pl.update_ema(want, kth, lens, bt, margin)
        pk.ema_update_cuda(ema, kth, lens, bt, margin)
        assert torch.equal(ema.isnan(), want.isnan())
        assert torch.equal(ema.nan_to_num(), want.nan_to_num())
        holders = [i for i in range(min(B, 3)) if lens[i] > 0]
        if B > 1:  # the shared key took the first live holder's k-th score
            k0 = int(bt[0, 0])
            k, lv, dv = kth[holders[0]], old[pl.EMA_LEVEL, k0], old[pl.EMA_DEV, k0]
            level = pl.EMA_ALPHA * k + (1 - pl.EMA_ALPHA) * lv
            dev = pl.EMA_ALPHA * (k - lv).abs() + (1 - pl.EMA_ALPHA) * dv
            if lv == 0 and dv == 0:  # its first update
                level, dev = k, torch.zeros_like(k)
            assert torch.equal(want[pl.EMA_LEVEL, k0], level)
            assert torch.equal(want[pl.EMA_DEV, k0].nan_to_num(), dev.nan_to_num())
            thr = level + margin * dev if margin else level
            assert torch.equal(want[pl.EMA_THR, k0].nan_to_num(), thr.nan_to_num())


def test_margin_raises_the_threshold_by_the_kth_movement():
    """Two steps of a request whose k-th score moves: the first update sets the level to the
    k-th score (deviation 0), the second is ECHO's EMA with the deviation the EMA of the k-th
    score's distance from it, and the op stages by level + margin x dev; the kernel stages by the
    threshold row alone (a level of -inf under a threshold of +inf stages nothing)."""
    for margin in (0.0, 1.5):
        inp, host_kv, h2g, st = _prefetch_case(31, "cpu")
        k1 = _run(pr.indexer_topk_prefetch_ref, inp, host_kv, h2g, st, 32, 16, 0.0, margin)[1]
        keys = pl.ema_keys(inp["block_table"], inp["seq_lens"], st["ema"].shape[1])
        live = inp["seq_lens"] > 0
        e = st["ema"][:, keys]
        assert torch.equal(e[pl.EMA_LEVEL][live], k1[live]) and not e[pl.EMA_DEV].any()
        assert torch.equal(e[pl.EMA_THR][live], k1[live])
        inp["weights"] = inp["weights"] * 1.25  # every score, so the k-th, moves
        k2 = _run(pr.indexer_topk_prefetch_ref, inp, host_kv, h2g, st, 32, 16, 0.0, margin)[1]
        assert not torch.equal(k2[live], k1[live])
        e = st["ema"][:, keys]
        level = 0.5 * k2 + 0.5 * k1
        dev = 0.5 * (k2 - k1).abs()
        assert torch.equal(e[pl.EMA_LEVEL][live], level[live])
        assert torch.equal(e[pl.EMA_DEV][live], dev[live])
        exp = level + margin * dev if margin else level
        assert torch.equal(e[pl.EMA_THR][live], exp[live])
    st["ema"][pl.EMA_THR].fill_(float("inf"))
    st["ema"][pl.EMA_LEVEL].fill_(float("-inf"))
    st["pf_stats"].zero_()
    _run(pk.indexer_topk_prefetch_cuda, inp, host_kv, h2g, st, 32, 16, 0.0, 1.5, cfg=SMALL)
    assert int(st["pf_stats"][pl.PF_CANDIDATES]) == 0


def _cache(fmt, prefetch, offload=True, cap=8, device="cpu"):
    return KVCache(CacheConfig(num_layers=1, host_tokens=64 * 20, gpu_tokens=3 * 32 + 16, topk=32,
                               fmt=fmt, offload=offload, max_batch=3, prefetch=prefetch,
                               prefetch_cap=cap, prefetch_ratio=0.02), device)  # fmt: skip


def _fill(cache, g, fmt):
    layer = cache.layers[0]
    n_h = layer.host_kv.shape[0]
    rows = torch.randint(0, 256, layer.host_kv.shape, dtype=torch.uint8, generator=g)
    layer.host_kv.copy_(rows)
    layer.index_k.copy_(make_indexer_inputs(1, n_h // 64 - 3, 8, [1], g)["index_cache"])


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize(
    "mode,thr",
    [
        ("request", None),
        ("global", None),
        ("request", "low"),
        ("global", "low"),
        ("request", "high"),
    ],
)
def test_prefetch_lossless_cache(fmt, mode, thr):
    check_lossless_cache(fmt, mode, thr, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize(
    "mode,thr", [("request", None), ("global", None), ("global", "low"), ("request", "high")]
)
@pytest.mark.parametrize("variant", sorted(ps.SCORES_VARIANTS))
def test_prefetch_lossless_cache_cuda(fmt, mode, thr, variant, monkeypatch):
    monkeypatch.setattr(ps, "DEFAULT_VARIANT", variant)  # the op's fused scores kernel
    check_lossless_cache(fmt, mode, thr, "cuda")


def check_lossless_cache(fmt, mode, thr, device):
    """Steps of select + fetch over drifting queries, a pool that evicts every step: the attended
    rows are torch.equal to GPU-only's and to prefetch off's; each recall evicts what the
    misses need (plus the reserve); the pool invariants hold; the recall writes no staging state
    and no entry is live for the next epoch between steps."""
    caches = {k: _cache(fmt, p, off, device=device) for k, p, off in
              (("gpu", "off", False), ("off", "off", True), ("on", mode, True))}  # fmt: skip
    for c in caches.values():
        _fill(c, _gen(5, "cpu"), fmt)
    g = _gen(6, "cpu")
    bt = torch.arange(18, dtype=torch.int32, device=device).view(3, 6)
    # seq_lens + step stay within the 6-page block table: the kernels trust it (no sync to check)
    lens = torch.tensor([300, 200, 370], dtype=torch.int32, device=device)
    base = {k: v.to(device) for k, v in make_indexer_inputs(3, 6, 8, [1, 1, 1], g).items()}
    on = caches["on"].layers[0]
    n_miss = n_sel = n_host = 0  # n_host: misses not staged, so copied from the host
    for step in range(8):
        inp = make_indexer_inputs(3, 6, 8, [1, 1, 1], g)  # fresh noise, mixed with a fixed query
        mix = (torch.rand(3, 8, 128, generator=g) < 0.8).to(device)
        q = torch.where(mix, base["q_fp8"], inp["q_fp8"].to(device))
        if thr is not None:
            on.staging.ema[pl.EMA_THR].fill_(float("-inf") if thr == "low" else float("inf"))
        rows = {}
        for k, c in caches.items():
            layer = c.layers[0]
            sel, kth = layer.select(q, base["weights"], bt, lens + step)
            if k == "on":
                pool = layer.pool
                h0 = sel[sel >= 0].long()
                g0 = pool.host_to_gpu[h0]
                misses = int((g0 < 0).sum())
                n_miss, n_sel = n_miss + misses, n_sel + g0.numel()
                st = layer.staging
                staged = pl.staged_source(h0, st.host_stage, st.stage_host, st.stage_ctr[-1])[0]
                n_host += int(((g0 < 0) & ~staged).sum())
                free0, ev0 = int(pool.meta[NFREE]), int(pool.totals[EVICTED])
                maps0 = (st.stage_host.clone(), st.host_stage.clone(), st.stage_ctr.clone())
            pool_kv, slots = layer.fetch(sel)
            rows[k] = (sel, pool_kv[slots.clamp(min=0).long()] * (slots >= 0)[..., None])
            if k == "on":
                # an eviction frees what the misses need plus a reserve (cache_layout.evict_target)
                needed, ev = max(misses - free0, 0), int(pool.totals[EVICTED]) - ev0
                reserve = reserve_slots(pool.gpu_free.numel())
                assert ev == 0 if needed == 0 else needed <= ev <= needed + reserve
                check_pool(pool, selected=sel, gpu_slots=slots, host_kv=layer.host_kv)
                # the recall leaves the staging state as it was, and nothing is live for the
                # next epoch: the next step's staging starts from no live entry
                for a, b in zip(maps0, (st.stage_host, st.host_stage, st.stage_ctr)):
                    assert torch.equal(a, b)
                nxt = st.stage_ctr.clone()
                nxt[-1] += 1
                assert not pl.live_staged(st.stage_host, nxt).any()
        for k in ("off", "on"):
            assert torch.equal(rows[k][0], rows["gpu"][0]) and torch.equal(
                rows[k][1], rows["gpu"][1]
            )
        if device == "cpu":  # the references are deterministic: prefetch leaves the same pool
            p_on, p_off = caches["on"].layers[0].pool, caches["off"].layers[0].pool
            for name in ("gpu_to_host", "host_to_gpu", "gpu_priority", "meta", "totals"):
                assert torch.equal(getattr(p_on, name), getattr(p_off, name)), name
    t = on.staging.totals.tolist()
    if thr == "high":
        assert t[pl.PF_STAGED] == 0
    else:
        assert t[pl.PF_STAGED] > 0 and t[pl.PF_PROMOTED] > 0  # prefetch really served misses
    st = caches["on"].stats()
    assert len(st["prefetch_precision"]) == 1 and 0.0 <= st["prefetch_coverage"][0] <= 1.0
    # staged rows count as misses (on the GPU the victims' order within an age bucket comes from
    # atomics, so the resident sets of on and off may part after ties: the count is checked)
    per = caches["on"].layer_stats()[0]
    assert per["recalled"] == n_miss and per["host_copied"] == n_host
    assert t[pl.PF_PROMOTED] == n_miss - n_host
    assert st["hit_rate"][0] == pytest.approx(1 - n_miss / n_sel)


def _selected_layer(seed: int, lens: list[int]):
    """A one-layer bf16 cache (per-request cap 16) after one select: rows staged, the selection."""
    c = _cache("bf16", "request", cap=16)
    _fill(c, _gen(seed, "cpu"), "bf16")
    layer = c.layers[0]
    inp = make_indexer_inputs(3, 6, 8, [1, 1, 1], _gen(seed + 1, "cpu"))
    bt = torch.arange(18, dtype=torch.int32).view(3, 6)
    sel, _ = layer.select(inp["q_fp8"], inp["weights"], bt, torch.tensor(lens).int())
    return layer, sel


def _recall_staged_args(layer, sel: torch.Tensor) -> tuple:
    s, p = layer.staging, layer.pool
    return (layer.host_kv, p.gpu_kv, p.gpu_free, p.gpu_priority, p.gpu_to_host, p.host_to_gpu,
            p.indices, p.miss_host, p.meta, p.hist, p.totals, sel, s.stage_kv, s.stage_host,
            s.host_stage, s.stage_ctr, s.totals)  # fmt: skip


# how echo::recall_staged runs: (cache_kernels.FUSED, LOOKUP_COPY_ROWS_STAGED)
STAGED_MODES = {"one_launch": (True, 0), "one_launch_lookup_copies": (True, 32),
                "per_phase": (False, 0)}  # fmt: skip


@pytest.fixture(params=list(STAGED_MODES))
def staged_mode(request, monkeypatch):
    from custom_ops import cache_kernels

    fused, rows = STAGED_MODES[request.param]
    monkeypatch.setattr(cache_kernels, "FUSED", fused)
    monkeypatch.setattr(cache_kernels, "LOOKUP_COPY_ROWS_STAGED", rows)
    return request.param


def test_recall_staged_triton_matches_reference(staged_mode):
    """The staged recall's Triton path (interpreter) against its reference from equal states:
    in one launch, the copy programs copying every row (the default) or the lookup programs
    copying the rows they placed first; and as a launch per phase."""
    outs = []
    for impl in ("ref", "triton"):
        c = _cache("fp8", "request", cap=16)
        _fill(c, _gen(9, "cpu"), "fp8")
        layer = c.layers[0]
        g = _gen(10, "cpu")
        bt = torch.arange(18, dtype=torch.int32).view(3, 6)
        lens = torch.tensor([300, 200, 370], dtype=torch.int32)
        res = []
        for step in range(3):
            inp = make_indexer_inputs(3, 6, 8, [1, 1, 1], g)
            sel, _ = layer.select(inp["q_fp8"], inp["weights"], bt, lens + step)
            s, p = layer.staging, layer.pool
            fn = pr.recall_staged_ref if impl == "ref" else pk.recall_staged_cuda
            slots = fn(*_recall_staged_args(layer, sel))
            check_pool(p, selected=sel, gpu_slots=slots, host_kv=layer.host_kv)
            res.append((sel, p.gpu_kv[slots.clamp(min=0).long()], s.totals.clone(),
                        p.totals.clone(), s.stage_host.clone(), s.host_stage.clone(),
                        s.stage_ctr.clone()))  # fmt: skip
        outs.append(res)
    for a, b in zip(*outs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_staged_misses_are_read_from_staging_reference():
    _staged_misses_are_read_from_staging("ref")


def test_staged_misses_are_read_from_staging_triton(staged_mode):
    _staged_misses_are_read_from_staging("triton")


def _staged_misses_are_read_from_staging(impl: str):
    """A staged miss's row comes from staging, the other misses' from the host: staging is
    planted with rows unlike the host's (which the engine never does) so the source shows; the
    recall writes no staging state and the statistics count what was staged and promoted."""
    layer, sel = _selected_layer(16, [300, 200, 370])
    s, p = layer.staging, layer.pool
    live, staged_h = _live(s.stage_host, s.stage_ctr)
    assert staged_h.numel() > 0
    s.stage_kv[live] = ~layer.host_kv[staged_h]  # unlike the host rows
    planted = {int(h): s.stage_kv[int(s.host_stage[h])].clone() for h in staged_h}
    state0 = (s.stage_host.clone(), s.host_stage.clone(), s.stage_ctr.clone())
    h_sel = torch.unique(sel[sel >= 0].long())
    missed = h_sel[p.host_to_gpu[h_sel] < 0]
    fn = pr.recall_staged_ref if impl == "ref" else pk.recall_staged_cuda
    fn(*_recall_staged_args(layer, sel))
    from_stage = 0
    for h in missed.tolist():
        row = p.gpu_kv[int(p.host_to_gpu[h])]
        want = planted.get(h, layer.host_kv[h])
        from_stage += h in planted
        assert torch.equal(row, want), f"host slot {h}: wrong source"
    assert from_stage > 0 and from_stage < missed.numel()  # both sources were exercised
    for a, b in zip(state0, (s.stage_host, s.host_stage, s.stage_ctr)):
        assert torch.equal(a, b)
    assert int(s.stage_ctr[-1]) == 1 and not s.stage_ctr[:-1].any()  # one staging call
    promoted = sum(h in planted for h in missed.tolist())
    assert s.totals[pl.PF_STAGED] == staged_h.numel() and s.totals[pl.PF_PROMOTED] == promoted
    assert s.totals[pl.PF_STEPS] == 1


def test_bad_inputs_raise():
    inp, host_kv, h2g, st = _prefetch_case(3, "cpu")
    with pytest.raises(ValueError, match="cap"):
        _run(torch.ops.echo.indexer_topk_prefetch, inp, host_kv, h2g, st, 32, 999, 0.0)
    with pytest.raises(ValueError, match="host_kv"):
        _run(torch.ops.echo.indexer_topk_prefetch, inp, host_kv[:-1], h2g, st, 32, 16, 0.0)
    with pytest.raises(ValueError, match="prefetch"):
        CacheConfig(num_layers=1, host_tokens=64, gpu_tokens=64, topk=8, prefetch="on")
    # a request stages at most its context, in the host pool: a cap over it is refused
    geometry = dict(num_layers=1, host_tokens=128, gpu_tokens=64, topk=8, prefetch="request")
    CacheConfig(**geometry, prefetch_cap=128)
    with pytest.raises(ValueError, match=r"prefetch_cap must be at most host_tokens \(128,"):
        CacheConfig(**geometry, prefetch_cap=129)


def test_bench_staged_recall_dry_run(tmp_path):
    """benchmarks/bench_staged_recall.py runs each timed variant's code path at toy sizes (CPU,
    interpreter; no timings, and not the per-phase profile) and records each scenario."""
    import json
    import subprocess
    import sys

    out = tmp_path / "sr.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_staged_recall", "--dry-run", "--hit-rates",
           "0.9", "--rounds", "1", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert set(res["results"]) == {"h0.9", "h0.9_steady"}
    for r in res["results"].values():
        names = {"plain", "staged", "plain_self0", "staged_self32"}
        assert r["misses"] > 0 and set(r["median_us"]) == names


def test_bench_prefetch_dry_run(tmp_path):
    """benchmarks/bench_prefetch.py's checks at toy sizes (CPU, interpreter): all PASS; and its
    timing code runs through (a wall-clock call each): every figure and derived figure there,
    from two rounds."""
    import json
    import subprocess
    import sys

    out = tmp_path / "pf.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_prefetch", "--dry-run", "--caps", "16",
           "--ratios", "0.004", "--hit-rates", "0.9", "--margins", "0,2", "--rounds", "2",
           "--ab-rounds", "1", "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    res = json.loads(out.read_text())
    assert res["timer"].startswith("one wall-clock call") and len(res["rounds"]) == 2
    r, parts = res["results"]["h0.9"], res["results"]["parts"]
    assert all(isinstance(parts[k], float) for k in ("scores_us", "indexer_us", "recall_h1.0_us"))
    for name in ("cap16_m2_rows8", "ratio0.04_m0_rows8_tile"):  # (the dry run: 10x the ratios)
        for key in (f"{name}_us", f"steady_{name}_us", f"{name}_of_bound",
                    f"amortized_{name}_of_bound"):  # fmt: skip
            assert isinstance(r[key], float), key
    assert r["bound_us"] > 0 and r["refill_period"] >= 1
    assert res["fusion_ab"]["indexer_slowdown_median"] is not None
    # 2 checks x 4 configurations x variants, and the perfect prefetch's (every miss staged) on
    # the full pool (it evicts the misses and the reserve) and with free slots (it evicts none)
    assert res["all_pass"] and len(res["checks"]) == 2 * 4 * len(ps.SCORES_VARIANTS) + 2
    full, steady = (res["checks"][f"recall_all_staged{w}_h0.9"] for w in ("", "_steady"))
    for c in (full, steady):
        assert c["promoted"] == c["misses"] > 0
    from benchmarks.bench_prefetch import TOY

    assert full["evicted"] == full["misses"] + reserve_slots(TOY["n_g"])
    assert steady["evicted"] == 0
    assert any(c.get("staged", 0) > 0 for c in res["checks"].values())
    # a margin stages only candidates above a higher threshold: never more of them
    fused = {k: c for k, c in res["checks"].items() if k.startswith("fused_")}
    for k, c in fused.items():
        if "_m2_" in k:
            assert c["candidates"] <= fused[k.replace("_m2_", "_m0_")]["candidates"]


def test_bench_prefetch_perfect_prefetch_check_sees_where_rows_come_from(monkeypatch):
    """bench_prefetch's perfect-prefetch check stages marked rows and requires them in the pool:
    a recall that read the misses from the host instead (staged rows equal to the host's here)
    fails it; and its staging buffer holds every miss, at least the configurations' rows."""
    from benchmarks import bench_prefetch as bp

    s = bp.Setup(bp.TOY, "bf16", torch.device("cpu"), 32)
    s.set_hit_rate(0.5)
    st = bp.all_staged(s, 32)
    assert st.stage_host.numel() >= s.n_miss == 64
    assert bp.all_staged(s, 512).stage_host.numel() >= 512
    for _ in range(2):  # the same staging again: its totals count this step alone
        assert bp.check_all_staged(s, st) == {"pass": True, "misses": 64, "promoted": 64,
                                              "evicted": 64 + reserve_slots(bp.TOY["n_g"])}
    stage = bp.stage_all_misses
    monkeypatch.setattr(bp, "stage_all_misses", lambda s_, st_, mark=0: stage(s_, st_))
    assert bp.check_all_staged(s, st)["pass"] is False


def test_bench_prefetch_rounds_take_each_figures_median():
    """bench_prefetch's figures are the medians of the rounds where they were timed: a round
    whose timing failed is left out of that figure, and a figure failed in every round keeps
    its error."""
    from benchmarks import bench_prefetch as bp

    err = {"error": "RuntimeError: x"}
    rounds = [{"a_us": 3.0, "b_us": err, "c_us": err},
              {"a_us": 1.0, "b_us": 7.0, "c_us": err},
              {"a_us": 2.0, "b_us": 5.0}]  # fmt: skip
    assert bp.median_rounds(rounds) == {"a_us": 2.0, "b_us": 6.0, "c_us": err}
    assert bp.median_rounds([{"x": 4.0}]) == {"x": 4.0}


def test_bench_prefetch_bounds_and_amortized_figures():
    """bench_prefetch's derived figures from made-up timings: both bounds as documented, a
    failed part leaving its bound out, and the refill period of the reserve."""
    from benchmarks import bench_prefetch as bp

    parts = {"indexer_us": 170.0, "scores_us": 100.0, "recall_h1.0_us": 10.0}
    r = {"recall_us": 50.0, "baseline_us": 220.0, "recall_all_staged_us": 30.0}
    b = bp.bounds(r, parts)
    assert b["bound_us"] == 180.0 and b["bound_staged_us"] == 200.0  # copies 40 / 20 < 100
    assert b["bound_staged_speedup"] == 220.0 / 200.0
    r_big = {"recall_us": 400.0, "baseline_us": 570.0, "recall_all_staged_us": 60.0}
    assert bp.bounds(r_big, parts)["bound_us"] == 170.0 + 10.0 + 290.0  # 390 - 100 unhidden
    failed = dict(r, recall_all_staged_us={"error": "x"})
    assert set(bp.bounds(failed, parts)) == {"bound_us", "bound_speedup"}
    r |= {"steady_recall_us": 20.0, "steady_recall_all_staged_us": 10.0,
          "steady_baseline_us": 190.0, "c_us": 200.0, "steady_c_us": 185.0}  # fmt: skip
    a = bp.amortized(r, 976, 4687, parts, ["c"])  # the paper's h = 0.97, 300K pool: 1 refill in 5
    am_recall, am_base, am_c = (50 + 4 * 20) / 5, (220 + 4 * 190) / 5, (200 + 4 * 185) / 5
    assert a["refill_period"] == 5 and a["amortized_recall_us"] == am_recall
    assert a["amortized_recall_all_staged_us"] == (30 + 4 * 10) / 5
    assert a["amortized_baseline_us"] == am_base and a["amortized_c_us"] == am_c
    assert a["amortized_bound_us"] == 180.0  # the amortized copies (16) hide under the scoring
    assert a["amortized_bound_staged_us"] == 170.0 + 14.0
    assert a["amortized_c_speedup"] == am_base / am_c
    assert a["amortized_c_of_bound"] == (am_base / am_c) / (am_base / 180.0)
    every = bp.amortized(r, 16384, 4687, parts, ["c"])  # every step refills
    assert every["amortized_recall_us"] == 50.0 and every["amortized_c_us"] == 200.0
    assert "amortized_d_us" not in bp.amortized(r, 976, 4687, parts, ["d"])  # not timed: left out


def test_bench_prefetch_steady_pool_frees_the_misses_and_the_reserve():
    from benchmarks import bench_prefetch as bp

    s = bp.Setup(bp.TOY, "bf16", torch.device("cpu"), 32)
    for steady, free in ((False, 0), (True, 64 + reserve_slots(bp.TOY["n_g"]))):
        s.set_hit_rate(0.5, steady=steady)
        assert int(s.pool.meta[NFREE]) == free
    with pytest.raises(ValueError, match="cannot hold"):
        bp.Setup(dict(bp.TOY, n_g=100), "bf16", torch.device("cpu"), 32).set_hit_rate(0.5, True)


def test_bench_prefetch_fusion_ab_alternates_and_reports_slowdowns(monkeypatch):
    """bench_prefetch's fusion A/B: each round times unfused and fused, in swapped order every
    other round, and the slowdowns are fused / unfused - 1 per round (timer replaced: no GPU)."""
    from benchmarks import bench_prefetch as bp

    calls, times = [], iter([100.0, 104.0, 110.0, 100.0, 100.0, 103.0, 102.0, 100.0])

    def fake_timed(fn, before, reps):
        calls.append(fn())
        return next(times)

    monkeypatch.setattr(bp, "timed", fake_timed)
    out = bp.fusion_ab({"indexer": (lambda: "u", lambda: "f", None)}, rounds=4, reps=1)
    assert calls == ["u", "f", "f", "u", "u", "f", "f", "u"]
    assert out["rounds"][1] == {"indexer_fused_us": 110.0, "indexer_unfused_us": 100.0}
    assert out["indexer_slowdowns"] == pytest.approx([0.02, 0.03, 0.04, 0.10])
    assert out["indexer_slowdown_median"] == pytest.approx(0.035)  # the middle two's mean
    assert (out["indexer_slowdown_min"], out["indexer_slowdown_max"]) == pytest.approx((0.02, 0.1))


def test_prefetch_op_rejects_bad_threshold_state_and_margin():
    """The op names the problem: the old 1-D threshold layout, a non-contiguous state, a
    negative or non-finite margin."""
    inp, host_kv, h2g, st = _prefetch_case(5, "cpu")
    n = st["ema"].shape[1]
    for bad in (torch.zeros(n), torch.zeros(n, pl.EMA_ROWS).t()):
        with pytest.raises(ValueError, match="ema a contiguous"):
            _run(pf.indexer_topk_prefetch, inp, host_kv, h2g, dict(st, ema=bad), 32, 16, 0.0)
    for margin in (-0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="margin must be a finite number"):
            _run(pf.indexer_topk_prefetch, inp, host_kv, h2g, st, 32, 16, 0.0, margin)


def test_opcheck_prefetch_ops():
    """Schemas, fakes and mutation declarations of both ops (torch.library.opcheck)."""
    inp, host_kv, h2g, st = _prefetch_case(4, "cpu")
    st["ema"].fill_(-1.0)
    args = [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]
    torch.library.opcheck(torch.ops.echo.indexer_topk_prefetch.default, (
        *args, 32, host_kv, h2g, st["stage_kv"], st["stage_host"], st["host_stage"],
        st["stage_ctr"], st["ema"], st["pf_stats"], 16, 0.0, 2.0))  # fmt: skip
    layer, sel = _selected_layer(12, [300, 0, 380])
    assert (layer.staging.stage_host >= 0).any()
    torch.library.opcheck(torch.ops.echo.recall_staged.default, _recall_staged_args(layer, sel))


def test_thresholds_follow_requests_not_rows():
    """A request's threshold is keyed by its first host page: swapping batch rows keeps each
    request's own; release (KVCache.release -> echo::release_layers) resets only its pages'."""
    c = _cache("bf16", "request", cap=8)
    _fill(c, _gen(14, "cpu"), "bf16")
    layer = c.layers[0]
    inp = make_indexer_inputs(3, 6, 8, [1, 1, 1], _gen(15, "cpu"))
    bt = torch.arange(18, dtype=torch.int32).view(3, 6)
    lens = torch.tensor([300, 200, 380], dtype=torch.int32)
    _, kth = layer.select(inp["q_fp8"], inp["weights"], bt, lens)
    level = layer.staging.ema[pl.EMA_LEVEL]
    assert torch.equal(level[[0, 6, 12]], kth)  # a first update: the k-th score itself
    perm = torch.tensor([2, 0, 1])
    inp["weights"] = inp["weights"] * 2  # new k-th scores, each request's own
    _, kth2 = layer.select(inp["q_fp8"][perm], inp["weights"][perm], bt[perm], lens[perm])
    kth2 = kth2[torch.argsort(perm)]  # back in request order
    assert not torch.equal(kth2, kth)
    # each request's EMA of its own two k-th scores, whatever its row
    assert torch.equal(level[[0, 6, 12]], 0.5 * kth2 + 0.5 * kth)
    c.release(torch.arange(6 * 64, 12 * 64))  # the second request's pages
    ema = layer.staging.ema
    assert not ema[:, 6].any() and torch.equal(level[[0, 12]], (0.5 * kth2 + 0.5 * kth)[[0, 2]])


def test_summarize_prefetch_tabulates_a_committed_run():
    """benchmarks/summarize_prefetch.py on a committed H100 run: one row per configuration of
    each hit rate, its figures from the JSON (gpu_session40 call 6: 0.917 of the bound at budget
    0.006, margin 4), '-' where a figure is missing."""
    import json
    from pathlib import Path

    from benchmarks import summarize_prefetch as sp

    results = Path(__file__).parent.parent / "benchmarks/results"
    path = results / "gpu_session40/call6_prefetch_h05_budgets_h100.json"
    res = json.loads(path.read_text())
    r = res["results"]["h0.5"]
    got = dict(sp.rows(r))
    assert len(got) == 10 and got["ratio0.006_m4_rows8"][3] == "0.917"
    assert got["ratio0.006_m4_rows8"][0] == f"{r['ratio0.006_m4_rows8_us']:.1f}"
    text = sp.summarize(res)
    assert "checks PASS, 3 rounds" in text and "| ratio0.003_m3_rows8 |" in text
    del r["ratio0.003_m3_rows8_precision"]
    assert dict(sp.rows(r))["ratio0.003_m3_rows8"][6] == "-"
