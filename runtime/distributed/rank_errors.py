"""One rank's start-up error made every rank's, so no rank waits in a collective for a rank that
stopped alone.

A start-up step that can fail on one rank only (a checkpoint file one host lacks, an option only
that rank was given, out of memory on its GPU) raised there alone: the rank ended its process
group and the others, at their next collective, got a ``RankFailure`` that named no cause, or,
before that collective, went on loading for minutes. Around such a step (one with no collective
inside) every rank records its error, or None, and all of them exchange the records (one gloo
all-gather) before the next collective: each rank then raises the first failing rank's error,
as vLLM's and SGLang's workers all stop with the failing worker's error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from runtime.distributed.process import DistContext, RankFailure, guarded

# errors a user fixes (a bad option, a missing file): ValueError on the other ranks too, so the
# CLI reports them alike on every rank (echo_compile/cli.py's USER_ERRORS); others, as
# RankFailure, keep their traceback
_USER = (ValueError, OSError)


def raise_first(ctx: DistContext, error: Exception | None, what: str) -> None:
    """Every rank's ``error`` (None: this rank is fine) gathered; if any rank has one, every rank
    raises the first failing rank's: that rank its own exception as it is, the others a
    ``ValueError`` (a ``ValueError`` or ``OSError`` there) or a ``RankFailure`` (anything
    else) whose message starts with ``rank <r>:`` and holds that rank's message. A collective:
    every rank calls it, whatever it has to say. The exchange itself failing (a peer gone: a
    ``RankFailure``): a rank with an error of its own raises that, the others the failure."""
    mine = None
    if error is not None:
        text = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
        mine = (isinstance(error, _USER), text)
    every: list = [None] * ctx.world_size
    try:
        with guarded(ctx, what):
            dist.all_gather_object(every, mine, group=ctx.cpu_group)
    except RankFailure:
        # NOTE: a peer gone as well: this rank's own error, not the exchange's failure, is what
        # it stops with (as if alone; the failure its context): the RankFailure hid it, and a
        # user's error (exit 2) became a traceback naming only "another rank failed"
        if error is not None:
            raise error  # noqa: B904 (the RankFailure stays its __context__, not its cause)
        raise
    failed = [(r, e) for r, e in enumerate(every) if e is not None]
    if not failed:
        return
    r, (user, text) = failed[0]
    if r == ctx.rank and error is not None:
        raise error
    more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
    # (this rank's own error, if a later rank's, stays as the cause)
    if user:
        raise ValueError(f"rank {r}: {text}{more}") from error
    raise RankFailure(f"rank {r}/{ctx.world_size}: {what} failed: {text}{more}") from error


@contextmanager
def rank_errors(ctx: DistContext | None, what: str) -> Iterator[None]:
    """Around a start-up step with no collective inside: an ``Exception`` it raises on any rank
    is raised on every rank once all of them have run it (``raise_first``). ``ctx`` None or of
    one rank: the step's error passes as it is, with nothing exchanged."""
    if ctx is None or ctx.world_size == 1:
        yield
        return
    error = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 (every rank must reach the exchange below)
        error = e
    raise_first(ctx, error, what)
