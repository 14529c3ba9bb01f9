"""What the prefetch ops' references (prefetch_ref.py) and their kernels (prefetch_kernels.py)
share: the statistics layout and the in-graph threshold update (a module of its own, so the
kernels do not import the op registrations that import them)."""

from __future__ import annotations

import torch

# ---- pf_stats layout (int64, cumulative) --------------------------------------------------------
PF_CANDIDATES = 0  # score > threshold and not on the GPU (before the cap)
PF_STAGED = 1  # rows copied host -> staging
PF_PROMOTED = 2  # staged rows the exact top-k selected, moved staging -> pool
PF_STEPS = 3  # indexer_topk_prefetch calls (staging epochs; one recall_staged follows each)
PF_LEN = 4
# ---- staging tags -------------------------------------------------------------------------------
# ``stage_host [S]`` int64 holds ``epoch << EPOCH_SHIFT | h`` for a slot staged in step ``epoch``
# (-1: never staged); the staging epoch is the last word of ``stage_ctr`` (int32, from 0). A
# staging call writes its tags with the epoch word + 1 and then stores that; the recall treats a
# miss h as staged only when ``s = host_stage[h]`` is a slot in [0, S) whose tag is the current
# epoch's for h. Earlier steps' entries are never cleared: their tags no longer match.
EPOCH_SHIFT = 32
HOST_MASK = (1 << EPOCH_SHIFT) - 1
EMA_ALPHA = 0.5  # weight of the newest k-th score (ECHO)
# The threshold state ``ema [EMA_ROWS, N_H / 64 + 1]`` fp32, one column per request (ema_keys):
EMA_THR = 0  # the staging threshold the fused indexer reads: level + margin * dev
EMA_LEVEL = 1  # EMA of the exact k-th score (ECHO's threshold)
EMA_DEV = 2  # EMA of |k-th score - level|: how far the k-th score strays from its EMA
EMA_ROWS = 3


def stage_tag(epoch: torch.Tensor | int, h: torch.Tensor) -> torch.Tensor:
    """int64 tags ``epoch << 32 | h`` of host slots ``h`` staged in step ``epoch``."""
    if isinstance(epoch, torch.Tensor):
        epoch = epoch.long()
    return (epoch << EPOCH_SHIFT) | h.long()


def live_staged(stage_host: torch.Tensor, stage_ctr: torch.Tensor) -> torch.Tensor:
    """[S] bool: the staging slots whose tag is the current epoch's (``stage_ctr[-1]``), i.e.
    staged by the last staging call; their host slots are ``stage_host & HOST_MASK``."""
    return (stage_host != -1) & ((stage_host >> EPOCH_SHIFT) == stage_ctr[-1].long())


def staged_source(h: torch.Tensor, host_stage: torch.Tensor, stage_host: torch.Tensor,
                  epoch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The recall's rule for host slots ``h`` (int64, in range): (staged [n] bool, slot [n]
    int64). h is staged iff ``s = host_stage[h]`` is in [0, S) and ``stage_host[s]`` is h's tag
    of the current ``epoch``: a stale entry (its slot since restaged for another row, or its
    host row rewritten since it was staged) fails the tag, so its bytes come from the host."""
    s = host_stage[h].long()
    ok = (s >= 0) & (s < stage_host.shape[0])
    tag = stage_host[s.clamp(0, stage_host.shape[0] - 1)]
    return ok & (tag == stage_tag(epoch, h)), s


def ema_keys(block_table: torch.Tensor, seq_lens: torch.Tensor, n_ema: int) -> torch.Tensor:
    """[B] int64: the column of each row's threshold state in ``ema [EMA_ROWS, n_ema]``
    (n_ema = N_H / 64 + 1). A request is keyed by its first host page, not by its batch row:
    rows shift whenever a request finishes, pages stay with their request. Padded rows
    (seq_len 0) go to the last column, a dump."""
    return torch.where(seq_lens > 0, block_table[:, 0].long(), n_ema - 1)


def threshold(level: torch.Tensor, dev: torch.Tensor, margin: float) -> torch.Tensor:
    """The staging threshold from the state: level + margin * dev (the level alone at margin 0,
    so a level of +-inf with an infinite dev is not 0 * inf = NaN)."""
    return level + margin * dev if margin else level


def update_ema(ema: torch.Tensor, kth: torch.Tensor, seq_lens: torch.Tensor,
               block_table: torch.Tensor, margin: float) -> None:  # fmt: skip
    """For live requests, in place, no host sync (the in-graph threshold update):
        dev   <- 0.5 |kth - level| + 0.5 dev
        level <- 0.5 kth + 0.5 level
        thr   <- level + margin * dev
    except on a request's first update (its state all 0, as a new or released request's is):
    level <- kth, dev <- 0 (so the deviation does not start at half the k-th score). The first
    step's threshold is 0, ECHO's start. margin = 0 is ECHO's threshold (the EMA of the k-th
    score); a margin above it stages only scores that clear how far the k-th score usually strays
    from its EMA: fewer rows the exact top-k then passes over (docs/prefetch.md, "The
    threshold"). A key that several live rows share (the members of an n > 1 group share their
    prompt's first page) is updated by the first of them, so the result does not depend on the
    order of the writes."""
    n_ema = ema.shape[1]
    key = ema_keys(block_table, seq_lens, n_ema)
    r = torch.arange(key.shape[0], device=key.device)
    live = seq_lens > 0
    earlier = ((key[None, :] == key[:, None]) & live[None, :] & (r[None, :] < r[:, None])).any(1)
    writer = live & ~earlier  # unique keys
    level, dev = ema[EMA_LEVEL, key], ema[EMA_DEV, key]
    fresh = (level == 0) & (dev == 0)  # the first update of this request
    new_dev = torch.where(fresh, 0.0, EMA_ALPHA * (kth - level).abs() + (1.0 - EMA_ALPHA) * dev)
    new_level = torch.where(fresh, kth, EMA_ALPHA * kth + (1.0 - EMA_ALPHA) * level)
    new = torch.stack([threshold(new_level, new_dev, margin), new_level, new_dev])  # [ROWS, B]
    # every other row writes the dump's own values to the dump: the same, whatever the order
    ema.index_copy_(1, torch.where(writer, key, n_ema - 1),
                    torch.where(writer, new, ema[:, n_ema - 1 :].expand_as(new)))  # fmt: skip
