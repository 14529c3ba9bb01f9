"""One generation request and its length bookkeeping."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from custom_ops.kv_format import PAGE  # tokens per host page (the block table's unit)
from runtime.prompt_kv import PromptKVSource
from runtime.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """Request state. Invariants (``check``):
    - ``num_computed <= num_tokens``: tokens whose KV row is in the cache never outrun the tokens
      known;
    - while running, ``len(pages) * PAGE >= len(prompt_ids) + params.max_tokens``: host pages for
      the whole lifetime are reserved at admission, so a running request never waits for memory.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    # prompt tokens found in the prefix cache (their KV was not computed again), and the pages
    # of this sequence the prefix cache holds (registered or matched; runtime.prefix_cache);
    # cache_stopped: a page's key was cached under another page, it registers no more
    cached_tokens: int = 0
    cache_pages: int = 0
    cache_stopped: bool = False
    # the prefix cache's last match of this prompt, (cache epoch, pages): continued, not redone,
    # while the request waits at the head of the queue (Scheduler._cached_prefix)
    prefix_match: tuple[int, list[int]] | None = field(default=None, repr=False)
    # the prompt's KV computed elsewhere (runtime.prompt_kv): written at admission instead of a
    # prefill, then dropped
    prompt_kv: PromptKVSource | None = field(default=None, repr=False)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    # params.prompt_logprobs: one entry per prompt token after the first (runtime.prompt_logprobs)
    prompt_logprobs: list = field(default_factory=list, repr=False)
    _block_row: torch.Tensor | None = field(default=None, repr=False)

    def prompt_logprobs_out(self) -> list | None:
        """``[None, entry of prompt token 1, ...]`` when ``params.prompt_logprobs`` asks, else
        None (the first token has nothing before it to predict it)."""
        if self.params.prompt_logprobs is None:
            return None
        return [None, *self.prompt_logprobs]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def prefill_end(self) -> int:
        """Prefill writes the KV of prompt tokens [0, prompt_len - 1); the last prompt token goes
        through a decode step, which samples the first output token. So every token is sampled by
        decode, and a request whose prompt KV was received (``prompt_kv``) is in the same state as
        one that was prefilled."""
        return len(self.prompt_ids) - 1

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_end

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    def block_row(self) -> torch.Tensor:
        """The request's pages as an int32 tensor: built once, since pages are reserved for the
        whole lifetime at admission (a per-step rebuild of 1500-page rows cost ~0.1 ms each)."""
        if self._block_row is None or self._block_row.shape[0] != len(self.pages):
            self._block_row = torch.tensor(self.pages, dtype=torch.int32)
        return self._block_row

    def slot_of(self, pos: int) -> int:
        """Host slot of token ``pos`` (page-granular block table)."""
        return self.pages[pos // PAGE] * PAGE + pos % PAGE

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Host slots of tokens [start, end) as an int64 tensor (``slot_of`` for each, without a
        Python loop: a 100K-token prompt's list took ~25 ms on a CPU core)."""
        if not 0 <= start <= end <= len(self.pages) * PAGE:
            raise ValueError(
                f"{self.request_id}: tokens [{start}, {end}) outside its "
                f"{len(self.pages) * PAGE} slots"
            )
        first = start // PAGE  # the range's own pages, read from ``pages`` itself (not a cache)
        pages = torch.tensor(self.pages[first : -(-end // PAGE)], dtype=torch.int64)
        pos = torch.arange(start, end)
        return pages[pos // PAGE - first] * PAGE + pos % PAGE

    def check(self) -> None:
        if self.num_computed > self.num_tokens:
            raise AssertionError(
                f"{self.request_id}: computed {self.num_computed} > tokens {self.num_tokens}"
            )
        if self.status is Status.RUNNING and len(self.pages) * PAGE < self.max_total_tokens:
            raise AssertionError(
                f"{self.request_id}: {len(self.pages)} pages < {self.max_total_tokens} tokens"
            )
