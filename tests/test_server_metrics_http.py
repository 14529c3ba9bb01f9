"""/metrics over HTTP on the REAL tiny engine (CPU, KV offloaded, lossless prefetch), as a
Prometheus scraper reads it: the text parses as the exposition format, the request gauges fall
back to 0 once requests finish, are aborted or fail, the counters only grow (a failed step does
not restart them), and two servers in one process keep their own series."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import running_server

from echo_compile.llm import LLM
from runtime.async_engine import AsyncEngine
from runtime.server import build_app

pytestmark = pytest.mark.aten_gemm  # CPU GEMMs without oneDNN (conftest.py)

MODEL = "tiny"
OPTIONS: dict[str, Any] = dict(
    device="cpu",
    compile=False,
    max_batch=2,
    host_tokens=64 * 64,
    gpu_tokens=2 * 32,  # max_batch x index_topk: the smallest pool, so decoding recalls rows
    max_model_len=512,
    progress=False,
    offload=True,
    prefetch="request",
    prefetch_cap=16,
)
PROMPT = [0] + [(7 * i) % 500 + 5 for i in range(140)]  # BOS, then no special tokens
NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[Series, dict[str, str]]:
    """Every sample of /metrics by (name, sorted labels), and each family's type. The strict
    parser of prometheus_client raises on text that is not the exposition format."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    series: Series = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(r.text):
        types[fam.name] = fam.type
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in series, f"duplicate series {key}"
            series[key] = s.value
    return series, types


def by_layer(series: Series, name: str) -> dict[str, float]:
    return {dict(lab)["layer"]: v for (n, lab), v in series.items() if n == name}


def complete(url: str, **body: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **body}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, **OPTIONS)


@pytest.fixture(scope="module")
def served(llm: LLM) -> Iterator[tuple[str, AsyncEngine]]:
    aengine = AsyncEngine(llm.engine)
    try:
        with running_server(build_app(aengine, MODEL)) as url:
            yield url, aengine
    finally:
        aengine.shutdown()


def test_exposition_is_valid_with_help_type_and_counter_suffixes(
    served: tuple[str, AsyncEngine],
) -> None:
    url, _ = served
    assert complete(url).status_code == 200
    series, types = scrape(url)
    text = httpx.get(url + "/metrics").text
    helped = {ln.split()[2] for ln in text.splitlines() if ln.startswith("# HELP ")}
    typed = {ln.split()[2]: ln.split()[3] for ln in text.splitlines() if ln.startswith("# TYPE ")}
    for name, kind in typed.items():
        assert NAME.fullmatch(name) and name in helped, name
        if kind == "counter":  # (the text format names a counter with its _total)
            assert name.endswith("_total"), name
    for name, _ in series:
        assert NAME.fullmatch(name), name
    assert types["vllm:generation_tokens"] == "counter"
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    assert types["echo_gpu_pool_selected"] == "counter"


def test_ttft_itl_and_e2e_observe_one_request_each(served: tuple[str, AsyncEngine]) -> None:
    """One request of 6 tokens: one TTFT (from arrival: at least the prefill), 5 inter-token
    gaps (the first token is not one), one end-to-end latency no shorter than TTFT + gaps."""
    url, _ = served
    before, _ = scrape(url)
    t0 = time.perf_counter()
    r = complete(url, stream=True)
    wall = time.perf_counter() - t0
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    after, _ = scrape(url)
    m = (("model_name", MODEL),)

    def delta(name: str) -> float:
        return after[(name, m)] - before.get((name, m), 0.0)

    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 5
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    ttft = delta("vllm:time_to_first_token_seconds_sum")
    itl = delta("vllm:inter_token_latency_seconds_sum")
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    assert 0 < ttft and 0 < itl and ttft + itl <= e2e <= wall
    assert delta("vllm:prompt_tokens_total") == len(PROMPT)
    assert delta("vllm:generation_tokens_total") == 6


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_request_token_histograms_observe_the_prompt_and_the_generation(
    served: tuple[str, AsyncEngine], stream: bool
) -> None:
    """vLLM's vllm:request_prompt_tokens / vllm:request_generation_tokens: one request with a
    P-token prompt and G generated tokens observes P and G, each in its 1-2-5 bucket; the
    bounds end at the last one within max_model_len (500 of 512), then +Inf."""
    url, _ = served
    p, g = len(PROMPT), 6
    before, _ = scrape(url)
    r = complete(url, max_tokens=g, ignore_eos=True, stream=stream)
    assert r.status_code == 200
    after, _ = scrape(url)
    m = (("model_name", MODEL),)

    def delta(name: str, le: str | None = None) -> float:
        key = (name, m) if le is None else (name, (("le", le), *m))
        return after[key] - before.get(key, 0.0)

    for name, n, (below, at) in (
        ("vllm:request_prompt_tokens", p, ("100.0", "200.0")),  # P = 141
        ("vllm:request_generation_tokens", g, ("5.0", "10.0")),
    ):
        assert (delta(name + "_count"), delta(name + "_sum")) == (1, n), name
        assert (delta(name + "_bucket", below), delta(name + "_bucket", at)) == (0, 1), name
        bounds = [dict(lab)["le"] for (k, lab), _ in after.items() if k == name + "_bucket"]
        assert bounds[-2:] == ["500.0", "+Inf"] and "1000.0" not in bounds, name


