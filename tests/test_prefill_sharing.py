"""n sequences of one prompt on ONE prefill (runtime.prefill_sharing): each sequence decodes
exactly what a separate request of its seed decodes (tokens and logits, torch.equal), offloading
or not; the prompt's full pages are held once, not n times; the last prompt page is copied, never
written by two sequences; every page and GPU-pool row comes back after finish, abort and
disconnect; and the server's n / best_of through the official openai client.

The separate requests of the references are added together, so that they decode in the same
batches as the group (the CPU forward is not batch-invariant in the last bits: tests/
test_server_engine.py's NOTE); one check also runs each sequence alone, for its tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from engine_records import Recorder, random_prompts, tiny
from server_utils import running_server

from custom_ops.kv_format import PAGE, pages_for
from runtime.async_engine import AsyncEngine
from runtime.engine import Engine, EngineConfig
from runtime.host_slots import HostSlotAllocator
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams

N = 3
PROMPT_LEN = 150  # prefill_end 149: two full shared pages, 21 rows copied into each page 2
MAX_TOKENS = 10
IDS = [f"s{j}" for j in range(N)]


def config(
    offload: bool = True, max_batch: int = 4, prefetch: str = "off", device: str = "cpu"
) -> EngineConfig:
    topk = tiny(device)[0].config.index_topk
    # the smallest GPU pool for the batch (max_batch x topk), prompts longer than topk: decoding
    # evicts and recalls rows. Prefill first: separate requests then decode in the batches the
    # group's forked members do (with decodes between chunks, the first would start alone), so
    # the two runs' logits compare bit for bit.
    return EngineConfig(max_batch=max_batch, host_tokens=64 * 24, gpu_tokens=max_batch * topk,
                        offload=offload, max_model_len=256, prefill_chunk=64, prefetch=prefetch,
                        prefetch_cap=16, device=device, decode_during_prefill=False)  # fmt: skip


def params(seed: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True,
                          logprobs=True)  # fmt: skip


def prompt(seed: int = 3, n: int = PROMPT_LEN) -> list[int]:
    return random_prompts([n], tiny()[0].config.vocab_size, seed)[0]


def engine(cfg: EngineConfig) -> tuple[Engine, Recorder]:
    model, tok = tiny(cfg.device)
    eng = Engine(model, model.config, tok, cfg)
    return eng, Recorder(eng)


def drain(eng: Engine, on_step=None) -> dict[str, list[int]]:  # noqa: ANN001
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if on_step is not None:
            on_step(eng)
    return out


def per_request_logits(rec: Recorder) -> dict[str, list[torch.Tensor]]:
    """Each request's decode logits, step by step."""
    out: dict[str, list[torch.Tensor]] = {}
    for is_decode, ids, logits in rec.logits:
        if is_decode:
            for i, rid in enumerate(ids):
                out.setdefault(rid, []).append(logits[i])
    return out


def assert_same_selected(a: Recorder, b: Recorder) -> None:
    """The same token positions attended by every sequence, position and layer."""
    assert a.selected and a.selected.keys() == b.selected.keys()
    assert all(torch.equal(v, b.selected[k]) for k, v in a.selected.items())


def assert_pools_empty(eng: Engine) -> None:
    s = eng.scheduler
    assert not s.running and not s.waiting and not s.groups and not eng.requests
    assert s.pages.num_free == s.pages.num_pages
    assert all(u == 0.0 for u in eng.cache.stats()["gpu_pool_usage_per_layer"])


def run_group(cfg: EngineConfig, ids: list[int], seeds: list[int], on_step=None):  # noqa: ANN001
    eng, rec = engine(cfg)
    eng.add_request_group(IDS[: len(seeds)], ids, [params(s) for s in seeds])
    return eng, rec, drain(eng, on_step)


def run_separate(cfg: EngineConfig, ids: list[int], seeds: list[int]):
    eng, rec = engine(cfg)
    for rid, s in zip(IDS, seeds):
        eng.add_request(rid, ids, params(s))
    return eng, rec, drain(eng)


