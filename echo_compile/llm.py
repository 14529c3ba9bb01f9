"""The offline Python API: ``LLM(model, **engine options).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, overload

import torch

from echo_compile.compiled import StepCompiler
from echo_compile.devices import check_device
from echo_compile.memory_checks import check_fits, check_host_pool, rank_weights
from echo_compile.threads import configure_threads
from runtime.chat_template import render_chat, reply_in_reasoning, thinking_of
from runtime.distributed.process import ended_on_error
from runtime.engine import Engine, EngineConfig, StepOutput
from runtime.engine_inputs import read_engine_inputs
from runtime.kv_sizing import SIZED, size_engine
from runtime.outputs import RequestOutput
from runtime.progress import LoadProgress, progress_bar
from runtime.reasoning import thinking_params
from runtime.sampling_params import SamplingParams, truncate_prompt
from runtime.tokenizer import Tokenizer
from runtime.tool_calls import functions_of


@dataclass
class RequestStats:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float  # time to first token
    latency_s: float  # arrival to finish
    itl_s: list[float] = field(default_factory=list)  # inter-token latencies


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None  # params.logprobs: each generated token's
    stats: RequestStats
    # params.top_logprobs > 0: per generated token, that many most likely (token id, logprob)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # params.prompt_logprobs: [None, (logprob, rank, top) of prompt token 1, ...]
    prompt_logprobs: list | None = None


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
        from model.loader import fp8_choice, load_model, read_checkpoint_meta
        from runtime.distributed.plan import rank_memory_device

        configure_threads()  # once per process: ECHO_COMPILE_THREADS, else by usable cores
        if "device" not in engine_options:
            engine_options["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        # on here, as vLLM's (serve and generate build an LLM: --no-enable-prefix-caching);
        # EngineConfig's own default is off, so an engine built directly (the tests, the bench)
        # holds no page once its requests are done
        engine_options.setdefault("enable_prefix_caching", True)
        config = EngineConfig(**engine_options)
        check_device(config.device, python=True)
        # the checkpoint's config, generation config and tokenizer's presence, read once: the
        # sizing, the checks, the engine inputs and the load (every rank's) all take this meta
        meta = read_checkpoint_meta(model)
        path, ckpt = meta.path, meta.config
        self.model_path = path
        # one choice of the FP8 checkpoint's weights, which the sizing, the memory check and
        # the load (every rank's) all take: the load its modules kept FP8, found here
        fp8 = fp8_choice(path, ckpt, fp8_weights)
        asked, fp8_weights = fp8_weights, fp8.weights
        if ckpt.quantization is not None and ckpt.quantization.method == "fp8":
            if fp8_weights == "fp8":
                how = "kept FP8 (--fp8-weights bf16 dequantises them at load)"
            elif asked == "bf16":
                how = "dequantised to bf16 at load (--fp8-weights bf16)"
            else:  # "auto" on a checkpoint converted to bf16 (no weight_scale_inv tensors)
                how = "bf16 as stored (its config.json declares FP8, its tensors have no scales)"
            logging.getLogger(__name__).info("FP8 checkpoint: weights %s", how)
        # on CUDA, the sizes left out chosen from the checkpoint and the memory (one log line);
        # the rank's weights and memory device found once for the sizing and the memory check
        # (the sizing changes no split or device they depend on). A rank of a dp/tp/ep job
        # joins the process group first: the ranks take the least of each automatic size, so
        # all size alike
        ctx, joined = None, False
        if config.world_size > 1:
            import torch.distributed as dist

            from runtime.distributed.dist_engine import join

            joined = not dist.is_initialized()  # (a caller's own group is the caller's to end)
            ctx = join(config)
        with ended_on_error(joined):  # (an error after the join: the group ended)
            given = set(SIZED) & set(engine_options)
            weights = rank_weights(ckpt, config, fp8_weights)
            memory_device = rank_memory_device(config)  # (torchrun: this rank's GPU)
            config = size_engine(
                meta, config, given, fp8_weights, host_memory_fraction, gpu_memory_utilization,
                weights, ctx, memory_device,
            )  # fmt: skip
            # the tokenizer, the generation config and the options against the model config, in
            # seconds: a mistake there is not found after minutes of reading weights
            inputs = read_engine_inputs(meta, config, generation_config)
            if config.device.startswith("cuda"):
                check_fits(meta, config, fp8_weights, weights, memory_device)
            else:
                check_host_pool(meta, config)
            compiled = compile if compile is not None else config.device.startswith("cuda")
            if config.dynamic_decode and not compiled:  # (before minutes of reading weights)
                raise ValueError(
                    f"dynamic_decode (--dynamic-decode) is how the decode step is compiled, but "
                    f"this engine runs eagerly on {config.device} (compile={compile!r}; the "
                    "default compiles on CUDA only): pass compile=True (--compile) or leave "
                    "dynamic_decode off"
                )
            if config.world_size > 1:
                # one rank of a dp/tp job (torchrun): every rank runs this same code
                # (docs/multi_gpu.md)
                from runtime.distributed.dist_engine import build_distributed_engine

                self.engine = build_distributed_engine(
                    meta, config, model, StepCompiler if compiled else None, ctx, fp8,
                    generation_config=generation_config, inputs=inputs, progress=progress,
                )  # fmt: skip
            else:
                # (keep_mtp=False: the MTP layer is never run; held, it is GiBs of host memory)
                with LoadProgress(enabled=progress) as loading:
                    net, extras = load_model(
                        meta, device=config.device, keep_mtp=False, fp8_weights=fp8,
                        progress=loading,
                    )  # fmt: skip
                logging.getLogger(__name__).info(loading.close())
                self.engine = Engine.from_loaded(
                    net, extras, config, model_name=model,
                    compiler=StepCompiler(config.device) if compiled else None, inputs=inputs,
                )  # fmt: skip
            mc = self.engine.model_config
            asked, limit = engine_options.get("max_model_len"), config.model_len(mc)
            if asked is not None and limit < asked:  # (serve's start-up line names it too)
                logging.getLogger(__name__).warning(
                    "max_model_len %d: requests get %d tokens at most, the least of it, the "
                    "model's max_position_embeddings (%d) and host_tokens (%d)",
                    asked, limit, mc.max_position_embeddings, config.host_tokens,
                )  # fmt: skip
            # warm-up captures every bucket, then forbids recompiles of the engine's steps: from
            # here on a request can never trigger a compile
            self.warmup_s = self.engine.runner.warmup(progress=progress) if compiled else 0.0
            if compiled and progress:
                # NOTE: a log line, not a print: generate()'s output is the caller's stdout
                n = self.engine.runner.num_graphs
                where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default")
                logging.getLogger(__name__).info(
                    "captured %d step graphs in %.1f s (compile cache: %s)", n, self.warmup_s, where
                )
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
        acc = {
            i: _Acc(i, e, sp or self._defaults(len(e))) for i, e, sp in zip(ids, encoded, params)
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


class _Acc:
    """One request of a ``generate()`` call: its step outputs (``RequestOutput``) and arrival."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        self.request_id, self.prompt_ids, self.params = request_id, prompt_ids, params
        self.out = RequestOutput()
        self.t0 = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.out.finished

    def add(self, out: StepOutput) -> None:
        self.out.add(out)

    def result(self) -> GenerationResult:
        o, t = self.out, self.out.token_times
        stats = RequestStats(
            len(self.prompt_ids),
            len(o.token_ids),
            (t[0] - self.t0) if t else 0.0,
            (t[-1] - self.t0) if t else 0.0,
            [b - a for a, b in zip(t, t[1:])],
        )
        return GenerationResult(
            self.request_id,
            self.prompt_ids,
            o.text,
            o.token_ids,
            o.finish_reason,
            o.logprobs if self.params.logprobs else None,
            stats,
            o.top_logprobs if self.params.top_logprobs else None,
            o.prompt_logprobs,
        )


def generate(
    prompts: str | Sequence[str | Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    model: str = "tiny",
    **options,
) -> list[GenerationResult]:
    """One call: load ``model``, generate, return the results."""
    return LLM(model, **options).generate(prompts, params)
