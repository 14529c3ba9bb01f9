"""A prompt's KV computed elsewhere: the decode side of prefill/decode disaggregation.

In a PD-disaggregated deployment (the setup the ECHO paper recommends, and what vLLM's and
SGLang's KV connectors serve) a prefill instance computes a prompt's KV cache and a decode
instance receives it into the host slots it reserved for the request, then decodes. Here the
receiving end is ``Engine.add_request(..., prompt_kv=kv)``; the sending end of a local engine is
``Engine.prompt_kv(request_id)``.

What is transferred, per layer, for the prompt's tokens ``0 .. len(prompt) - 2`` (the last prompt
token goes through the first decode step, which samples the first output token, exactly as after
a local prefill; see ``Request.prefill_end``), in the cache's own byte formats
(``custom_ops.kv_format``):
- the MLA latent row of each token: ``uint8 [T, ROW_BYTES[fmt]]`` (``pack_kv_rows``);
- the indexer key row of each token: ``uint8 [T, 132]`` (``pack_index_k``: 128 e4m3 + fp32 scale).

A source is anything with ``num_layers``, ``num_tokens``, ``row_bytes`` and
``chunk(layer, start, end) -> (kv_rows, index_rows)``: ``PromptKV`` holds the tensors, and a
generator (the benchmark's random KV) can produce chunks on demand instead of holding 100K-token
prompts in memory. The engine writes the rows chunk by chunk at admission, through the same
``LayerKV.store`` that prefill writes with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from custom_ops.kv_format import INDEX_DIM, INDEX_PAGE_BYTES, INDEX_ROW_BYTES, PAGE


@runtime_checkable
class PromptKVSource(Protocol):
    """Where an engine reads a prompt's KV rows from (see the module docstring)."""

    num_layers: int
    num_tokens: int
    row_bytes: int

    def chunk(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of tokens ``[start, end)`` of ``layer``: (kv uint8 [n, row_bytes],
        index uint8 [n, 132]), on any device."""
        ...


class PromptKV:
    """A prompt's KV rows held as tensors: ``kv_rows`` and ``index_rows`` are per layer
    ``uint8 [T, row_bytes]`` and ``uint8 [T, 132]`` (a list of one tensor per layer, or one
    tensor ``[layers, T, ...]``)."""

    def __init__(
        self,
        kv_rows: Sequence[torch.Tensor] | torch.Tensor,
        index_rows: Sequence[torch.Tensor] | torch.Tensor,
    ):
        kv, ix = list(kv_rows), list(index_rows)
        if not kv or len(kv) != len(ix):
            raise ValueError(
                f"PromptKV: kv_rows and index_rows need one entry per layer, got {len(kv)} and "
                f"{len(ix)}"
            )
        t, row = _shape2(kv[0], "kv_rows[0]")
        for i, (k, x) in enumerate(zip(kv, ix)):
            if _shape2(k, f"kv_rows[{i}]") != (t, row):
                raise ValueError(
                    f"PromptKV: kv_rows[{i}] is {tuple(k.shape)}, layer 0 is {(t, row)}"
                )
            if _shape2(x, f"index_rows[{i}]") != (t, INDEX_ROW_BYTES):
                raise ValueError(
                    f"PromptKV: index_rows[{i}] must be uint8 [{t}, {INDEX_ROW_BYTES}], "
                    f"got {tuple(x.shape)}"
                )
        self.kv_rows, self.index_rows = kv, ix
        self.num_layers, self.num_tokens, self.row_bytes = len(kv), t, row

    def chunk(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_rows[layer][start:end], self.index_rows[layer][start:end]


def _shape2(t: torch.Tensor, name: str) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"PromptKV: {name} must be a 2-D uint8 tensor, got {got}")
    return tuple(t.shape)  # type: ignore[return-value]


def check_source(kv: object, num_layers: int, num_tokens: int, row_bytes: int, fmt: str) -> None:
    """Raise ValueError unless ``kv`` can fill a prompt of ``num_tokens`` KV rows in a cache of
    ``num_layers`` layers with ``row_bytes``-byte rows (format ``fmt``)."""
    if not isinstance(kv, PromptKVSource):
        raise ValueError(
            "prompt_kv must be a runtime.prompt_kv.PromptKV (or have num_layers, num_tokens, "
            f"row_bytes and chunk()), got {type(kv).__name__}"
        )
    if kv.num_layers != num_layers:
        raise ValueError(f"prompt_kv has {kv.num_layers} layers, the model has {num_layers}")
    if kv.num_tokens != num_tokens:
        raise ValueError(
            f"prompt_kv holds {kv.num_tokens} tokens; a prompt of {num_tokens + 1} tokens needs "
            f"the KV of all but its last token: {num_tokens}"
        )
    if kv.row_bytes != row_bytes:
        raise ValueError(
            f"prompt_kv rows are {kv.row_bytes} bytes, the cache's {fmt!r} rows are {row_bytes}"
        )


def check_uncut(prompt_tokens: int, kept_tokens: int) -> None:
    """A request with ``prompt_kv`` whose ``truncate_prompt_tokens`` cut its prompt is refused:
    the KV is the uncut prompt's (its token count check would name rows, not the cut)."""
    if kept_tokens < prompt_tokens:
        raise ValueError(
            f"truncate_prompt_tokens cut the prompt from {prompt_tokens} to {kept_tokens} "
            "tokens, but prompt_kv holds the KV of the uncut prompt: truncate before computing "
            "the KV, and send the kept tokens"
        )


def check_chunk(kv: torch.Tensor, index: torch.Tensor, n: int, row_bytes: int, where: str) -> None:
    """A source's chunk must have the shapes it promised (a generator could get them wrong)."""
    for t, width, name in ((kv, row_bytes, "kv rows"), (index, INDEX_ROW_BYTES, "index rows")):
        ok = isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape == (n, width)
        if not ok:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
            raise ValueError(f"prompt_kv chunk {where}: {name} must be uint8 [{n}, {width}], {got}")


def read_prompt_kv(layers: Sequence, slots: torch.Tensor | Sequence[int]) -> PromptKV:
    """The rows of host ``slots`` in every layer of a cache (``KVCache.layers``), as a
    ``PromptKV``: the latent rows from the host pool, the indexer rows from the paged indexer
    cache (its per-page layout: 64 x 128 value bytes, then 64 fp32 scales)."""
    kv, index = [], []
    slots = torch.as_tensor(slots, dtype=torch.int64)  # once, not per layer
    for layer in layers:
        s = slots.to(layer.host_kv.device)
        kv.append(layer.host_kv[s].clone())
        s = s.to(layer.index_k.device)
        page, off = s // PAGE, s % PAGE
        flat = layer.index_k.view(-1)
        base = page * INDEX_PAGE_BYTES
        vidx = (base + off * INDEX_DIM)[:, None] + torch.arange(INDEX_DIM, device=s.device)
        sidx = (base + PAGE * INDEX_DIM + off * 4)[:, None] + torch.arange(4, device=s.device)
        index.append(torch.cat([flat[vidx], flat[sidx]], dim=-1))
    return PromptKV(kv, index)


# tokens written per store call: bounds the staging memory of a received prompt's load
WRITE_CHUNK = 16384


def write_prompt_kv(
    layers: Sequence,
    src: PromptKVSource,
    slots_of,  # (start, end) -> int64 host slots [end - start] on the cache's device
    n: int,
    row_bytes: int,
    device: torch.device,
) -> None:
    """Write the first ``n`` tokens of a received prompt KV into every layer's host slots, chunk
    by chunk, through the prefill's own write path (``LayerKV.store``); a malformed chunk raises
    ValueError naming its layer and range (the tokens before it are written)."""
    for start in range(0, n, WRITE_CHUNK):
        end = min(start + WRITE_CHUNK, n)
        slots = slots_of(start, end)
        for i, layer in enumerate(layers):
            kv, index = src.chunk(i, start, end)
            check_chunk(kv, index, end - start, row_bytes, f"layer {i} [{start}, {end})")
            layer.store(kv.to(device), index.to(device), slots)
