"""The OpenAI API's request bodies and error format, and their mapping onto ``SamplingParams``.

Known fields are strictly typed (no "5" for 5); unknown fields that would change the output
are refused (``check_unsupported``), the rest ignored; every client error is
an ``APIError`` answered as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from runtime.json_words import type_value
from runtime.sampling_params import SamplingParams, SamplingParamsError

CONTEXT_CODE = "context_length_exceeded"


class APIError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )
        # Anthropic's machine-readable ``error.details`` (its SDK acts on ``error_code``); only
        # the Messages route's shape carries it (messages_protocol.anthropic_body)
        self.details = details

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# ---- request bodies: known fields strictly typed (no "5" for 5), unknown fields ignored --------
class _Strict(BaseModel):
    # Unknown fields are kept (not validated) so check_unsupported can refuse the ones that would
    # change the output; the rest are ignored, as the OpenAI API does.
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far on every chunk


# Optional fields accept an explicit null, meaning the default (as the OpenAI API does).
class _SamplingRequest(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # default 1
    top_p: float | None = None  # default 1
    top_k: int | None = None  # extension; default -1 (disabled)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool | None = None  # extension
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # sampling controls (runtime.sampling_controls); the last three are vLLM's extensions
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema
    prompt_logprobs: int | None = None  # vLLM's (runtime.prompt_logprobs)
    skip_special_tokens: bool | None = None  # vLLM's; default true
    spaces_between_special_tokens: bool | None = None  # vLLM's; default true
    truncate_prompt_tokens: int | None = None  # vLLM's: the prompt's last N tokens (-1: context)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or several
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None  # candidates per prompt; the n best by cumulative logprob return


class ChatMessage(_Strict):
    role: str  # system, developer, user, assistant, tool (runtime.chat_template checks it)
    content: str | list[dict[str, Any]] | None = None  # a list: text parts
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call (chat_template._in_call_order)
    name: str | None = None
    # an assistant's earlier reasoning (thinking mode): DeepSeek's name, and vLLM's
    reasoning_content: str | None = None
    reasoning: str | None = None
    # DeepSeek's API's chat prefix completion: the last (assistant) message is continued
    prefix: bool | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # runtime.tool_calls
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: {"thinking": true} (or enable_thinking) renders in thinking mode and splits the
    # reasoning out of the reply (runtime.chat_template.thinking_of; other keys are ignored)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: end with the assistant's turn opened (default true), or leave the last message
    # (the assistant's) open for the model to continue (runtime.chat_template.render_chat)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    # vLLM's: the last message's content (the assistant's) before the reply (server_chat.echoed)
    echo: bool | None = None

    @property
    def max_tokens_field(self) -> str:
        """The field that caps the completion, as the client sent it: ``max_completion_tokens``
        (OpenAI's name now) over ``max_tokens``."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): a prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # prompt: add the BOS (default true)
    add_generation_prompt: bool | None = None  # messages: end with the assistant's turn (true)
    continue_final_message: bool | None = None  # messages: leave the last one open, as chat's
    tools: list[dict[str, Any]] | None = None  # messages: offered in the prompt, as chat's
    tool_choice: str | dict[str, Any] | None = None  # messages: "none" offers none
    chat_template_kwargs: dict[str, Any] | None = None  # messages: thinking mode, as chat's
    return_token_strs: bool | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# Friendlier messages for union-typed fields, whose raw errors list one failure per member type.
_FIELD_HINTS = {
    "prompt": "prompt must be a string, a list of token ids, or a list of either",
    "stop": "stop must be a string or a list of strings",
}


def continuation(req: ChatCompletionRequest | TokenizeRequest) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message) of a chat or /tokenize request: vLLM's two
    fields, or DeepSeek's API's ``"prefix": true`` on the last message, which must be the
    assistant's (chat prefix completion: the same continuation, the fields not needed)."""
    msgs = req.messages or []
    for i, m in enumerate(msgs):
        if m.prefix and (i != len(msgs) - 1 or m.role != "assistant"):
            msg = f"prefix is only allowed on the last message, an assistant's: messages[{i}]"
            raise APIError(400, msg, param=f"messages[{i}].prefix")
    if msgs and msgs[-1].prefix:
        return False, True
    return req.add_generation_prompt is not False, bool(req.continue_final_message)


