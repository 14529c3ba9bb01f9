"""SamplingParams: how one request is decoded, validated once when the request arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_TOP_LOGPROBS = 20  # as vLLM's default cap
# a repetition penalty past this can overflow a seen negative logit to -inf in fp32 (a logit of
# magnitude 3.4e8 would do: none is near it, so smaller penalties never mask)
OVERFLOWING_PENALTY = 1e30


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

    - ``max_tokens``: at most this many generated tokens (>= 1); None: up to the context limit,
      as vLLM reads it (the engine sets it to the limit less the prompt when the request is
      added, ``fill_max_tokens``; its host pages are reserved for that whole length).
    - ``temperature``: >= 0; 0 means greedy (argmax), and then top_k / top_p / seed are ignored.
    - ``top_p``: nucleus filtering, 0 < top_p <= 1 (1 disables it).
    - ``top_k``: keep the k most likely tokens; -1 or 0 disables it (stored as -1, as vLLM
      reads 0), otherwise >= 1.
    - ``seed``: a request with a seed reproduces exactly, whatever else is in the batch; ``None``
      lets the engine draw one (``runtime.sampler.request_seed``). Must fit in int64.
    - ``stop``: strings that end generation; the text is cut before the stop string. A single
      string or a list is accepted and stored as a tuple (None: none, as vLLM reads it; so
      for ``stop_token_ids`` and ``logit_bias``).
    - ``stop_token_ids``: token ids that end generation (besides EOS).
    - ``ignore_eos``: keep generating after EOS (benchmarks).
    - ``logprobs``: return the log-probability of every chosen token.
    - ``presence_penalty`` / ``frequency_penalty`` (OpenAI's, in [-2, 2]): subtract
      ``presence * [count > 0] + frequency * count`` from the logit of every token generated so
      far (``count`` = times generated).
    - ``repetition_penalty`` (> 0, 1 disables): divide positive / multiply negative logits of
      every token in the prompt or generated so far (CTRL's, as vLLM and HF apply it).
    - ``logit_bias``: ``{token_id: bias}`` (or (token_id, bias) pairs, which may name a token
      once) added to those logits, bias in [-100, 100]; stored as a sorted tuple of pairs so the
      object stays hashable.
    - ``min_p``: in [0, 1]; drop tokens whose probability (after temperature) is below
      ``min_p`` times the top token's. Ignored by greedy rows (the argmax always survives).
    - ``min_tokens``: EOS and ``stop_token_ids`` cannot be chosen before this many tokens, and
      no stop string ends in their text (one that ends in a later token's does; vLLM's rule);
      at most ``max_tokens``.
    - ``grammar``: an llguidance grammar (``runtime.structured_output.json_schema_grammar`` makes
      one from a JSON schema) the output must follow; None: free text.
    - ``grammar_after_reasoning``: the grammar starts after the reasoning, at the token after the
      one that completes ``</think>`` in the output (thinking mode: the server and ``LLM.chat``
      set it there); before it nothing is masked, and a reply that never writes ``</think>``
      is not constrained at all (``max_tokens``, ``min_tokens`` and EOS count and end it as
      usual). ``runtime.structured_output`` applies it; without a grammar it does nothing.
    - ``top_logprobs``: 0..20; return that many most likely (token, logprob) per generated token
      (log-softmax of the logits after the controls, before temperature and top-k / top-p).
    - ``prompt_logprobs``: None, or 0..20: the logprob of every prompt token after the first and
      that many most likely alternatives (log-softmax of the model's raw logits; vLLM's). NOTE:
      such a request's prefill runs eagerly (``runtime.prompt_logprobs``).
    - ``skip_special_tokens`` (vLLM's, default True): the generated text leaves out special
      tokens (BOS, EOS under ``ignore_eos``, the chat markers); False keeps their text, so a stop
      string naming one then matches it. An EOS or a ``stop_token_ids`` token that ends the
      request is never in the text either way (as vLLM's).
    - ``spaces_between_special_tokens`` (vLLM's, default True): False gives a special (added)
      token that follows another its own text alone, as vLLM's fast-tokenizer detokenizer does;
      only with ``skip_special_tokens=False``. The byte-level decoder (DeepSeek's) never puts a
      space between them, so there the text is the same either way.
    - ``truncate_prompt_tokens`` (vLLM's): None (default) or an integer >= 1: the request runs on
      the prompt's last N tokens only (left truncation, as vLLM truncates for generation); -1:
      the last ``max_model_len``. More than ``max_model_len`` is refused when the request is
      added (``truncate_prompt``), as vLLM refuses it. The truncated prompt is the request's
      prompt everywhere: the context check, ``max_tokens=None``, the prefix cache, usage,
      ``prompt_logprobs`` and the returned prompt ids.
    ``runtime.sampling_controls`` applies the penalties, ``logit_bias``, ``min_p`` and
    ``min_tokens``, on the device, before sampling.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | dict[int, float] = ()
    min_p: float = 0.0
    min_tokens: int = 0
    top_logprobs: int = 0
    grammar: str | None = None
    grammar_after_reasoning: bool = False
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingParamsError(
                "max_tokens", f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}"
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
        # (a k past the vocabulary keeps every token; past int64 it cannot reach the sampler)
        if not _is_int(self.top_k) or not (
            self.top_k in (-1, 0) or 1 <= self.top_k <= INT64_MAX
        ):
            raise SamplingParamsError(
                "top_k",
                f"top_k must be -1 or 0 (disabled) or an integer in [1, 2**63), got {self.top_k!r}",
            )
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)
        if self.seed is not None and (
            not _is_int(self.seed) or not (INT64_MIN <= self.seed <= INT64_MAX)
        ):
            raise SamplingParamsError(
                "seed", f"seed must be null or a 64-bit signed integer, got {self.seed!r}"
            )
        # Normalise the sequence fields to tuples so the object stays hashable and immutable
        # (None: empty, as vLLM's SamplingParams takes it).
        for name in ("stop", "stop_token_ids", "logit_bias"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
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
        bools = (
            "ignore_eos",
            "logprobs",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "grammar_after_reasoning",
        )
        for name in bools:
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(
                    name, f"{name} must be a boolean, got {getattr(self, name)!r}"
                )

        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or not (t == -1 or t >= 1)):
            raise SamplingParamsError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be null, -1 or an integer >= 1, got {t!r}",
            )
        self._check_controls()

    def _check_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2 <= v <= 2:
                raise SamplingParamsError(name, f"{name} must be a number in [-2, 2], got {v!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not math.isfinite(rp) or rp <= 0:
            raise SamplingParamsError(
                "repetition_penalty", f"repetition_penalty must be a finite number > 0, got {rp!r}"
            )
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, dict) else bias
        if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple))
            and len(p) == 2
            and _is_int(p[0])
            and p[0] >= 0
            and _is_number(p[1])
            and -100 <= p[1] <= 100
            for p in pairs
        ):
            raise SamplingParamsError(
                "logit_bias",
                f"logit_bias must map token ids >= 0 to numbers in [-100, 100], got {bias!r}",
            )
        seen = [int(p[0]) for p in pairs]
        if len(set(seen)) != len(seen):  # (each would be added: two +100s made +200)
            dup = next(t for t in seen if seen.count(t) > 1)
            raise SamplingParamsError(
                "logit_bias", f"logit_bias gives token {dup} more than one bias, got {bias!r}"
            )
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise SamplingParamsError(
                "min_p", f"min_p must be a number in [0, 1], got {self.min_p!r}"
            )
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise SamplingParamsError("grammar", "grammar must be a non-empty string or None")
        if self.grammar is not None:
            # a finished grammar allows only EOS: forbidding EOS would leave no allowed token
            for name in ("min_tokens", "ignore_eos"):
                if getattr(self, name):
                    raise SamplingParamsError(
                        name, f"{name} cannot be combined with structured output (a grammar)"
                    )
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError(
                "top_logprobs",
                f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                f"got {self.top_logprobs!r}",
            )
        pl = self.prompt_logprobs
        if pl is not None and (not _is_int(pl) or not 0 <= pl <= MAX_TOP_LOGPROBS):
            raise SamplingParamsError(
                "prompt_logprobs",
                f"prompt_logprobs must be null or an integer in [0, {MAX_TOP_LOGPROBS}], "
                f"got {pl!r}",
            )
        most = self.max_tokens if self.max_tokens is not None else self.min_tokens
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= most:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}",
            )

    @property
    def has_controls(self) -> bool:
        """Some penalty, bias, min_p or min_tokens is set (``runtime.sampling_controls``)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or (self.min_p > 0 and not self.greedy)
            or self.min_tokens
        )

    def may_mask_every_token(self, generated: int) -> bool:
        """Its own parameters may leave no token to sample (every logit -inf) at the step that
        samples its ``generated + 1``-th token, so the engine checks its row then
        (``runtime.decode_sampling``): ``min_tokens`` holds back EOS and every ``stop_token_ids``
        token (all of them, if those are every id) until it is reached, a grammar masks what it does
        not allow, and a huge ``repetition_penalty`` sends a seen negative logit to -inf (fp32
        overflow). The penalties, ``logit_bias`` (at most -100) and ``min_p`` (relative to the
        best token) never take the last token. (Called per row per step: no allocation.)"""
        return (
            generated < self.min_tokens
            or self.grammar is not None
            or self.repetition_penalty > OVERFLOWING_PENALTY
        )

    def masking(self, generated: int) -> list[str]:
        """The parameters behind ``may_mask_every_token(generated)``, a phrase each:
        what a request left without a token to sample is told (``Engine._processor_error``)."""
        why = []
        if generated < self.min_tokens:
            why.append(f"min_tokens {self.min_tokens} holding back EOS and its stop_token_ids")
        if self.grammar is not None:
            why.append("its grammar allowing no token")
        if self.repetition_penalty > OVERFLOWING_PENALTY:
            why.append(f"repetition_penalty {self.repetition_penalty:g} overflowing to -inf")
        return why

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0


