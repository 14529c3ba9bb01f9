"""Expert parallelism computes each rank's own experts only (model/parallel.py ``EPMoE``): a pick
of another rank's expert is the skip id ``E`` (one past the rank's experts), which the MoE ops'
grouping (``moe_align``) gives no slot and every form of the routed experts leaves out. The
greedy-token and logit comparisons of dp = ep = 2 with one process are in test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from custom_ops import awq as ops
from custom_ops import awq_kernels as K
from model.loader import load_model
from model.moe import Experts
from model.parallel import EPMoE, TPGroup
from model.shard_loader import load_sharded_model


def _with_skips(t: int, e: int, k: int, gen: torch.Generator, p_skip: float = 0.4):
    """Random distinct expert ids ``[t, k]`` with about ``p_skip`` of them the skip id ``e``."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    skip = torch.rand(t, k, generator=gen) < p_skip
    return ids.masked_fill(skip, e), torch.rand(t, k, generator=gen), skip


def _dropped(ids: torch.Tensor, w: torch.Tensor, skip: torch.Tensor, e: int):
    """The same routing with the skipped picks sent to expert 0 with weight 0 (the old form)."""
    return ids.masked_fill(skip, 0).clamp(max=e - 1), w.masked_fill(skip, 0.0)


@pytest.mark.parametrize("t,block_m", [(1, 16), (9, 16), (40, 32)])
def test_moe_align_gives_skipped_pairs_no_slot(t, block_m):
    g = torch.Generator().manual_seed(t)
    e, k = 4, 3
    ids, _, skip = _with_skips(t, e, k, g)
    sorted_ids, block_expert = K.moe_align(ids, e, block_m)
    p = t * k
    slots = sorted_ids[sorted_ids < p].tolist()
    want = sorted(i for i in range(p) if not skip.view(-1)[i])
    assert sorted(slots) == want  # every kept pair exactly once, no skipped one
    for b, ex in enumerate(block_expert.tolist()):  # each block holds pairs of its expert only
        rows = [i for i in sorted_ids[b * block_m : (b + 1) * block_m].tolist() if i < p]
        if ex >= e:
            assert rows == []
        assert all(ids.view(-1)[i].item() == ex for i in rows)


@pytest.mark.parametrize("t", [3, 17])
def test_skipped_picks_contribute_nothing_in_every_form(t):
    g = torch.Generator().manual_seed(100 + t)
    e, k, d, inter = 4, 3, 128, 128
    x = torch.randn(t, d, generator=g).to(torch.bfloat16)
    ids, w, skip = _with_skips(t, e, k, g)
    m = Experts(e, d, inter)
    with torch.no_grad():
        m.w13_weight.copy_(torch.randn(e, 2 * inter, d, generator=g) * 0.05)
        m.w2_weight.copy_(torch.randn(e, d, inter, generator=g) * 0.05)
    want = ops.moe_bf16_ref(x, *_dropped(ids, w, skip, e), m.w13_weight, m.w2_weight)
    ref = ops.moe_bf16_ref(x, ids, w, m.w13_weight, m.w2_weight)
    assert torch.equal(ref, want)  # the reference loops over real experts only
    dense = m.forward_all_experts(x, ids, w)
    torch.testing.assert_close(dense, want, rtol=0, atol=1e-4)  # BLAS order only
    cfg = dict(BM=16, BN=32, BK=64, num_warps=4, num_stages=1)
    kern = K.moe_bf16_triton(x, ids, w, m.w13_weight, m.w2_weight, config=cfg)  # interpreter
    assert ((kern - want).norm() / want.norm()).item() < 2e-3  # as test_awq_moe_bf16 bounds it
    assert torch.isfinite(kern).all()


def test_each_ep_rank_computes_only_its_own_experts_picks():
    """Count the (token, expert) pairs each rank's experts are handed and the slots its grouped
    kernels would run: exactly the picks of its own experts, together every pick once."""
    full, _ = load_model("tiny", keep_mtp=False)
    cfg = full.config
    shards = [load_sharded_model("tiny", TPGroup(r, 2, "", gather=True), ep=True)[0]
              for r in range(2)]  # fmt: skip
    t, k = 24, cfg.num_experts_per_tok
    x = torch.randn(t, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    x = x.to(torch.bfloat16)
    layer = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    _, global_ids = full.model.layers[layer].mlp.gate(x)  # [T, k], the same router on each rank
    seen: list[torch.Tensor] = []
    for s in shards:
        moe = s.model.layers[layer].mlp
        assert isinstance(moe, EPMoE)
        inner = moe.experts.forward
        moe.experts.forward = lambda x_, ids, w, inner=inner: (seen.append(ids), inner(x_, ids, w))[
            1
        ]
        moe.partial(x)
        ids = seen[-1]
        kept = ids < moe.n_local
        own = (global_ids >= moe.first) & (global_ids < moe.first + moe.n_local)
        assert torch.equal(kept, own)  # exactly this rank's experts' picks are kept
        assert torch.equal(ids[kept] + moe.first, global_ids[own])  # renumbered, not moved
        sorted_ids, _ = K.moe_align(ids, moe.n_local, 16)
        assert int((sorted_ids < t * k).sum()) == int(own.sum())  # the kernels' rows
        assert 0 < int(own.sum()) < t * k  # a real split: neither rank does everything
    assert sum(int((i < 4).sum()) for i in seen) == t * k  # every pick computed once in all


def test_ep_moe_benchmark_answers_help_on_cpu(capsys):
    from benchmarks import bench_ep_moe

    with pytest.raises(SystemExit) as e:
        bench_ep_moe.main(["--help"])
    assert e.value.code == 0 and "--ep" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="must divide 256 experts"):
        bench_ep_moe.main(["--out", "x.json", "--ep", "3"])


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 64, 512])
def test_skip_ids_on_gpu_at_v32_expert_shapes(t):
    """The Triton kernel with skip ids (an EP rank of 8: 32 experts of V3.2's shapes) against its
    reference, and an all-skipped token's row exactly zero."""
    g = torch.Generator("cuda").manual_seed(t)
    e, k, d, inter = 32, 8, 7168, 2048
    x = torch.randn(t, d, device="cuda", generator=g).bfloat16()
    ids = torch.rand(t, 256, device="cuda", generator=g).topk(k, dim=-1).indices
    ids = torch.where(ids < e, ids, torch.full_like(ids, e))  # 7/8 of the picks foreign
    ids[0] = e
    w = torch.rand(t, k, device="cuda", generator=g)
    w13 = (torch.randn(e, 2 * inter, d, device="cuda", generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(e, d, inter, device="cuda", generator=g) * 0.02).bfloat16()
    y = K.moe_bf16_triton(x, ids, w, w13, w2)
    ref = ops.moe_bf16_ref(x, ids, w, w13, w2)
    assert (y[0] == 0).all() and torch.isfinite(y).all()
    if t > 1:
        assert ((y - ref).norm() / ref.norm()).item() < 5e-3