def validation_error(exc: RequestValidationError, content_type: str | None = None) -> APIError:
    """``content_type``: the request's header. FastAPI parses a body as JSON only under a JSON
    Content-Type (and, depending on its version, none), so a JSON object sent as a form (``curl
    -d`` without ``-H``) or with no type arrives as unparsed bytes: saying "must be a JSON
    object" about it would name the wrong problem."""
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error')}")
    if not loc and err.get("type") == "missing":  # (FastAPI's "Field required" about the body)
        return APIError(400, "the request body is empty: expected a JSON object")
    if not loc and isinstance(exc.body, (bytes, bytearray)):  # not parsed: not sent as JSON
        mime = (content_type or "").split(";")[0].strip().lower()
        got = repr(mime) if mime else "no Content-Type"
        msg = f"the request body must be JSON with Content-Type: application/json, got {got}"
        return APIError(400, msg)
    if not loc:
        return APIError(400, f"request body must be a JSON object: {err.get('msg')}")
    if loc[0] in _FIELD_HINTS and len(loc) > 1:
        return APIError(400, _FIELD_HINTS[loc[0]], param=loc[0])
    return APIError(400, f"{'.'.join(loc)}: {err.get('msg')}", param=loc[0])


def _neutral(value: Any, *defaults: Any) -> bool:
    """A field left at a value that changes nothing (absent, null, or a default)."""
    return value is None or any(value == d and type(value) is type(d) for d in defaults)


# Fields this server does not implement, with the values that leave them off. Any other value is a
# 400 naming the field, never silently ignored. A field stays here until it works.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": ([],),  # the deprecated form of tools
    "function_call": ("none",),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "structured_outputs": (),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    # vLLM's extra fields that would change the output
    "include_stop_str_in_output": (False,),
    "return_tokens_as_token_ids": (False,),  # ("token_id:N" logprob tokens)
    # vLLM's sampling extras that restrict the tokens (they were silently ignored)
    "allowed_token_ids": (),
    "bad_words": ([],),
    "logits_processors": ([],),
}
# Only for completions / only for chat.
UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    "suffix": ("",),
    "tools": ([],),  # chat only
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
}
UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),  # a legacy completions parameter (OpenAI's chat has none)
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "chat_template": (),
    "add_special_tokens": (False,),  # vLLM's; the template writes the BOS itself
}


def check_unsupported(req: _SamplingRequest) -> None:
    """400 for options this server does not implement, rather than silently ignoring them.

    Reads the model's extra fields too: ``extra="ignore"`` would drop them, so the request models
    keep them (``extra="allow"``) and only this check looks at them."""
    table = dict(UNSUPPORTED)
    table.update(UNSUPPORTED_COMPLETION if isinstance(req, CompletionRequest) else UNSUPPORTED_CHAT)
    fields = {**(req.model_extra or {}), **{k: getattr(req, k) for k in type(req).model_fields}}
    if req.n is not None and req.n < 1:
        raise APIError(400, f"n must be an integer >= 1, got {req.n}", param="n")
    if isinstance(req, CompletionRequest) and req.best_of is not None:
        n = req.n or 1
        if req.best_of < n:
            msg = f"best_of must be >= n ({n}), got {req.best_of}"
            raise APIError(400, msg, param="best_of")
        if req.stream and req.best_of > n:  # the best are known only at the end (OpenAI, vLLM)
            raise APIError(400, "best_of > n cannot be streamed", param="best_of")
    opts = req.stream_options
    if opts is not None and opts.model_fields_set and not req.stream:  # vLLM's rule ({} is let be)
        msg = "stream_options is only allowed with stream: true"
        raise APIError(400, msg, param="stream_options")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    refuse_unsupported(fields, table)


