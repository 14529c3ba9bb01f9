"""The served prefill (sparse, absorbed: MLA._prefill) against the reference's explicit form
(model/prefill_ref.py) on the tiny preset, CPU: identical selected sets, outputs within the bf16
rounding of the two forms, and the cache rows that decode later reads bit-identical whichever
prefill wrote them."""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch

from custom_ops.kv_format import PAGE
from model.config import ModelConfig
from model.model import DeepseekV32ForCausalLM
from model.prefill_ref import explicit_prefill, explicit_prefill_in
from model.presets import preset_config
from tests.test_model import Req, _mla_setup, all_logits, make_cache, random_ids, rel_err


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return preset_config("tiny")  # index_topk = 32


def _chunks(n: int, chunk: int, pad: int) -> list[tuple[int, int, int]]:
    """(start, end, padded length) of each prefill chunk of n tokens."""
    return [(s, min(n, s + chunk), min(n, s + chunk) - s + (pad if s + chunk >= n else 0))
            for s in range(0, n, chunk)]  # fmt: skip


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_sparse_prefill_matches_explicit_with_identical_selections(cfg, fmt):
    # 100 tokens in chunks of 48 (the last one padded like the runtime): positions 0..31 select
    # their whole prefix, the rest really choose 32 of up to 100 keys
    n, topk = 100, cfg.index_topk
    torch.manual_seed(0)
    mla, x, (cos, sin) = _mla_setup(cfg, n, seed=5)
    req = Req([4, 1])  # non-contiguous pages
    sparse_cache, explicit_cache = make_cache(cfg, fmt), make_cache(cfg, fmt)
    masks: list[torch.Tensor] = []
    outs_s, outs_e = [], []
    with torch.no_grad():
        for s, e, t in _chunks(n, 48, 5):
            ids = torch.zeros(e - s, dtype=torch.int64)
            meta = req.prefill(ids, s, pad_to=t)
            xs = torch.cat([x[s:e], x[e - 1 : e].expand(t - (e - s), -1)])
            cs, sn = cos[meta.positions], sin[meta.positions]
            outs_s.append(mla(xs, cs, sn, meta, sparse_cache.layers[0])[: e - s])
            mla._prefill = functools.partial(explicit_prefill, mla, masks=masks)
            try:
                outs_e.append(mla(xs, cs, sn, meta, explicit_cache.layers[0])[: e - s])
            finally:
                del mla._prefill
            # the selection the sparse path made for this chunk, from the same cache and queries
            qr = mla.q_a_layernorm(mla.q_a_proj(xs))
            q_idx, w_idx, _ = mla.indexer(xs, qr, cs, sn)
            sel = torch.ops.echo.prefill_indexer_topk(
                q_idx.view(torch.uint8), w_idx, sparse_cache.layers[0].index_k,
                meta.block_table, meta.positions, topk,
            )  # fmt: skip
            mask = torch.cat(masks)  # the explicit path's selection, its query blocks in order
            masks.clear()
            L = meta.block_table.shape[1] * PAGE
            for q in range(t):
                chosen = sel[q][sel[q] >= 0].tolist()
                assert chosen == mask[q].nonzero().flatten().tolist(), f"query {s + q}"
                assert len(chosen) == min(topk, int(meta.positions[q]) + 1) and max(chosen) < L
    # the rows decode will read: the same bits whichever prefill wrote them
    assert torch.equal(sparse_cache.layers[0].host_kv, explicit_cache.layers[0].host_kv)
    assert torch.equal(sparse_cache.layers[0].index_k, explicit_cache.layers[0].index_k)
    sparse, explicit = torch.cat(outs_s), torch.cat(outs_e)
    err = rel_err(sparse, explicit)
    # absorbed vs explicit: the same selected rows, different bf16 roundings (q_abs, o_lat, the
    # probabilities in the kernel's form); stated bound 1.5e-2 = ~4 bf16 ulps of the row max, as
    # for decode vs explicit (tests/test_model.py). Measured: max 7.6e-3, median 4.3e-3.
    assert err[:topk].max() < 1.5e-2, f"whole-prefix positions: {err[:topk].max():.3e}"
    assert err.max() < 1.5e-2, f"max rel err {err.max():.3e} at position {err.argmax()}"


def test_model_sparse_prefill_close_to_explicit_and_rows_identical(cfg):
    """The whole tiny model, two chunks: both prefills store through the same path (layer 0's
    rows, computed before any attention, are bit-identical: a check of the write path, not of
    the forms' numerics; deeper layers' rows differ by the forms' rounding), every layer writes
    the same slots, the logits agree within the bf16 noise the
    forms' discrete flips allow (test_model's position-by-position bounds). Every expert is
    routed, so MoE routing cannot flip: up to index_topk the selections are whole prefixes and
    nothing can flip; past it index top-k boundary flips may move a position's logits."""
    n = 80
    cfg = dataclasses.replace(cfg, num_experts_per_tok=cfg.n_routed_experts, topk_group=cfg.n_group)
    m = DeepseekV32ForCausalLM(cfg).random_init_(0)
    ids, req = random_ids(cfg, n, seed=6), Req([2, 7])
    caches, logits = [], []
    with torch.no_grad():
        for explicit in (False, True):
            cache = make_cache(cfg)
            ctx = explicit_prefill_in(m) if explicit else contextlib.nullcontext()
            with ctx:
                parts = [
                    all_logits(m, req.prefill(ids[s:e], s, all_logits=True), cache)
                    for s, e, _ in _chunks(n, 48, 0)
                ]
            caches.append(cache)
            logits.append(torch.cat(parts))
    a, b = caches
    assert torch.equal(a.layers[0].host_kv, b.layers[0].host_kv)
    assert torch.equal(a.layers[0].index_k, b.layers[0].index_k)
    slots = torch.tensor([req.slot(p) for p in range(n)])
    for la, lb in zip(a.layers, b.layers, strict=True):
        written_a = la.host_kv.view(la.host_kv.shape[0], -1).ne(0).any(1)
        written_b = lb.host_kv.view(lb.host_kv.shape[0], -1).ne(0).any(1)
        assert torch.equal(written_a, written_b)
        assert written_a[slots].all() and int(written_a.sum()) == n
    r = rel_err(logits[0], logits[1])  # measured: prefix max 1.5e-2, median 9e-3, max 7.2e-2
    assert r[: cfg.index_topk].max() <= 2e-2, f"whole-prefix positions: {r[: cfg.index_topk].max()}"
    assert r.median() <= 2e-2 and r.max() <= 0.3, f"median {r.median():.3e}, max {r.max():.3e}"
    agree = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean()
    assert agree >= 0.9, f"greedy agreement {agree:.2f}"