def truncate_prompt(ids: list[int], params: SamplingParams, limit: int) -> list[int]:
    """The prompt ``ids`` a request with ``params`` runs on: its last
    ``params.truncate_prompt_tokens`` tokens (-1: the last ``limit``, the context), ``ids`` itself
    when that is unset or not shorter. SamplingParamsError when it asks for more than ``limit``
    (vLLM's check: such a prompt can never fit). Applied once where a request enters the engine,
    before the context check, ``fill_max_tokens`` and the prefix cache's lookup; applying it
    again changes nothing."""
    n = params.truncate_prompt_tokens
    if n is None:
        return ids
    if n == -1:
        n = limit
    if n > limit:
        raise SamplingParamsError(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens ({n}) is greater than the context limit (max_model_len) "
            f"of {limit} tokens",
        )
    return ids[-n:] if len(ids) > n else ids


def fill_max_tokens(params: SamplingParams, n_prompt: int, limit: int) -> SamplingParams:
    """``params`` with ``max_tokens=None`` made what the context ``limit`` leaves after a prompt of
    ``n_prompt`` tokens (ValueError when it leaves nothing); other params as they are."""
    if params.max_tokens is not None:
        return params
    if n_prompt >= limit:
        raise ValueError(
            f"max_tokens=None: the prompt ({n_prompt} tokens) leaves nothing to generate within "
            f"the context limit of {limit} tokens"
        )
    return replace(params, max_tokens=limit - n_prompt)


