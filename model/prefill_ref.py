"""The reference's explicit prefill attention, what tests compare the served (sparse, absorbed)
prefill with; the engine never runs it (over a 100K context it costs minutes: kv_b_proj expansion
of the whole context and dense fp32 attention of every head over all of it).

For each query: keys and values expanded by ``kv_b_proj`` from the request's cached latent rows,
192-wide q·k over the whole context, masked to the indexer's top-k (chosen by a full stable sort of
the index scores, ties to the earlier token) and causality, softmax and P·V in fp32. Queries are
processed in blocks so the fp32 score tensor stays under ``PREFILL_BLOCK_ELEMS``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from custom_ops.cache.kv_cache import LayerKV
from custom_ops.kv_format import PAGE, index_cache_gather, unpack_kv_rows
from model.forward_meta import ForwardMeta

# Explicit attention materialises [query block, heads, context] fp32 scores: bound the block.
PREFILL_BLOCK_ELEMS = 1 << 24


def index_scores(
    q_fp8: torch.Tensor,  # [Q, Hi, 128] e4m3
    weights: torch.Tensor,  # [Q, Hi] fp32, every scale folded in
    k: torch.Tensor,  # [L, 128] fp32 (dequantised e4m3 values)
    k_scale: torch.Tensor,  # [L] fp32
) -> torch.Tensor:
    """Index scores ``[Q, L]``: ``k_scale[t] * Σ_h w[q, h] * ReLU(q_h · k_t)``, the formula (and
    the operation order) of ``custom_ops.indexer.indexer_topk_ref``. ReLU before the head weights
    (docs/model_notes.md, indexer step 6)."""
    logits = torch.einsum("qhd,td->qht", q_fp8.float(), k)  # [Q, Hi, L]
    return (logits.relu() * weights.float()[:, :, None]).sum(dim=1) * k_scale  # [Q, L]


def prefill_topk_mask(score: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """bool ``[Q, L]``: the keys query ``q`` (at absolute position ``positions[q]``) attends: the
    top ``min(topk, p + 1)`` causal keys by ``score [Q, L]``, ties to the earlier token, exactly as
    ``echo::indexer_topk`` selects for a request of ``p + 1`` tokens. Causality is built in."""
    q, n = score.shape
    t = torch.arange(n, device=score.device)
    causal = t[None, :] <= positions[:, None]  # [Q, L]
    score = torch.where(causal, score, torch.full_like(score, float("-inf")))
    k = min(topk, n)
    order = torch.sort(-score, dim=1, stable=True).indices[:, :k]  # [Q, K] best first
    n_sel = (positions.long() + 1).clamp(max=k)  # [Q]
    chosen = torch.arange(k, device=score.device)[None, :] < n_sel[:, None]  # [Q, K]
    return torch.zeros(q, n, dtype=torch.bool, device=score.device).scatter(1, order, chosen)


def explicit_prefill(
    mla: torch.nn.Module,  # model.model.MLA
    q_nope: torch.Tensor,  # [T, H, nope]
    q_pe: torch.Tensor,  # [T, H, 64]
    q_idx: torch.Tensor,  # [T, Hi, 128] e4m3
    w_idx: torch.Tensor,  # [T, Hi] fp32
    meta: ForwardMeta,
    cache_layer: LayerKV,
    masks: list[torch.Tensor] | None = None,  # gets each query block's selection mask [qb, L]
) -> torch.Tensor:
    """``MLA._prefill``'s result in the explicit form, ``[T, H, v]``: the signature of
    ``MLA._prefill`` (plus ``masks``), so a test can run a whole model with it."""
    t, h = q_nope.shape[0], mla.n_heads
    nope, rope, dv = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    bt = meta.block_table
    n = bt.shape[1] * PAGE
    pos_all = torch.arange(n, device=bt.device)
    slots_all = bt[0, pos_all // PAGE].long() * PAGE + pos_all % PAGE  # [L] host slots
    kv_all = unpack_kv_rows(cache_layer.read(slots_all, pos_all), cache_layer.fmt)  # [L, 576]
    c_all, pe_all = torch.split(kv_all, [mla.kv_lora_rank, rope], dim=-1)
    kvb = mla.kv_b_proj(c_all).view(n, h, nope + dv)  # [L, H, nope+v]
    k_nope, v = torch.split(kvb, [nope, dv], dim=-1)
    k = torch.cat([k_nope, pe_all[:, None, :].expand(n, h, rope)], dim=-1).float()  # [L, H, 192]
    v = v.float()  # [L, H, v]
    q = torch.cat([q_nope, q_pe], dim=-1).float()  # [T, H, 192]
    k_idx, k_scale = index_cache_gather(cache_layer.index_k, slots_all)  # [L, 128], [L]
    qb = max(1, min(t, PREFILL_BLOCK_ELEMS // (max(h, q_idx.shape[1]) * n)))
    outs = []
    for s in range(0, t, qb):
        e = min(t, s + qb)
        score = index_scores(q_idx[s:e], w_idx[s:e], k_idx, k_scale)  # [qb, L]
        sel = prefill_topk_mask(score, meta.positions[s:e], mla.index_topk)  # [qb, L]
        if masks is not None:
            masks.append(sel)
        att = torch.einsum("qhd,thd->qht", q[s:e], k) * mla.softmax_scale  # [qb, H, L]
        att = att.masked_fill(~sel[:, None, :], float("-inf"))
        outs.append(torch.einsum("qht,thd->qhd", att.softmax(dim=-1), v))  # [qb, H, v]
    return torch.cat(outs).to(q_nope.dtype)  # [T, H, v]


@contextlib.contextmanager
def explicit_prefill_in(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every MLA of ``model`` (or ``model`` itself, an MLA) prefills in the
    explicit form (an instance attribute shadows ``MLA._prefill``; removed on exit). Tests only."""
    mlas = [m for m in model.modules() if hasattr(m, "_prefill") and hasattr(m, "kv_b_proj")]
    for m in mlas:
        m._prefill = functools.partial(explicit_prefill, m)
    try:
        yield
    finally:
        for m in mlas:
            del m._prefill
