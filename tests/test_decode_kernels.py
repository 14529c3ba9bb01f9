"""Decode kernels (custom_ops/indexer_kernels.py, custom_ops/attention_kernels.py) against their
torch references, at small sizes: on CPU through the Triton interpreter (conftest sets
TRITON_INTERPRET=1 without a GPU), on the GPU as they are. Full sizes: test_decode_kernels_cuda.py.

The input builders and checks below are shared with that file and with
benchmarks/bench_decode_kernels.py."""

from __future__ import annotations

import pytest
import torch

from custom_ops import attention_kernels as ak
from custom_ops import indexer_kernels as ik
from custom_ops.attention import sparse_mla_decode_ref
from custom_ops.fp8 import FP8_DTYPE, act_quant
from custom_ops.indexer import indexer_topk_ref
from custom_ops.kv_format import INDEX_DIM, PAGE, index_cache_gather, pack_index_k, pack_kv_rows


def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device)


def make_index_cache(n_pages: int, gen: torch.Generator) -> torch.Tensor:
    """A paged indexer cache [n_pages, 8448] of random fp8 keys with ue8m0 scales."""
    kq, ks = act_quant(_randn(n_pages * PAGE, INDEX_DIM, gen=gen), 128, "ue8m0")
    rows = pack_index_k(kq, ks).view(n_pages, PAGE, INDEX_DIM + 4)
    # per page: the 64 value rows, then the 64 scales
    return torch.cat([rows[..., :INDEX_DIM].flatten(1), rows[..., INDEX_DIM:].flatten(1)], 1)


