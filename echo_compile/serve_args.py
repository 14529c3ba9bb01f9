"""``echo-compile serve``'s own flags (the engine's: engine_args.py; vLLM's: vllm_flags.py)
and the server options they give, ``runtime.server.serve``'s keyword arguments."""

from __future__ import annotations

import argparse

from echo_compile.engine_args import add_engine_args, add_generation_config_arg
from echo_compile.vllm_flags import add_vllm_args

# NOTE: no torch here either: the flags are in every --help (cli_args.py says why).

API_KEY_ENV = "ECHO_COMPILE_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's: read after ours, so a key set for vLLM still applies
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """serve's flags: the engine's, the checkpoint as a positional, the HTTP server's, the
    generation config's and vLLM's."""
    add_engine_args(p)
    p.add_argument(
        "model",  # (SUPPRESS: left out, --model's value stands; given, the later of the two)
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="MODEL",
        help="the checkpoint, as vLLM's `vllm serve MODEL` spells it (the same as --model)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on; 0.0.0.0 for every interface (default: %(default)s)",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require Authorization: Bearer <key> on /v1/* (default: ${API_KEY_ENV}, else "
        f"${VLLM_API_KEY_ENV}, which keep the key out of `ps`)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients may use for the model (default: --model)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds in-flight requests may run after SIGTERM before they are aborted "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max-body-mb",
        type=float,
        default=16.0,
        help="largest request body in MiB; larger ones get 413 (default: %(default)s)",
    )
    p.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        help="generation requests in flight at once; more get 429 (default: no limit)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=None,
        help="allow browser requests from this origin (repeatable; '*' for any; default: "
        "none, no CORS headers)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        type=str.lower,
        choices=UVICORN_LOG_LEVELS,
        default="info",
        help="level of uvicorn's log lines (its access lines are at info), as vLLM's flag "
        "(default: %(default)s)",
    )
    add_generation_config_arg(p, "temperature / top_p / top_k / min_p / repetition_penalty")
    add_vllm_args(p, serve=True)


def _env_api_key() -> str | None:
    """The API key from the environment: ours, else vLLM's; None when neither is set (or empty)."""
    import os

    return os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or None


def serve_options(a: argparse.Namespace) -> dict:
    """``runtime.server.serve`` keyword arguments from the serve flags (checked before the model
    loads); the API key falls back to ``$ECHO_COMPILE_API_KEY``, then vLLM's ``$VLLM_API_KEY``
    (an operator moving from vLLM with only that set got a server without authentication)."""
    import math

    if not (a.shutdown_grace >= 0 and math.isfinite(a.shutdown_grace)):
        raise ValueError(f"--shutdown-grace must be a finite number >= 0, got {a.shutdown_grace}")
    if not (a.max_body_mb > 0 and math.isfinite(a.max_body_mb)):
        raise ValueError(f"--max-body-mb must be a finite number > 0, got {a.max_body_mb}")
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {a.port}")
    if a.max_concurrent is not None and a.max_concurrent < 1:
        raise ValueError(f"--max-concurrent must be >= 1, got {a.max_concurrent}")
    return dict(
        host=a.host,
        port=a.port,
        api_key=a.api_key if a.api_key is not None else _env_api_key(),
        grace_s=a.shutdown_grace,
        asked_max_len=a.max_model_len,
        max_body_bytes=int(a.max_body_mb * 2**20),
        max_concurrent=a.max_concurrent,
        cors_origins=a.cors_origin,
        uvicorn_log_level=a.uvicorn_log_level,
    )
