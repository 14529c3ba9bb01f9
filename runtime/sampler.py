"""Batched token sampling without host syncs.

Every row of the batch is sampled on the device from its own parameters (temperature, top-k,
top-p, seed, step) with fixed shapes and no ``.item()`` / ``.tolist()``, so the sampler can be
compiled into the decode step (fullgraph, CUDA graphs).

Sampling uses the exponential race: with ``E_v ~ Exp(1)`` independent per token,
``argmax_v p_v / E_v`` is distributed as ``p``. ``E_v`` comes from an integer hash of
(seed, step, vocab index) computed in torch, so a seeded request reproduces exactly whatever else
is in the batch and wherever its row is, and no generator state is carried between steps.

Logprob reported for the chosen token (``logprobs`` output):
- sampled rows (temperature > 0): the log-probability under the distribution actually sampled from,
  i.e. ``log_softmax(logits / temperature)`` after top-k and top-p filtering, renormalised over
  the kept tokens;
- greedy rows (temperature 0): ``log_softmax(logits)`` of the unscaled, unfiltered model
  distribution (the temperature -> 0 limit is a point mass whose logprob is always 0).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.request import Request

_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so that (x < 2**32) * c < 2**63 never overflows int64.
_MUL1 = 0x7FEB352D
_MUL2 = 0x5BD1E995
_SALT_SEED_HI = 0x85EBCA6B
_SALT_STEP = 0x27D4EB2F


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xorshift-multiply, lowbias32 style) on int64 values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _M32
    return x ^ (x >> 16)


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from (seed, step); [B] int64 in [0, 2**32)."""
    # NOTE: >> on int64 is arithmetic; masking afterwards gives the two's-complement halves, so
    # negative seeds are fine.
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    h = _mix32(lo)
    h = _mix32(h ^ hi ^ _SALT_SEED_HI)
    return _mix32(h ^ (steps & _M32) ^ _SALT_STEP)


def exponential_noise(
    seeds: torch.Tensor, steps: torch.Tensor, vocab_ids: torch.Tensor
) -> torch.Tensor:
    """``E ~ Exp(1)`` for each (row, vocab id): fp32 [B, N], a pure function of its inputs.

    ``vocab_ids`` is [B, N] or [N] int64 (the token each column stands for), so noise is attached
    to the token, not to its position after sorting.
    """
    key = _row_keys(seeds, steps)[:, None]  # [B, 1]
    # NOTE: no multiply on vocab_ids: inductor folds an arange into Triton's int32 index math,
    # where a constant >= 2**31 does not compile. The second mix, keyed again, decorrelates rows
    # whose keys differ by a small offset.
    x = (vocab_ids + key) & _M32  # [B, N]
    x = _mix32(_mix32(x) ^ key)
    # t ~ U(0, 1). Built from 0 upwards so that fp32 keeps full relative precision for small t,
    # where the race is decided (small E wins); E = -log(1 - t) keeps that precision via log1p.
    # Clamp: for x near 2**32 the fp32 sum rounds up to 1, which would give E = inf.
    t = ((x.to(torch.float32) + 0.5) * 2.0**-32).clamp(max=1.0 - 2.0**-24)
    return -torch.log1p(-t)


