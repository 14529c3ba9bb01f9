"""Start-up and shutdown of the server process: the start-up log line, and SIGTERM / Ctrl-C as a
graceful drain (stop admitting, finish or abort in-flight requests, free their slots, exit)."""

from __future__ import annotations

import logging
import socket
import threading
from types import FrameType
from typing import Any

import uvicorn

from runtime.async_engine import AsyncEngine
from runtime.sampling_params import GENERATION_DEFAULT_FIELDS, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0  # how long in-flight requests may run after SIGTERM


def startup_summary(
    async_engine: AsyncEngine, model_name: str, asked_max_len: int | None, url: str | None = None
) -> str:
    """One line naming what is served: model, the address (``url``; uvicorn names it only when
    it binds the socket itself), device, pools, the real context limit (and why it is less than
    asked, when it is)."""
    engine = async_engine.engine
    cfg = getattr(engine, "config", None)
    parts = [f"serving {model_name!r}" + ("" if url is None else f" on {url}")]
    if cfg is not None:
        parts.append(f"device {getattr(cfg, 'device', '?')}")
        offload = getattr(cfg, "offload", None)
        parts.append(
            f"host pool {getattr(cfg, 'host_tokens', '?')} rows/layer, "
            f"GPU pool {getattr(cfg, 'gpu_tokens', '?')} rows/layer"
            + ("" if offload is None else f", offload {'on' if offload else 'off'}")
        )
        prefetch = getattr(cfg, "prefetch", "off")
        if offload and prefetch != "off":  # the staging limits the mode uses, and the margin
            rows = (f"{cfg.prefetch_cap} rows/request" if prefetch == "request" else
                    f"{cfg.prefetch_ratio:g} rows/context token, at most "
                    f"{cfg.max_batch * cfg.prefetch_cap} rows/layer")  # fmt: skip
            parts.append(f"prefetch {prefetch} ({rows}, margin {cfg.prefetch_margin:g})")
        parts.append(f"max_batch {getattr(cfg, 'max_batch', '?')}")
    limit = async_engine.max_model_len
    text = f"max_model_len {limit}"
    if asked_max_len is not None and asked_max_len != limit:
        why = limit_reasons(engine, limit)
        text += f" (asked {asked_max_len}; limited by {' and '.join(why) or 'the engine'})"
    parts.append(text)
    changed = sampling_changes(async_engine.sampling_defaults)
    if changed:  # vLLM logs this too: a request's unset fields are not OpenAI's defaults
        parts.append(f"sampling defaults {changed} (generation_config.json)")
    return ", ".join(parts)


def limit_reasons(engine: Any, limit: int) -> list[str]:
    """What caps the context limit ``limit`` of ``engine`` (an ``Engine``) below its
    --max-model-len: the host pool, the model's positions; empty where neither does (or the
    engine does not say)."""
    cfg = getattr(engine, "config", None)
    why = []
    if cfg is not None and getattr(cfg, "host_tokens", None) == limit:
        why.append("the host pool size (--host-tokens)")
    mc = getattr(engine, "model_config", None)
    if mc is not None and getattr(mc, "max_position_embeddings", None) == limit:
        why.append("the model's max_position_embeddings")
    return why


def sampling_changes(defaults: SamplingParams) -> str:
    """The default sampling fields that differ from ``SamplingParams()``'s, as ``k=v`` text."""
    base = SamplingParams()
    diff = [
        f"{k}={getattr(defaults, k)!r}"
        for k in GENERATION_DEFAULT_FIELDS
        if getattr(defaults, k) != getattr(base, k)
    ]
    return " ".join(diff)


def server_url(host: str, port: int, sock: socket.socket | None = None) -> str:
    """The address clients use, ``http://host:port`` (an IPv6 host in brackets); ``sock``: the
    bound socket, whose port is the real one (``--port 0`` binds a free one)."""
    if sock is not None:
        port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening: connections are refused until the server
    runs), as uvicorn binds it. ``echo-compile serve`` binds it before the model loads, as vLLM
    does, so a port in use or a bad host is an ``OSError`` naming the address in seconds, not
    after the weights."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise OSError(f"cannot listen on {where} (--host / --port): {e.strerror or e}") from None
    return sock


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM / SIGINT drains the engine (``AsyncEngine.drain``)
    before uvicorn's own shutdown; a second one exits at once.

    Without this, uvicorn waits for every open response, so a SIGTERM let each in-flight generation
    run to its max_tokens."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, grace_s: float) -> None:
        super().__init__(config)
        self.async_engine, self.grace_s = async_engine, grace_s
        self.draining = threading.Event()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining.is_set():  # a second signal: no more waiting
            self.force_exit = True
            self.should_exit = True
            return
        self.draining.set()
        logger.info(
            "signal %s: refusing new requests; in-flight ones get %.0f s, then are aborted",
            sig,
            self.grace_s,
        )
        threading.Thread(target=self._drain, name="echo-drain", daemon=True).start()

    def _drain(self) -> None:
        aborted = self.async_engine.drain(self.grace_s)
        logger.info("drained (%d request(s) aborted); stopping the HTTP server", aborted)
        self.should_exit = True


def serve_app(
    app: Any,
    async_engine: AsyncEngine,
    host: str,
    port: int,
    grace_s: float = DEFAULT_GRACE_S,
    sock: socket.socket | None = None,
    log_level: str = "info",
) -> None:
    """Run ``app`` until SIGTERM / Ctrl-C, draining the engine first; the engine is shut down
    whatever happens. ``sock``: already bound to ``host``:``port`` (``bind_socket``); None: uvicorn
    binds it. ``log_level``: uvicorn's loggers' (``--uvicorn-log-level``)."""
    # The drain already ended every response; uvicorn's own wait only covers stragglers.
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5
    )
    try:
        DrainingServer(config, async_engine, grace_s).run(None if sock is None else [sock])
    finally:
        async_engine.shutdown()