# ---- the engine ---------------------------------------------------------------------------------
def test_n3_on_one_prefill_equals_separate_requests_and_counts_pages_once():
    ids, seeds = prompt(), [7, 8, 9]
    used: list[int] = []
    refs: list[list[int]] = []

    def count(eng: Engine) -> None:
        used.append(eng.scheduler.pages.num_used)
        if eng.requests:
            first = next(iter(eng.requests.values()))
            refs.append([eng.scheduler.pages.refs(p) for p in first.pages[:2]])

    shared, rec_s, out_s = run_group(config(), ids, seeds, count)
    sep, rec_p, out_p = run_separate(config(), ids, seeds)
    assert out_s == out_p and len({tuple(t) for t in out_s.values()}) > 1  # the seeds differ
    assert all(len(t) == MAX_TOKENS for t in out_s.values())
    # one prefill of 149 tokens in 64-token chunks, against one per sequence
    prefills = [ids_ for is_decode, ids_, _ in rec_s.logits if not is_decode]
    assert len(prefills) == 3 and all(p == [f"{IDS[0]}#prefill"] for p in prefills)
    assert sum(not d for d, _, _ in rec_p.logits) == 3 * N
    # the same decode batches, the same logits bit for bit, the same attended positions
    a, b = per_request_logits(rec_s), per_request_logits(rec_p)
    assert a.keys() == b.keys() == set(IDS)
    for rid in IDS:
        assert len(a[rid]) == len(b[rid]) == MAX_TOKENS
        assert all(torch.equal(x, y) for x, y in zip(a[rid], b[rid])), rid
    assert_same_selected(rec_s, rec_p)
    # host pages: the two full prompt pages once (three holders each), then each sequence's own
    s, total = (PROMPT_LEN - 1) // PAGE, PROMPT_LEN + MAX_TOKENS
    decoding = [u for u in used[3:-1]]  # after the prefill steps, before the last one
    assert decoding and set(decoding) == {s + N * (pages_for(total) - s)}
    assert s + N * (pages_for(total) - s) < N * pages_for(total)
    assert refs[3] == [N, N]
    # while prefilling: the head's prompt pages + the members' own ones
    assert used[0] == pages_for(PROMPT_LEN - 1) + N * (pages_for(total) - s)
    assert_pools_empty(shared)
    assert_pools_empty(sep)


def test_each_sequence_alone_gives_its_tokens():
    """The tokens of a shared-prefill sequence are those of its seed's request run alone (the
    logits differ only in the last bits of a batch-dependent matmul: not compared here)."""
    ids, seeds = prompt(5, 100), [1, 2]
    _, _, out = run_group(config(), ids, seeds)
    for rid, s in zip(IDS, seeds):
        eng, _ = engine(config())
        eng.add_request("alone", ids, params(s))
        assert drain(eng)["alone"] == out[rid], rid


def test_prompt_logprobs_computed_once_for_the_group():
    """Members asking prompt_logprobs (N = 2, none, 4) share the ONE prefill too: it computes the
    entries once, for the largest N, and each member gets them with its own N, equal to a lone
    request's; the tokens are those of the group without prompt_logprobs."""
    ids, seeds = prompt(4, 130), [7, 8, 9]
    asked = [2, None, 4]
    ps = [dataclasses.replace(params(s), prompt_logprobs=k) for s, k in zip(seeds, asked)]
    eng, rec = engine(config())
    eng.add_request_group(IDS, ids, ps)
    got: dict[str, list | None] = {}
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if len(out[o.request_id]) == 1:
                got[o.request_id] = o.prompt_logprobs
    prefills = [r for d, r, _ in rec.logits if not d]
    assert len(prefills) == 3 and all(p == [f"{IDS[0]}#prefill"] for p in prefills)  # one
    lone, _ = engine(config())
    lone.add_request("alone", ids, dataclasses.replace(params(7), prompt_logprobs=4))
    want = None
    while lone.has_unfinished():
        for o in lone.step():
            want = o.prompt_logprobs if o.prompt_logprobs is not None else want
    assert want is not None and len(want) == len(ids) and want[0] is None
    assert got["s2"] == want and got["s1"] is None
    assert got["s0"] == [None] + [(lp, r, top[:2]) for lp, r, top in want[1:]]
    assert all(len(top) == 4 for _, _, top in want[1:])
    _, _, plain = run_group(config(), ids, seeds)
    assert out == plain
    assert_pools_empty(eng)