def _blocked_cumsum(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``x.cumsum(-1)`` for [B, V] as a scan within blocks plus a scan of the block totals.

    NOTE: inductor (torch 2.11, CUDA) fails to generate code for one long [B, 129280] scan
    (its split-scan path); short scans of both levels compile fine. Fixed shapes throughout.
    """
    B, V = x.shape
    xp = torch.nn.functional.pad(x, (0, (-V) % block))  # [B, nb * block]
    inner = xp.view(B, -1, block).cumsum(dim=-1)  # [B, nb, block]
    totals = inner[..., -1]  # [B, nb]
    before = totals.cumsum(dim=-1) - totals  # mass of the earlier blocks
    return (inner + before[..., None]).view(B, -1)[:, :V]


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    *,
    all_greedy: bool = False,
    filters: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns ``(token_ids int64 [B], logprobs fp32 [B])``.

    Args:
        logits: fp32 [B, V].
        temperature: fp32 [B]; 0 = greedy (argmax) for that row.
        top_k: int64 [B]; -1 (or any value < 1) disables top-k for that row.
        top_p: fp32 [B] in (0, 1]; 1 disables top-p for that row.
        seeds: int64 [B], the request's seed.
        steps: int64 [B], how many tokens the request has generated before this one.
        all_greedy: static hint (the caller knows its batch's temperatures on the host): every
            row is greedy, skip the sampling path entirely.
        filters: static hint: ``False`` when no row uses top-k or top-p, which skips the sort.
            Rows sample the same token either way (the noise is tied to the vocab id).

    See the module docstring for which logprob is returned.
    """
    _check_inputs(logits, temperature, top_k, top_p, seeds, steps)
    B, V = logits.shape
    greedy_ids = logits.argmax(dim=-1)  # [B]
    greedy_lp = torch.log_softmax(logits, dim=-1).gather(-1, greedy_ids[:, None]).squeeze(-1)
    if all_greedy:
        return greedy_ids, greedy_lp

    is_greedy = temperature <= 0
    t = torch.where(is_greedy, torch.ones_like(temperature), temperature)  # avoid 0-division
    # NOTE: a temperature past fp32's max (SamplingParams takes any finite float, 1e39) is inf
    # here: a masked -inf logit / inf is NaN (a NaN row, token 0), and every other logit / inf
    # is 0, a tie that top-k breaks by vocab order. t = 1e30 is the same limit (uniform over the
    # allowed tokens) without either, and keeps a logit gap down to 1.2e-8 a normal fp32 number
    # (fp32's max made gaps under ~4 subnormal: a flush-to-zero path would tie them again).
    t = t.clamp(max=1e30)
    # NOTE: shift by the row's max first (softmax is shift-invariant): a tiny temperature (fp32
    # 1e-45) then sends the other tokens to -inf, the right limit, where logits / t overflows to
    # +inf, and inf - inf is a NaN distribution (a garbage token, NaN logprobs, a 500).
    top = logits.gather(-1, greedy_ids[:, None])  # [B, 1]
    scaled = (logits - top) / t[:, None]  # [B, V]
    if filters:
        # Sort once: top-k is a rank mask and top-p a cumulative-mass mask in sorted order.
        # stable=True: ties keep vocab order, so top_k=1 picks exactly what argmax picks.
        vals, ids = scaled.sort(dim=-1, descending=True, stable=True)  # [B, V] each
        ranks = torch.arange(V, device=logits.device)
        k = torch.where(top_k >= 1, top_k, V)  # [B]
        vals = vals.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        mass_before = _blocked_cumsum(probs) - probs  # exclusive cumsum; 0 for the top token
        # NOTE: skip rows with top_p == 1: fp32 cumsum can reach 1.0 before the tail and would
        # otherwise drop tokens that an unfiltered row keeps.
        cut = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
        vals = vals.masked_fill(cut, float("-inf"))
    else:
        vals = scaled
        ids = torch.arange(V, device=logits.device).expand(B, V)
    logp = torch.log_softmax(vals, dim=-1)  # [B, V]; -inf on filtered tokens
    noise = exponential_noise(seeds, steps, ids)  # [B, V]
    pos = (logp - torch.log(noise)).argmax(dim=-1, keepdim=True)  # [B, 1]: argmax p / E
    sampled = ids.gather(-1, pos).squeeze(-1)
    sampled_lp = logp.gather(-1, pos).squeeze(-1)
    token_ids = torch.where(is_greedy, greedy_ids, sampled)
    return token_ids, torch.where(is_greedy, greedy_lp, sampled_lp)


def _check_inputs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
) -> None:
    # Shape and dtype checks only: they are static, so they cost nothing under torch.compile.
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 [B, V], got {logits.dtype} {tuple(logits.shape)}")
    B = logits.shape[0]
    for name, x, dtype in (
        ("temperature", temperature, torch.float32),
        ("top_k", top_k, torch.int64),
        ("top_p", top_p, torch.float32),
        ("seeds", seeds, torch.int64),
        ("steps", steps, torch.int64),
    ):
        if x.shape != (B,) or x.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} [{B}], got {x.dtype} {tuple(x.shape)}")


