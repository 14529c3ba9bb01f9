"""The ranks' agreement on the KV sizes each chose from its own memory (runtime/kv_sizing.py).

Each rank sizes its context and pools from what it sees (its host's memory, its GPU), so ranks
on hosts with other memory limits, other GPUs or another number of ranks per host choose other
sizes; but a multi-rank engine needs one configuration: every rank truncates, caps and refuses
a request by its own ``max_model_len`` (``DistributedEngine.add_request``: a rank that refuses
alone leaves the others in the next collective; with tp, ranks that cap ``max_tokens`` apart
run other steps), the server answers by rank 0's, and ``check_same_options`` refuses ranks
built with other options. As vLLM takes the least KV block count over its workers, every rank
takes the least of each size over the ranks: each size is at most the rank's own, so it fits
every rank's memory (the device and host bytes grow with each size), and the least context is
still within the least host pool (on each rank the context is at most its host pool).
"""

from __future__ import annotations

import torch.distributed as dist

from runtime.distributed.process import DistContext, guarded


def agree_min(ctx: DistContext, own: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Every rank's ``own`` sizes gathered (a gloo all-gather on every rank): name -> (the least
    over the ranks that have the name, the first rank with it). A gather, not an all-reduce with
    MIN, so the result names the rank that limited each size. A rank that could not size has
    stopped every rank before this (``kv_sizing.size_engine``, through ``rank_errors``)."""
    every: list = [None] * ctx.world_size
    with guarded(ctx, "the KV size agreement"):
        dist.all_gather_object(every, own, group=ctx.cpu_group)
    agreed = {}
    for name in own:
        values = [(sizes[name], r) for r, sizes in enumerate(every) if name in sizes]
        agreed[name] = min(values)
    return agreed
