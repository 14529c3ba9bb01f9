"""The HTTP server's engine front end with dp/tp/ep > 1: rank 0 drives, the other ranks follow.

Process model (``echo-compile serve --dp N --tp N`` under torchrun): every rank loads its shard
and builds its ``DistributedEngine``; rank 0's process then runs the server (HTTP, tokenization,
the ``AsyncEngine`` loop) over a ``DriverEngine``, and every other rank runs ``follow``. Each call
the ``AsyncEngine`` loop makes (add, abort, step, the unfinished check) is first broadcast to the
followers as a command (gloo, a small pickled tuple), then made on rank 0; a follower makes the
same call on its own ``DistributedEngine``, so every rank reaches the same collectives in the same
order (the SPMD contract of ``dist_engine``). Requests are balanced over the DP ranks by
``DistributedEngine.add_request`` (``balance.assign``) and every rank's outputs are gathered at
each step, so rank 0 streams every request's tokens back. ``metrics`` (a scrape) is one more
command: every rank's snapshot gathered and combined; ``reset_stats`` another, every rank's own.

Why rank 0 and not a separate front process: SGLang puts its HTTP server and tokenizer in a front
process and talks to one scheduler process per rank over ZMQ (its DP controller balances); vLLM's
DP front end is an API process talking to engine-core processes over ZMQ, while its TP workers
(and its torchrun "external launcher" mode) follow a driver in rank 0 by broadcast. Our engine is
already SPMD over one gloo control group (rank 0's arguments are broadcast), so a rank-0 driver
needs no second transport, no serialisation layer and no extra process; what it costs is that
rank 0's HTTP and detokenisation work shares its process (and GIL) with its step loop, which the
other ranks then wait for at the next collective. A separate front process is the better shape
once that cost is measured to matter (issue 21).

Idle servers: a follower waits for the next command inside a collective that times out after
``collective_timeout_s``; the driver sends a ``ping`` when it has been silent for a quarter of
that, so an idle server never times out its followers, while a dead rank 0 still stops them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from runtime.distributed.dist_engine import DistributedEngine
from runtime.distributed.process import RankFailure, guarded, shutdown
from runtime.engine import EngineClosed, StepOutput
from runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# command -> the DistributedEngine method both sides call
_METHODS = {
    "add": "add_request",
    "abort": "abort_request",
    "step": "step",
    "unfinished": "has_unfinished",
    "metrics": "metrics",
    "reset_stats": "reset_stats",
}


# The Engine attributes a driver reads from rank 0's engine, all alike on every rank (the
# config is rank 0's, broadcast): what AsyncEngine, the server and its start-up line read.
# Anything else of an Engine changes or reads one rank's state (add_request_group: n > 1 then
# prefills per choice; prompt_kv, logits_processors, requests, the cache, the step counters,
# check_pools): on rank 0 alone it would be silently wrong, so it is an AttributeError; what
# every rank must do is a command (_METHODS) with a method of its own here.
_READ_FROM_RANK0 = frozenset(
    {"tokenizer", "model_name", "max_model_len", "sampling_defaults", "eos_token_ids", "config",
     "model_config"}
)  # fmt: skip


def _broadcast(engine: DistributedEngine, obj: Any, what: str) -> Any:
    box = [obj]
    with guarded(engine.ctx, what):
        dist.broadcast_object_list(box, src=0, group=engine.ctx.cpu_group)
    return box[0]


class DriverEngine:
    """Rank 0's engine for ``AsyncEngine``: ``Engine``'s interface, each call mirrored on every
    rank. Only the ``AsyncEngine`` loop thread calls it (and the heartbeat, under the lock)."""

    def __init__(
        self,
        engine: DistributedEngine,
        heartbeat_s: float | None = None,
        on_failure: Callable[[], None] | None = None,
    ):
        if engine.ctx.rank != 0:
            raise ValueError(f"the driver runs on rank 0, not rank {engine.ctx.rank}")
        self.inner = engine
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else engine.ctx.timeout_s / 4
        if not self.heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        self.pings = 0  # heartbeats sent (the tests read it)
        # the error that ended the multi-rank engine (a rank gone, a failed step), or None;
        # on_failure is called once then (serve: stop the HTTP server, which stays up otherwise)
        self.failure: str | None = None
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="echo-driver-ping", daemon=True)
        self._beat.start()

    def __getattr__(self, name: str) -> Any:
        # (called only for names the class does not define: its methods mirror every rank)
        if name not in _READ_FROM_RANK0:
            raise AttributeError(
                f"DriverEngine has no attribute {name!r}: a multi-rank engine reads only "
                f"{', '.join(sorted(_READ_FROM_RANK0))} from rank 0's engine (alike on every "
                "rank), and makes every other call on every rank or not at all"
            )
        return getattr(self.inner.engine, name)

    def _send(self, kind: str, args: tuple) -> None:
        _broadcast(self.inner, (kind, args), f"the {kind!r} command to the other ranks")
        self._last = time.monotonic()

    def _call(self, kind: str, *args: Any) -> Any:
        with self._lock:
            if self._closed.is_set():
                raise EngineClosed(self.failure or "the multi-rank engine is closed")
            try:
                self._send(kind, args)
                return getattr(self.inner, _METHODS[kind])(*args)
            except Exception as e:
                # A failed step has destroyed the process group and a RankFailure means a rank is
                # gone: the engine cannot go on. A refused add (ValueError) is the request's own.
                if kind == "step" or isinstance(e, RankFailure):
                    self._fail(e)
                raise

    def _fail(self, e: BaseException) -> None:
        """The engine is over (called under the lock): refuse every later call with ``e``'s
        reason and tell the owner once. Without this the server stayed up with /health ok,
        answering each request with the dead group's error (a 400 'Group ... is not
        registered' after a rank died mid-step) and never exited."""
        if self.failure is not None:
            return
        self.failure = f"the multi-rank engine stopped: {type(e).__name__}: {e}"
        self._closed.set()
        shutdown()  # the other followers' next collective fails now, not at the timeout
        if self._on_failure is not None:
            self._on_failure()

    # ---- Engine's interface --------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt_kv=None
    ) -> None:
        if prompt_kv is not None:  # refused here, before any rank is told about the request
            raise ValueError("prompt_kv is not supported with dp/tp > 1 yet")
        self._call("add", request_id, list(prompt_token_ids), params)

    def abort_request(self, request_id: str) -> None:
        self._call("abort", request_id)

    def step(self) -> list[StepOutput]:
        return self._call("step")

    def has_unfinished(self) -> bool:
        return self._call("unfinished")

    def metrics(self) -> dict[str, Any]:
        """Every rank's metrics combined (``DistributedEngine.metrics``): with dp > 1 a command
        that gathers the ranks' snapshots (only when asked: a scrape, never each step); with
        dp == 1 rank 0's own, which every rank shares, and nothing sent. Closed or failed:
        ``EngineClosed``, whatever dp (a scrape then answers 503)."""
        if self._closed.is_set():
            raise EngineClosed(self.failure or "the multi-rank engine is closed")
        if self.inner.dp == 1:
            return self.inner.metrics()
        return self._call("metrics")

    def reset_stats(self) -> None:
        """``Engine.reset_stats`` on every rank: a command, since ``metrics`` sums every rank's
        counters (handed to rank 0's engine alone, the others' kept counting from the start)."""
        self._call("reset_stats")

    def recover(self) -> None:
        # NOTE: a failed DistributedEngine step has destroyed the process group: nothing to reset
        # that would let the ranks go on together; the next call fails with RankFailure.
        raise RuntimeError("a multi-rank engine cannot recover from a failed step")

    def close(self, failed: bool = False) -> None:
        """Tell the followers to stop: they return from ``follow``, or with ``failed`` (rank 0
        stops on an error, without the clean end's barrier) raise ``RankFailure``; idempotent."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            try:
                self._send("stop", (failed,))
            except Exception:  # a rank already gone: nothing left to tell
                logger.exception("could not tell the other ranks to stop")
        # the ping thread ends at its next wake (a quarter heartbeat): joined, it no longer holds
        # the engine, and so the process group, into the interpreter's exit (see process.finish)
        if threading.current_thread() is not self._beat:
            self._beat.join()

    def _heartbeat(self) -> None:
        while not self._closed.wait(self.heartbeat_s / 4):
            with self._lock:
                if self._closed.is_set() or time.monotonic() - self._last < self.heartbeat_s:
                    continue
                try:
                    self._send("ping", ())
                    self.pings += 1
                except Exception as e:
                    logger.exception("heartbeat to the other ranks failed; the service stops")
                    self._fail(e)


def follow(engine: DistributedEngine) -> int:
    """Ranks 1..: make rank 0's calls on this rank's engine until it says stop; returns how many
    commands were applied. A request refused on its rank is refused on every rank (the driver
    answers it with an HTTP error), so a ``ValueError`` of ``add_request`` (or of ``metrics``, a
    scrape's) does not stop us."""
    if engine.ctx.rank == 0:
        raise ValueError("rank 0 drives (DriverEngine); follow() is for the other ranks")
    applied = 0
    while True:
        kind, args = _broadcast(engine, None, "waiting for rank 0's next command")
        if kind == "stop":
            if args and args[0]:
                raise RankFailure(
                    f"rank {engine.ctx.rank}/{engine.ctx.world_size}: rank 0 stopped on an error "
                    "(its log says which); stopping"
                )
            return applied
        if kind == "ping":
            continue
        try:
            getattr(engine, _METHODS[kind])(*args)
        except ValueError:
            if kind not in ("add", "metrics"):  # (metrics: rank 0 logs it, the scrape goes on)
                raise
        applied += 1
