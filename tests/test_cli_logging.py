"""``echo-compile``'s logging: the command line (not a library module) puts our packages' log
lines on stderr at ``--log-level`` (else ``$ECHO_COMPILE_LOGGING_LEVEL``, ``$VLLM_LOGGING_LEVEL``,
info), so ``serve``'s drain on shutdown is seen."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from echo_compile import cli

ROOT = Path(__file__).resolve().parents[1]

# `echo-compile serve` with the model replaced by test_server's fake engine (no weights to load)
SERVE_FAKE = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import echo_compile.llm
from server_utils import make_tokenizer_dir
from test_server import FakeEngine
from runtime.tokenizer import Tokenizer

class FakeLLM:
    def __init__(self, *args, **kwargs):
        tok = Tokenizer.from_dir(make_tokenizer_dir(Path({tmp!r}) / "t"))
        self.engine = FakeEngine(tok, step_s=0.05)

echo_compile.llm.LLM = FakeLLM
from echo_compile.cli import main
sys.exit(main(["serve", "--device", "cpu", "--port", sys.argv[1], "--shutdown-grace", "0.5",
               *sys.argv[2:]]))
"""


@pytest.fixture(autouse=True)
def keep_log_levels():
    names = ("echo_compile", "runtime", "model", "custom_ops")
    levels = {n: logging.getLogger(n).level for n in names}
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


def test_serve_logs_its_drain_on_stderr(tmp_path: Path) -> None:
    script = tmp_path / "serve_fake.py"
    script.write_text(SERVE_FAKE.format(tests=str(ROOT / "tests"), tmp=str(tmp_path)))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.endswith("LOGGING_LEVEL")}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(port)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**env, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120  # imports torch: slow on a busy machine
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        err = proc.communicate()[1]
    assert "runtime.server_lifecycle: signal 15: refusing new requests" in err, err
    assert "INFO" in err and "drained (0 request(s) aborted)" in err, err


def test_log_level_flag_then_the_environment(capsys, monkeypatch) -> None:
    runtime = logging.getLogger("runtime")
    bad_port = ["serve", "--device", "cpu", "--port", "70000"]  # refused before any model loads
    monkeypatch.delenv("ECHO_COMPILE_LOGGING_LEVEL", raising=False)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # vLLM's variable, read after ours
    assert cli.main(bad_port) == 2 and runtime.level == logging.DEBUG
    monkeypatch.setenv("ECHO_COMPILE_LOGGING_LEVEL", "error")
    assert cli.main(bad_port) == 2 and runtime.level == logging.ERROR
    assert cli.main([*bad_port, "--log-level", "WARNING"]) == 2
    assert runtime.level == logging.WARNING and logging.getLogger("model").level == logging.WARNING
    capsys.readouterr()
    monkeypatch.setenv("ECHO_COMPILE_LOGGING_LEVEL", "loud")
    assert cli.main(bad_port) == 2
    err = capsys.readouterr().err
    assert err.startswith("echo-compile: error: $ECHO_COMPILE_LOGGING_LEVEL must be one of"), err
