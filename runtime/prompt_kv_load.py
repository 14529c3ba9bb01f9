"""The receiving end of prefill/decode disaggregation in the engine: a just-admitted request's
received prompt KV (``runtime.prompt_kv``) written into its host slots in place of its prefill
(``Engine._schedule`` calls it before the batch that would prefill the request)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from custom_ops.cache.kv_cache import KVCache
from runtime.prompt_kv import write_prompt_kv
from runtime.request import Request
from runtime.scheduler import Scheduler


def load_prompt_kv(
    req: Request,
    cache: KVCache,
    device: torch.device,
    scheduler: Scheduler,
    fail: Callable[[Request], None],
) -> float:
    """Write ``req``'s received prompt KV into its host slots (``write_prompt_kv``) and mark its
    prompt computed; returns the seconds the write took. A bad chunk, or a source whose
    ``chunk()`` raises anything else (a connector's I/O error, rows that cannot be copied), is
    re-raised after ``fail(req)`` (the engine finishes it with an error: left queued, every later
    step would retry the load and raise again)."""
    n = req.prefill_end
    t0 = time.perf_counter()
    try:
        write_prompt_kv(
            cache.layers, req.prompt_kv, lambda s, e: req.slots(s, e).to(device),
            n, cache.config.row_bytes, device,
        )  # fmt: skip
    except Exception:
        fail(req)  # its pages hold a partial prompt: never decode them
        raise
    if device.type == "cuda":
        # so that the time is the load's own (the decode step after it syncs on its sampled
        # tokens anyway)
        torch.cuda.synchronize(device)
    took = time.perf_counter() - t0
    req.num_computed = n
    req.prompt_kv = None  # the rows are in the cache now; let the source go
    scheduler.computed(req)
    return took
