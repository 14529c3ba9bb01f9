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


def ema_keys(block_table: torch.Tensor, seq_lens: torch.Tensor, n_ema: int) -> torch.Tensor:
    """[B] int64: where each row's threshold lives in ``ema [N_H / 64 + 1]``. A request is keyed
    by its first host page, not by its batch row: rows shift whenever a request finishes, pages
    stay with their request. Padded rows (seq_len 0) go to the last entry, a dump."""
    return torch.where(seq_lens > 0, block_table[:, 0].long(), n_ema - 1)


def update_ema(ema: torch.Tensor, kth: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor) -> None:  # fmt: skip
    """ema[key] <- 0.5 ema[key] + 0.5 kth for live requests (in place, no host sync). A key that
    several live rows share (the members of an n > 1 group share their prompt's first page) is
    updated by the first of them, so the result does not depend on the order of the writes."""
    n_ema = ema.shape[0]
    key = ema_keys(block_table, seq_lens, n_ema)
    r = torch.arange(key.shape[0], device=key.device)
    live = seq_lens > 0
    earlier = ((key[None, :] == key[:, None]) & live[None, :] & (r[None, :] < r[:, None])).any(1)
    writer = live & ~earlier  # unique keys
    new = EMA_ALPHA * kth + (1.0 - EMA_ALPHA) * ema[key]
    # every other row writes the dump's own value to the dump: the same value, whatever the order
    ema.index_copy_(0, torch.where(writer, key, n_ema - 1),
                    torch.where(writer, new, ema[n_ema - 1].expand_as(new)))  # fmt: skip
