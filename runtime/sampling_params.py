"""SamplingParams: how one request is decoded, validated once when the request arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class SamplingParamsError(ValueError):
    """A bad sampling parameter; ``param`` names the field (the server reports it as ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(x: Any) -> bool:
    # NOTE: bool is a subclass of int; `max_tokens=True` is a caller bug, not 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (_is_int(x) or isinstance(x, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters of one request.

    - ``max_tokens``: at most this many generated tokens (>= 1).
    - ``temperature``: >= 0; 0 means greedy (argmax), and then top_k / top_p / seed are ignored.
    - ``top_p``: nucleus filtering, 0 < top_p <= 1 (1 disables it).
    - ``top_k``: keep the k most likely tokens; -1 disables it, otherwise >= 1.
    - ``seed``: a request with a seed reproduces exactly, whatever else is in the batch; ``None``
      lets the engine draw one (``runtime.sampler.request_seed``). Must fit in int64.
    - ``stop``: strings that end generation; the text is cut before the stop string. A single
      string or a list is accepted and stored as a tuple.
    - ``stop_token_ids``: token ids that end generation (besides EOS).
    - ``ignore_eos``: keep generating after EOS (benchmarks).
    - ``logprobs``: return the log-probability of every chosen token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError(
                "max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if (
            not _is_number(self.temperature)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise SamplingParamsError(
                "temperature", f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise SamplingParamsError(
                "top_p", f"top_p must be a number with 0 < top_p <= 1, got {self.top_p!r}"
            )
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise SamplingParamsError(
                "top_k", f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}"
            )
        if self.seed is not None and (
            not _is_int(self.seed) or not (INT64_MIN <= self.seed <= INT64_MAX)
        ):
            raise SamplingParamsError(
                "seed", f"seed must be null or a 64-bit signed integer, got {self.seed!r}"
            )
        # Normalise the sequence fields to tuples so the object stays hashable and immutable.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise SamplingParamsError(
                "stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}"
            )
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise SamplingParamsError(
                "stop_token_ids",
                f"stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}",
            )
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        for name in ("ignore_eos", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(
                    name, f"{name} must be a boolean, got {getattr(self, name)!r}"
                )

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0
