"""DeepSeek-V3.2 feed-forward blocks (docs/model_notes.md): the dense ``MLP`` (layers below
``first_k_dense_replace`` and the shared experts), the router ``Gate`` and the ``MoE`` with its
routed experts stacked in one module (``Experts``: ``w13_weight [E, 2I, D]``, ``w2_weight
[E, D, I]``, docs/CONTRACTS.md).

Numerics follow the reference: projections in bf16, ``silu(gate) * up`` in fp32 rounded to bf16 as
the down projection's input, the router in fp32, the weighted sum of the experts in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import custom_ops  # noqa: F401  (registers torch.ops.echo.moe_bf16)
from model.config import ModelConfig

DTYPE = torch.bfloat16


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the dense FFN and the shared experts."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter_dim, bias=False, dtype=DTYPE)
        self.up_proj = nn.Linear(dim, inter_dim, bias=False, dtype=DTYPE)
        self.down_proj = nn.Linear(inter_dim, dim, bias=False, dtype=DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate_proj(x).float()) * self.up_proj(x).float()  # [T, I] fp32
        return self.down_proj(h.to(x.dtype))  # [T, D]


class Gate(nn.Module):
    """The ``noaux_tc`` router: sigmoid scores; the correction bias steers the *selection* only
    (group score = sum of the group's top-2 biased scores, keep ``topk_group`` groups, then the
    top-k experts of those); the weights are the *unbiased* scores of the chosen experts,
    normalised to sum 1 (``norm_topk_prob``) and multiplied by ``routed_scaling_factor``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.topk = config.num_experts_per_tok
        self.n_groups = config.n_group
        self.topk_groups = config.topk_group
        self.route_scale = config.routed_scaling_factor
        self.norm_topk_prob = config.norm_topk_prob
        e, d = config.n_routed_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(e, d, dtype=DTYPE))
        # fp32 like the reference and vLLM; config validation guarantees topk_method == noaux_tc,
        # the condition under which the bias exists (docs/model_notes.md, MoE gate).
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, D]`` -> (weights fp32 ``[T, k]``, expert ids int64 ``[T, k]``)."""
        t = x.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E] fp32
        original = scores
        scores = scores + self.e_score_correction_bias  # [T, E] biased: selection only
        if self.n_groups > 1:
            grouped = scores.view(t, self.n_groups, -1)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
            keep = group_scores.topk(self.topk_groups, dim=-1).indices  # [T, topk_group]
            drop = torch.ones(t, self.n_groups, dtype=torch.bool, device=x.device)
            drop = drop.scatter(1, keep, False)  # [T, G] True = group not kept
            scores = grouped.masked_fill(drop.unsqueeze(-1), float("-inf")).flatten(1)  # [T, E]
        indices = scores.topk(self.topk, dim=-1).indices  # [T, k]
        weights = original.gather(1, indices)  # [T, k] unbiased sigmoid scores
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, indices


class Experts(nn.Module):
    """The routed experts, stacked: ``w13_weight [E, 2I, D]`` (rows ``0..I-1`` = gate_proj,
    ``I..2I-1`` = up_proj) and ``w2_weight [E, D, I]`` (down_proj).

    ``forward(x [T, D], topk_ids [T, k], topk_weights [T, k] fp32) -> fp32 [T, D]``, the interface
    ``model/awq.py``'s quantised experts keep (the caller accepts either fp32 or x's dtype back).
    An id equal to ``n_experts`` is a pick to skip (expert parallelism: another rank's expert):
    every MoE op and its grouping (``custom_ops.moe_align``) leave it out, contributing 0.

    The forward is one call of the grouped ``echo::moe_bf16``: each token runs through its k
    experts only (on CUDA a Triton kernel that groups the (token, expert) pairs by expert on the
    device: fixed shapes, no host syncs, so the decode step stays one CUDA graph), with the
    numerics of the 16-bit ``MLP`` (projections rounded to bf16, ``silu(g) * u`` in fp32, fp32
    weighted sum). ``forward_all_experts`` is the former form, kept as the test's reference and
    the fallback for dimensions the kernel does not tile (not multiples of 128).
    """

    def __init__(self, n_experts: int, dim: int, inter_dim: int):
        super().__init__()
        self.n_experts, self.dim, self.inter_dim = n_experts, dim, inter_dim
        self.w13_weight = nn.Parameter(torch.empty(n_experts, 2 * inter_dim, dim, dtype=DTYPE))
        self.w2_weight = nn.Parameter(torch.empty(n_experts, dim, inter_dim, dtype=DTYPE))
        # NOTE: the Triton kernel walks K in tiles of up to 128 without a K mask.
        self.grouped = dim % 128 == 0 and inter_dim % 128 == 0

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if not self.grouped:
            return self.forward_all_experts(x, topk_ids, topk_weights)
        return torch.ops.echo.moe_bf16(x, topk_ids, topk_weights, self.w13_weight, self.w2_weight)

    def forward_all_experts(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Every expert on every token (batched matmuls over E), then each token gathers its k
        experts' outputs: E/k times the routed FLOPs. Gathering (rather than multiplying unrouted
        outputs by a zero weight) keeps the result exact even if an unrouted expert gave inf."""
        t, d = x.shape
        inter = self.inter_dim
        gu = torch.matmul(x.unsqueeze(0), self.w13_weight.transpose(1, 2))  # [E, T, 2I]
        h = F.silu(gu[..., :inter].float()) * gu[..., inter:].float()  # [E, T, I] fp32
        y = torch.matmul(h.to(x.dtype), self.w2_weight.transpose(1, 2))  # [E, T, D]
        kept = (topk_ids < self.n_experts).unsqueeze(-1)  # [T, k, 1] id E: a pick to skip (EP)
        ids = topk_ids.long().clamp(max=self.n_experts - 1)
        idx = ids.unsqueeze(-1).expand(t, topk_ids.shape[1], d)  # [T, k, D]
        y_sel = y.transpose(0, 1).gather(1, idx)  # [T, k, D] outputs of each token's experts
        y_sel = torch.where(kept, y_sel.float() * topk_weights.float().unsqueeze(-1), 0.0)
        return y_sel.sum(dim=1)  # [T, D] fp32


class MoE(nn.Module):
    """``y = Σ_k w_k · Expert_{idx_k}(x) + SharedExperts(x)`` (shared unscaled), summed in fp32."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, inter = config.hidden_size, config.moe_intermediate_size
        self.gate = Gate(config)
        self.experts = Experts(config.n_routed_experts, d, inter)
        self.shared_experts = (
            MLP(d, config.n_shared_experts * inter) if config.n_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x)  # [T, k] fp32, [T, k]
        y = self.experts(x, indices, weights).float()  # [T, D]
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return y.to(x.dtype)
