"""Asynchronous scheduling's choice (``EngineConfig.async_scheduling``): which decode batch
``Engine.step`` launches before it reads the tokens of the step in flight, or None to read them
first (docs/design.md, "Asynchronous scheduling")."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.request import Status
from runtime.sampler import LogitsProcessor
from runtime.scheduler import ScheduledBatch, Scheduler


def run_ahead(
    batch: ScheduledBatch,
    async_scheduling: bool,
    logits_processors: Sequence[LogitsProcessor],
    scheduler: Scheduler,
) -> ScheduledBatch | None:
    """The decode batch to launch before the tokens of the step of ``batch`` (in flight) are
    read, or None to read them first. It is the batch ``schedule()`` would give once they are
    read: ``batch``'s requests still running, less those whose token in flight is their last by
    length (they finish when it is read; a request that finished on EOS, a stop string or an
    abort since is gone already), when the scheduler would run exactly those
    (``Scheduler.repeats``: no admission, no prefill). None when a request has a grammar or the
    engine has logits processors (they read the tokens on the host), and with
    ``async_scheduling`` off; the penalties and the other sampling controls count the token in
    flight on the device. A request that finishes on EOS or a stop string while the step after
    it runs leaves a row there that is dropped (``Engine.discarded_rows``)."""
    if not async_scheduling or logits_processors:
        return None
    reqs, leaving = [], []
    for r in batch.requests:
        p = r.params
        if r.status is not Status.RUNNING:
            continue
        if p.grammar is not None:
            return None
        # the token in flight is the (len + 1)-th: its last if that is max_tokens
        (leaving if len(r.output_ids) + 2 > p.max_tokens else reqs).append(r)
    if not reqs or not scheduler.repeats(reqs, leaving):
        return None
    if len(reqs) == len(batch.requests):
        return batch  # unchanged: the same list (its input ids need no gather)
    return ScheduledBatch(True, reqs)
