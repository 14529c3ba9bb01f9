"""DeepGEMM's DSA decode indexer as ``echo::`` ops: ``fp8_paged_mqa_logits`` and its schedule.

``echo::dg_paged_mqa_schedule(seq_lens, schedule)`` fills the static schedule buffer
(``[num_sms + 1, 2]`` int32, ``get_paged_mqa_logits_metadata``); it depends only on the step's
lengths, so the cache runs it once per decode step and every layer's logits read it.
``echo::dg_paged_mqa_logits(q, weights, index_cache, block_table, seq_lens, schedule, width)`` ->
scores fp32 [B, width]: ``k_scale[t] * sum_h w[b, h] * relu(q[b, h] . k[t])`` for t < seq_len;
entries at t >= seq_len are unspecified (no clean-up pass: every top-k here reads live positions
only). ``width`` (>= P * 64, a multiple of ``WIDTH_ALIGN``) is the row width DeepGEMM allocates, so
the output is one contiguous tensor, not a slice.

No copy around the call: the paged indexer cache ``[pages, 8448]`` uint8 (per page 64 x 128 e4m3
values, then 64 fp32 scales) is, viewed as ``[pages, 64, 1, 132]``, DeepGEMM's fused KV cache
(strides (8448, 132, 132, 1): the values of token j at byte 128 j of its page, its scale at byte
64 x 128 + 4 j, which is where DeepGEMM reads them; ``fused_kv_view`` and the CPU test check it).

Default kernels (CPU): the logits are the reference scores (-inf past
each length); the schedule is DeepGEMM's private data, so its CPU kernel writes zeros (only the
DeepGEMM kernel reads it). The library is imported on the first CUDA call.
"""

from __future__ import annotations

import functools

import torch

from custom_ops.kv_format import INDEX_DIM, INDEX_PAGE_BYTES, PAGE, index_cache_gather

BLOCK_KV = PAGE  # DeepGEMM's block_kv: our page (SM90 supports 64 only)
WIDTH_ALIGN = 1024  # DeepGEMM rounds its row width up (to a multiple of <= 4 x 64): stay aligned
HEADS = (32, 64)  # index heads the SM90 kernel is built for (V3.2 has 64)
PREFILL_WIDTH_ALIGN = 256  # fp8_mqa_logits' block_kv on SM90 (prefill_logits_width)


