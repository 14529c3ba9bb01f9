"""Decode kernels on the GPU at full size against the references: the indexer at B = 64 with a
100K-token context and top-2048, the sparse MLA attention at B = 64, H = 128, K = 2048, both row
formats; determinism, the lossless property, the registered ops, and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
from test_decode_kernels import (
    SCORE_REL_GPU,
    _gen,
    _randn,
    _tie_scores,
    attention_close,
    check_scores,
    check_selection_near,
    make_indexer_inputs,
    make_pool,
    scores_ref,
    select_ref,
)

from custom_ops import attention_kernels as ak
from custom_ops import indexer_kernels as ik
from custom_ops.attention import sparse_mla_decode_ref
from custom_ops.indexer import indexer_topk_ref

pytestmark = pytest.mark.cuda

B, P, HI, TOPK = 64, 1563, 64, 2048  # L = 100032 tokens
L = P * 64
LENS = [L] * 52 + [L - 1, 99_000, 77_777, 64 * 700, 2049, 2048, 2047, 1000, 64, 1, 0, 0]


def _args(inp: dict) -> list[torch.Tensor]:
    return [inp[k] for k in ("q_fp8", "weights", "index_cache", "block_table", "seq_lens")]


@pytest.fixture(scope="module")
def indexer_inputs() -> dict:
    return make_indexer_inputs(B, P, HI, LENS, _gen(1, "cuda"))


def test_indexer_full_size(indexer_inputs: dict) -> None:
    inp = indexer_inputs
    args = _args(inp)
    host, kth = ik.indexer_topk_cuda(*args, TOPK)
    # exact: the reference's selection from the kernel's own scores
    scores = ik.index_scores(*args, ik.IndexerConfig())
    host_x, kth_x = select_ref(scores, inp["block_table"], inp["seq_lens"], TOPK)
    assert torch.equal(host, host_x) and torch.equal(kth, kth_x)
    ref, mag = scores_ref(inp)
    worst = check_scores(scores, ref, mag, SCORE_REL_GPU)
    print(f"\nscores: worst error {worst:.3g} of the term magnitudes")
    host_r, kth_r = indexer_topk_ref(*args, TOPK)
    tol = SCORE_REL_GPU * torch.where(torch.isfinite(ref), mag, 0).amax(dim=1)
    check_selection_near(host, kth, host_r, kth_r, ref, inp["block_table"], tol)
    n_same = sum(len(set(host[b].tolist()) & set(host_r[b].tolist()) - {-1}) for b in range(B))
    print(f"selected as the reference: {n_same} of {int((host_r >= 0).sum())}")


def test_indexer_deterministic_fused_and_op(indexer_inputs: dict) -> None:
    args = _args(indexer_inputs)
    host, kth = ik.indexer_topk_cuda(*args, TOPK)
    for _ in range(2):
        h2, k2 = ik.indexer_topk_cuda(*args, TOPK)
        assert torch.equal(host, h2) and torch.equal(kth.view(torch.int32), k2.view(torch.int32))
    # the default scores kernel is unfused; the fused-histogram variant must select the same
    h3, k3 = ik.indexer_topk_cuda(*args, TOPK, ik.IndexerConfig(fuse_hist=True))
    assert torch.equal(host, h3) and torch.equal(kth, k3)
    h4, k4 = torch.ops.echo.indexer_topk(*args, TOPK)  # the op dispatches to the kernels
    assert torch.equal(host, h4) and torch.equal(kth, k4)


@pytest.mark.parametrize("kind", ["ties", "equal", "spread", "near"])
def test_topk_exact_full_size(kind: str) -> None:
    # "ties": a few distinct values, thresholds inside long runs of ties; "near": values one ulp
    # apart, every radix digit decides
    scores = _tie_scores(B, L, _gen(3), kind).cuda()
    lens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    bt = torch.randperm(B * P + 5, device="cuda")[: B * P].view(B, P).int()
    host, kth = ik.topk_from_scores(scores, bt, lens, TOPK, ik.IndexerConfig())
    want = select_ref(scores, bt, lens, TOPK)
    assert torch.equal(host, want[0]) and torch.equal(kth, want[1])


def _att_inputs(B: int, H: int, K: int, N: int, fmt: str, seed: int):
    gen = _gen(seed, "cuda")
    pool = make_pool(N, fmt, gen)
    q = (_randn(B, H, 576, gen=gen) * 0.5).bfloat16()
    slots = torch.rand(B, N, generator=gen, device="cuda").argsort(dim=1)[:, :K].int()
    slots[torch.rand(B, K, generator=gen, device="cuda") < 0.1] = -1
    slots[min(3, B - 1)] = -1  # a padded batch row
    slots[0, K // 2 :] = -1
    return q, pool, slots


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("B", [64, 2])  # one split per program / several splits and a combine
def test_attention_full_size(fmt: str, B: int) -> None:
    H, K, N = 128, 2048, 200_000
    q, pool, slots = _att_inputs(B, H, K, N, fmt, 10 + B)
    scale = 0.1352
    out = ak.sparse_mla_decode_cuda(q, pool, slots, scale, fmt)
    attention_close(out, sparse_mla_decode_ref(q, pool, slots, scale, fmt))
    e = min(3, B - 1)
    assert torch.equal(out[e], torch.zeros_like(out[e]))
    assert torch.equal(out, ak.sparse_mla_decode_cuda(q, pool, slots, scale, fmt))
    assert torch.equal(out, torch.ops.echo.sparse_mla_decode(q, pool, slots, scale, fmt))
    # lossless: the same rows elsewhere in the pool give the same bits
    perm = torch.randperm(N, device="cuda")
    pool2 = torch.empty_like(pool)
    pool2[perm] = pool
    slots2 = torch.where(slots >= 0, perm[slots.clamp(min=0).long()].int(), slots)
    assert torch.equal(out, ak.sparse_mla_decode_cuda(q, pool2, slots2, scale, fmt))


def test_cuda_graph_replay() -> None:
    """Both launchers captured in one CUDA graph (no host sync, static grids) replay with new
    lengths, queries and slots written in place, and give what eager calls give."""
    Bs, Ps = 8, 160
    inp = make_indexer_inputs(Bs, Ps, HI, [Ps * 64] * Bs, _gen(4, "cuda"))
    args = _args(inp)
    q, pool, slots = _att_inputs(Bs, 128, TOPK, 30_000, "fp8", 5)

    def step():
        return ik.indexer_topk_cuda(*args, TOPK), ak.sparse_mla_decode_cuda(
            q, pool, slots, 0.1, "fp8"
        )

    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        (g_host, g_kth), g_out = step()
    gen = _gen(6, "cuda")
    for lens in ([Ps * 64 - 7, 100, 0, 2048, 5000, 64, 9000, 1], [Ps * 64] * Bs):
        inp["seq_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        inp["q_fp8"].copy_(
            _randn(*inp["q_fp8"].shape, gen=gen).to(torch.float8_e4m3fn).view(torch.uint8)
        )
        q.copy_(_randn(*q.shape, gen=gen).bfloat16())
        slots.copy_(slots.roll(1, dims=1))
        g.replay()
        (host, kth), out = step()
        assert torch.equal(g_host, host) and torch.equal(g_kth, kth)
        assert torch.equal(g_out, out)
