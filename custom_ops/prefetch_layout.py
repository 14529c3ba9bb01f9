"""What the prefetch ops' references (prefetch.py) and their kernels (prefetch_kernels.py) share:
the statistics layout and the in-graph threshold update (a module of its own, so the kernels do
not import the op registrations that import them)."""

from __future__ import annotations

import torch

# ---- pf_stats layout (int64, cumulative) --------------------------------------------------------
PF_CANDIDATES = 0  # score > threshold and not on the GPU (before the cap)
PF_STAGED = 1  # rows copied host -> staging
PF_PROMOTED = 2  # staged rows the exact top-k selected, moved staging -> pool
PF_STEPS = 3  # recall_staged calls
PF_LEN = 4
EMA_ALPHA = 0.5  # weight of the newest k-th score (ECHO)


def update_ema(ema: torch.Tensor, kth: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """ema[:B] <- 0.5 ema + 0.5 kth where the request is live (in place, no host sync)."""
    B = kth.shape[0]
    e = ema[:B]
    new = EMA_ALPHA * kth + (1.0 - EMA_ALPHA) * e
    e.copy_(torch.where(seq_lens > 0, new, e))
