"""Sparse prefill ops (custom_ops/prefill.py) and their Triton kernels
(custom_ops/prefill_kernels.py) against the references, at small sizes: on CPU through the Triton
interpreter (conftest sets TRITON_INTERPRET=1 without a GPU). Full sizes on the GPU:
test_prefill_cuda.py. The input builders are shared with test_prefill_cuda.py and
benchmarks/bench_prefill.py."""

from __future__ import annotations

import pytest
import torch

from custom_ops import indexer_kernels as ik
from custom_ops import prefill as pf
from custom_ops import prefill_kernels as pk
from custom_ops.fp8 import FP8_DTYPE
from custom_ops.kv_format import INDEX_DIM, PAGE, index_cache_gather
from tests.test_decode_kernels import (
    SCORE_REL,
    attention_close,
    check_scores,
    make_index_cache,
    make_pool,
)

# small launch shapes so the interpreter covers many tiles, causal skips and selection chunks
SMALL = pk.PrefillIndexerConfig(
    block_q=16, block_t=64, num_warps=4, score_elems=16 * 192, select=ik.IndexerConfig(sel_block=64)
)


def make_prefill_inputs(
    P: int, n_heads: int, T: int, start: int, n_pad: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """A chunk of T queries at positions start.. (the last n_pad of them padding that repeats the
    last real position, as the runtime pads), over a request of P pages (not contiguous)."""
    dev = gen.device
    n_pages = P + 3
    bt = torch.randperm(n_pages, generator=gen, device=dev)[:P].view(1, P).int()
    q = (torch.randn(T, n_heads, INDEX_DIM, generator=gen, device=dev) * 2).to(FP8_DTYPE)
    w = torch.randn(T, n_heads, generator=gen, device=dev) * n_heads**-0.5  # some negative
    pos = torch.arange(start, start + T, device=dev)
    if n_pad:
        pos[T - n_pad :] = start + T - n_pad - 1
    return dict(q_fp8=q.view(torch.uint8), weights=w, index_cache=make_index_cache(n_pages, gen),
                block_table=bt, positions=pos)  # fmt: skip


# The prefill logits kernel multiplies FP8 on the tensor cores. Hopper's FP8 MMA accumulates with
# less than fp32's precision (DeepSeek-V3 report, 3.3.2), so its scores are further from the fp32
# reference than the decode kernel's (measured on the H200: 2e-5 of the term magnitudes; decode's
# SCORE_REL is 1e-5): the bound here is 1e-4.
PREFILL_SCORE_REL = 1e-4


def check_selection_near_ties(
    got: torch.Tensor, want: torch.Tensor, score_ref: torch.Tensor, mag: torch.Tensor, rel: float
) -> float:
    """Prefill selections ``[T, K]`` (positions, -1 padded): the same count per row as the
    reference, and where the sets differ, only at tokens whose reference score is within
    ``2 * rel * max(mag)`` of the row's reference k-th score (a near-tie decided by rounding).
    Returns the fraction of rows selected identically."""
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1)), "selection counts differ"
    T, L = score_ref.shape
    masks = []
    for sel in (got, want):
        m = torch.zeros(T, L + 1, dtype=torch.bool, device=sel.device)
        m.scatter_(1, torch.where(sel >= 0, sel.long(), L), True)
        masks.append(m[:, :L])
    diff = masks[0] ^ masks[1]
    ref_sel = torch.where(masks[1], score_ref, torch.full_like(score_ref, float("inf")))
    kth = ref_sel.min(1).values  # the reference's k-th score per row
    tol = 2 * rel * mag.amax(1)
    gap = (score_ref - kth[:, None]).abs()
    bad = diff & ~(gap <= tol[:, None])
    assert not bad.any(), f"{int(bad.any(1).sum())} rows select tokens that are not near-ties"
    return float((~diff.any(1)).float().mean())