class SamplingBatch(NamedTuple):
    """Per-row sampling tensors plus the static hints, built on the host by ``prepare_batch``."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    all_greedy: bool
    filters: bool


def prepare_batch(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    steps: Sequence[int],
    device: torch.device | str = "cpu",
) -> SamplingBatch:
    """Build the [B] tensors of ``sample`` from each row's params, seed (``request_seed``) and step.

    Rows are in batch order; the engine pads with greedy rows if it needs a fixed batch size.
    """
    if not (len(params) == len(seeds) == len(steps)):
        raise ValueError(
            f"prepare_batch: params, seeds and steps differ in length "
            f"({len(params)}, {len(seeds)}, {len(steps)})"
        )
    # built on the host, then one copy per dtype: to a CUDA device from pinned memory and
    # non_blocking, since a pageable copy waits for the step's graph to finish (the sampling
    # kernels then queue behind the graph instead; no measurable step-time difference at B = 64
    # on the H200, docs/quantization.md)
    floats = torch.tensor(
        [[p.temperature for p in params], [p.top_p for p in params]], dtype=torch.float32
    )
    ints = torch.tensor([[p.top_k for p in params], list(seeds), list(steps)], dtype=torch.int64)
    device = torch.device(device)
    if device.type == "cuda":
        floats, ints = (t.pin_memory().to(device, non_blocking=True) for t in (floats, ints))
    else:
        floats, ints = floats.to(device), ints.to(device)
    return SamplingBatch(
        temperature=floats[0],
        top_k=ints[0],
        top_p=floats[1],
        seeds=ints[1],
        steps=ints[2],
        all_greedy=all(p.greedy for p in params),
        filters=any(not p.greedy and (p.top_k >= 1 or p.top_p < 1) for p in params),
    )


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a fresh random one drawn once per request."""
    if params.seed is not None:
        return params.seed
    return random.SystemRandom().getrandbits(63)


class LogitsProcessor(Protocol):
    """A hook on each decode step's logits before sampling: ``Engine.logits_processors`` holds
    them, applied in order (batch-level, like vLLM v1's logits processors).

    Called with the step's requests, in batch order (their ``prompt_ids``, ``output_ids``,
    ``params`` and ``request_id`` say what each row is), and the fp32 logits ``[B, V]`` of those
    rows; returns logits of the same shape (it may modify them in place). Runs on the host, once
    per decode step, outside any captured graph; device work in it should be a few batched ops
    (a per-row Python loop of kernels costs more than a compiled step's own launches). Sampling
    then runs on what it returns: greedy rows take its argmax, sampled rows its distribution,
    and logprobs are computed from it. A returned row with a NaN or +inf, or every logit -inf,
    ends that request with finish_reason "error" naming the processor (``bad_stage``; the other
    rows go on); an output of the wrong type, shape, dtype or device is a ValueError from the
    step.
    """

    def __call__(self, requests: Sequence[Request], logits: torch.Tensor) -> torch.Tensor: ...


def unusable_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool ``[B]``: the rows of fp32 logits ``[B, V]`` that cannot be sampled from: a NaN or a
    +inf, or every logit -inf (no token left). On the device, no host sync."""
    return ~((logits < math.inf).all(-1) & (logits > -math.inf).any(-1))


def bad_stage(unusable: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per row of a decode step, which logits processor made its logits unusable, on the device
    (no host sync: the code goes to the host with the step's tokens). ``unusable``: the
    ``unusable_rows`` of the logits before the processors, then after each (taken as each
    returns: a later processor may write in place). int64 ``[B]``: 0 when the last stage is
    usable; else ``k + 2`` for processor ``k``, the one after the row's last usable stage; 1 when
    the row was unusable before any processor ran."""
    bad = torch.stack(list(unusable), 1)  # [B, P + 1]
    idx = torch.arange(bad.shape[1], device=bad.device)
    last_ok = torch.where(bad, -1, idx).max(1).values  # [B]
    return torch.where(bad[:, -1], last_ok + 2, 0)


def force_tokens(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """Make each row in ``rows`` choose its token in ``tokens`` whatever the sampling parameters:
    every other logit of the row becomes -inf (the row's distribution is then a point mass, so
    greedy and sampled rows alike pick it, with logprob 0). In place on ``logits`` [B, V]; two
    indexed writes for the whole batch. For logits processors."""
    if len(rows) != len(tokens):
        raise ValueError(f"force_tokens: {len(rows)} rows but {len(tokens)} tokens")
    if not rows:
        return logits
    idx = torch.tensor([list(rows), list(tokens)], dtype=torch.int64)
    if logits.is_cuda:
        # pinned + non_blocking: a pageable copy would wait for the step's graph to finish
        idx = idx.pin_memory().to(logits.device, non_blocking=True)
    r, t = idx[0], idx[1]
    logits[r] = float("-inf")
    logits[r, t] = 0.0
    return logits
