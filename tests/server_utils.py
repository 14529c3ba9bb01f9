"""Shared test helpers: a small trained tokenizer, and a real uvicorn server on a free local port.

Import from test files (pytest puts ``tests/`` on ``sys.path``)::

    from server_utils import make_tokenizer_dir, running_server

    with running_server(build_app(async_engine, "m", None)) as base_url:  # http://127.0.0.1:PORT
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x")
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:  # the server packages are imported where a server runs: the GPU machine has none
    from fastapi import FastAPI

BOS, EOS = "<bos>", "<eos>"
# ChatML-like, different from the tiny checkpoint's, with a raise_exception branch.
TEST_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('the conversation must not start with an assistant message') }}"
    "{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# ASCII only: characters outside it are split into byte tokens, which is what the UTF-8 tests need.
TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world, hello there! "
    "Streaming text arrives one token at a time; stop strings end it early. "
    "0123456789 numbers, punctuation: (a) [b] {c} <d> 'e' \"f\" - + * / = ? "
) * 20


def make_tokenizer_dir(path: Path, vocab_size: int = 320) -> Path:
    """Train a byte-level BPE on a small ASCII text and write ``tokenizer.json`` and
    ``tokenizer_config.json`` (bos/eos, ``TEST_CHAT_TEMPLATE``) into ``path``; returns it."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": BOS, "eos_token": {"content": EOS}, "chat_template": TEST_CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return path


@contextmanager
def running_server(app: FastAPI, timeout_s: float = 10.0) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread on a free 127.0.0.1 port; yields the base URL.

    The socket is bound here and handed to uvicorn, so there is no race for the port.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=lambda: asyncio.run(server.serve(sockets=[sock])), name="uvicorn", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()