# The generation_config.json fields that become a request's defaults where it leaves them unset,
# the ones vLLM's ``--generation-config auto`` reads (``do_sample`` is not read, as there), besides
# max_new_tokens, HF's name of max_tokens: the default of a request without params (``LLM``'s),
# as in vLLM's ``LLM.generate``; NOT applied by the server, whose requests always set max_tokens
# (the OpenAI default, or what the context leaves).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG_MODES = ("auto", "none")
# how an error about generation_config.json says it can be left unread
UNREAD_HINT = "(generation_config='none', --generation-config none: the file is not read)"


def generation_defaults(gen: Any, mode: str = "auto") -> SamplingParams:
    """The parameters of a request that sets none (``Engine.sampling_defaults``): with ``mode``
    "auto" those a checkpoint's ``generation_config.json`` (parsed; ``{}`` when absent; the
    ``ValueError`` of a file that is not JSON, raised here) sets, checked as ``SamplingParams``
    checks them (its ``max_new_tokens`` as ``max_tokens``); with "none" ``SamplingParams()``'s,
    ``gen`` unread. Raises ``ValueError`` naming a bad mode or field."""
    if mode not in GENERATION_CONFIG_MODES:
        modes = " or ".join(GENERATION_CONFIG_MODES)
        raise ValueError(f"generation_config must be {modes}, got {mode!r}")
    if mode == "none":
        return SamplingParams()
    ignore = UNREAD_HINT
    if isinstance(gen, ValueError):  # not valid JSON (model.checkpoint_meta.read_checkpoint_meta)
        raise ValueError(f"{gen} {ignore}") from gen
    if not isinstance(gen, dict):
        raise ValueError(f"generation_config.json: expected a JSON object, got {gen!r} {ignore}")
    fields = {k: gen[k] for k in GENERATION_DEFAULT_FIELDS if gen.get(k) is not None}
    if gen.get("max_new_tokens") is not None:
        fields["max_tokens"] = gen["max_new_tokens"]
    try:
        return SamplingParams(**fields)
    except SamplingParamsError as e:
        name = "max_new_tokens" if e.param == "max_tokens" else e.param
        raise ValueError(f"generation_config.json field {name!r}: {e} {ignore}") from e