@pytest.mark.parametrize("prefetch", ["off", "request"])
def test_offload_equals_gpu_only_with_sharing(prefetch: str):
    """Lossless with sharing; with prefetch on too, whose threshold the sequences share (it is
    keyed by the first host page): that may change what is staged, never what is attended."""
    ids, seeds = prompt(11, 140), [3, 4, 5]
    off = config(offload=True, prefetch=prefetch)
    (eng, rec_off, out_off), (_, rec_gpu, out_gpu) = (
        run_group(c, ids, seeds) for c in (off, config(offload=False))
    )
    if prefetch != "off":
        assert sum(eng.cache.stats()["prefetched_per_step"]) > 0  # it did stage rows
    assert out_off == out_gpu
    assert len(rec_off.logits) == len(rec_gpu.logits)
    for (d1, ids1, x), (d2, ids2, y) in zip(rec_off.logits, rec_gpu.logits):
        assert (d1, ids1) == (d2, ids2) and torch.equal(x, y), ids1
    assert_same_selected(rec_off, rec_gpu)


@pytest.mark.cuda
def test_shared_prefill_lossless_and_equal_to_separate_cuda():
    """On the GPU (eager): the group's logits equal separate requests' and, offloaded, the
    GPU-only run's, bit for bit (the fork's copy reads host rows the prefill wrote via UVA)."""
    ids, seeds = prompt(), [7, 8, 9]
    _, rec_s, out_s = run_group(config(device="cuda"), ids, seeds)
    _, rec_p, out_p = run_separate(config(device="cuda"), ids, seeds)
    gpu, rec_g, out_g = run_group(config(offload=False, device="cuda"), ids, seeds)
    assert out_s == out_p == out_g
    a, b, c = (per_request_logits(r) for r in (rec_s, rec_p, rec_g))
    for rid in IDS:
        assert all(torch.equal(x, y) and torch.equal(x, z)
                   for x, y, z in zip(a[rid], b[rid], c[rid], strict=True)), rid  # fmt: skip
    assert_same_selected(rec_s, rec_g)
    assert_pools_empty(gpu)


def test_abort_one_sequence_others_unchanged_and_pages_freed_once():
    """Aborting sequence 0 mid-decode keeps the shared pages for the other two (their tokens are
    those of the run without the abort, their logits bit for bit those of the run in which
    sequence 0 ends there by itself); the last one to finish frees them."""
    ids, seeds = prompt(), [7, 8, 9]
    _, rec_full, full = run_group(config(), ids, seeds)
    eng_ref, rec_ref = engine(config())  # the abort's batches: sequence 0 ends at 3 tokens
    eng_ref.add_request_group(IDS, ids, [params(7, max_tokens=3), params(8), params(9)])
    ref = drain(eng_ref)
    eng, rec = engine(config())
    eng.add_request_group(IDS, ids, [params(s) for s in seeds])
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if len(out.get("s0", [])) == 3 and "s0" in eng.requests:
            shared = eng.requests["s0"].pages[:2]
            own = eng.requests["s0"].pages[2:]
            eng.abort_request("s0")
            assert [eng.scheduler.pages.refs(p) for p in shared] == [2, 2]
            assert all(eng.scheduler.pages.refs(p) == 0 for p in own)
    assert out["s0"] == full["s0"][:3] and out["s1"] == full["s1"] and out["s2"] == full["s2"]
    assert out == ref
    # NOTE: bit for bit against the run that decodes the same batches, not against rec_full:
    # there the batch keeps its third row for 7 more steps, and a CPU GEMM's last bits may
    # depend on the rows
    # (they did on an AVX2-only CPU, with oneDNN and with ATen's own kernels)
    a, b = per_request_logits(rec), per_request_logits(rec_ref)
    assert a.keys() == b.keys() == set(IDS)
    assert all(torch.equal(x, y) for rid in IDS for x, y in zip(a[rid], b[rid], strict=True))
    assert len(a["s1"]) == len(per_request_logits(rec_full)["s1"])
    assert_pools_empty(eng)