def magnitudes(inp: dict[str, torch.Tensor]) -> torch.Tensor:
    """``k_scale * sum_h |w_h| * sum_d |q_hd k_d|`` per (query, token): bounds the rounding error
    of any summation order of the score."""
    L = inp["block_table"].shape[1] * PAGE
    t = torch.arange(L, device=inp["positions"].device)
    slots = inp["block_table"][0, t // PAGE].long() * PAGE + t % PAGE
    k, ks = index_cache_gather(inp["index_cache"], slots)
    q = inp["q_fp8"].view(FP8_DTYPE).float()
    mag = torch.einsum("qhd,td->qht", q.abs(), k.abs()) * inp["weights"].abs()[:, :, None]
    return mag.sum(1) * ks


@pytest.mark.parametrize(
    ("P", "n_heads", "T", "start", "n_pad"),
    [(3, 4, 40, 0, 0), (5, 16, 32, 150, 5), (4, 8, 20, 230, 0)],
)
def test_prefill_logits_kernel_matches_reference(P, n_heads, T, start, n_pad):
    inp = make_prefill_inputs(P, n_heads, T, start, n_pad, torch.Generator().manual_seed(P * T))
    ref = pf.prefill_index_logits_ref(**inp)
    out = pk.prefill_index_logits(**inp, cfg=SMALL)
    # -inf exactly past each query's position (a causal tile skipped or computed alike)
    check_scores(out, ref, magnitudes(inp), SCORE_REL)
    assert torch.isfinite(ref).sum() == int((inp["positions"].clamp(max=P * PAGE - 1) + 1).sum())


def _tied_scores(Q: int, L: int, positions: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Scores with many exact ties (few distinct values, some +-0.0), -inf past each position."""
    s = torch.randint(-3, 4, (Q, L), generator=gen).float() * 0.5
    s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=gen) < 0.5, 0.0, -0.0)
    causal = torch.arange(L)[None, :] <= positions[:, None]
    return torch.where(causal, s, torch.full_like(s, float("-inf")))


# one program per row (the count pass skipped; given, or asked for) and three per row
@pytest.mark.parametrize(("sel_chunk", "one"), [(192, False), (None, False), (None, True)])
def test_prefill_topk_kernel_equals_reference_with_ties(sel_chunk, one, monkeypatch):
    # positions 20..35 cross topk = 32: whole prefixes and real selections in one block
    L, topk, start = 192, 32, 20
    gen = torch.Generator().manual_seed(L + topk)
    pos = torch.arange(start, start + 16)
    scores = _tied_scores(16, L, pos, gen)
    cfg = pk.PrefillIndexerConfig(
        select=ik.IndexerConfig(sel_block=64, sel_chunk=sel_chunk), select_one_per_row=one
    )
    assert ik._chunking(16, L, cfg.select, scores.device)[1] == (1 if sel_chunk else 3)
    calls = []
    one_chunk = pk._select_one_chunk
    monkeypatch.setattr(pk, "_select_one_chunk", lambda *a: calls.append(1) or one_chunk(*a))
    out = pk.prefill_topk_from_scores(scores, pos, topk, cfg)
    assert bool(calls) == (sel_chunk is not None or one)  # the path this case is about
    ref = pf.prefill_topk_from_scores_ref(scores, pos, topk)
    assert torch.equal(out, ref)
    # the rule itself: min(topk, p + 1) positions, ascending, within the causal prefix
    n = (ref >= 0).sum(1)
    assert torch.equal(n, (pos + 1).clamp(max=topk))
    for q in range(16):
        sel = ref[q, : n[q]]
        assert (sel[1:] > sel[:-1]).all() and int(sel.max()) <= int(pos[q])


def test_prefill_indexer_topk_kernel_equals_reference():
    """The whole op, several query blocks (score_elems forces 16-row blocks), one chunk crossing
    index_topk: positions <= topk select their whole prefix."""
    inp = make_prefill_inputs(3, 4, 24, 20, 3, torch.Generator().manual_seed(7))
    topk = 32
    ref = pf.prefill_indexer_topk_ref(**inp, topk=topk)
    out = pk.prefill_indexer_topk_cuda(**inp, topk=topk, cfg=SMALL)
    assert torch.equal(out, ref)
    pos = inp["positions"]
    whole = pos < topk
    expect = torch.arange(topk)[None, :].expand(int(whole.sum()), -1)
    assert torch.equal(ref[whole].long(), torch.where(expect <= pos[whole, None], expect, -1))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_sparse_mla_prefill_kernel_matches_reference(fmt):
    gen = torch.Generator().manual_seed(11)
    T, H, L, K = 6, 4, 150, 48
    q = (torch.randn(T, H, 576, generator=gen) * 0.3).bfloat16()
    rows = make_pool(L, fmt, gen)
    sel = torch.stack([torch.randperm(L, generator=gen)[:K].sort().values for _ in range(T)])
    sel[1, 20:] = -1  # a short selection
    sel[2] = -1  # nothing selected: zeros
    sel = sel.int()
    ref = pf.sparse_mla_prefill_ref(q, rows, sel, 0.1352, fmt)
    out = pk.sparse_mla_prefill_cuda(q, rows, sel, 0.1352, fmt)
    attention_close(out, ref)
    assert (ref[2] == 0).all() and (out[2] == 0).all()


def test_ops_registered_with_fakes_and_checked():
    inp = make_prefill_inputs(2, 4, 16, 40, 2, torch.Generator().manual_seed(3))
    torch.library.opcheck(torch.ops.echo.prefill_indexer_topk, (*inp.values(), 32))
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 576, generator=gen).bfloat16()
    rows = make_pool(70, "fp8", gen)
    sel = torch.tensor([[0, 5, -1], [1, 2, 3], [-1, -1, -1]], dtype=torch.int32)
    torch.library.opcheck(torch.ops.echo.sparse_mla_prefill, (q, rows, sel, 0.1, "fp8"))
    bad = dict(inp, block_table=inp["block_table"].expand(2, -1))
    with pytest.raises(ValueError, match="one request"):
        torch.ops.echo.prefill_indexer_topk(*bad.values(), 32)
    with pytest.raises(ValueError, match="positions must be int64"):
        bad = dict(inp, positions=inp["positions"].int())
        torch.ops.echo.prefill_indexer_topk(*bad.values(), 8)
    with pytest.raises(ValueError, match="sel must be int32"):
        torch.ops.echo.sparse_mla_prefill(q, rows, sel[:2], 0.1, "fp8")


def test_score_rows_bounds_the_block():
    assert pf.score_rows(100_000, 2048) * 100_000 <= pf.SCORE_ELEMS
    assert pf.score_rows(100_000, 2048) % 16 == 0
    assert pf.score_rows(64, 2048) == 2048  # short contexts: the whole chunk at once
    assert pf.score_rows(10**9, 2048) == 16  # never fewer than 16 queries (tl.dot's minimum)
    assert pk.score_rows(100_000, 2048, pf.SCORE_ELEMS) == pf.score_rows(100_000, 2048)


def test_bench_prefill_help_runs_on_cpu(capsys):
    from benchmarks import bench_prefill

    with pytest.raises(SystemExit) as e:
        bench_prefill.main(["--help"])
    assert e.value.code == 0
    assert "--ttft" in capsys.readouterr().out


def test_check_selection_near_ties_accepts_rounding_flips_only():
    """The GPU checks' rule: sets may differ only at near-ties of the reference k-th score."""
    score = torch.tensor([[5.0, 4.0, 3.0, 3.0 + 1e-6, 1.0], [2.0, 9.0, 8.0, 0.5, 7.0]])
    mag = torch.full_like(score, 10.0)
    want = torch.tensor([[0, 1, 3], [1, 2, 4]])
    flip = torch.tensor([[0, 1, 2], [1, 2, 4]])  # 2 for 3: 1e-6 apart, within 2 * 1e-4 * 10
    assert check_selection_near_ties(flip, want, score, mag, 1e-4) == 0.5
    assert check_selection_near_ties(want, want, score, mag, 1e-4) == 1.0
    with pytest.raises(AssertionError, match="not near-ties"):
        check_selection_near_ties(torch.tensor([[0, 1, 4], [1, 2, 4]]), want, score, mag, 1e-4)
    with pytest.raises(AssertionError, match="counts"):
        check_selection_near_ties(torch.tensor([[0, 1, -1], [1, 2, 4]]), want, score, mag, 1e-4)
