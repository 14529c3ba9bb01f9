"""The one typed object a forward pass needs besides the weights and the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardMeta:
    """Per-step inputs, all device tensors (docs/CONTRACTS.md).

    input_ids [T] int64, positions [T] int64, out_slots [T] int64 (-1 = padding),
    block_table [B, P] int32 host pages, seq_lens [B] int32 (0 = padded row),
    logits_indices [B] int64 (which tokens produce logits), is_decode (T == B, one token each).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    is_decode: bool
