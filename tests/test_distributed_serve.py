"""`echo-compile serve --dp 2` under torchrun on CPU (gloo): two processes, rank 0 serving and
driving, rank 1 following (runtime/distributed/driver.py). The official ``openai`` client gets
the same greedy text (completions and chat, streamed and not) from it as from a single-process
server; and the driver's heartbeat keeps an idle follower from timing out."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from server_utils import running_server

from runtime.distributed.process import free_port, spawn

ROOT = Path(__file__).resolve().parent.parent
OPTS = dict(max_batch=4, host_tokens=1024, max_model_len=256)
PROMPTS = ["The quick brown fox", "Hello world, hello", "Streaming text arrives", "0123456789"]
CHAT = [{"role": "user", "content": "hello there, quick fox"}]
MAX_TOKENS = 8


def _answers(base_url: str) -> dict:
    """What the openai client gets: one batched completion (4 prompts: spread over the DP
    ranks), a streamed completion, a chat completion, a streamed chat completion."""
    c = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0.0)
    batch = c.completions.create(prompt=PROMPTS, **kw)
    stream = c.completions.create(prompt=PROMPTS[1], stream=True, **kw)
    chat = c.chat.completions.create(messages=CHAT, **kw)
    chat_stream = c.chat.completions.create(messages=CHAT, stream=True, **kw)
    return {
        "batch": sorted((ch.index, ch.text) for ch in batch.choices),
        "stream": "".join(ch.choices[0].text for ch in stream if ch.choices),
        "chat": chat.choices[0].message.content,
        "chat_stream": "".join(
            ch.choices[0].delta.content or "" for ch in chat_stream if ch.choices
        ),
    }


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the multi-rank server did not come up")


def test_two_rank_server_answers_the_openai_client_like_one_process():
    from echo_compile.llm import LLM
    from runtime.async_engine import AsyncEngine
    from runtime.server import build_app

    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "echo_compile.cli", "serve", "--dp", "2",
        "--device", "cpu", "--no-compile", "--port", str(port), "--max-batch", "4",
        "--host-tokens", "1024", "--max-model-len", "256", "--collective-timeout", "60",
        "--threads", "1", "--served-model-name", "tiny",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        llm = LLM("tiny", compile=False, progress=False, device="cpu", **OPTS)
        ref_engine = AsyncEngine(llm.engine)
        try:
            with running_server(build_app(ref_engine, "tiny")) as ref_url:
                want = _answers(ref_url)
        finally:
            ref_engine.shutdown()
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, 120)
        got = _answers(url)
        assert got == want
        assert all(text for _, text in want["batch"]), want  # something was generated
        # /metrics covers both DP ranks: a series per engine, the totals over both
        scraped = httpx.get(url + "/metrics", timeout=60).text
        for rank in ("0", "1"):
            assert f'vllm:num_requests_running{{engine="{rank}",model_name="tiny"}}' in scraped
        selected = [
            float(line.rsplit(" ", 1)[1])
            for line in scraped.splitlines()
            if line.startswith("echo_gpu_pool_selected_total{")
        ]
        assert selected and all(s > 0 for s in selected), scraped[-2000:]
        # SIGTERM to both ranks (what a Ctrl-C or torchrun's forwarding does): rank 0 drains
        # and tells rank 1 to stop; both exit cleanly, so torchrun does too
        ranks = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(ranks) == 2, ranks
        for pid in ranks:
            os.kill(int(pid), signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_driver_heartbeat_keeps_an_idle_follower_alive(tmp_path):
    from driver_workers import heartbeat_worker

    spawn(heartbeat_worker, 2, str(tmp_path))
    assert int((tmp_path / "rank0.txt").read_text()) >= 3  # 3 s idle, a ping every 0.5 s
    # the refused add did not stop the follower; the step after it was applied
    assert (tmp_path / "rank1.txt").read_text() == "2 [('add', 'bad'), 'step']"


def test_driver_stops_the_server_once_a_rank_is_gone(tmp_path):
    """A follower that dies ends the multi-rank engine: the driver says so once (serve then
    stops the HTTP server and exits 1) and refuses later calls with that reason. It kept
    serving: /health ok, each request answered with the dead group's error, never exiting."""
    from driver_workers import driver_failure_worker

    ctx = spawn(driver_failure_worker, 2, str(tmp_path), join=False)
    for p in ctx.processes:
        p.join(90)
    assert all(p.exitcode is not None for p in ctx.processes), "a rank hung"
    assert ctx.processes[1].exitcode == 3
    first, failure, later, told = (tmp_path / "rank0.txt").read_text().split("\n")
    assert first.startswith("RankFailure: rank 0/2:"), first
    assert failure == "the multi-rank engine stopped: " + first
    assert later == "EngineClosed: " + failure  # a RuntimeError, not a ValueError: a 503, not a 400
    assert told == "['stop']"


def test_rank_zero_failing_to_start_stops_the_follower_with_one_line():
    """Rank 0 cannot bind its port: rank 1 is told the stop is a failure and says so in one line
    (it took the stop for a clean end, waited at the final barrier rank 0 never reached, and died
    with gloo's traceback)."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), "-m", "echo_compile.cli", "serve", "--dp", "2",
            "--device", "cpu", "--no-compile", "--port", str(port), "--max-batch", "4",
            "--host-tokens", "1024", "--max-model-len", "256", "--collective-timeout", "60",
            "--threads", "1",
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "address already in use" in out, out[-3000:]
    assert "echo-compile: error: rank 1/2: rank 0 stopped on an error" in out, out[-3000:]
    assert "[rank1]" not in out, out[-3000:]  # no traceback from the follower
