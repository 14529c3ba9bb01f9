"""Continuous batching with admission by host-pool and GPU-pool capacity.

Policy (vLLM-v0 style, kept simple):
- FCFS admission from the waiting queue while the request fits: a free decode row (the largest
  captured bucket bounds the batch), host pages for its whole lifetime (prompt + max_tokens), and,
  when offloading, room in every layer's GPU pool for one more selection (B x topk <= N_G per layer,
  so the guaranteed recall never has to evict a token selected in the same step). A request that
  does not fit waits; nothing is dropped. One that could never fit is rejected at ``add``.
- A running request with prompt tokens left gets one prefill chunk per step (prefill first);
  otherwise every running request decodes one token (the first decode step of a request processes
  its last prompt token and samples its first output token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from custom_ops.cache.config import max_decode_rows
from custom_ops.kv_format import pages_for
from runtime.host_slots import HostSlotAllocator
from runtime.request import PAGE, Request, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int  # the largest decode bucket
    max_model_len: int  # longest prompt + output a request may have
    host_tokens: int  # host KV pool rows (a multiple of PAGE)
    topk: int  # index_topk: rows a request selects per layer per step
    gpu_tokens: int | None = None  # per-layer GPU pool rows when offloading; None = GPU-only
    prefill_chunk: int = 2048

    def __post_init__(self) -> None:
        if self.max_batch <= 0 or self.prefill_chunk <= 0 or self.max_model_len <= 0:
            raise ValueError(
                "SchedulerConfig: max_batch, prefill_chunk and max_model_len must be positive"
            )
        if self.gpu_tokens is not None and self.gpu_tokens < self.topk:
            raise ValueError(
                f"GPU pool of {self.gpu_tokens} tokens per layer cannot hold one selection "
                f"of {self.topk}"
            )

    @property
    def max_running(self) -> int:
        """Decode rows the GPU pools can serve at once (B x topk <= N_G)."""
        return max_decode_rows(self.max_batch, self.topk, self.gpu_tokens)


@dataclass
class ScheduledBatch:
    is_decode: bool
    requests: list[Request]
    chunk_start: int = 0  # prefill only: token range [chunk_start, chunk_end) of requests[0]
    chunk_end: int = 0


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.pages = HostSlotAllocator(cfg.host_tokens // PAGE)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    # ---- requests in and out -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        total = req.max_total_tokens
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        if total > self.cfg.max_model_len:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) = "
                f"{total} exceeds the model's context limit of {self.cfg.max_model_len} tokens"
            )
        if pages_for(total) > self.pages.num_pages:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens can never fit the host KV pool "
                f"({self.pages.num_pages * PAGE} tokens)"
            )
        self.waiting.append(req)

    def remove(self, req: Request) -> list[int]:
        """Take ``req`` out of the queues and free its host pages; returns the pages it held."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        pages, req.pages = req.pages, []
        if pages:
            self.pages.free(pages)
        req.status = Status.FINISHED
        return pages

    # ---- one step ------------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            pages = self.pages.alloc(pages_for(req.max_total_tokens))
            if pages is None:
                break  # host pool full: wait for a running request to finish
            self.waiting.popleft()
            req.pages = pages
            req.status = Status.RUNNING
            self.running.append(req)

    def schedule(self) -> ScheduledBatch | None:
        self._admit()
        for req in self.running:
            if req.in_prefill:
                end = min(req.num_computed + self.cfg.prefill_chunk, req.prefill_end)
                return ScheduledBatch(False, [req], req.num_computed, end)
        if not self.running:
            return None
        return ScheduledBatch(True, list(self.running))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
