"""The OpenAI API's request bodies and error format, and their mapping onto ``SamplingParams``.

Known fields are strictly typed (no "5" for 5) and unknown fields ignored; every client error is
an ``APIError`` answered as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

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
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )

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
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = None


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


# Friendlier messages for union-typed fields, whose raw errors list one failure per member type.
_FIELD_HINTS = {
    "prompt": "prompt must be a string or a list of token ids (one prompt per request)",
    "stop": "stop must be a string or a list of strings",
}


def validation_error(exc: RequestValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {err.get('ctx', {}).get('error')}")
    if not loc:
        return APIError(400, f"request body must be a JSON object: {err.get('msg')}")
    if loc[0] in _FIELD_HINTS and len(loc) > 1:
        return APIError(400, _FIELD_HINTS[loc[0]], param=loc[0])
    return APIError(400, f"{'.'.join(loc)}: {err.get('msg')}", param=loc[0])


def check_unsupported(req: _SamplingRequest) -> None:
    """400 for options this server does not implement, rather than silently ignoring them."""
    bad: list[tuple[str, str]] = []
    if req.n not in (None, 1):
        bad.append(("n", f"n must be 1 (one choice per request), got {req.n}"))
    for name in ("presence_penalty", "frequency_penalty", "logit_bias"):
        if getattr(req, name):
            bad.append((name, f"{name} is not supported"))
    if isinstance(req, CompletionRequest):
        if req.echo:
            bad.append(("echo", "echo is not supported"))
        if req.best_of not in (None, 1):
            bad.append(("best_of", "best_of must be 1"))
        if req.suffix:
            bad.append(("suffix", "suffix is not supported"))
        if req.logprobs not in (None, 0):
            bad.append(
                (
                    "logprobs",
                    "logprobs must be 0: only the chosen tokens' logprobs are "
                    "returned, not top alternatives",
                )
            )
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs:
        bad.append(("top_logprobs", "top_logprobs must be 0: top alternatives are not returned"))
    if bad:
        raise APIError(400, bad[0][1], param=bad[0][0])


def sampling_params(req: _SamplingRequest, max_tokens: int, logprobs: bool) -> SamplingParams:
    def default(value: Any, fallback: Any) -> Any:
        return fallback if value is None else value

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=default(req.temperature, 1.0),
            top_p=default(req.top_p, 1.0),
            top_k=default(req.top_k, -1),
            seed=req.seed,
            stop=req.stop or (),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
        )
    except SamplingParamsError as e:
        raise APIError(400, str(e), param=e.param) from e
