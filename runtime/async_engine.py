"""AsyncEngine: the engine loop on a background thread, fed and drained from asyncio.

The ``Engine`` is not thread-safe, so only the loop thread ever calls it. Requests, aborts and
metric reads from the asyncio side are queued as commands and applied between two steps; each
request's outputs go back through ``loop.call_soon_threadsafe`` into its own ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.engine import EngineClosed, StepOutput
from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.engine import Engine
    from runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Sink:
    """Where one request's outputs go: a queue owned by an asyncio loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StepOutput]
    prompt_tokens: int
    completion_tokens: int = 0

    def push(self, out: StepOutput) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
            return True
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            return False


@dataclass
class _Command:
    kind: str  # "add" | "add_group" | "abort" | "metrics"
    request_id: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    params: SamplingParams | None = None
    sink: _Sink | None = None
    future: concurrent.futures.Future[Any] | None = None
    # add_group: (request id, params, sink) of each sequence sharing the prompt's prefill
    group: list[tuple[str, SamplingParams, _Sink]] = field(default_factory=list)
    # abort from a stream: only the request whose outputs go to this queue
    queue: asyncio.Queue[StepOutput] | None = None


def _check_request(request_id: object, params: object) -> None:
    """A malformed request is the caller's error, raised to it before anything is queued."""
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"params must be a SamplingParams (or None: the engine's defaults), got "
            f"{type(params).__name__}"
        )