def test_a_waiting_group_counts_its_sequences_in_the_metrics():
    """A queued group is one entry of the waiting queue (its hidden head): ``waiting`` (the
    server's vllm:num_requests_waiting) counts its n sequences, as ``running`` does once it is
    admitted; it counted 1."""
    eng, _ = engine(config())
    eng.add_request_group(IDS, prompt(), [params(s) for s in (1, 2, 3)])
    eng.add_request("r", prompt(seed=4), params(4))
    assert eng.metrics()["waiting"] == 4.0
    eng.abort_request(IDS[0])  # a member leaving before admission leaves the count
    assert eng.metrics()["waiting"] == 3.0
    eng.step()  # the group (its first chunk) and r are admitted
    assert (eng.metrics()["running"], eng.metrics()["waiting"]) == (3.0, 0.0)
    for rid in [*IDS[1:], "r"]:
        eng.abort_request(rid)
    assert_pools_empty(eng)


def test_the_balancer_weighs_a_waiting_group_by_all_its_sequences():
    """``placement`` (what the dp balancer compares between ranks) counted a queued group as its
    one head: the pages and tokens of one sequence, not of n."""
    from runtime.request import Request
    from runtime.scheduler import Scheduler
    from runtime.scheduler_config import SchedulerConfig

    cfg = SchedulerConfig(max_batch=4, max_model_len=512, host_tokens=64 * 16, topk=32,
                          gpu_tokens=128)  # fmt: skip
    s = Scheduler(cfg)
    s.add_group([Request(f"g{i}", [5] * 150, SamplingParams(max_tokens=100)) for i in range(3)])
    (g,) = s.groups.values()
    left, free, cached = s.placement([9] * 10, False)
    assert free == 16 - g.pages_needed() == 7  # (was 12: one sequence's 4 pages)
    assert left == 150 + 3 * 100 and cached == 0  # the prompt once, each sequence's tokens
    s.schedule()  # admitted: the head prefills, its members run only after the fork
    assert g.admitted and s.placement([9] * 10, False)[0] == 150 + 3 * 100  # (was 250)


@pytest.mark.parametrize("when", ["waiting", "prefilling"])
def test_abort_every_sequence_before_the_fork(when: str):
    eng, _ = engine(config())
    eng.add_request_group(IDS, prompt(), [params(s) for s in (1, 2, 3)])
    if when == "prefilling":
        eng.step()  # the first prefill chunk: the group is admitted, its head mid-prefill
        assert eng.scheduler.groups and eng.scheduler.pages.num_used > 0
    for rid in IDS:
        eng.abort_request(rid)
    assert not eng.has_unfinished()
    assert_pools_empty(eng)
    # the engine still serves a new group afterwards
    eng.add_request_group(IDS[:2], prompt(), [params(1), params(2)])
    out = drain(eng)
    assert all(len(out[r]) == MAX_TOKENS for r in IDS[:2])
    assert_pools_empty(eng)


def test_group_larger_than_the_decode_rows_is_split_and_bad_groups_are_refused():
    ids = prompt(2, 70)
    eng, rec = engine(config(max_batch=2))
    many = [f"m{j}" for j in range(5)]
    eng.add_request_group(many, ids, [params(j) for j in range(5)])
    out = drain(eng)
    assert sorted(out) == many and all(len(t) == MAX_TOKENS for t in out.values())
    assert sum(not d for d, _, _ in rec.logits) == 3 * 2  # groups of 2, 2 and 1: 3 prefills
    assert_pools_empty(eng)
    with pytest.raises(ValueError, match="distinct"):
        eng.add_request_group(["a", "a"], ids, [params(1), params(2)])
    with pytest.raises(ValueError, match="context limit"):
        eng.add_request_group(["a", "b"], ids, [params(1), params(2, max_tokens=250)])
    assert not eng.requests and not eng.has_unfinished()  # refused as a whole
    eng.add_request_group(["one-a", "one-b"], [5], [params(1), params(2)])  # nothing to prefill
    assert not eng.scheduler.groups and sorted(drain(eng)) == ["one-a", "one-b"]


def test_host_slot_refcounts():
    a = HostSlotAllocator(4)
    p = a.alloc(2)
    a.share(p)
    assert a.last_holder(p) == [] and a.free(p) == [] and a.num_free == 2
    assert a.last_holder(p) == p and a.free(p) == p and a.num_free == 4
    with pytest.raises(ValueError, match="not allocated"):
        a.share(p)
    q = a.alloc(1)
    with pytest.raises(ValueError, match="not allocated"):
        a.free(q + q)  # one page twice in one call
    assert a.refs(q[0]) == 1