def logits_width(L: int) -> int:
    """The score row width for a block table of L = P * 64 tokens."""
    return -(-L // WIDTH_ALIGN) * WIDTH_ALIGN


def prefill_logits_width(L: int) -> int:
    """The row width of DeepGEMM's prefill scores (``fp8_mqa_logits``, compressed rows:
    custom_ops/backends/deep_gemm_prefill.py) over L = P * 64 keys: L rounded up to its SM90
    block_kv of 256."""
    return -(-L // PREFILL_WIDTH_ALIGN) * PREFILL_WIDTH_ALIGN


def fused_kv_view(index_cache: torch.Tensor) -> torch.Tensor:
    """The paged indexer cache as DeepGEMM's fused ``[pages, 64, 1, 132]`` uint8: a view."""
    if index_cache.dtype != torch.uint8 or index_cache.shape[-1] != INDEX_PAGE_BYTES:
        raise ValueError(f"deep_gemm: index cache must be uint8 [pages, {INDEX_PAGE_BYTES}]")
    return index_cache.view(index_cache.shape[0], PAGE, 1, INDEX_DIM + 4)


@functools.lru_cache(maxsize=1)
def _lib():
    import deep_gemm  # the optional [kernels] extra; select.py checks it is installed

    return deep_gemm


def schedule_rows(device: torch.device) -> int:
    """Rows of the schedule buffer: DeepGEMM's SM count + 1."""
    if device.type != "cuda":
        return 133
    return int(_lib().get_num_sms()) + 1


def scores_ref(q_fp8, weights, index_cache, block_table, seq_lens, width: int) -> torch.Tensor:
    B, P = block_table.shape
    L = P * PAGE
    t = torch.arange(L, device=q_fp8.device)
    slots = block_table[:, t // PAGE].long() * PAGE + (t % PAGE)  # [B, L]
    k, k_scale = index_cache_gather(index_cache, slots)  # [B, L, 128], [B, L]
    logits = torch.einsum("bhd,btd->bht", q_fp8.view(torch.float8_e4m3fn).float(), k)
    score = (logits.relu() * weights.float()[:, :, None]).sum(dim=1) * k_scale  # [B, L]
    score = torch.where(t[None, :] < seq_lens[:, None].long(), score, float("-inf"))
    out = score.new_full((B, width), float("-inf"))
    out[:, :L] = score
    return out


def _check(q_fp8, weights, index_cache, block_table, seq_lens, schedule, width) -> None:
    if q_fp8.dtype != torch.uint8 or q_fp8.dim() != 3 or q_fp8.shape[-1] != INDEX_DIM:
        raise ValueError(f"dg_paged_mqa_logits: q must be uint8 [B, H, {INDEX_DIM}] (e4m3 bytes)")
    B, H = q_fp8.shape[:2]
    if weights.shape != (B, H) or weights.dtype != torch.float32:
        raise ValueError(f"dg_paged_mqa_logits: weights must be fp32 [{B}, {H}]")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("dg_paged_mqa_logits: block_table and seq_lens must be int32")
    if block_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError("dg_paged_mqa_logits: block_table must be [B, P] and seq_lens [B]")
    if width < block_table.shape[1] * PAGE or width % WIDTH_ALIGN:
        raise ValueError(
            f"dg_paged_mqa_logits: width {width} must cover the block table and be a multiple "
            f"of {WIDTH_ALIGN}"
        )
    if schedule.dtype != torch.int32 or schedule.dim() != 2 or schedule.shape[1] != 2:
        raise ValueError("dg_paged_mqa_logits: schedule must be int32 [num_sms + 1, 2]")
    fused_kv_view(index_cache)


def _lens(seq_lens: torch.Tensor) -> torch.Tensor:
    """The context lengths as DeepGEMM gets them, in both calls alike: ``[B, next_n = 1]`` (this
    build, 0.1.5.post1, asserts 2-D) and at least 1. NOTE: when every length is 0 (the engine's
    padded warm-up batch) its schedule and its logits kernel each read one entry past their
    arrays (read in its sm90 scheduler source); with 1, a padding row scores position 0 of
    page 0, which the top-k never takes (it reads the real lengths). Not verified on a GPU to be
    the cause of the B = 64 warm-up failure (docs/backends.md)."""
    return seq_lens.clamp(min=1).view(-1, 1)


@torch.library.custom_op("echo::dg_paged_mqa_schedule", mutates_args=("schedule",))
def dg_paged_mqa_schedule(seq_lens: torch.Tensor, schedule: torch.Tensor) -> None:
    """Default kernel (CPU): zeros (DeepGEMM's private data; nothing else reads it)."""
    schedule.zero_()


@dg_paged_mqa_schedule.register_kernel("cuda")
def _(seq_lens, schedule):
    meta = _lib().get_paged_mqa_logits_metadata(_lens(seq_lens), BLOCK_KV, schedule.shape[0] - 1)
    schedule.copy_(meta)  # a few hundred bytes, once per step


@dg_paged_mqa_schedule.register_fake
def _(seq_lens, schedule):
    return None


@torch.library.custom_op("echo::dg_paged_mqa_logits", mutates_args=())
def dg_paged_mqa_logits(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    schedule: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Default kernel (CPU): the reference scores."""
    _check(q_fp8, weights, index_cache, block_table, seq_lens, schedule, width)
    return scores_ref(q_fp8, weights, index_cache, block_table, seq_lens, width)


@dg_paged_mqa_logits.register_kernel("cuda")
def _(q_fp8, weights, index_cache, block_table, seq_lens, schedule, width):
    _check(q_fp8, weights, index_cache, block_table, seq_lens, schedule, width)
    if q_fp8.shape[1] not in HEADS:
        raise ValueError(f"dg_paged_mqa_logits: DeepGEMM needs {HEADS} index heads")
    q = q_fp8.contiguous().view(torch.float8_e4m3fn).unsqueeze(1)  # [B, next_n = 1, H, 128]
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    out = _lib().fp8_paged_mqa_logits(
        q, fused_kv_view(index_cache), weights.contiguous(), _lens(seq_lens), bt,
        schedule, width, False,
    )  # fmt: skip
    # NOTE: the fake promises a contiguous [B, width]; with width aligned DeepGEMM returns that
    # already, and a copy only happens if a build aligns rows more coarsely than WIDTH_ALIGN
    return out if out.is_contiguous() else out.contiguous()


@dg_paged_mqa_logits.register_fake
def _(q_fp8, weights, index_cache, block_table, seq_lens, schedule, width):
    return q_fp8.new_empty((q_fp8.shape[0], width), dtype=torch.float32)
