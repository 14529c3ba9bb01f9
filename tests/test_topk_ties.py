"""Exact top-k with ties, end to end through ``echo::indexer_topk`` (the CPU reference) and the
Triton kernel: the keys are one fp8 vector with power-of-two scales, so each token's score is
``scale * S`` exactly and whole runs of tokens tie. The expected selection is written here from
the rule alone: the top ``min(topk, seq_len)`` tokens by score, ties to the earlier token, listed
in ascending position, -1 padded; ``kth`` is the lowest selected score."""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from custom_ops import indexer as _indexer  # noqa: F401  (registers echo::indexer_topk)
from custom_ops import indexer_kernels as ik
from custom_ops.fp8 import act_quant
from custom_ops.kv_format import INDEX_DIM, PAGE, pack_index_k

HEADS = 2


def _inputs(exps: list[list[int]], lens: list[int], pages: int):
    """Rows b of ``exps`` give each token's scale exponent; pages are interleaved across rows."""
    B = len(exps)
    v = torch.linspace(-1.0, 1.0, INDEX_DIM)
    kq, _ = act_quant(v[None, :], 128, "ue8m0")  # one e4m3 key vector for every token
    n_pages = B * pages
    scales = torch.ones(n_pages * PAGE)
    bt = torch.arange(n_pages, dtype=torch.int32).view(pages, B).T.contiguous()  # [B, P]
    for b in range(B):
        slots = (bt[b].long()[:, None] * PAGE + torch.arange(PAGE)).flatten()[: len(exps[b])]
        scales[slots] = torch.tensor([2.0**e for e in exps[b]])
    rows = pack_index_k(kq.expand(n_pages * PAGE, -1), scales).view(n_pages, PAGE, -1)
    cache = torch.cat([rows[..., :INDEX_DIM].flatten(1), rows[..., INDEX_DIM:].flatten(1)], 1)
    q = kq.expand(B, HEADS, INDEX_DIM).contiguous().view(torch.uint8)  # q = k: q.k > 0
    w = torch.full((B, HEADS), 0.5)
    return q, w, cache, bt, torch.tensor(lens, dtype=torch.int32)


def _expected(exps, lens, bt, topk):
    host, kth_exp = [], []
    for b, n in enumerate(lens):
        order = sorted(range(n), key=lambda t: (-exps[b][t], t))[: min(topk, n)]
        pos = sorted(order)
        row = [int(bt[b, p // PAGE]) * PAGE + p % PAGE for p in pos]
        host.append(row + [-1] * (topk - len(row)))
        kth_exp.append(min(exps[b][t] for t in order) if order else None)
    return torch.tensor(host, dtype=torch.int32), kth_exp


@st.composite
def tie_case(draw):
    pages = draw(st.integers(1, 3))
    B = draw(st.integers(1, 3))
    topk = draw(st.sampled_from([1, 4, 16, 31, 32, 33, 64]))
    few = draw(st.integers(1, 3))  # 1-3 distinct scores: the threshold falls inside a tie run
    exps = [draw(st.lists(st.integers(-few, few), min_size=pages * PAGE,
                          max_size=pages * PAGE)) for _ in range(B)]  # fmt: skip
    lens = [draw(st.sampled_from([0, 1, topk - 1, topk, topk + 1, pages * PAGE]) | st.integers(
        0, pages * PAGE)) for _ in range(B)]  # fmt: skip
    return exps, [max(0, min(n, pages * PAGE)) for n in lens], pages, topk


def _check(host, kth, exps, lens, bt, topk, what):
    want, kth_exp = _expected(exps, lens, bt, topk)
    assert torch.equal(host, want), what
    s = None
    for b, e in enumerate(kth_exp):
        if e is None:
            assert kth[b] == float("-inf"), what
        else:
            s = float(kth[b]) / 2.0**e if s is None else s  # kth = 2^e * S, S the same for all
            assert float(kth[b]) == 2.0**e * s, what


@settings(max_examples=50, deadline=None)
@given(tie_case())
@example(([[0] * 64], [64], 1, 32))  # every score equal: the first 32 tokens
@example(([[1, 0] * 32], [64], 1, 33))  # 32 winners, then one of the ties: the earliest
@example(([[0] * 64, [0] * 64], [0, 5], 1, 16))  # an empty row, and one shorter than topk
def test_reference_topk_with_ties(case):
    exps, lens, pages, topk = case
    q, w, cache, bt, sl = _inputs(exps, lens, pages)
    host, kth = torch.ops.echo.indexer_topk(q, w, cache, bt, sl, topk)
    _check(host, kth, exps, lens, bt, topk, case)


@settings(max_examples=5, deadline=None)
@given(tie_case())
@example(([[1, 0] * 32, [0] * 64], [64, 40], 1, 33))
def test_kernel_topk_with_ties(case):
    exps, lens, pages, topk = case
    q, w, cache, bt, sl = _inputs(exps, lens, pages)
    cfg = ik.IndexerConfig(score_block=64, score_tokens=128, sel_block=64, sel_chunk=64)
    host, kth = ik.indexer_topk_cuda(q, w, cache, bt, sl, topk, cfg)
    _check(host, kth, exps, lens, bt, topk, case)