def test_best_of_order():
    from runtime.server_completions import best_of_order

    def res(*lps: float) -> RequestOutput:
        return RequestOutput(logprobs=list(lps))

    results = [res(-1, -1), res(-0.5), res(-3), res(-2), res(-1, -0.5), res(-1.5)]
    # two prompts x best_of 3: sums -2, -0.5, -3 | -2, -1.5, -1.5 (a tie keeps the order)
    assert best_of_order(results, best_of=3, n=2) == [1, 0, 4, 5]


# ---- the server -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    from runtime.server import build_app  # the server packages: the GPU machine has none

    eng, rec = engine(config(max_batch=8))
    aengine = AsyncEngine(eng)
    with running_server(build_app(aengine, "tiny")) as base:
        yield base, aengine, rec
    aengine.shutdown()


def prefills_of(rec: Recorder) -> list[str]:
    return [ids[0] for is_decode, ids, _ in rec.logits if not is_decode]


def _idle(aengine: AsyncEngine) -> Engine:
    eng = aengine.engine
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        m = asyncio.run(aengine.metrics())
        if (m["running"], m["waiting"], m["host_pool_usage"]) == (0.0, 0.0, 0.0):
            break
        time.sleep(0.05)
    assert_pools_empty(eng)
    return eng


def test_server_n_shares_one_prefill_streamed_and_not(served):
    import openai  # not at the top: the GPU machine that runs the cuda tests has none

    base, aengine, rec = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    ids = prompt(9, 90)
    body = dict(model="tiny", prompt=ids, max_tokens=6, temperature=1.0, seed=5, logprobs=0)
    before = len(prefills_of(rec))
    r = client.completions.create(**body, n=3)
    new = prefills_of(rec)[before:]  # 89 tokens in 64-token chunks, once for the three
    assert len(new) == 2 and all(p.endswith("-0#prefill") for p in new)
    many = [c.logprobs.tokens for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len({tuple(t) for t in many}) > 1
    single = [client.completions.create(**{**body, "seed": 5 + j}).choices[0].logprobs.tokens
              for j in range(3)]  # fmt: skip
    assert many == single
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 18
    text = ["", "", ""]
    for chunk in client.completions.create(**body, n=3, stream=True):
        for c in chunk.choices:
            text[c.index] += c.text
    assert text == [c.text for c in r.choices]
    _idle(aengine)


def test_server_best_of_returns_the_highest_cumulative_logprobs(served):
    import openai  # not at the top: the GPU machine that runs the cuda tests has none

    base, aengine, _ = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    body = dict(model="tiny", prompt=prompt(4, 80), max_tokens=5, temperature=1.0, seed=11)
    every = client.completions.create(**body, n=4, logprobs=0).choices
    sums = [sum(c.logprobs.token_logprobs) for c in every]
    want = sorted(range(4), key=lambda i: -sums[i])[:2]
    best = client.completions.create(**body, n=2, best_of=4)
    assert [c.text for c in best.choices] == [every[i].text for i in want]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    best_lp = client.completions.create(**body, n=2, best_of=4, logprobs=0)
    assert [c.logprobs.tokens for c in best_lp.choices] == [every[i].logprobs.tokens for i in want]
    # best_of == n streams like n
    got = ["", ""]
    for chunk in client.completions.create(**body, n=2, best_of=2, stream=True):
        for c in chunk.choices:
            got[c.index] += c.text
    assert got == [every[0].text, every[1].text]
    # streaming best_of > n, best_of < n, and best_of in chat are refused, naming best_of
    for extra, stream in (({"n": 1, "best_of": 2}, True), ({"n": 3, "best_of": 2}, False)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**body, **extra, stream=stream)
        assert e.value.body["param"] == "best_of"
    import httpx

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "best_of": 2}
    r = httpx.post(base + "/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    _idle(aengine)


def test_server_disconnect_frees_a_group(served):
    import httpx

    base, aengine, _ = served
    body = {"model": "tiny", "prompt": prompt(6, 70), "max_tokens": 180, "n": 3,
            "ignore_eos": True, "stream": True}  # fmt: skip
    before = aengine.engine.generated_tokens
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk is enough: leave with the sequences decoding
    eng = _idle(aengine)
    # every member aborted, not one run to max_tokens (a leaked member alone would add ~180)
    assert eng.generated_tokens - before < 180
