"""The per-step agreement that keeps every rank's collectives in line.

With data-parallel attention the MoE all-gathers the same number of rows from every rank, so all
ranks must run the same kind of step with the same padded size at the same time. Before each
step every rank says what it wants (a prefill chunk bucket, a decode bucket, or nothing); the
step is then: a prefill sub-step of the largest wanted prefill bucket if any rank wants one, and
a decode sub-step of the largest wanted decode bucket if any rank wants one. A rank runs its own
batch in the sub-step of its kind and an empty padded batch (seq_len 0, out_slot -1: every op
ignores it) in the other, so a rank without requests never stalls the others and each rank's
sequence of real batches is the one it would run alone. Decode buckets are the captured ones,
so each decode sub-step replays the same CUDA graph (collectives inside) on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.distributed.process import DistContext, guarded

# torch >= 2.12 renamed all_gather_into_tensor (the old name warns)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class StepPlan:
    prefill_bucket: int  # 0: no prefill sub-step
    decode_bucket: int  # 0: no decode sub-step
    any_unfinished: bool  # some rank still has requests (running or waiting)


def combine(wants: torch.Tensor) -> StepPlan:
    """``wants [world, 3]`` int64 rows (prefill bucket, decode bucket, unfinished) -> the plan."""
    m = wants.max(dim=0).values.tolist()
    return StepPlan(int(m[0]), int(m[1]), bool(m[2]))


def agree(ctx: DistContext, prefill_bucket: int, decode_bucket: int, unfinished: bool) -> StepPlan:
    """Exchange every rank's wants (a gloo all-gather of 3 integers) and combine them."""
    mine = torch.tensor([prefill_bucket, decode_bucket, int(unfinished)], dtype=torch.int64)
    out = torch.empty(ctx.world_size * 3, dtype=torch.int64)
    with guarded(ctx, "the step agreement"):
        _all_gather(out, mine, group=ctx.cpu_group)
    return combine(out.view(ctx.world_size, 3))
