"""The engine loop: schedule -> prepare -> forward -> postprocess.

Offline ``generate()`` (echo_compile.LLM) and the server (runtime.async_engine) drive the same
``step()``. The engine owns the scheduler, the KV cache and the model runner; it never touches the
model's internals.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from model.config import ModelConfig
from runtime.admission import check_group, check_received_kv, check_request, queue_group
from runtime.decode_sampling import LOGPROB_FLOOR as LOGPROB_FLOOR  # (importable from here)
from runtime.decode_sampling import sample_decode
from runtime.detokenize import RequestDetokenizer, eos_ids
from runtime.engine_config import EngineConfig
from runtime.engine_inputs import EngineInputs, read_engine_inputs
from runtime.engine_metrics import engine_metrics
from runtime.model_runner import StepCompiler, build_runner
from runtime.prefill_sharing import copy_rows
from runtime.prompt_kv import PromptKV, PromptKVSource, read_prompt_kv
from runtime.prompt_kv_load import load_prompt_kv
from runtime.prompt_logprobs import prompt_logprobs
from runtime.readback import PoolChecks, SampledStep, check_overflow
from runtime.request import PAGE, Request, Status
from runtime.run_ahead import run_ahead
from runtime.sampler import LogitsProcessor, request_seed
from runtime.sampling_controls import SamplingControls
from runtime.sampling_params import SamplingParams, fill_max_tokens
from runtime.scheduler import ScheduledBatch, Scheduler
from runtime.step_output import StepOutput, error_output, token_output, unusable_logits_message
from runtime.structured_output import StructuredOutput
from runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from model.loader import LoadExtras

logger = logging.getLogger(__name__)


class EngineClosed(RuntimeError):
    """A call to an engine that has stopped for good: shut down (``AsyncEngine.shutdown``) or,
    multi-rank, its driver closed or its group failed (``DriverEngine``). Callers that outlive
    the engine (a /metrics scrape during shutdown) answer it without a traceback."""


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        tokenizer: Tokenizer | None,
        config: EngineConfig,
        model_name: str = "model",
        compiler: StepCompiler | None = None,
        sampling_defaults: SamplingParams | None = None,
        eos_token_ids: frozenset[int] | None = None,
    ):
        """``compiler`` (echo_compile.compiled.StepCompiler): compile the runner's steps; call
        ``runner.warmup()`` before serving. None: eager. ``sampling_defaults``: the parameters
        of a request that sets none (the checkpoint's generation config,
        ``runtime.sampling_params.generation_defaults``; None: ``SamplingParams()``); the
        server and ``LLM`` fill unset fields from it, ``add_request`` takes params as given.
        ``eos_token_ids``: the ids that end a request as its EOS (``runtime.detokenize.eos_ids``;
        None: those of ``model_config`` and ``tokenizer``)."""
        self.sampling_defaults = sampling_defaults or SamplingParams()
        if tokenizer is not None:
            tokenizer.check_vocab(model_config.vocab_size)
        if eos_token_ids is None:
            eos_token_ids = eos_ids(model_config, tokenizer)
        self.eos_token_ids = eos_token_ids
        self.model_config = model_config
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device = torch.device(config.device)
        # the runner owns the KV cache and the (eager or ``compiler``-compiled) step functions
        self.runner = build_runner(model, config, compiler, model_config)
        self.cache = self.runner.cache
        self.max_model_len = config.model_len(model_config)
        self.scheduler = Scheduler(
            config.scheduler_config(model_config),
            self._release_pages,
            lambda src, dst: copy_rows(self.cache, src, dst),  # a group's fork
        )
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, RequestDetokenizer] = {}
        self._seeds: dict[str, int] = {}
        self._recent: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens) per step
        self.num_steps = 0
        # Batch-level hooks on each decode step's logits, applied in order before sampling
        # (see ``runtime.sampler.LogitsProcessor``).
        self.logits_processors: list[LogitsProcessor] = []
        # penalties, logit_bias, min_p, min_tokens, before the processors (sampling_controls.py)
        self.sampling_controls = SamplingControls(self.eos_token_ids)
        # SamplingParams.grammar as a token mask, before the controls (structured_output.py)
        self.structured_output = StructuredOutput(
            tokenizer, model_config.vocab_size, model_config.eos_token_id
        )
        self.prompt_kv_load_s = 0.0  # time spent writing received prompt KV (add_request)
        self.finished_requests: list[Request] = []  # kept for statistics (benchmarks)
        self.keep_finished = False
        self.num_decode_steps = 0
        self.decode_rows = 0  # sum of decode batch sizes: / num_decode_steps = effective batch
        self.generated_tokens = 0
        # The host's part of back-to-back decode steps: from a step's sampled tokens on the host
        # (the step's one sync) to the call of the next decode step's function (its own dispatch,
        # a compiled step's guards and graph launch, not included). The device has finished all
        # it was given by then, so on a GPU it idles at least this long each step (metrics).
        self.host_gap_s = 0.0
        self.host_gaps = 0
        self._tokens_at: float | None = None  # when the last decode step's tokens arrived
        # The device's idle time between back-to-back decode steps (CUDA): from the end of a
        # step (its tokens' copy to the host) to the start of the next (recorded once its inputs
        # are built on the host), both as the GPU timed them; in either loop (metrics)
        self.gpu_idle_ms = 0.0
        self.gpu_idle_gaps = 0
        self._pool_checks = PoolChecks()  # a finish's overflow check, read without a sync
        self._last_end: torch.cuda.Event | None = None  # the last read decode step's end
        # asynchronous scheduling (EngineConfig.async_scheduling): the decode step launched one
        # token ahead, before the tokens of the step before it were read (step())
        self._in_flight: SampledStep | None = None
        self.decode_steps_ahead = 0  # decode steps launched one token ahead
        self.discarded_rows = 0  # their rows of requests that had finished meanwhile

    @classmethod
    def from_loaded(
        cls,
        model: torch.nn.Module,
        extras: LoadExtras,
        config: EngineConfig,
        model_name: str = "model",
        compiler: StepCompiler | None = None,
        generation_config: str = "auto",
        inputs: EngineInputs | None = None,
    ) -> Engine:
        """An engine over a checkpoint ``model.loader`` loaded, with the ``inputs`` read from its
        directory (``read_engine_inputs``: pass them when they were read before the load)."""
        mc: ModelConfig = model.config  # type: ignore[assignment]
        inputs = inputs or read_engine_inputs(extras.path, config, generation_config)
        return cls(
            model, mc, inputs.tokenizer, config, model_name=model_name, compiler=compiler,
            sampling_defaults=inputs.sampling_defaults, eos_token_ids=inputs.eos_token_ids,
        )  # fmt: skip

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt_kv: PromptKVSource | None = None,
    ) -> None:
        """Queue a request.

        ``prompt_kv``: the prompt's KV computed elsewhere (a prefill instance, as in a
        prefill/decode-disaggregated deployment; ``runtime.prompt_kv`` describes the rows): at
        admission it is written into the request's host slots instead of running a prefill, and
        decoding starts from the last prompt token. Its layer count, token count
        (``len(prompt) - 1``) and row width are checked here; the chunks a generator yields are
        checked as they are written. ``params.truncate_prompt_tokens`` keeps the prompt's last
        tokens (``truncate_prompt``) before anything else reads it."""
        ids = self._check_new(request_id, prompt_token_ids, params)
        params = fill_max_tokens(params, len(ids), self.max_model_len)
        if prompt_kv is not None:
            check_received_kv(
                prompt_kv, params, len(prompt_token_ids), ids, self.model_config.num_hidden_layers,
                self.cache.config.row_bytes, self.cache.config.fmt,
            )  # fmt: skip
        req = Request(request_id, ids, params, prompt_kv=prompt_kv)
        self.scheduler.add(req)  # raises ValueError for requests that can never fit
        self._register(req)

    def add_request_group(
        self,
        request_ids: list[str],
        prompt_token_ids: list[int],
        params: list[SamplingParams],
    ) -> None:
        """Queue n sequences of one prompt (``params[j]`` for sequence ``request_ids[j]``: the
        server's n choices, or best_of candidates) that share ONE prefill and the host slots of
        the prompt's full pages (runtime.prefill_sharing). Each sequence is then an ordinary
        request: its own id, seed, outputs, finish and abort. The result is what n separate
        requests would give (decoded in the same batches: separate requests that take turns
        with each other's prefill chunks start decoding at different steps, which may change
        the last bits of batch-dependent matmuls); a group larger than the decode rows the
        pools serve at once is split into groups of at most that many, and a one-token prompt
        (nothing to prefill) makes separate requests. All are refused, and none queued, if one
        is invalid."""
        prompt = check_group(request_ids, prompt_token_ids, params, self._check_new)
        params = [fill_max_tokens(p, len(prompt), self.max_model_len) for p in params]
        reqs = [Request(rid, prompt, p) for rid, p in zip(request_ids, params)]
        queue_group(self.scheduler, reqs, self._register)

    def _register(self, req: Request) -> None:
        params = req.params
        self.requests[req.request_id] = req
        self._detok[req.request_id] = RequestDetokenizer(
            self.tokenizer, params, req.prompt_ids, self.eos_token_ids
        )
        self._seeds[req.request_id] = request_seed(params)

    def _check_new(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[int]:
        """``check_request`` against this engine's requests, vocabulary and context."""
        return check_request(
            request_id, prompt_token_ids, params, self.requests, self.model_config.vocab_size,
            self.max_model_len, self.structured_output,
        )  # fmt: skip

    def prompt_kv(self, request_id: str) -> PromptKV:
        """The KV rows of a running request's prompt once it is prefilled (the sending side of
        prefill/decode disaggregation: ``add_request(..., prompt_kv=...)`` on another engine
        with the same model and KV format continues from them)."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}")
        # (a one-token prompt has no KV to hand over: nothing to wait for)
        if req.prefill_end and (not req.pages or req.in_prefill or req.prompt_kv is not None):
            raise ValueError(f"request {request_id!r} is not prefilled yet")
        return read_prompt_kv(self.cache.layers, req.slots(0, req.prefill_end))

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _release_pages(self, pages: list[int]) -> None:
        """The scheduler's hook for pages whose last holder leaves: forget their host slots in
        every layer's GPU pool BEFORE they go back to the allocator (a stale host->GPU entry
        would serve the next owner old rows). A page still shared by another sequence of the same
        prompt is not released: its rows stay valid, and cached."""
        # the page ids cross to the device, not their 64x as many slots (one small copy)
        first = torch.tensor(pages, dtype=torch.int64).to(self.device)[:, None] * PAGE
        self.cache.release((first + torch.arange(PAGE, device=self.device)).flatten())

    def _finish(self, req: Request, reason: str) -> None:
        # releases the GPU-pool rows of the pages it frees; after an error its rows may be
        # partial: none goes to the prefix cache
        self.scheduler.remove(req, cache=reason != "error")
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        self.requests.pop(req.request_id, None)
        self._detok.pop(req.request_id, None)
        self._seeds.pop(req.request_id, None)
        # its control slot and grammar matcher now: dropped at the next step otherwise, which an
        # engine going idle never takes
        self.sampling_controls.slots.pop(req.request_id, None)
        self.structured_output.matchers.pop(req.request_id, None)
        fl = self._in_flight
        if fl is not None and all(r.status is Status.FINISHED for r in fl.batch.requests):
            self.discarded_rows += len(fl.batch.requests)  # a step nobody is left to read
            self._in_flight = None
            # the device's last decode work (GPU idle, metrics; the next read waits for it)
            self._last_end = fl.copied
        if self.keep_finished:
            self.finished_requests.append(req)

    def recover(self) -> None:
        """After a failed step: abort every request and empty the GPU pools, whose maps a
        half-applied recall may have left inconsistent (the host pool is authoritative)."""
        fl, self._in_flight = self._in_flight, None  # its tokens are never read
        self._gap_broken()
        try:
            if fl is not None:
                fl.wait()  # (a failed device raises here, and is reset below)
        except Exception:  # noqa: BLE001
            pass
        try:
            for req in list(self.requests.values()):
                try:
                    self._finish(req, "error")
                except Exception:  # keep going: the pools are reset below anyway
                    self.requests.pop(req.request_id, None)
                    if req.status != Status.FINISHED:  # the scheduler has not let it go yet
                        try:
                            # its pages are freed even if it raises
                            self.scheduler.remove(req, cache=False)
                        except Exception:  # noqa: BLE001  (the pools are reset below)
                            pass
        finally:
            self.cache.reset_pools()
            self._pool_checks.clear()  # counts of the pools before the reset

    def reset_stats(self) -> None:
        """Zero the step/token counters, the pools' hit/recall totals and the prefix cache's
        lookup counters (its pages stay cached), and forget finished requests (benchmarks: one
        engine measures several workloads in turn)."""
        self.num_steps = self.num_decode_steps = self.decode_rows = self.generated_tokens = 0
        self.decode_steps_ahead = self.discarded_rows = 0
        self.prompt_kv_load_s = self.host_gap_s = 0.0
        self.host_gaps = 0
        self._gap_broken()
        self.gpu_idle_ms, self.gpu_idle_gaps = 0.0, 0
        self._recent.clear()
        self.finished_requests.clear()
        self.cache.reset_stats()
        if self.scheduler.prefix is not None:
            self.scheduler.prefix.reset_stats()

    def check_pools(self) -> None:
        """Raise if a recall ever had more misses than free GPU-pool rows. The scheduler's
        admission (B x topk <= N_G) makes this impossible; a non-zero count is a bug, and the
        selections it dropped would have changed the output. (Each finish checks this too,
        without a host sync: ``PoolChecks``.)"""
        self._pool_checks.clear()  # the count only grows: this check covers theirs
        check_overflow(int(self.cache.overflow()))

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one step; returns the tokens it produced. With ``async_scheduling``, the next
        decode step is launched before the last one's tokens are read back when the scheduler's
        choice does not depend on them (``_run_ahead``), so the device computes it while the host
        finishes the last; each call then returns the outputs of the step before the one it
        launched."""
        prev = self._in_flight
        if prev is not None:
            nxt = self._run_ahead(prev)
            self._in_flight = None if nxt is None else self._decode(nxt, prev)
            return self._complete(prev)
        batch = self._schedule()
        if batch is None:
            self._gap_broken()  # idle: the wait for work is no gap
            self._pool_checks.drain()
            return []
        if not batch.is_decode:
            self._gap_broken()  # a prefill step between two decode steps: no gap counted
            return self._postprocess(batch, self.runner.forward(batch))
        cur = self._decode(batch)
        nxt = self._run_ahead(cur)
        if nxt is not None:
            self._in_flight = self._decode(nxt, cur)
        return self._complete(cur)

    def _schedule(self) -> ScheduledBatch | None:
        """The scheduler's next batch to compute, once the received prompt KV of the requests it
        admits is written (``_load_prompt_kv``, their prefill), and, before the first chunk of a
        prompt that starts on cached pages, those pages' rows are in the prefill buffer (the
        chunks read their context there; every path that runs a step schedules here)."""
        batch = self.scheduler.schedule()
        while batch is not None and not batch.is_decode and batch.requests[0].prompt_kv is not None:
            self._load_prompt_kv(batch.requests[0])
            self._gap_broken()  # the load's copies kept the device busy: no gap counted
            batch = self.scheduler.schedule()
        if batch is not None and not batch.is_decode:
            req = batch.requests[0]
            if batch.chunk_start == req.cached_tokens > 0:  # its first chunk after the cache
                self.cache.load_prefill(req.slots(0, req.cached_tokens).to(self.device))
        return batch

    def _gap_broken(self) -> None:
        """Something other than a decode step comes next: no host or GPU gap is counted until
        the next decode step's tokens are read."""
        self._tokens_at = self._last_end = None

    def _decode(self, batch: ScheduledBatch, after: SampledStep | None = None) -> SampledStep:
        """Launch a decode step of ``batch`` and sample it on the device; ``after``: the step it
        follows, whose tokens (each request's row of them) are its input ids, still on the
        device."""
        if after is not None:  # the device has `after` queued
            rows = None
            if batch.requests is not after.batch.requests:  # some left: their rows go
                row = {id(r): i for i, r in enumerate(after.batch.requests)}
                rows = [row[id(r)] for r in batch.requests]
            logits = self.runner.forward(batch, after.tokens, rows)
        else:
            logits = self.runner.forward(batch)
        # (CUDA) recorded before the step's first input copy (the GPU's idle time, metrics)
        started = self.runner.decode_started
        if after is None and self._tokens_at is not None:
            self.host_gap_s += self.runner.decode_call_t - self._tokens_at
            self.host_gaps += 1
        # the rows' newest tokens, not on the host yet (None: on the host)
        pending = None if after is None else self.runner.decode_next_ids
        return self._sample(batch, logits, pending=pending, started=started)

    def _run_ahead(self, s: SampledStep) -> ScheduledBatch | None:
        """The decode batch to launch before ``s``'s tokens are read, or None to read them first
        (``runtime.run_ahead``)."""
        return run_ahead(
            s.batch, self.config.async_scheduling, self.logits_processors, self.scheduler
        )

    def _load_prompt_kv(self, req: Request) -> None:
        """``load_prompt_kv`` (a failed load finishes ``req`` with an error), its time counted in
        ``prompt_kv_load_s``."""
        self.prompt_kv_load_s += load_prompt_kv(
            req, self.cache, self.device, self.scheduler, lambda r: self._finish(r, "error")
        )

    def _postprocess(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[StepOutput]:
        """A step's outputs from its logits, synchronously (decode: sample, then read)."""
        if not batch.is_decode:
            self.num_steps += 1
            req = batch.requests[0]
            if req.params.prompt_logprobs is not None and batch.chunk_start == len(
                req.prompt_logprobs
            ):  # (a chunk run again after a preemption adds nothing twice)
                nxt = req.prompt_ids[batch.chunk_start + 1 : batch.chunk_end + 1]
                req.prompt_logprobs += prompt_logprobs(logits, nxt, req.params.prompt_logprobs)
            req.num_computed = batch.chunk_end  # prefill samples nothing
            self.scheduler.computed(req)  # its full pages to the prefix cache
            return []
        return self._complete(self._sample(batch, logits))

    def _complete(self, s: SampledStep) -> list[StepOutput]:
        """Read a decode step's tokens (the step's one host sync) and hand them to its requests;
        a request that finished after the step was launched (asynchronous scheduling) is
        skipped."""
        toks, lps, tops, chosen = s.read()
        now = self._tokens_at = time.perf_counter()
        if self._last_end is not None and s.started is not None:
            # both have run (reading s waited for its end, which the GPU ran after its start)
            self.gpu_idle_ms += max(self._last_end.elapsed_time(s.started), 0.0)
            self.gpu_idle_gaps += 1
        self._last_end = s.copied
        self.num_steps += 1
        self.num_decode_steps += 1
        self.decode_steps_ahead += s.ahead
        outs = []
        bad = s.bad_stages or [0] * len(toks)
        for r, tok, lp, top, raw, stage in zip(s.batch.requests, toks, lps, tops, chosen, bad):
            if r.status is Status.FINISHED:
                self.discarded_rows += 1
                continue
            if stage:  # its logits were unusable: its token is garbage, never appended
                outs.append(self._processor_error(r, stage))
                continue
            r.num_computed = r.num_tokens
            r.output_ids.append(tok)
            self.scheduler.computed(r)
            r.output_logprobs.append(lp)
            r.token_times.append(now)
            if r.first_token_time is None:
                r.first_token_time = now
            detok = self._detok[r.request_id]
            text, reason = detok.add(tok, len(r.output_ids))
            if reason is not None:
                self._finish(r, reason)
            r.check()
            outs.append(token_output(r, tok, lp, top, raw, text, reason, detok.stop_string))
        self._pool_checks.poll()
        if any(o.finished for o in outs):
            self._pool_checks.add(self.cache.overflow())
            if not self.scheduler.has_unfinished():
                self._pool_checks.drain()  # going idle: nothing in flight to overlap
        self.decode_rows += len(outs)
        new = sum(len(o.new_token_ids) for o in outs)  # (a failed row's output has none)
        self.generated_tokens += new
        self._recent.append((now, new))
        return outs

    def _processor_error(self, req: Request, stage: int) -> StepOutput:
        """Finish ``req``, whose row of a decode step had unusable logits (``bad_stage``'s
        ``stage``), with finish_reason "error" and a message naming the processor (stage 1:
        the request's own parameters, or the model); the other rows of the step go on."""
        msg = unusable_logits_message(req, stage, self.logits_processors)
        logger.warning("%s; it ends with an error", msg)
        self._finish(req, "error")
        return error_output(req, msg)

    def _sample(
        self,
        batch: ScheduledBatch,
        logits: torch.Tensor,
        pending: torch.Tensor | None = None,
        started: torch.cuda.Event | None = None,
    ) -> SampledStep:
        """``sample_decode`` with this engine's seeds, grammar, controls and processors."""
        return sample_decode(
            batch, logits, self._seeds, self.structured_output, self.sampling_controls,
            self.logits_processors, pending=pending, started=started,
        )  # fmt: skip

    # ---- observability -------------------------------------------------------------------------
    def metrics(self) -> dict[str, float | list[float]]:
        """Observability counters (syncs with the device: call between steps;
        ``runtime.engine_metrics``)."""
        return engine_metrics(
            self.scheduler, self.cache.stats(), self._recent,
            generated_tokens=self.generated_tokens, host_gap_s=self.host_gap_s,
            host_gaps=self.host_gaps, decode_steps=self.num_decode_steps,
            decode_steps_ahead=self.decode_steps_ahead, gpu_idle_ms=self.gpu_idle_ms,
            gpu_idle_gaps=self.gpu_idle_gaps, discarded_rows=self.discarded_rows,
        )  # fmt: skip