def test_gauges_fall_back_after_abort(served: tuple[str, AsyncEngine]) -> None:
    """Four streams on a batch of 2 (two running, two waiting), the clients leave: running,
    waiting and the KV-cache usage read 0 again, and each counts as an abort."""
    url, aengine = served
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    aborts = ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL)))
    eng = (("engine", "0"), ("model_name", MODEL))
    before, _ = scrape(url)

    async def main() -> Series:
        async with httpx.AsyncClient(timeout=60) as http:

            async def one() -> None:
                async with http.stream("POST", url + "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            tasks = [asyncio.create_task(one()) for _ in range(4)]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                m = await aengine.metrics()
                if (m["running"], m["waiting"]) == (2.0, 2.0):
                    break
                await asyncio.sleep(0.05)
            busy = await asyncio.to_thread(lambda: scrape(url)[0])
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return busy

    busy = asyncio.run(main())
    assert busy[("vllm:num_requests_running", eng)] == 2.0
    assert busy[("vllm:num_requests_waiting", eng)] == 2.0
    assert busy[("vllm:kv_cache_usage_perc", eng)] > 0.0
    deadline = time.monotonic() + 30
    while True:
        after, _ = scrape(url)
        idle = after[("vllm:num_requests_running", eng)] + after[("vllm:num_requests_waiting", eng)]
        if idle == 0.0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):  # fmt: skip
        assert after[(name, eng)] == 0.0, name
    for name in ("echo_running_requests", "echo_waiting_requests", "echo_host_pool_usage"):
        assert after[(name, ())] == 0.0, name
    assert after[aborts] - before.get(aborts, 0.0) == 4


def test_a_failed_step_does_not_restart_the_counters(
    served: tuple[str, AsyncEngine], llm: LLM
) -> None:
    """A step that raises fails its request and empties the GPU pools (Engine.recover). The
    lookup counters, the hit rate and the prefetch shares go on from where they were: the
    engine's totals restarted from 0, so the counters missed every lookup until the totals
    passed their old values again (a request after the failure moved them by nothing), and
    prefetch coverage read 0."""
    url, aengine = served
    sel0 = by_layer(scrape(url)[0], "echo_gpu_pool_selected_total")
    assert complete(url).status_code == 200
    s1, _ = scrape(url)
    sel1 = by_layer(s1, "echo_gpu_pool_selected_total")
    one = {layer: v - sel0.get(layer, 0.0) for layer, v in sel1.items()}  # a request's lookups
    cov1 = by_layer(s1, "echo_prefetch_coverage")
    assert sel1 and all(v > 0 for v in one.values())
    assert any(v > 0 for v in cov1.values())

    forward, calls = llm.engine.runner.forward, [0]

    def failing(batch: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:  # a decode step, after some lookups
            raise RuntimeError("simulated step failure")
        return forward(batch)

    llm.engine.runner.forward = failing
    try:
        r = complete(url)
    finally:
        llm.engine.runner.forward = forward
    assert r.status_code == 500
    deadline = time.monotonic() + 30  # recover() runs on the loop thread after the 500 went out
    while asyncio.run(aengine.metrics())["gpu_pool_usage"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    s2, _ = scrape(url)
    # the shares are of every lookup since start: the failure changed none of them
    assert by_layer(s2, "echo_prefetch_coverage") == pytest.approx(cov1, rel=0.5)
    assert all(v > 0 for v in by_layer(s2, "echo_gpu_pool_hit_rate").values())
    assert complete(url).status_code == 200  # as many lookups again as the first request
    s3, _ = scrape(url)
    sel3 = by_layer(s3, "echo_gpu_pool_selected_total")
    rec3 = by_layer(s3, "echo_gpu_pool_recalled_total")
    snap = llm.engine.metrics()
    for layer, n in one.items():
        assert sel3[layer] - sel1[layer] >= n, layer
        assert sel3[layer] == snap["gpu_pool_selected"][int(layer)]  # nothing lost on the way
        assert s3[("echo_gpu_pool_hit_rate", (("layer", layer),))] == pytest.approx(
            1 - rec3[layer] / sel3[layer]
        )


def test_two_servers_in_one_process_keep_their_own_series(
    served: tuple[str, AsyncEngine],
) -> None:
    """A second engine and server beside the first: its counters start at 0 and a request to
    it moves its own series alone (each app has its own registry)."""
    url1, _ = served
    first, _ = scrape(url1)
    other = AsyncEngine(LLM(MODEL, **{**OPTIONS, "prefetch": "off"}).engine)
    try:
        with running_server(build_app(other, "other")) as url2:
            fresh, _ = scrape(url2)
            m2 = (("model_name", "other"),)
            assert fresh[("vllm:generation_tokens_total", m2)] == 0.0
            assert fresh[("echo_generation_tokens_total", ())] == 0.0
            body = {"model": "other", "prompt": PROMPT, "max_tokens": 3, "temperature": 0}
            assert httpx.post(url2 + "/v1/completions", json=body, timeout=120).status_code == 200
            s2, _ = scrape(url2)
            assert s2[("vllm:generation_tokens_total", m2)] == 3.0
            assert s2[("echo_generation_tokens_total", ())] == 3.0
            assert not any(dict(lab).get("model_name") == MODEL for _, lab in s2)
    finally:
        other.shutdown()
    again, _ = scrape(url1)
    m1 = (("model_name", MODEL),)
    for key in (("vllm:generation_tokens_total", m1), ("vllm:prompt_tokens_total", m1),
                ("echo_generation_tokens_total", ())):  # fmt: skip
        assert again[key] == first[key], key
    assert not any(dict(lab).get("model_name") == "other" for _, lab in again)
