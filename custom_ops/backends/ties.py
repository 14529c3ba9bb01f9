"""Exact top-k from scores, and the tie fix-up that makes any library's top-k select our set.

The engine's rule (``echo::indexer_topk``): of the live scores (t < seq_len) take the
min(topk, seq_len) largest, ties going to the earlier token, and list their host slots in ascending
token position (-1 padded). Ties are common: after the ReLU many index scores are exactly 0.

A library top-k may break ties any way it likes, but every correct top-k has the same k-th value
(the multiset of the k largest values is unique). So from its k-th value alone the set is fixed:
every live score above it, then the earliest live scores equal to it until k are taken
(``threshold_select_ref``). ``stable_select_ref`` is the definition (a stable sort), and the tests
check the two agree with many ties.
"""

from __future__ import annotations

import torch

from custom_ops.kv_format import PAGE


def _host_slots(block_table: torch.Tensor, L: int) -> torch.Tensor:
    """[B, L] host slot of every token position (block_table [B, P], L <= P * 64)."""
    t = torch.arange(L, device=block_table.device)
    return block_table[:, t // PAGE].long() * PAGE + (t % PAGE)


def _live_scores(scores: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor):
    # NOTE: a library may hand back scores wider than the block table spans (DeepGEMM pads its
    # row width); positions past P * 64 are never live (seq_len <= P * 64).
    L = min(scores.shape[1], block_table.shape[1] * PAGE)
    s = scores[:, :L].float()
    t = torch.arange(L, device=s.device)
    live = t[None, :] < seq_lens[:, None].long()
    return torch.where(live, s, torch.full_like(s, float("-inf"))), live, L


def _positions_to_slots(chosen: torch.Tensor, block_table: torch.Tensor, topk: int, L: int):
    """chosen bool [B, L] (at most topk per row) -> host slots ascending by position, -1 pad."""
    B = chosen.shape[0]
    t = torch.arange(L, device=chosen.device).expand(B, L)
    pos = torch.sort(torch.where(chosen, t, L), dim=1).values[:, : min(topk, L)]  # pad = L
    slots = _host_slots(block_table, L)
    host = torch.where(pos < L, slots.gather(1, pos.clamp(max=L - 1)), -1).to(torch.int32)
    if host.shape[1] < topk:
        host = torch.cat([host, host.new_full((B, topk - host.shape[1]), -1)], dim=1)
    return host


def stable_select_ref(
    scores: torch.Tensor,  # [B, W] fp32, W >= the live lengths
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    topk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: (host slots int32 [B, topk], kth fp32 [B]) by a stable descending sort, as
    ``indexer_topk_ref`` selects (kth: the lowest selected score, -inf for an empty row)."""
    s, live, L = _live_scores(scores, block_table, seq_lens)
    K = min(topk, L)
    order = torch.sort(-s, dim=1, stable=True).indices[:, :K]  # best first, ties: earlier t
    n_sel = seq_lens.long().clamp(max=K)
    take = torch.arange(K, device=s.device)[None, :] < n_sel[:, None]
    chosen = torch.zeros_like(live).scatter_(1, order, take)
    kth = s.gather(1, order).gather(1, (n_sel - 1).clamp(min=0)[:, None]).squeeze(1)
    kth = torch.where(n_sel > 0, kth, torch.full_like(kth, float("-inf")))
    return _positions_to_slots(chosen, block_table, topk, L), kth


def threshold_select_ref(
    scores: torch.Tensor,  # [B, W] fp32
    block_table: torch.Tensor,  # [B, P] int32
    seq_lens: torch.Tensor,  # [B] int32
    kth: torch.Tensor,  # [B] fp32: the k-th largest live score (any correct top-k's lowest)
    topk: int,
) -> torch.Tensor:
    """The fix-up: host slots int32 [B, topk] of every live score > kth, then of the earliest live
    scores == kth until min(topk, seq_len) are taken (float compare: -0.0 == +0.0, as the
    stable sort sees them)."""
    s, live, L = _live_scores(scores, block_table, seq_lens)
    k = seq_lens.long().clamp(max=topk)[:, None]  # [B, 1]
    kth = kth.float()[:, None]
    gt = live & (s > kth)
    eq = live & (s == kth)
    need = k - gt.sum(dim=1, keepdim=True)
    chosen = gt | (eq & (torch.cumsum(eq.long(), dim=1) <= need))
    return _positions_to_slots(chosen, block_table, topk, L)


def kth_from_indices_ref(scores: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """kth fp32 [B]: the lowest score at a library's selected positions raw [B, k] (-1 = none),
    -inf for a row with none."""
    v = scores.float().gather(1, raw.long().clamp(min=0))
    v = torch.where(raw >= 0, v, torch.full_like(v, float("inf")))
    m = v.min(dim=1).values
    return torch.where(torch.isinf(m) & (m > 0), torch.full_like(m, float("-inf")), m)


def sort_positions_ref(
    scores: torch.Tensor,  # [B, W] fp32
    block_table: torch.Tensor,  # [B, P] int32
    raw: torch.Tensor,  # [B, topk] int32: a library's selected positions, -1 = none
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a library whose own tie-break is trusted (FlashInfer's ``tie_break=1``, smaller index
    first): its positions in ascending order as host slots (-1 last), and their lowest score."""
    B, K = raw.shape
    big = torch.iinfo(torch.int32).max
    pos = torch.sort(torch.where(raw >= 0, raw, big), dim=1).values
    ok = pos != big
    p = pos.clamp(max=block_table.shape[1] * PAGE - 1).long()
    slots = block_table.gather(1, p // PAGE).long() * PAGE + p % PAGE
    host = torch.where(ok, slots, -1).to(torch.int32)
    return host, kth_from_indices_ref(scores, raw)