def refuse_unsupported(fields: dict[str, Any], table: dict[str, tuple[Any, ...]]) -> None:
    """400 naming the first of ``fields`` (a request's, sent or not) that ``table`` (name -> the
    values that leave it off) lists at another value."""
    for name, defaults in table.items():
        if name in fields and not _neutral(fields[name], *defaults):
            raise APIError(400, f"{name} is not supported by this server", param=name)


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> list[tuple[int, float]]:
    """(token, bias) pairs: keys naming one token twice ("5", "05") stay two pairs, which
    SamplingParams refuses (a dict keyed by token id kept the last silently)."""
    out: list[tuple[int, float]] = []
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab:
            msg = f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}"
            raise APIError(400, msg, param="logit_bias")
        out.append((int(key), value))
    return out


def _stop_token_ids(ids: list[int] | None, vocab: int) -> tuple[int, ...]:
    if any(isinstance(t, int) and t >= vocab for t in ids or ()):
        msg = f"stop_token_ids must be token ids in [0, {vocab}), got {ids!r}"
        raise APIError(400, msg, param="stop_token_ids")
    return tuple(ids or ())


def response_grammar(fmt: dict[str, Any] | None) -> str | None:
    """The llguidance grammar ``response_format`` asks for (None: free text)."""
    from runtime.structured_output import json_schema_grammar

    if fmt is None:
        return None
    kind = fmt.get("type")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return json_schema_grammar(None)
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ValueError("json_schema must be an object with a 'schema' object")
            return json_schema_grammar(spec.get("schema", {}))
    except ValueError as e:
        raise APIError(400, f"response_format: {e}", param="response_format") from e
    msg = f"response_format.type must be text, json_object or json_schema, got {type_value(fmt)}"
    raise APIError(400, msg, param="response_format")


def sampling_params(
    req: _SamplingRequest,
    max_tokens: int,
    logprobs: bool,
    vocab: int,
    defaults: SamplingParams | None = None,
) -> SamplingParams:
    """``vocab``: the tokenizer's size, to check logit_bias and stop_token_ids; ``defaults``:
    what a field the request leaves unset takes (the checkpoint's generation config,
    ``Engine.sampling_defaults``; None: ``SamplingParams()``'s)."""
    base = defaults or SamplingParams()
    if isinstance(req, CompletionRequest):
        top, top_param = req.logprobs or 0, "logprobs"  # the legacy API's logprobs = N
        max_param = "max_tokens"
    else:
        top, top_param = (req.top_logprobs or 0) if req.logprobs else 0, "top_logprobs"
        max_param = req.max_tokens_field

    def default(value: Any, fallback: Any) -> Any:
        return fallback if value is None else value

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=default(req.temperature, base.temperature),
            top_p=default(req.top_p, base.top_p),
            top_k=default(req.top_k, base.top_k),
            seed=req.seed,
            stop=default(req.stop, ()),  # ("" is refused as [""] is, not read as no stop)
            stop_token_ids=_stop_token_ids(req.stop_token_ids, vocab),
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            presence_penalty=default(req.presence_penalty, 0.0),
            frequency_penalty=default(req.frequency_penalty, 0.0),
            repetition_penalty=default(req.repetition_penalty, base.repetition_penalty),
            logit_bias=_logit_bias(req.logit_bias, vocab),
            min_p=default(req.min_p, base.min_p),
            min_tokens=default(req.min_tokens, 0),
            top_logprobs=top,
            grammar=response_grammar(req.response_format),
            prompt_logprobs=req.prompt_logprobs,
            skip_special_tokens=default(req.skip_special_tokens, True),
            spaces_between_special_tokens=default(req.spaces_between_special_tokens, True),
            truncate_prompt_tokens=req.truncate_prompt_tokens,
        )
    except SamplingParamsError as e:  # named as the client sent it
        param = {"top_logprobs": top_param, "max_tokens": max_param}.get(e.param, e.param)
        # (a null max_tokens here is the OpenAI default, never SamplingParams' "up to the
        # context": its "or None" would mislead a JSON client)
        msg = str(e).replace(" or None", "") if e.param == "max_tokens" else str(e)
        raise APIError(400, msg.replace(e.param, param), param=param) from e
