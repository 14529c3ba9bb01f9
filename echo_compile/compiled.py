"""The compiled model object: one fullgraph step per batch bucket, cache management included.

``echo_compile.compile(model, ...)`` returns a ``CompiledModel``. It owns:
- the model (weights, static),
- the ``KVCache`` (host KV pool, paged indexer cache, per-layer GPU pools: static buffers that the
  captured graphs mutate in place),
- one compiled decode step per decode bucket and one compiled prefill step per chunk bucket.

Call signature (all device tensors; see docs/CONTRACTS.md for the slot/page conventions)::

    logits = cm.decode(input_ids [B], positions [B], out_slots [B], block_table [B, P],
                       seq_lens [B])
    logits = cm.prefill(input_ids [T], positions [T], out_slots [T], block_table [1, P],
                        seq_lens [1])

``decode`` returns fp32 logits [B, V] (B padded internally to the next bucket and cut back);
``prefill`` returns the logits of the chunk's last token [1, V]. Outputs are cloned, so they
survive the next CUDA-graph replay. The engine (runtime.Engine) drives the same object.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn
from tqdm import tqdm

from custom_ops.cache.config import CacheConfig
from custom_ops.cache.kv_cache import KVCache
from echo_compile import settings
from runtime.model_runner import ModelRunner, next_bucket


def _wrap(compiled: nn.Module, runner: ModelRunner):
    def run(*args: torch.Tensor) -> torch.Tensor:
        if runner.device.type == "cuda":
            # decode and prefill graphs alternate: start a new cudagraph-tree generation each call
            torch.compiler.cudagraph_mark_step_begin()
        if runner.frozen:
            # after warm-up no request may trigger a compile; the stance is scoped to our own calls
            # so that other torch.compile users in the process are not affected
            with torch.compiler.set_stance("fail_on_recompile"):
                return compiled(*args).clone()
        return compiled(*args).clone()

    return run


def compile_runner(runner: ModelRunner, strict: bool = False, prefill: bool = True) -> None:
    """Replace ``runner``'s eager decode (and, with ``prefill``, prefill) step by fullgraph
    torch.compile'd ones."""
    settings.apply(len(runner.decode_buckets) + len(runner.prefill_buckets), strict=strict)
    mode = settings.compile_mode(runner.device)
    opts = dict(fullgraph=True, dynamic=False, mode=mode)
    runner.decode_fn = _wrap(torch.compile(runner.decode_step, **opts), runner)
    if prefill:
        # a compiled prefill has fixed shapes: its block table spans max_model_len (see
        # ModelRunner.prefill_inputs), so it suits short max_model_len only
        runner.prefill_static_width = True
        runner.prefill_fn = _wrap(torch.compile(runner.prefill_step, **opts), runner)


@torch.no_grad()
def warmup(
    runner: ModelRunner, calls: int = 3, progress: bool = True, prefill: bool = True
) -> float:
    """Compile and capture every bucket (``calls`` runs each: warm-up, record, replay) on padding
    rows that every op ignores, then forbid recompiles of these steps; returns the seconds it
    took."""
    t0 = time.perf_counter()
    jobs = [("decode", b) for b in runner.decode_buckets]
    if prefill:
        jobs += [("prefill", b) for b in runner.prefill_buckets]
    runner.frozen = False
    for kind, b in tqdm(jobs, desc="capturing graphs", disable=not progress, unit="graph"):
        args = runner.padding_inputs(kind == "decode", b)
        fn = runner.decode_fn if kind == "decode" else runner.prefill_fn
        for _ in range(calls):
            fn(*args)
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    runner.cache.reset_stats()  # the padding steps are not traffic
    runner.frozen = True
    return time.perf_counter() - t0


class CompiledModel:
    """See the module docstring."""

    def __init__(
        self,
        model: nn.Module,
        cache_config: CacheConfig,
        device: torch.device,
        max_model_len: int,
        decode_buckets: Sequence[int],
        prefill_buckets: Sequence[int],
        strict: bool = False,
    ):
        self.cache = KVCache(cache_config, device)
        self.runner = ModelRunner(
            model, self.cache, device, max_model_len, decode_buckets, prefill_buckets
        )
        compile_runner(self.runner, strict=strict)

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    def warmup(self, calls: int = 3, progress: bool = True, prefill: bool = True) -> float:
        return warmup(self.runner, calls, progress, prefill)

    def _pad(self, t: torch.Tensor, n: int, value: int) -> torch.Tensor:
        if t.shape[0] == n:
            return t
        pad = t.new_full((n - t.shape[0], *t.shape[1:]), value)
        return torch.cat([t, pad])

    def decode(self, input_ids, positions, out_slots, block_table, seq_lens) -> torch.Tensor:
        n = input_ids.shape[0]
        cfg = self.cache.config
        if cfg.offload and n * cfg.topk > cfg.gpu_tokens:
            # the guaranteed recall needs every row's selection on the GPU at once
            raise ValueError(
                f"decode batch {n} x top-k {cfg.topk} exceeds the GPU pool of {cfg.gpu_tokens} rows"
            )
        b = next_bucket(n, self.runner.decode_buckets)
        args = (
            self._pad(input_ids, b, 0),
            self._pad(positions, b, 0),
            self._pad(out_slots, b, -1),
            self._pad(block_table, b, 0),
            self._pad(seq_lens, b, 0),
            torch.arange(b, device=input_ids.device),
        )
        return self.runner.decode_fn(*args)[:n]

    def prefill(self, input_ids, positions, out_slots, block_table, seq_lens) -> torch.Tensor:
        n = input_ids.shape[0]
        b = next_bucket(n, self.runner.prefill_buckets)
        last = positions[n - 1 : n]
        args = (
            self._pad(input_ids, b, 0),
            torch.cat([positions, last.expand(b - n)]),
            self._pad(out_slots, b, -1),
            block_table,
            seq_lens,
            torch.tensor([n - 1], device=input_ids.device),
        )
        return self.runner.prefill_fn(*args)


def compile(  # noqa: A001  (the public name: echo_compile.compile)
    model: nn.Module,
    *,
    host_tokens: int,
    gpu_tokens: int,
    kv_format: str = "bf16",
    offload: bool = True,
    max_batch: int = 8,
    max_model_len: int = 4096,
    decode_buckets: Sequence[int] | None = None,
    prefill_chunk: int = 2048,
    device: str | torch.device | None = None,
    warmup_now: bool = False,
) -> CompiledModel:
    """Compile ``model`` (a ``model.DeepseekV32ForCausalLM``) for offloaded decode; see the module
    docstring for the call signature and the state the returned object owns."""
    from runtime.model_runner import default_decode_buckets, default_prefill_buckets

    device = torch.device(device) if device is not None else next(model.parameters()).device
    cfg = model.config
    cm = CompiledModel(
        model,
        CacheConfig(
            num_layers=cfg.num_hidden_layers,
            host_tokens=host_tokens,
            gpu_tokens=gpu_tokens,
            topk=cfg.index_topk,
            fmt=kv_format,
            offload=offload,
            max_batch=max_batch,
            prefill_tokens=max_model_len if offload else 0,
        ),
        device,
        max_model_len,
        tuple(decode_buckets or default_decode_buckets(max_batch)),
        default_prefill_buckets(prefill_chunk),
    )
    if warmup_now:
        cm.warmup()
    return cm
