"""Turns a scheduled batch into fixed-shape device tensors and runs one forward step.

Shapes are static per bucket so a compiled step (echo_compile) can replay a CUDA graph: the decode
batch is padded to the next bucket (padded rows: seq_len 0, out_slot -1, ignored by every op), the
prefill chunk to the next chunk bucket, and the block table always has ``pages_per_seq`` columns.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from custom_ops.cache.kv_cache import KVCache
from custom_ops.kv_format import pages_for
from model.config import ModelConfig
from model.forward_meta import ForwardMeta
from runtime.engine_config import EngineConfig
from runtime.progress import progress_bar
from runtime.request import Request
from runtime.scheduler import ScheduledBatch

StepInputs = tuple[
    torch.Tensor, ...
]  # input_ids, positions, out_slots, block_table, seq_lens, logits_indices


class StepModule(nn.Module):
    """The function a step runs: model + cache as submodules, so that their parameters and buffers
    are static inputs to torch.compile (and CUDA graphs replay over them without copies)."""

    def __init__(self, model: nn.Module, cache: KVCache, is_decode: bool):
        super().__init__()
        self.model = model
        self.cache = cache
        self.is_decode = is_decode

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        meta = ForwardMeta(
            input_ids, positions, out_slots, block_table, seq_lens, logits_indices, self.is_decode
        )
        return self.model(meta, self.cache)


def _pad(t: torch.Tensor, n: int, value: int) -> torch.Tensor:
    """``t`` with rows of ``value`` appended up to ``n`` rows."""
    if t.shape[0] == n:
        return t
    return torch.cat([t, t.new_full((n - t.shape[0], *t.shape[1:]), value)])


def next_bucket(n: int, buckets: Sequence[int]) -> int:
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class CompiledStep(Protocol):
    """A step function a ``StepCompiler`` made."""

    frozen: bool  # set after warm-up: a call that would compile raises instead

    def __call__(self, *args: torch.Tensor) -> torch.Tensor: ...


class StepCompiler(Protocol):
    """Turns an eager step into a compiled one that serves ``num_graphs`` input shapes (one per
    bucket). echo_compile.compiled.StepCompiler is the one implementation: it holds every compiler
    setting, and runtime never imports it. ``dynamic_batch``: one compile whose batch dim is
    symbolic serves every bucket (EngineConfig.dynamic_decode)."""

    def __call__(
        self, step: StepModule, num_graphs: int, dynamic_batch: bool = False
    ) -> CompiledStep: ...


class ModelRunner:
    """Prepares inputs and calls the decode/prefill step functions: eager, or compiled by the
    ``compiler`` passed in (prefill too when ``compile_prefill``); the runner owns them."""

    def __init__(
        self,
        model: nn.Module,
        cache: KVCache,
        device: torch.device,
        max_model_len: int,
        decode_buckets: Sequence[int],
        prefill_buckets: Sequence[int],
        compiler: StepCompiler | None = None,
        compile_prefill: bool = True,
        dynamic_decode: bool = False,
    ):
        self.model = model
        self.cache = cache
        self.device = device
        self.max_model_len = max_model_len  # the context limit: positions < it
        self.pages_per_seq = pages_for(max_model_len)
        self.decode_buckets = tuple(decode_buckets)
        self.prefill_buckets = tuple(prefill_buckets)
        self._decode_bt: dict[int, list[tuple[torch.Tensor, list[Request | None]]]] = {}
        self.decode_step = StepModule(model, cache, is_decode=True)
        self.prefill_step = StepModule(model, cache, is_decode=False)
        self.decode_fn: Callable[..., torch.Tensor] = self.decode_step
        self.prefill_fn: Callable[..., torch.Tensor] = self.prefill_step
        self.decode_call_t = 0.0  # perf_counter() when the last decode step's function was called
        self.decode_started: torch.cuda.Event | None = None  # see decode_inputs
        self.decode_next_ids: torch.Tensor | None = None  # see decode_inputs
        # (kind, buckets, compiled step) of every compiled step, for warm-up
        self.compiled: list[tuple[str, tuple[int, ...], CompiledStep]] = []
        if compiler is not None:
            dec = compiler(self.decode_step, len(self.decode_buckets), dynamic_batch=dynamic_decode)
            self.decode_fn = dec
            self.compiled.append(("decode", self.decode_buckets, dec))
            if compile_prefill:
                pre = compiler(self.prefill_step, len(self.prefill_buckets))
                self.prefill_fn = pre
                self.compiled.append(("prefill", self.prefill_buckets, pre))
        # False: a prefill's block table spans only the request's pages (eager, any width);
        # True: always pages_per_seq wide (fixed shapes for a compiled prefill)
        self.prefill_static_width = self.prefill_fn is not self.prefill_step

    @property
    def num_graphs(self) -> int:
        return sum(len(b) for _, b, _ in self.compiled)

    @torch.no_grad()
    def warmup(self, calls: int = 3, progress: bool = True) -> float:
        """Compile and capture every bucket of the compiled steps (``calls`` runs each: warm-up,
        record, replay) on padding rows that every op ignores, then freeze them (no recompile from
        here on), and compile the cache's kernels that run outside them; returns the seconds it
        took."""
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
            # NOTE: 0 compiled nothing and froze the steps: every later call was a refused
            # "recompile"
            raise ValueError(
                f"warmup calls must be a positive integer (runs of each bucket: warm-up, record, "
                f"replay), got {calls!r}"
            )
        t0 = time.perf_counter()
        # largest bucket first: a dynamic decode step (EngineConfig.dynamic_decode) compiles its
        # symbolic graph at the first batch above 1 it sees, and Inductor picks its kernels'
        # configs for that size: the largest, where a step takes longest (docs/compile.md)
        jobs = [
            (kind, b, fn) for kind, buckets, fn in self.compiled for b in sorted(buckets)[::-1]
        ]
        for _, _, fn in self.compiled:
            fn.frozen = False
        bar = progress_bar(jobs, enabled=progress, desc="capturing graphs", unit="graph")
        for kind, b, fn in bar:
            args = self.padding_inputs(kind == "decode", b)
            for _ in range(calls):
                fn(*args)
        self.cache.warm_kernels()  # and the cache ops that run outside the graphs
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.cache.reset_stats()  # the padding steps are not traffic
        for _, _, fn in self.compiled:
            fn.frozen = True
        return time.perf_counter() - t0

    # ---- inputs --------------------------------------------------------------------------------
    def _block_table(self, reqs: Sequence[Request], rows: int) -> torch.Tensor:
        bt = torch.zeros(rows, self.pages_per_seq, dtype=torch.int32)
        for i, r in enumerate(reqs):
            row = r.block_row()
            bt[i, : row.shape[0]] = row
        return bt

    def _decode_block_table(self, reqs: Sequence[Request], bucket: int) -> torch.Tensor:
        """The decode block table [bucket, P], kept per bucket and rewritten only in rows whose
        request changed: a request's pages are fixed from admission to finish, so a steady decode
        batch rewrites nothing (rebuilding 32 rows of 1500 pages took milliseconds a step).
        Two pinned buffers per bucket, used in turn: a step launched ahead (asynchronous
        scheduling) may change rows while the step before it, whose host->device copy of its
        buffer may still be pending, is in flight; the other buffer's last step has been read."""
        if bucket not in self._decode_bt:
            pin = self.device.type == "cuda"
            self._decode_bt[bucket] = [
                (
                    torch.zeros(bucket, self.pages_per_seq, dtype=torch.int32, pin_memory=pin),
                    [None] * bucket,
                )
                for _ in range(2)
            ]
        buffers = self._decode_bt[bucket]
        buffers.reverse()  # the one not used last time
        bt, owners = buffers[0]
        for i in range(bucket):
            r = reqs[i] if i < len(reqs) else None
            if owners[i] is r:
                continue
            owners[i] = r
            if r is None:
                bt[i].zero_()
            else:
                row = r.block_row()
                bt[i, : row.shape[0]] = row
                bt[i, row.shape[0] :] = 0
        return bt

    def decode_inputs(
        self,
        reqs: Sequence[Request],
        bucket: int,
        next_ids: torch.Tensor | None = None,
        next_rows: Sequence[int] | None = None,
    ) -> StepInputs:
        """``next_ids``: the step runs one token ahead of the host (asynchronous scheduling):
        each request's newest token is the one the step before sampled (int64 on the device, not
        read back yet), ``next_ids[i]``, or ``next_ids[next_rows[i]]`` when the batch changed, at
        position ``num_tokens``. On CUDA ``decode_started`` is then an event recorded once the
        inputs are built on the host, before their first copy to the device (the GPU's idle time
        between decode steps, Engine.metrics), and ``decode_next_ids`` the rows' input ids
        taken from ``next_ids`` ([len(reqs)] on the device; None without ``next_ids``)."""
        n, ahead = len(reqs), int(next_ids is not None)
        # the newest token of each, not yet in the cache
        last = [r.num_tokens - 1 + ahead for r in reqs]
        ids = torch.zeros(bucket, dtype=torch.int64)
        pos = torch.zeros(bucket, dtype=torch.int64)
        slots = torch.full((bucket,), -1, dtype=torch.int64)
        lens = torch.zeros(bucket, dtype=torch.int32)
        if not ahead:
            ids[:n] = torch.tensor([r.token_at(p) for r, p in zip(reqs, last)], dtype=torch.int64)
        pos[:n] = torch.tensor(last, dtype=torch.int64)
        slots[:n] = torch.tensor([r.slot_of(p) for r, p in zip(reqs, last)], dtype=torch.int64)
        lens[:n] = pos[:n].to(torch.int32) + 1
        logits_idx = torch.arange(bucket, dtype=torch.int64)
        bt = self._decode_block_table(reqs, bucket)
        extra = () if next_rows is None else (torch.tensor(next_rows, dtype=torch.int64),)
        if self.device.type == "cuda":
            self.decode_started = torch.cuda.Event(enable_timing=True)
            self.decode_started.record()
        (*inputs,) = self._to_device(ids, pos, slots, bt, lens, logits_idx, *extra)
        if next_ids is not None:
            if next_rows is not None:
                next_ids = next_ids.index_select(0, inputs.pop())
            inputs[0][:n].copy_(next_ids)  # device-side: no sync
        self.decode_next_ids = next_ids
        return tuple(inputs)

    def prefill_inputs(self, req: Request, start: int, end: int, bucket: int) -> StepInputs:
        n = end - start
        ids = torch.zeros(bucket, dtype=torch.int64)
        pos = torch.zeros(bucket, dtype=torch.int64)
        slots = torch.full((bucket,), -1, dtype=torch.int64)
        ids[:n] = torch.tensor(req.prompt_ids[start:end], dtype=torch.int64)
        pos[:n] = torch.arange(start, end, dtype=torch.int64)
        pos[n:] = end - 1  # padding repeats the last position; its out_slot is -1 (never written)
        slots[:n] = req.slots(start, end)
        lens = torch.tensor([end], dtype=torch.int32)
        logits_idx = torch.tensor([n - 1], dtype=torch.int64)
        # The prefill reads the rows of every position the block table covers (the ops mask each
        # query's causal prefix), so an eager prefill passes only the pages it needs.
        width = self.pages_per_seq if self.prefill_static_width else pages_for(end)
        bt = self._block_table([req], 1)[:, :width].contiguous()
        return self._to_device(ids, pos, slots, bt, lens, logits_idx)

    def padding_inputs(self, is_decode: bool, bucket: int) -> StepInputs:
        """Inputs made only of padding (seq_len 0, out_slot -1): for warm-up and graph capture."""
        rows = bucket if is_decode else 1
        return self._to_device(
            torch.zeros(bucket, dtype=torch.int64),
            torch.zeros(bucket, dtype=torch.int64),
            torch.full((bucket,), -1, dtype=torch.int64),
            torch.zeros(rows, self.pages_per_seq, dtype=torch.int32),
            torch.zeros(rows, dtype=torch.int32),
            torch.arange(rows, dtype=torch.int64) if is_decode else torch.tensor([bucket - 1]),
        )

    def pad_inputs(
        self,
        is_decode: bool,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> StepInputs:
        """Step inputs a caller built itself (echo_compile.CompiledModel: device tensors of n rows
        or n tokens), padded to the next bucket as ``decode_inputs``/``prefill_inputs`` pad: ids
        0, out_slot -1, decode rows of seq_len 0 with a zero block-table row, prefill padding
        repeating the last position; logits of every decode row, of a prefill's last token."""
        n, dev = input_ids.shape[0], input_ids.device
        if is_decode:
            b = next_bucket(n, self.decode_buckets)
            return (
                _pad(input_ids, b, 0),
                _pad(positions, b, 0),
                _pad(out_slots, b, -1),
                _pad(block_table, b, 0),
                _pad(seq_lens, b, 0),
                torch.arange(b, device=dev),
            )
        b = next_bucket(n, self.prefill_buckets)
        return (
            _pad(input_ids, b, 0),
            torch.cat([positions, positions[n - 1 : n].expand(b - n)]),
            _pad(out_slots, b, -1),
            block_table,
            seq_lens,
            torch.tensor([n - 1], device=dev),
        )

    def _to_device(self, *ts: torch.Tensor) -> StepInputs:
        if self.device.type == "cuda":
            return tuple(
                (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True)
                for t in ts
            )
        return ts

    # ---- forward -------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        batch: ScheduledBatch,
        next_ids: torch.Tensor | None = None,
        next_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Logits fp32 [len(batch.requests), V] (for prefill: of the chunk's last token; of all
        its tokens, ``[n, V]``, for a request asking for ``prompt_logprobs``). ``next_ids``,
        ``next_rows``: a decode step one token ahead, as ``decode_inputs`` takes them."""
        if batch.is_decode:
            n = len(batch.requests)
            bucket = next_bucket(n, self.decode_buckets)
            inputs = self.decode_inputs(batch.requests, bucket, next_ids, next_rows)
            self.decode_call_t = time.perf_counter()  # Engine's host gap (metrics)
            return self.decode_fn(*inputs)[:n]
        req = batch.requests[0]
        if req.params.prompt_logprobs is not None:
            return self.prefill_logits(batch)
        bucket = next_bucket(batch.chunk_end - batch.chunk_start, self.prefill_buckets)
        return self.prefill_fn(
            *self.prefill_inputs(req, batch.chunk_start, batch.chunk_end, bucket)
        )

    @torch.no_grad()
    def prefill_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits fp32 [n, V] of every token of a prefill chunk (``prompt_logprobs``). NOTE:
        eager and unpadded, whatever the runner compiled: a compiled prefill returns one row."""
        req, start, end = batch.requests[0], batch.chunk_start, batch.chunk_end
        *inputs, _ = self.prefill_inputs(req, start, end, end - start)
        every = torch.arange(end - start, dtype=torch.int64, device=inputs[0].device)
        return self.prefill_step(*inputs, every)


def build_runner(
    model: nn.Module,
    config: EngineConfig,
    compiler: StepCompiler | None = None,
    model_config: ModelConfig | None = None,
) -> ModelRunner:
    """The one way a runner is made (``Engine`` and ``echo_compile.compile``): its cache, buckets
    and context limit from ``config`` and the model's config (default ``model.config``), its steps
    compiled by ``compiler`` (prefill as ``config.prefill_compiled`` says) or eager. The model's
    weights are final here, so it fuses MLA's projections of ``x`` in place
    (``fuse_a_projections``, docs/model_notes.md, MLA)."""
    mc = model_config if model_config is not None else model.config
    device = torch.device(config.device)
    emb = model.model.embed_tokens.weight  # bf16 in every checkpoint format (model.checkpoint)
    if emb.dtype != torch.bfloat16:
        # NOTE: the KV rows, the cache and the ops are bf16: a cast model failed at its first
        # step, deep in a trace ("expected scalar type torch.float32 but found torch.bfloat16")
        raise ValueError(
            f"the model's weights are {emb.dtype}: its steps run the bf16 weights load_model "
            "gives (a model cast with .float() or .half() is not supported)"
        )
    model.fuse_a_projections()
    return ModelRunner(
        model,
        KVCache(config.cache_config(mc), device),
        device,
        config.model_len(mc),
        config.buckets,
        config.prefill_buckets,
        compiler=compiler,
        compile_prefill=config.prefill_compiled(mc),
        dynamic_decode=config.dynamic_decode,
    )
