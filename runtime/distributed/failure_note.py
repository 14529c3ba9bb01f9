"""A rank's own error left where the other ranks read it after the process group is gone.

A rank whose step raises destroys the process group (``DistributedEngine.step``), so that the
other ranks fail at their next collective at once instead of at the timeout; but a collective
that fails says only that a peer went away, so their ``RankFailure`` named no cause: with rank 0
serving HTTP, a step that raised on rank 3 left the server's log, its error line and its failed
requests saying "another rank failed". Before it ends the group the failing rank writes a note,
``rank <r>: <ExceptionType>: <message>``, to the job's key-value store (the TCPStore the group
was set up through: no collective, and it outlives the group); a rank whose collective fails
(``process.guarded``) reads it, waiting ``READ_WAIT_S`` at most, and names that error, as vLLM's
and SGLang's workers all stop with the failing worker's error. No note (a rank killed, or one
that hung): the failure reads as before. The first note of a job stays (``compare_set``): the
ranks that fail after it fail because of it. A job's first rank clears the key as it creates
the group (``clear_note``): a store can outlive a job (torchrun's agent store, or a store the
process still holds, re-joined on the same port), and a new job read the last one's note.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Protocol

import torch.distributed as dist


class RankContext(Protocol):
    """What these functions read of a ``process.DistContext`` (that module imports this one)."""

    rank: int
    world_size: int
    store: Any


logger = logging.getLogger(__name__)

KEY = "echo_compile/rank_failure"
# the failing rank writes before it ends the group, so a peer whose collective failed for that
# reason finds the note at once; the wait covers a peer that gave up first (its timeout)
READ_WAIT_S = 1.0
_MAX_CHARS = 500  # one line of a log or an HTTP error, not a traceback


def job_store() -> Any | None:
    """The default process group's store (None without one), kept in ``DistContext.store``: a
    reference of our own keeps it (and, on the rank that hosts it, its server) alive past
    ``destroy_process_group``."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def clear_note(store: Any | None) -> None:
    """Remove an earlier job's note from ``store`` (called by rank 0 as it creates the group,
    before any collective, so before any rank of this job can leave one): the key outlives a
    job where the store does, and that job's error was named as this one's."""
    if store is None:
        return
    try:
        store.delete_key(KEY)
    except Exception:  # noqa: BLE001 (no note, or a store without deletes: nothing to clear)
        logger.debug("no earlier failure note cleared", exc_info=True)


def leave_note(ctx: RankContext, error: BaseException, where: str) -> None:
    """Record this rank's ``error`` (raised in ``where``, e.g. "its step") for the other ranks,
    before this rank ends the group. Never raises: the rank goes on to raise ``error`` itself."""
    if ctx.store is None or ctx.world_size == 1:
        return
    lines = str(error).strip().splitlines()
    text = f"rank {ctx.rank}: {type(error).__name__}: {lines[0] if lines else ''}".rstrip()
    try:
        ctx.store.compare_set(KEY, "", f"{where}\n{text[:_MAX_CHARS]}")
    except Exception:  # noqa: BLE001 (the store gone too: the others get today's message)
        logger.warning("rank %d: could not leave its error for the other ranks", ctx.rank)


def read_note(ctx: RankContext, wait_s: float = READ_WAIT_S) -> tuple[str, str] | None:
    """Another rank's note, ``(where, "rank <r>: <type>: <message>")``, or None when there is none
    after ``wait_s`` (or the store cannot be reached: its host gone) or the note is this rank's."""
    if ctx.store is None or ctx.world_size == 1:
        return None
    try:
        ctx.store.wait([KEY], datetime.timedelta(seconds=wait_s))
        where, text = ctx.store.get(KEY).decode(errors="replace").split("\n", 1)
    except Exception:  # noqa: BLE001 (no note in time, or no store: nothing to name)
        return None
    if text.startswith(f"rank {ctx.rank}:"):
        return None
    return where, text