def make_indexer_inputs(
    B: int, P: int, n_heads: int, seq_lens: list[int], gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Random inputs of ``indexer_topk_ref`` on the generator's device, distinct pages per row."""
    dev = gen.device
    n_pages = B * P + 3
    bt = torch.randperm(n_pages, generator=gen, device=dev)[: B * P].view(B, P).int()
    q = (_randn(B, n_heads, INDEX_DIM, gen=gen) * 2).to(FP8_DTYPE).view(torch.uint8)
    w = _randn(B, n_heads, gen=gen) * n_heads**-0.5  # some weights negative
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    return dict(q_fp8=q, weights=w, index_cache=make_index_cache(n_pages, gen), block_table=bt,
                seq_lens=sl)  # fmt: skip


def make_pool(n: int, fmt: str, gen: torch.Generator) -> torch.Tensor:
    return pack_kv_rows(_randn(n, 512, gen=gen), _randn(n, 64, gen=gen), fmt)


def host_slots(block_table: torch.Tensor) -> torch.Tensor:
    """[B, P*64] int64: host slot of every position."""
    B, P = block_table.shape
    t = torch.arange(P * PAGE, device=block_table.device)
    return block_table[:, t // PAGE].long() * PAGE + t % PAGE


def select_ref(
    score: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection half of ``indexer_topk_ref``, line for line, on given scores [B, L]."""
    B, L = score.shape
    dev = score.device
    t = torch.arange(L, device=dev)
    slots = host_slots(block_table)
    valid = t[None, :] < seq_lens[:, None].long()
    score = torch.where(valid, score, torch.full_like(score, float("-inf")))
    K = min(topk, L)
    order = torch.sort(-score, dim=1, stable=True).indices[:, :K]
    n_sel = seq_lens.long().clamp(max=K)
    chosen = torch.arange(K, device=dev)[None, :] < n_sel[:, None]
    kth = score.gather(1, order).gather(1, (n_sel - 1).clamp(min=0)[:, None]).squeeze(1)
    kth = torch.where(n_sel > 0, kth, torch.full_like(kth, float("-inf")))
    pos = torch.sort(torch.where(chosen, order, L), dim=1).values
    host = torch.where(pos < L, slots.gather(1, pos.clamp(max=L - 1)), -1).to(torch.int32)
    if K < topk:
        host = torch.cat([host, host.new_full((B, topk - K), -1)], dim=1)
    return host, kth


def scores_ref(inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The score half of ``indexer_topk_ref`` (fp32, -inf past each length), and for each score
    the sum of the magnitudes of its terms, ``k_scale * sum_h |w_h| * sum_d |q_hd * k_d|``,
    which bounds the rounding error of any summation order."""
    slots = host_slots(inp["block_table"])
    k, k_scale = index_cache_gather(inp["index_cache"], slots)
    q = inp["q_fp8"].view(FP8_DTYPE).float()
    w = inp["weights"].float()[:, :, None]
    logits = torch.einsum("bhd,btd->bht", q, k)
    score = (logits.relu() * w).sum(dim=1) * k_scale
    mag = (torch.einsum("bhd,btd->bht", q.abs(), k.abs()) * w.abs()).sum(dim=1) * k_scale
    L = score.shape[1]
    valid = torch.arange(L, device=score.device)[None, :] < inp["seq_lens"][:, None].long()
    return torch.where(valid, score, torch.full_like(score, float("-inf"))), mag


def check_scores(scores: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, rel: float) -> float:
    """-inf exactly where the reference has it, elsewhere |s - ref| <= rel * mag. Returns the
    largest |s - ref| / mag seen."""
    valid = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(scores), valid)
    assert torch.equal(scores[~valid], ref[~valid])
    if not valid.any():
        return 0.0
    ratio = ((scores - ref).abs() / mag.clamp(min=1e-30))[valid]
    worst = float(ratio.max())
    assert worst <= rel, f"score error {worst:.3g} of the term magnitudes (allowed {rel:.3g})"
    return worst


def check_selection_near(
    host: torch.Tensor,
    kth: torch.Tensor,
    host_ref: torch.Tensor,
    kth_ref: torch.Tensor,
    score_ref: torch.Tensor,
    block_table: torch.Tensor,
    tol: torch.Tensor,  # [B] score tolerance
) -> None:
    """The kernel's selection equals the reference's except for tokens whose reference score is
    within tolerance of the reference threshold (a near tie decided by rounding). Same counts,
    same -1 padding, no duplicates, kth within tolerance."""
    B, L = score_ref.shape
    slots = host_slots(block_table)
    pos_of = torch.full((int(slots.max()) + 1,), -1, dtype=torch.long, device=slots.device)
    for b in range(B):
        n_k = int((host[b] >= 0).sum())
        n_r = int((host_ref[b] >= 0).sum())
        assert n_k == n_r, f"row {b}: {n_k} selected, reference {n_r}"
        assert (host[b, n_k:] == -1).all(), f"row {b}: selections after the -1 padding"
        if n_k == 0:
            assert kth[b] == float("-inf")
            continue
        pos_of.fill_(-1)
        pos_of[slots[b]] = torch.arange(L, device=slots.device)
        sel = []
        for h in (host[b, :n_k], host_ref[b, :n_r]):
            p = pos_of[h.long()]
            assert (p >= 0).all(), f"row {b}: a slot not of this request"
            m = torch.zeros(L, dtype=torch.bool, device=p.device)
            m[p] = True
            assert int(m.sum()) == n_k, f"row {b}: duplicate selections"
            sel.append(m)
        gap = (score_ref[b][sel[0] ^ sel[1]] - kth_ref[b]).abs()
        assert (gap <= 2 * tol[b]).all(), f"row {b}: selection differs {gap.max()} from the kth"
        assert (kth[b] - kth_ref[b]).abs() <= tol[b], f"row {b}: kth {kth[b]} vs {kth_ref[b]}"


def attention_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 tolerance: the kernel multiplies bf16 probabilities (the reference keeps them fp32)
    and both round the output to bf16, so each element may differ by about 2^-8 of the output's
    scale: |out - ref| <= 1e-2 * max|ref| + 1e-2 * |ref|, and in norm by at most 4e-3."""
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all()
    scale = r.abs().amax().clamp(min=1e-6)
    bad = (o - r).abs() > 1e-2 * scale + 1e-2 * r.abs()
    assert not bad.any(), f"{int(bad.sum())} elements off, max err {(o - r).abs().max()}"
    assert (o - r).norm() <= 4e-3 * r.norm() + 1e-6


def order_key_torch(score: torch.Tensor) -> torch.Tensor:
    """The kernels' int32 order key of fp32 scores, computed independently in torch."""
    bits = score.contiguous().view(torch.int32)
    bits = torch.where((bits & 0x7FFFFFFF) == 0, torch.zeros_like(bits), bits)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# ------------------------------------------------------------------------------------------------
# indexer


# scores within fp32 rounding of any summation order: a small multiple of 2^-24 per term, of the
# sum of the terms' magnitudes (the interpreter on the CPU sums in fp32)
SCORE_REL = 1e-5
# NOTE: fp8 tensor-core sums are not fp32-exact on Hopper (fewer bits kept while accumulating),
# so on the GPU the scores may differ from the fp32 reference by more than fp32 rounding; bounded
# by 2^-10 of the sum of the terms' magnitudes (a wrong weight, scale or ReLU is off by O(1)).
SCORE_REL_GPU = 2**-10


def score_rel(device: str) -> float:
    return SCORE_REL_GPU if torch.device(device).type == "cuda" else SCORE_REL


SMALL = ik.IndexerConfig(score_block=64, score_tokens=128, sel_block=64, sel_chunk=64)
# lengths: empty, below topk, exact page multiples, above topk, the whole table
CASES = [
    (1, 5, 8, [300], 64),
    (2, 5, 4, [0, 200], 32),
    (3, 5, 16, [64, 128, 256], 8),
    (4, 5, 64, [17, 320, 63, 65], 64),
    (4, 4, 8, [256, 1, 0, 100], 16),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_select_ref_is_the_reference(case: int, device: str) -> None:
    # the line-for-line copy of the selection used by the checks below agrees with the op's ref
    B, P, Hi, lens, topk = CASES[case]
    inp = make_indexer_inputs(B, P, Hi, lens, _gen(100 + case, device))
    host, kth = select_ref(scores_ref(inp)[0], inp["block_table"], inp["seq_lens"], topk)
    host_r, kth_r = indexer_topk_ref(**inp, topk=topk)
    assert torch.equal(host, host_r) and torch.equal(kth, kth_r)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_scores_and_histogram(case: int, device: str) -> None:
    B, P, Hi, lens, topk = CASES[case]
    inp = make_indexer_inputs(B, P, Hi, lens, _gen(200 + case, device))
    hists = torch.zeros(B, 4, 256, dtype=torch.int32, device=device)
    args = [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]
    scores = ik.index_scores(*args, SMALL, hists)
    ref, mag = scores_ref(inp)
    check_scores(scores, ref, mag, score_rel(device))
    valid = torch.isfinite(ref)
    # the fused pass-1 histogram counts the top 8 key bits of the live scores
    digit = (order_key_torch(scores) >> 24) + 128
    for b in range(B):
        want = torch.bincount(digit[b][valid[b]].long(), minlength=256).int()
        assert torch.equal(hists[b, 0].cpu(), want.cpu())
    assert not hists[:, 1:].any()


@pytest.mark.parametrize("cfg", [SMALL, ik.IndexerConfig(), ik.IndexerConfig(fuse_hist=False,
                                 sel_block=32, sel_chunk=96), ik.IndexerConfig(fuse_hist=True,
                                 score_tokens=128, sel_block=64, sel_chunk=64)])  # fmt: skip
@pytest.mark.parametrize("case", range(len(CASES)))
def test_indexer_topk_vs_reference(case: int, cfg: ik.IndexerConfig, device: str) -> None:
    B, P, Hi, lens, topk = CASES[case]
    inp = make_indexer_inputs(B, P, Hi, lens, _gen(300 + case, device))
    args = [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]
    host, kth = ik.indexer_topk_cuda(*args, topk, cfg)
    assert host.shape == (B, topk) and host.dtype == torch.int32 and kth.shape == (B,)
    # exact: the selection the reference makes from the kernel's own scores
    scores = ik.index_scores(*args, cfg)
    host_x, kth_x = select_ref(scores, inp["block_table"], inp["seq_lens"], topk)
    assert torch.equal(host, host_x) and torch.equal(kth, kth_x)
    # near: against the reference end to end, differing only at near-ties of the threshold
    host_r, kth_r = indexer_topk_ref(**inp, topk=topk)
    ref, mag = scores_ref(inp)
    tol = score_rel(device) * torch.where(torch.isfinite(ref), mag, 0).amax(dim=1)
    check_selection_near(host, kth, host_r, kth_r, ref, inp["block_table"], tol)


def _tie_scores(B: int, L: int, gen: torch.Generator, kind: str) -> torch.Tensor:
    if kind == "ties":  # a few distinct values: thresholds fall inside long runs of ties
        s = torch.randint(-2, 3, (B, L), generator=gen).float()
        s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=gen) < 0.5, -0.0, 0.0)
    elif kind == "equal":  # one value: every live score is a candidate, the first k are taken
        s = torch.full((B, L), 0.25)
    elif kind == "spread":  # signs and magnitudes from 1e-30 to 1e30, some -inf
        mag = torch.exp((torch.randn(B, L, generator=gen) * 20).clamp(-80, 80))  # finite
        s = torch.randn(B, L, generator=gen) * mag
        s[torch.rand(B, L, generator=gen) < 0.05] = float("-inf")
    else:  # "near": distinct values one ulp apart, so every radix digit matters
        base = torch.tensor(1.0).view(torch.int32)
        s = (base + torch.randint(0, 600, (B, L), generator=gen).int()).view(torch.float32)
    return s


@pytest.mark.parametrize("kind", ["ties", "equal", "spread", "near"])
@pytest.mark.parametrize("topk", [8, 33, 64])
def test_topk_exact(kind: str, topk: int, device: str) -> None:
    B, P = 4, 5
    gen = _gen(400 + topk)  # CPU: the same scores whatever the device
    L = P * PAGE
    scores = _tie_scores(B, L, gen, kind).to(device)
    lens = torch.tensor([300, topk, 0, 128], dtype=torch.int32, device=device)
    for b in range(B):  # what lies past a request's length must be ignored, even huge values
        scores[b, int(lens[b]) :] = 1e30
    bt = torch.randperm(B * P + 2, generator=gen)[: B * P].view(B, P).int().to(device)
    want = select_ref(scores, bt, lens, topk)
    for cfg in (SMALL, ik.IndexerConfig(sel_block=128, sel_chunk=128)):
        host, kth = ik.topk_from_scores(scores, bt, lens, topk, cfg)
        assert torch.equal(host, want[0]), (kind, cfg)
        assert torch.equal(kth, want[1]), (kind, cfg)


def test_indexer_deterministic(device: str) -> None:
    B, P, Hi, lens, topk = CASES[3]
    inp = make_indexer_inputs(B, P, Hi, lens, _gen(500, device))
    args = [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]
    a = ik.indexer_topk_cuda(*args, topk, SMALL)
    b = ik.indexer_topk_cuda(*args, topk, SMALL)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.int32), b[1].view(torch.int32))


