"""The offline Python API: ``LLM(model, **engine options).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, overload

from echo_compile.generation_result import GenerationResult, ResultAccumulator
from echo_compile.startup import start_engine
from echo_compile.threads import configure_threads
from runtime.chat_template import render_chat, reply_in_reasoning, thinking_of
from runtime.engine import Engine, StepOutput
from runtime.progress import progress_bar
from runtime.reasoning import thinking_params
from runtime.sampling_params import SamplingParams, truncate_prompt
from runtime.tokenizer import Tokenizer
from runtime.tool_calls import functions_of


class LLM:
    """Load a checkpoint and serve it offline.

    ``model``: a checkpoint directory, or ``"tiny"`` / ``"tiny-fp8"`` / ``"tiny-awq"`` (generated on
    first use). Engine options (``EngineConfig``): ``max_batch``, ``host_tokens`` (host KV pool rows
    per layer), ``gpu_tokens`` (GPU pool rows per layer), ``kv_format`` ("bf16" | "fp8"),
    ``offload`` (False: the whole KV cache on the device), ``max_model_len``, ``prefill_chunk``,
    (on CUDA, ``max_model_len``, ``host_tokens`` and ``gpu_tokens`` left out are sized from the
    checkpoint and the memory, ``host_memory_fraction`` of the host's and
    ``gpu_memory_utilization`` of the GPU's, vLLM's name: runtime/kv_sizing.py; under torchrun
    the least of each over the ranks; on the CPU they are ``EngineConfig``'s),
    ``enable_prefix_caching`` (default here: True, as vLLM's, unlike ``EngineConfig``'s; a
    prompt that starts with the full 64-token pages of an earlier sequence skips their prefill,
    runtime/prefix_cache.py),
    ``decode_buckets``, ``device``, ``compile_prefill`` (None: compile prefill, one graph per chunk
    bucket, for any ``max_model_len``; False: eager prefill), ``dynamic_decode`` (one decode compile
    for every bucket, its batch dim symbolic; default off: one per bucket; an eager engine refuses
    it), ``dp`` / ``tp`` (multi-process: run the same script on every rank under torchrun,
    docs/multi_gpu.md). ``compile`` (default: on CUDA) captures every bucket into CUDA graphs at
    start-up, then forbids recompiles. Any number of engines may live in one process: each owns its
    compiled steps. ``fp8_weights`` (FP8 checkpoints): ``"auto"`` (default) keeps them FP8, one byte
    per weight, as vLLM serves them (docs/quantization.md; sharded on block boundaries with
    dp/tp/ep), as does ``"fp8"`` (an error on a checkpoint that is not FP8); ``"bf16"`` dequantises
    them at load (the reference); which one is logged at start-up. ``generation_config``: ``"auto"``
    (default) takes a request's unset sampling fields (temperature, top_p, top_k, min_p,
    repetition_penalty) from the checkpoint's ``generation_config.json``, as vLLM does, in
    ``generate()`` without params (its ``max_new_tokens`` too, as their ``max_tokens``, capped at
    what the context leaves) and in the server; ``"none"``: ``SamplingParams()``'s defaults
    (``engine.sampling_defaults``). ``progress``: the warm-up's "capturing graphs" bar, drawn only
    when stderr is a terminal (no redraws in a log), then a one-line summary logged at INFO
    (``echo_compile.llm``; the CLI's ``--log-level``).
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        compile: bool | None = None,  # noqa: A002
        progress: bool = True,
        fp8_weights: str = "auto",
        generation_config: str = "auto",
        host_memory_fraction: float | None = None,  # None: kv_sizing's default
        gpu_memory_utilization: float | None = None,
        **engine_options,
    ):
        configure_threads()  # once per process: ECHO_COMPILE_THREADS, else by usable cores
        self.engine, self.model_path, self.warmup_s = start_engine(
            model, engine_options, compile=compile, progress=progress, fp8_weights=fp8_weights,
            generation_config=generation_config, host_memory_fraction=host_memory_fraction,
            gpu_memory_utilization=gpu_memory_utilization,
        )  # fmt: skip
        self._ids = itertools.count()
        # request id -> outputs of a live generate() / stream request not yet read by its caller
        self._outputs: dict[str, list[StepOutput]] = {}

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=True)
        # (a dict, a tensor: not read as token ids; nor bytes, a Sequence of ints that was
        # silently taken for token ids: b"Hello" was the prompt [72, 101, 108, 108, 111])
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        return list(prompt)

    def _defaults(self, n_prompt: int) -> SamplingParams:
        """A request's parameters when it gives none: the engine's sampling defaults, whose
        max_tokens (the checkpoint's max_new_tokens) is capped at what the context leaves after
        the prompt, as vLLM caps it (a max_new_tokens of 100000 refused every prompt)."""
        d = self.engine.sampling_defaults
        left = self.engine.max_model_len - n_prompt
        if d.max_tokens is not None and 1 <= left < d.max_tokens:
            return dataclasses.replace(d, max_tokens=left, min_tokens=min(d.min_tokens, left))
        return d

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[GenerationResult]:
        """Run every prompt to completion (continuous batching) and return results in order
        (``progress``: a bar of finished requests, on a terminal only). A bad prompt is a
        TypeError or ValueError naming its index (``prompt i: ...``), and no prompt of the call is
        left queued."""
        if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray, memoryview)):
            raise TypeError(
                "prompts must be a string, a list of token ids or a list of either, "
                f"got {type(prompts).__name__}"
            )
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        encoded = []
        for i, p in enumerate(prompts):
            with _named(f"prompt {i}"):
                encoded.append(self._encode(p))
        return self._run(encoded, params, progress, "prompt")

    def _run(
        self,
        encoded: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
        progress: bool,
        what: str,
    ) -> list[GenerationResult]:
        """Queue every prompt of ``encoded`` (with ``params``, or ``params[i]``; None: the
        defaults), run them to completion and return the results in order. A prompt the engine
        refuses is a ValueError naming it (``"{what} {i}: ..."``), and no request of the call is
        left queued."""
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(encoded)  # (None: the defaults, per prompt below)
        elif not isinstance(params, Sequence) or not all(
            isinstance(p, SamplingParams) for p in params
        ):
            raise TypeError("params must be a SamplingParams, a list of them or None")
        if len(params) != len(encoded):
            raise ValueError(f"{len(encoded)} {what}s but {len(params)} sampling params")
        ids = [f"gen-{next(self._ids)}" for _ in encoded]
        eos = (self.tokenizer.eos_token_id, self.engine.eos_token_ids)
        acc = {
            i: ResultAccumulator(i, e, sp or self._defaults(len(e)), *eos)
            for i, e, sp in zip(ids, encoded, params)
        }
        added: list[str] = []
        try:
            for k, a in enumerate(acc.values()):
                with _named(f"{what} {k}"):
                    # (the result's prompt_ids are those it ran on, as vLLM's)
                    limit = self.engine.max_model_len
                    a.prompt_ids = truncate_prompt(a.prompt_ids, a.params, limit)
                    self.engine.add_request(a.request_id, a.prompt_ids, a.params)
                added.append(a.request_id)
        except Exception:
            for rid in added:  # a bad prompt rejects the whole call: leave nothing queued
                self.engine.abort_request(rid)
            raise
        bar = progress_bar(total=len(ids), enabled=progress, desc="generating", unit="req")
        self._outputs.update((rid, []) for rid in ids)
        try:
            while any(not a.done for a in acc.values()):
                for out in self._step_for(ids):
                    acc[out.request_id].add(out)
                    bar.update(int(out.finished))
        finally:
            bar.close()
            for rid in ids:
                self._outputs.pop(rid, None)
                if not acc[rid].done:  # interrupted: nothing of this call is left running
                    self.engine.abort_request(rid)
        return [acc[i].result() for i in ids]

    def generate_stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[StepOutput]:
        """Yield each step's output of one request as it is produced (other requests may run,
        other streams and ``generate()`` calls of this LLM too, in any interleaving). Closing the
        iterator early aborts the request and frees its slots."""
        if params is not None and not isinstance(params, SamplingParams):
            # (as generate(): a dict or a list of params was an AttributeError from the engine)
            raise TypeError(f"params must be a SamplingParams or None, got {type(params).__name__}")
        rid = f"gen-{next(self._ids)}"
        ids = self._encode(prompt)
        self.engine.add_request(rid, ids, params or self._defaults(len(ids)))
        self._outputs[rid] = []
        done = False
        try:
            while not done:
                for out in self._step_for([rid]):
                    done = out.finished
                    yield out
        finally:
            self._outputs.pop(rid, None)
            if not done:
                self.engine.abort_request(rid)

    def _step_for(self, rids: Sequence[str]) -> list[StepOutput]:
        """The next outputs of ``rids``: those the steps of another caller of this LLM (a
        ``generate()`` call, another stream) set aside for them, else one engine step's. Each
        step's outputs of other callers' requests are set aside for them, so no caller loses
        what a step driven by another produced."""
        got = [out for rid in rids for out in self._take(rid)]
        if got:
            return got
        try:
            outs = self.engine.step()
        except BaseException:
            # a half-applied step may have left the GPU pools' maps inconsistent: every request
            # ends and the pools start afresh, as the server's loop does (a rank of a torchrun
            # run has no recover: its run ends with the error)
            if isinstance(self.engine, Engine):
                self.engine.recover()
            raise
        for out in outs:
            if out.request_id in self._outputs:
                self._outputs[out.request_id].append(out)
        got = [out for rid in rids for out in self._take(rid)]
        # (asked only after an empty step: on a DistributedEngine it is a collective)
        if not got and not outs and not self.engine.has_unfinished():
            raise RuntimeError(f"requests {list(rids)} are no longer in the engine (aborted?)")
        return got

    def _take(self, rid: str) -> list[StepOutput]:
        """``rid``'s outputs set aside so far (emptied)."""
        outs = self._outputs.get(rid)
        if not outs:
            return []
        self._outputs[rid] = []
        return outs

    @overload
    def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> GenerationResult: ...

    @overload
    def chat(
        self,
        messages: list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[GenerationResult]: ...

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> GenerationResult | list[GenerationResult]:
        """The reply to an OpenAI-style conversation (a list of message dicts), or the replies to
        a list of conversations (a list, in order; ``params`` one for all or one each), each
        rendered as the server renders it (``runtime.chat_template.render_chat``: the
        checkpoint's template, or DeepSeek-V3.2's own encoding, which its release uses in place
        of one). ``tools``: OpenAI function tools offered in every prompt, as the server offers
        a request's (``tool_choice`` auto; the reply's text is returned as it is, its DSML calls
        unparsed: ``runtime.tool_calls.parse_tool_calls`` reads them). ``chat_template_kwargs``:
        as vLLM's, ``{"thinking": True}`` (or ``enable_thinking``) renders DeepSeek-V3.2's
        thinking mode; the text is returned whole, as vLLM's ``LLM.chat`` returns it
        (``runtime.reasoning.split_reasoning`` splits the reasoning off); a ``params.grammar``
        then constrains only what follows ``</think>``, as the server's ``response_format``
        (``grammar_after_reasoning`` set for it; vLLM's ``LLM.chat`` does so when the engine has
        a reasoning parser). ``add_generation_prompt`` / ``continue_final_message``: as vLLM's,
        end with the assistant's turn opened, or leave each conversation's last message (the
        assistant's) open and continue it ("prefill"; it needs ``add_generation_prompt=False``):
        the text is the continuation only (a continued message with content has its reasoning
        closed: a grammar then starts at once). A bad conversation is a TypeError or ValueError
        naming it
        (``conversation i``), before any is queued."""
        if not isinstance(messages, list):
            raise TypeError(
                "messages must be a conversation (a list of message dicts) or a list of "
                f"conversations, got {type(messages).__name__}"
            )
        if not messages:
            raise ValueError("messages is empty: no conversation to reply to")
        batch = isinstance(messages[0], list)
        conversations = messages if batch else [messages]
        functions = functions_of(tools) or None  # (a ValueError naming the bad tools[i])
        thinking = thinking_of(chat_template_kwargs)
        encoded, in_reasoning = [], []
        for i, conversation in enumerate(conversations):
            with _named(f"conversation {i}"):
                if not isinstance(conversation, list):
                    raise TypeError(
                        f"must be a list of message dicts, got {type(conversation).__name__}"
                    )
                # (the template writes the BOS itself)
                text = render_chat(
                    self.tokenizer,
                    conversation,
                    add_generation_prompt,
                    functions,
                    thinking,
                    continue_final_message,
                )
                encoded.append(self.tokenizer.encode(text, add_bos=False))
                in_reasoning.append(
                    reply_in_reasoning(conversation, thinking, continue_final_message)
                )
        if any(in_reasoning):  # a grammar starts after </think>, as the server's
            if isinstance(params, SamplingParams):
                params = [params] * len(encoded)
            if isinstance(params, (list, tuple)) and len(params) == len(encoded):
                # (other types or lengths: _run's error)
                params = [
                    thinking_params(p) if r and isinstance(p, SamplingParams) else p
                    for p, r in zip(params, in_reasoning)
                ]
        results = self._run(encoded, params, progress, "conversation")
        return results if batch else results[0]


@contextmanager
def _named(where: str) -> Iterator[None]:
    """A TypeError or ValueError raised inside, its message prefixed by ``where`` (its type and
    attributes kept; Python 3.10 has no ``add_note``)."""
    try:
        yield
    except (TypeError, ValueError) as e:
        e.args = (f"{where}: {e}",)
        raise


def generate(
    prompts: str | Sequence[str | Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    model: str = "tiny",
    **options,
) -> list[GenerationResult]:
    """One call: load ``model``, generate, return the results."""
    return LLM(model, **options).generate(prompts, params)