class RequestStream:
    """The outputs of one request, as an async iterator of ``StepOutput``.

    Iteration ends after the output with ``finished=True``. Closing the stream before that
    (``aclose``, leaving ``async with``, cancelling a pending ``__anext__`` as a client disconnect
    does, or dropping the stream) aborts the request, which frees its slots.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue[StepOutput]):
        self.request_id = request_id
        self._engine = engine
        self._queue = queue
        self.finished = False

    def _abort(self) -> None:
        # Bound to this stream's queue: once its request has ended (an abort whose final output
        # nobody read), the id may carry a new request, which this must not touch.
        self._engine._submit(_Command("abort", self.request_id, queue=self._queue), check=False)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except asyncio.CancelledError:  # the consumer went away (e.g. the client disconnected)
            await self.aclose()
            raise
        if out.finished:
            self.finished = True
        return out

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        if not self.finished:
            self.finished = True
            self._abort()

    def __del__(self) -> None:
        # A stream dropped unread must not keep generating until max_tokens.
        if not self.finished:
            self._abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncEngine:
    """Runs ``engine.step()`` on a background thread while there is work; asyncio-friendly API.

    A crash in ``step()`` fails every request in the engine with ``finish_reason="error"`` (the
    step ran them all; their state is suspect), aborts them in the engine, and keeps serving.
    """

    # Seconds of history behind ``tokens_per_s``: long enough to smooth steps, short enough that an
    # idle server reads 0 soon after its last token.
    RATE_WINDOW_S = 10.0

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.model_name: str = engine.model_name
        # what a request's unset sampling fields take (Engine.sampling_defaults)
        self.sampling_defaults: SamplingParams = getattr(
            engine, "sampling_defaults", SamplingParams()
        )
        # the ids that end a request as its EOS (Engine.eos_token_ids; fakes: the tokenizer's)
        self.eos_token_ids: frozenset[int] = getattr(
            engine, "eos_token_ids", frozenset({self.tokenizer.eos_token_id})
        )
        # the tokenizer's EOS, of those the one vLLM reports no stop_reason for (the others are
        # stop token ids there: RequestOutput.stop_reason)
        self.eos_token_id: int | None = self.tokenizer.eos_token_id
        self.max_model_len: int = engine.max_model_len
        self.generation_tokens_total = 0  # tokens handed to callers (a Prometheus counter)
        self._cond = threading.Condition()
        self._commands: list[_Command] = []
        self._stopping = False
        self._draining = False  # drain() began: new requests are refused
        self._rate_lock = threading.Lock()
        self._token_log: deque[tuple[float, int]] = deque()  # (monotonic time, tokens) per step
        self._started = time.monotonic()
        self._sinks: dict[str, _Sink] = {}  # loop thread only
        self._thread = threading.Thread(target=self._run, name="echo-engine-loop", daemon=True)
        self._thread.start()

    # ---- asyncio side --------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> RequestStream:
        """Add a request and return its output stream (``params`` None: ``sampling_defaults``).

        The request is in the engine when this returns: a ``ValueError`` from
        ``Engine.add_request`` (prompt too long, empty, duplicate id, ...) is raised here, before
        any output, so a server can still answer with an HTTP error; a request id that is not a
        str, or params that are not a ``SamplingParams``, is a ``TypeError``.
        """
        if self._draining:
            raise RuntimeError("the server is shutting down: no new requests are admitted")
        params = self.sampling_defaults if params is None else params
        _check_request(request_id, params)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        sink = _Sink(loop, queue, prompt_tokens=len(prompt_ids))
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Command("add", request_id, list(prompt_ids), params, sink, future))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The add may still be applied after we stop waiting: make sure it does not run.
            self._submit(_Command("abort", request_id, queue=queue), check=False)
            raise
        return RequestStream(self, request_id, queue)

    @property
    def caches_prefixes(self) -> bool:
        """The engine keeps a prefix cache (usage reports ``cached_tokens``)."""
        config = getattr(self.engine, "config", None)
        return bool(getattr(config, "enable_prefix_caching", False))

    @property
    def shares_prefill(self) -> bool:
        """The engine can run n sequences of one prompt on one prefill (``generate_group``)."""
        return hasattr(self.engine, "add_request_group")

    async def generate_group(
        self,
        request_ids: Sequence[str],
        prompt_ids: Sequence[int],
        params: Sequence[SamplingParams],
    ) -> list[RequestStream]:
        """``generate`` for n sequences of one prompt that share its prefill
        (``Engine.add_request_group``): all are added, or none (the ``ValueError`` is raised
        here); each has its own stream, and closing one aborts only that sequence."""
        if self._draining:
            raise RuntimeError("the server is shutting down: no new requests are admitted")
        for rid, p in zip(request_ids, params, strict=True):
            _check_request(rid, p)
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue[StepOutput]] = [asyncio.Queue() for _ in request_ids]
        group = [
            (rid, p, _Sink(loop, q, prompt_tokens=len(prompt_ids)))
            for rid, p, q in zip(request_ids, params, queues, strict=True)
        ]
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        cmd = _Command("add_group", prompt_ids=list(prompt_ids), future=future, group=group)
        self._submit(cmd)
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            for rid, q in zip(request_ids, queues):
                self._submit(_Command("abort", rid, queue=q), check=False)
            raise
        return [RequestStream(self, rid, q) for rid, q in zip(request_ids, queues)]

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored). Its stream, if still
        read, ends with ``finish_reason="abort"``."""
        self._submit(_Command("abort", request_id), check=False)

    async def metrics(self) -> dict[str, float | list[float]]:
        """``engine.metrics()``, read on the loop thread between two steps."""
        future: concurrent.futures.Future[dict[str, float | list[float]]] = (
            concurrent.futures.Future()
        )
        self._submit(_Command("metrics", future=future))
        return await asyncio.wrap_future(future)

    @property
    def is_alive(self) -> bool:
        """The loop thread is running and accepting requests."""
        return self._thread.is_alive() and not self._stopping and not self._draining

    @property
    def num_in_flight(self) -> int:
        """Requests added and not yet finished (read from any thread: a dict's len is atomic)."""
        return len(self._sinks)

    def tokens_per_s(self, now: float | None = None) -> float:
        """Tokens generated per second over the last ``RATE_WINDOW_S`` seconds (fewer just after
        start-up); it falls to 0 once the server has been idle for the window."""
        now = time.monotonic() if now is None else now
        window = min(self.RATE_WINDOW_S, now - self._started)
        with self._rate_lock:
            n = sum(k for t, k in self._token_log if t > now - self.RATE_WINDOW_S)
        return n / window if window > 0 else 0.0

    def drain(self, grace_s: float, poll_s: float = 0.05) -> int:
        """Graceful shutdown (blocking: call it off the event loop): refuse new requests at once,
        let in-flight ones run for up to ``grace_s`` seconds, then abort the rest (their streams
        end with ``finish_reason="abort"``, which frees their slots) and stop the loop thread.
        Returns how many requests were aborted."""
        self._draining = True
        deadline = time.monotonic() + grace_s
        while self._sinks and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(poll_s)
        aborted = len(self._sinks)
        if aborted:
            logger.warning("grace period over: aborting %d in-flight request(s)", aborted)
        self.shutdown()  # the loop thread ends every open stream with "abort"
        return aborted

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop thread; unfinished requests end with ``finish_reason="abort"``."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def _submit(self, command: _Command, check: bool = True) -> None:
        with self._cond:
            if self._stopping:
                if check:
                    raise EngineClosed("the engine is shut down")
                return
            self._commands.append(command)
            self._cond.notify()

    # ---- loop thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        commands: list[_Command] = []
        while True:
            with self._cond:
                while not (self._commands or self._stopping or self._has_work()):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                if self._stopping:
                    break
            try:
                for command in commands:
                    self._apply_one(command)
                if self._has_work():
                    self._step()
            except Exception:  # a bug here must not leave callers waiting forever
                logger.exception("engine loop error")
                self._fail_all("error", "engine loop error")
        self._close(commands)

    def _has_work(self) -> bool:
        # Requests without a listener cannot exist (an abort removes both), so live sinks are the
        # work; the engine is asked too, so a request it dropped without output fails, not hangs.
        if not self._sinks:
            return False
        if self._guard(self.engine.has_unfinished, False):
            return True
        self._fail_all("error", "the engine dropped the request")
        return False

    def _apply_one(self, c: _Command) -> None:
        """One command; an error in it goes to its caller (its future), or is logged: it never
        reaches the requests in flight nor the commands queued after it."""
        try:
            self._apply(c)
        except Exception as e:
            if c.future is not None and not c.future.done():
                c.future.set_exception(e)
            else:
                logger.exception("engine loop: command %r failed", c.kind)

    def _apply(self, c: _Command) -> None:
        if c.kind == "add":
            assert c.future is not None and c.sink is not None and c.params is not None
            if c.request_id in self._sinks:
                c.future.set_exception(ValueError(f"request id {c.request_id!r} is already in use"))
                return
            try:
                self.engine.add_request(c.request_id, c.prompt_ids, c.params)
            except Exception as e:  # ValueError: the user's fault; anything else is ours
                c.future.set_exception(e)
                return
            self._sinks[c.request_id] = c.sink
            c.future.set_result(None)
        elif c.kind == "add_group":
            assert c.future is not None
            ids = [rid for rid, _, _ in c.group]
            if used := [rid for rid in ids if rid in self._sinks]:
                c.future.set_exception(ValueError(f"request id {used[0]!r} is already in use"))
                return
            try:
                self.engine.add_request_group(ids, c.prompt_ids, [p for _, p, _ in c.group])
            except Exception as e:
                c.future.set_exception(e)
                return
            for rid, _, sink in c.group:
                self._sinks[rid] = sink
            c.future.set_result(None)
        elif c.kind == "abort":
            sink = self._sinks.get(c.request_id)
            if sink is not None and (c.queue is None or sink.queue is c.queue):
                del self._sinks[c.request_id]
                self._guard(lambda: self.engine.abort_request(c.request_id), None)
                sink.push(self._final(c.request_id, sink, "abort"))
        elif c.kind == "metrics":
            assert c.future is not None
            try:
                c.future.set_result(self.engine.metrics())
            except Exception as e:
                c.future.set_exception(e)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception:
            logger.exception("engine step failed; failing the requests it was running")
            self._fail_all("error", "engine step failed")
            # a half-applied step may have left the GPU pools' maps inconsistent: start them afresh
            self._guard(lambda: self.engine.recover(), None)
            return
        self._log_tokens(sum(len(o.new_token_ids) for o in outputs))
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # aborted between the step and now
            sink.completion_tokens = out.completion_tokens
            self.generation_tokens_total += len(out.new_token_ids)
            if out.finished:
                del self._sinks[out.request_id]
            if not sink.push(out):
                self._sinks.pop(out.request_id, None)
                self._guard(lambda rid=out.request_id: self.engine.abort_request(rid), None)

    def _log_tokens(self, n: int) -> None:
        now = time.monotonic()
        with self._rate_lock:
            self._token_log.append((now, n))
            while self._token_log and self._token_log[0][0] <= now - self.RATE_WINDOW_S:
                self._token_log.popleft()

    def _fail_all(self, reason: str, why: str) -> None:
        for rid, sink in list(self._sinks.items()):
            self._guard(lambda rid=rid: self.engine.abort_request(rid), None)
            logger.warning("request %s ends with %r: %s", rid, reason, why)
            sink.push(self._final(rid, sink, reason))
        self._sinks.clear()

    def _close(self, commands: list[_Command]) -> None:
        for c in commands + self._commands:
            if c.future is not None and not c.future.done():
                c.future.set_exception(EngineClosed("the engine is shut down"))
        self._fail_all("abort", "shutdown")

    @staticmethod
    def _final(request_id: str, sink: _Sink, reason: str) -> StepOutput:
        return StepOutput(
            request_id=request_id,
            new_token_ids=[],
            new_logprobs=None,
            new_text="",
            finished=True,
            finish_reason=reason,
            prompt_tokens=sink.prompt_tokens,
            completion_tokens=sink.completion_tokens,
        )

    @staticmethod
    def _guard(fn: Callable[[], Any], default: Any) -> Any:
        # Engine calls made while cleaning up must not take the loop thread down with them.
        try:
            return fn()
        except Exception:
            logger.exception("engine call failed")
            return default