# ------------------------------------------------------------------------------------------------
# attention

ATT_CFGS = [
    ak.MlaConfig(block_h=16, block_k=16, n_split=1),
    ak.MlaConfig(block_h=16, block_k=16, n_split=3),
    ak.MlaConfig(block_h=32, block_k=32),  # split count from the shapes
]


def _att_inputs(B, H, K, N, fmt, seed, device):
    gen = _gen(seed)
    pool = make_pool(N, fmt, gen).to(device)
    q = (torch.randn(B, H, 576, generator=gen) * 0.5).bfloat16().to(device)
    slots = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(B)]).int()
    slots[torch.rand(B, K, generator=gen) < 0.2] = -1  # holes
    slots[B - 1, K // 2 :] = -1  # a partly used row: the tail unused
    return q, pool, slots.to(device)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("cfg", range(len(ATT_CFGS)))
@pytest.mark.parametrize("shape", [(1, 4, 1), (2, 4, 37), (3, 20, 64), (2, 16, 48)])
def test_attention_vs_reference(fmt: str, cfg: int, shape: tuple, device: str) -> None:
    B, H, K = shape
    q, pool, slots = _att_inputs(B, H, K, 200, fmt, 600 + K + H, device)
    scale = 576**-0.5 * (1 + K % 3)
    out = ak.sparse_mla_decode_cuda(q, pool, slots, scale, fmt, ATT_CFGS[cfg])
    attention_close(out, sparse_mla_decode_ref(q, pool, slots, scale, fmt))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_attention_empty_rows_are_zero(fmt: str, device: str) -> None:
    q, pool, slots = _att_inputs(3, 4, 40, 100, fmt, 700, device)
    slots[1] = -1
    for cfg in ATT_CFGS[:2]:
        out = ak.sparse_mla_decode_cuda(q, pool, slots, 0.1, fmt, cfg)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert out[0].abs().amax() > 0


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("cfg", range(2))
def test_attention_lossless(fmt: str, cfg: int, device: str) -> None:
    """The same rows at other pool slots (pool and slots permuted together) give the same bits,
    and two runs give the same bits: the attended set alone decides the output."""
    c = ATT_CFGS[cfg]
    q, pool, slots = _att_inputs(2, 20, 56, 150, fmt, 800 + cfg, device)
    out = ak.sparse_mla_decode_cuda(q, pool, slots, 0.07, fmt, c)
    assert torch.equal(out, ak.sparse_mla_decode_cuda(q, pool, slots, 0.07, fmt, c))
    N = pool.shape[0]
    perm = torch.randperm(N, generator=_gen(9)).to(device)  # row i moves to perm[i]
    pool2 = torch.empty_like(pool)
    pool2[perm] = pool
    slots2 = torch.where(slots >= 0, perm[slots.clamp(min=0).long()].int(), slots)
    out2 = ak.sparse_mla_decode_cuda(q, pool2, slots2, 0.07, fmt, c)
    assert torch.equal(out, out2)
    # and the rows unused by a -1 slot are never read: NaN there changes nothing
    pool3 = pool.clone()
    used = torch.zeros(N, dtype=torch.bool, device=device)
    used[slots[slots >= 0].long()] = True
    pool3[~used] = 0xFF  # 0xFF bytes are NaN in bf16, e4m3 and fp32
    assert torch.equal(out, ak.sparse_mla_decode_cuda(q, pool3, slots, 0.07, fmt, c))
