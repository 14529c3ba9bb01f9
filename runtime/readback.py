"""Reading a decode step's results back to the host without waiting for later steps.

A plain ``.tolist()`` of a device tensor copies to pageable memory and synchronises the whole
stream, so it would also wait for a step launched after it (``Engine``'s asynchronous
scheduling). Here each result is copied to pinned memory with ``non_blocking=True`` and an event
is recorded after the copy: the reader waits for that event alone. On a CPU the tensors are the
results themselves and there is nothing to wait for.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from runtime.scheduler import ScheduledBatch

TopLogprobs = list[tuple[int, float]]


def to_host(x: torch.Tensor, timed: bool = False) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``x`` on the host (pinned, filled when the event has passed) and the event after its copy
    (None on a CPU, where ``x`` is returned as it is); ``timed``: an event that can be timed."""
    if not x.is_cuda:
        return x, None
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    done = torch.cuda.Event(enable_timing=timed)
    done.record()
    return host, done


@dataclass
class SampledStep:
    """A decode step whose tokens were sampled on the device and not read yet: the next step
    launched ahead takes ``tokens`` as its input ids; ``host`` receives, per row, the token id,
    its logprob, and with ``n_top`` alternatives their ids and logprobs, then the token's own
    logprob in their distribution (float64: token ids are exact); ``copied`` (CUDA) is recorded
    after that copy, so reading waits for this step alone."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # int64 [n], on the device
    host: torch.Tensor  # float64 [n, 2 (+ 2 n_top + 1)], pinned host memory on CUDA
    n_top: int
    copied: torch.cuda.Event | None  # (CUDA, timed) after the copy to ``host``
    ahead: bool  # launched before the step before it was read
    started: torch.cuda.Event | None  # (CUDA, timed) before the step's first input copy
    # logits processors ran: ``host`` has one more column, per row the stage whose logits went
    # non-finite (``runtime.decode_sampling``; 0: none), read into ``bad_stages``
    checked: bool = False
    bad_stages: list[int] | None = None

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()

    def read(self) -> tuple[list[int], list[float], list[TopLogprobs | None], list[float | None]]:
        """Token ids, logprobs, (per request, its ``top_logprobs`` many, else None) top
        alternatives and the token's logprob in the alternatives' distribution (the raw
        log-softmax; None with no alternatives), once this step's copy has passed: the step's
        one wait."""
        self.wait()
        rows = self.host.tolist()
        toks = [int(row[0]) for row in rows]
        lps = [row[1] for row in rows]
        if self.checked:
            self.bad_stages = [int(row[-1]) for row in rows]
        if not self.n_top:
            return toks, lps, [None] * len(rows), [None] * len(rows)
        n, tops, chosen = self.n_top, [], []
        for row, r in zip(rows, self.batch.requests):
            k = r.params.top_logprobs
            ids, vs = row[2 : 2 + n], row[2 + n : 2 + 2 * n]
            tops.append([(int(i), v) for i, v in zip(ids[:k], vs[:k])] if k else None)
            chosen.append(row[2 + 2 * n] if k else None)
        return toks, lps, tops, chosen


class PoolChecks:
    """The finish-time check that no recall overflowed a GPU pool (a capacity-check bug), without
    a host sync: each count is copied to the host behind an event (``add``) and checked once the
    event has passed (``poll``), or waited for (``drain``: the engine going idle)."""

    def __init__(self) -> None:
        self._pending: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()

    def add(self, count: torch.Tensor) -> None:
        self._pending.append(to_host(count))
        self.poll()  # a CPU count is checked at once

    def poll(self) -> None:
        while self._pending and (self._pending[0][1] is None or self._pending[0][1].query()):
            check_overflow(int(self._pending.popleft()[0]))

    def drain(self) -> None:
        while self._pending:
            count, done = self._pending.popleft()
            if done is not None:
                done.synchronize()
            check_overflow(int(count))

    def clear(self) -> None:
        """Forget pending counts (the pools were reset: they no longer say anything)."""
        self._pending.clear()


def check_overflow(count: int) -> None:
    if count:
        raise RuntimeError(f"GPU pool overflow in {count} recall(s): a capacity-check bug")
