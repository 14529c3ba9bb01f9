"""Asynchronous scheduling (``EngineConfig.async_scheduling``), driven through the REAL Engine (tiny
checkpoint, CPU, offloading on): a decode step launched before the tokens of the step before it
are read must give what the synchronous loop gives, token for token and logit for logit, and
leave nothing behind.

Every comparison runs the same script of requests added and aborted before given ``step()`` calls
through two fresh engines, synchronous and asynchronous. In a steady batch both return one decode
step's outputs per call; when the batch changes, the asynchronous engine first returns the step it
has in flight, so a later event can meet it one step further on."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_records import Recorder, random_prompts, tiny

from custom_ops.cache.invariants import check_pool
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams

CFG = EngineConfig(max_batch=4, host_tokens=64 * 24, gpu_tokens=128, max_model_len=256)


def _engine(async_scheduling: bool, eos: int | None = None, **cfg) -> tuple[Engine, Recorder]:
    model, tok = tiny()
    mc = model.config if eos is None else dataclasses.replace(model.config, eos_token_id=eos)
    config = dataclasses.replace(CFG, async_scheduling=async_scheduling, **cfg)
    eng = Engine(model, mc, tok, config)
    return eng, Recorder(eng)


def _drive(eng: Engine, script: dict[int, list]) -> dict[str, dict]:
    """Call ``step()`` until nothing is left; before call i, run ``script[i]``'s actions
    (``("add", id, prompt, params)``, ``("group", ids, prompt, params list)`` or
    ``("abort", id)``). Returns per request: its token ids, logprobs, top alternatives and
    finish reasons."""
    out: dict[str, dict] = {}
    i = 0
    while eng.has_unfinished() or any(k >= i for k in script):
        for action in script.get(i, []):
            if action[0] == "add":
                _, rid, prompt, params = action
                eng.add_request(rid, prompt, params)
                out[rid] = {"ids": [], "lps": [], "tops": [], "reasons": []}
            elif action[0] == "group":  # n sequences of one prompt, one shared prefill
                _, rids, prompt, params = action
                eng.add_request_group(rids, prompt, params)
                out |= {rid: {"ids": [], "lps": [], "tops": [], "reasons": []} for rid in rids}
            else:
                eng.abort_request(action[1])
        for o in eng.step():
            r = out[o.request_id]
            r["ids"] += o.new_token_ids
            r["lps"] += o.new_logprobs or []
            r["tops"] += o.new_top_logprobs or []
            if o.finished:
                r["reasons"].append(o.finish_reason)
        i += 1
    return out


def _assert_nothing_held(eng: Engine) -> None:
    assert not eng.requests and not eng.has_unfinished()
    assert eng.scheduler.pages.num_free == eng.scheduler.pages.num_pages
    assert eng.cache.stats()["gpu_pool_usage"] == 0.0
    eng.check_pools()
    for layer in eng.cache.layers if eng.config.offload else []:
        check_pool(layer.pool, host_kv=layer.host_kv)  # every occupied GPU row equals its host row


def _compare(script: dict[int, list], eos: int | None = None, **cfg) -> tuple[Engine, Recorder]:
    """Run ``script`` synchronously and asynchronously; assert equal outputs; returns the
    asynchronous engine and its recorder."""
    sync, rec_s = _engine(False, eos, **cfg)
    asyn, rec_a = _engine(True, eos, **cfg)
    out_s, out_a = _drive(sync, script), _drive(asyn, script)
    assert out_a == out_s
    # the indexer selected the same positions for every request, position and layer; beyond
    # those, only the rows the asynchronous engine dropped
    assert rec_s.selected.keys() <= rec_a.selected.keys()
    extra = len(rec_a.selected) - len(rec_s.selected)
    assert extra == asyn.discarded_rows * len(asyn.cache.layers)
    for key, sel in rec_s.selected.items():
        assert torch.equal(rec_a.selected[key], sel), key
    assert rec_a.fetch_checks > 0  # and every fetch handed attention the selected rows
    if asyn.discarded_rows == 0:  # (a dropped row's step is a row larger in the async run)
        assert rec_a.batch_sizes == rec_s.batch_sizes  # the scheduler's batches, step by step
    for eng in (sync, asyn):
        _assert_nothing_held(eng)
    assert sync.metrics()["decode_ahead_fraction"] == 0.0
    return asyn, rec_a


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "ignore_eos": True, "temperature": 0.0, **kw})


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    model, _ = tiny()
    return random_prompts([70, 5, 140, 33, 90, 2][:n], model.config.vocab_size, seed)


@pytest.mark.parametrize(
    "cfg",
    [{}, {"kv_format": "fp8"}, {"prefetch": "request"}, {"offload": False}],
    ids=["bf16", "fp8", "prefetch", "gpu-only"],
)
def test_same_tokens_logits_and_selections_as_the_synchronous_loop(cfg) -> None:
    """Greedy, seeded sampling (top-k / top-p), logprobs and top alternatives, and lengths
    that end at different steps (1 and 2 tokens: the length rule's edge); both KV formats,
    with lossless prefetch (its per-layer state is updated inside each step), and GPU-only."""
    ps = _prompts(4)
    params = [
        _params(max_tokens=12, logprobs=True, top_logprobs=3),
        _params(max_tokens=1),
        _params(max_tokens=9, temperature=0.8, top_p=0.9, seed=5, logprobs=True),
        _params(max_tokens=2, temperature=1.2, top_k=7, seed=9),
    ]
    script = {0: [("add", f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]}
    eng, rec = _compare(script, **cfg)
    m = eng.metrics()
    # it ran ahead: every decode step of the unchanged 2-row batch after the short ones ended
    assert m["decode_ahead_fraction"] >= 0.5, m
    assert m["discarded_rows"] == 0.0  # only length finishes, which it never runs past
    logits_rows = [lg for d, _, lg in rec.logits if d]
    assert len(logits_rows) == eng.num_decode_steps


def test_it_runs_ahead_past_requests_finishing_by_length() -> None:
    """Requests of 5, 7, 9 and 11 tokens: each finishes when its last token is read, and the
    step launched ahead meanwhile leaves it out (the batch the scheduler will run), so every
    decode step but the first runs ahead, no row is dropped, and the batches are the
    synchronous loop's."""
    ps = _prompts(4, seed=10)
    script = {0: [("add", f"r{i}", p, _params(max_tokens=5 + 2 * i)) for i, p in enumerate(ps)]}
    # (prefill first: all four prefill, then decode together from the first decode step)
    sync, rec_s = _engine(False, decode_during_prefill=False)
    asyn, rec_a = _engine(True, decode_during_prefill=False)
    assert _drive(sync, script) == _drive(asyn, script)
    assert rec_a.batch_sizes == rec_s.batch_sizes == [4] * 5 + [3] * 2 + [2] * 2 + [1] * 2
    m = asyn.metrics()
    assert m["decode_ahead_fraction"] == 10 / 11 and m["discarded_rows"] == 0.0
    for (_, _, lg_s), (_, _, lg_a) in zip(rec_s.logits, rec_a.logits):
        assert torch.equal(lg_s, lg_a)
    _assert_nothing_held(asyn)


def test_the_same_logits_at_every_decode_step() -> None:
    """torch.equal of every decode step's logits, synchronous against asynchronous."""
    ps = _prompts(3, seed=1)
    script = {0: [("add", f"r{i}", p, _params(max_tokens=10)) for i, p in enumerate(ps)]}
    sync, rec_s = _engine(False)
    asyn, rec_a = _engine(True)
    assert _drive(sync, script) == _drive(asyn, script)
    assert rec_a.batch_sizes == rec_s.batch_sizes
    assert len(rec_a.logits) == len(rec_s.logits)
    for (d_s, ids_s, lg_s), (d_a, ids_a, lg_a) in zip(rec_s.logits, rec_a.logits):
        assert (d_s, ids_s) == (d_a, ids_a)
        assert torch.equal(lg_s, lg_a)
    assert asyn.metrics()["decode_ahead_fraction"] > 0.5


def test_a_stop_token_finish_drops_the_row_run_ahead_of_it() -> None:
    """A request that stops on a sampled token (EOS, a stop token id) was already in the step
    launched after that token: its row there is dropped. That step's batch is then one row
    larger than the synchronous loop's, which may change the last bits of batch-dependent
    matmuls (docs/design.md, "Lossless"): the tokens here are equal (deterministic on CPU), the
    logprobs are not compared (none are asked for)."""
    ps = _prompts(3, seed=2)
    ref = _drive(_engine(False)[0], {0: [("add", "r0", ps[0], _params(max_tokens=12))]})
    stop = ref["r0"]["ids"][4]  # a token r0 samples at its fifth step (maybe earlier too)
    params = [_params(max_tokens=12, stop_token_ids=[stop]), _params(), _params(max_tokens=7)]
    script = {0: [("add", f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]}
    eng, _ = _compare(script)
    assert eng.metrics()["discarded_rows"] >= 1.0
    # EOS the same way (the model's own EOS, not ignored)
    params = [_params(max_tokens=12, ignore_eos=False), _params(), _params(max_tokens=7)]
    script = {0: [("add", f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]}
    eng, _ = _compare(script, eos=stop)
    assert eng.metrics()["discarded_rows"] >= 1.0


def test_arrivals_and_aborts_between_steps() -> None:
    """Requests added while a step is in flight wait for it (the batch changes: the loop drains
    and schedules afresh); an abort mid-flight drops that row of the step in flight; a group of
    two sequences of one prompt prefills once, forks, then runs ahead."""
    ps = _prompts(5, seed=3)
    script = {
        0: [("add", "a", ps[0], _params(max_tokens=14)), ("add", "b", ps[1], _params())],
        3: [("add", "c", ps[2], _params(max_tokens=6, temperature=0.7, seed=1))],
        7: [("abort", "b")],  # a step of a, b and c is in flight then
        8: [("add", "d", ps[3], _params(max_tokens=3)), ("add", "e", ps[4], _params())],
        9: [("abort", "e")],  # still waiting
        10: [("group", ["g0", "g1"], ps[4], [_params(temperature=0.9, seed=s) for s in (1, 2)])],
    }
    eng, _ = _compare(script)
    m = eng.metrics()
    assert m["decode_ahead_fraction"] > 0.0 and m["discarded_rows"] >= 1.0


def test_a_waiting_request_that_does_not_fit_keeps_it_running_ahead() -> None:
    """With every decode row taken, a queued request cannot be admitted: the batch is unchanged
    and the engine keeps running ahead; it is admitted when a row frees."""
    ps = _prompts(4, seed=4)
    script = {0: [("add", f"r{i}", p, _params(max_tokens=8 + 3 * i)) for i, p in enumerate(ps)]}
    eng, _ = _compare(script, max_batch=2)
    assert eng.metrics()["decode_ahead_fraction"] >= 0.5


def test_a_request_waiting_for_host_pages_is_admitted_when_a_finish_frees_them() -> None:
    """The third request waits for host pages until the first finishes: the loop must not run
    ahead past the step that frees them (the synchronous loop admits it there)."""
    ps = _prompts(3, seed=11)
    script = {0: [("add", f"r{i}", ps[i], _params(max_tokens=6 + 4 * i)) for i in range(3)]}
    # pages: r0 70 + 6 tokens 2, r1 5 + 10 tokens 1, r2 140 + 14 tokens 3; the pool's 4 take
    # r2 only once r0 has finished
    eng, _ = _compare(script, host_tokens=64 * 4)
    assert eng.metrics()["decode_ahead_fraction"] > 0.3


@pytest.mark.parametrize(
    "extra",
    [
        {"presence_penalty": 0.5, "frequency_penalty": 0.7},
        {"repetition_penalty": 1.3},
        {"min_tokens": 5, "ignore_eos": False},  # holds EOS back: counts the token in flight
        {"logit_bias": {17: 3.0}, "min_p": 0.05},
    ],
    ids=["presence-frequency", "repetition", "min-tokens", "bias-min-p"],
)
def test_sampling_controls_run_ahead_counting_the_token_in_flight(extra) -> None:
    """Penalties count every generated token; the step run ahead counts its newest one (not on
    the host yet) on the device, and min_tokens counts it too: the same tokens and logprobs as
    the synchronous loop, sampled and greedy, with EOS at the model's own id."""
    ps = _prompts(3, seed=5)
    params = [
        _params(max_tokens=10, temperature=0.9, seed=2, logprobs=True, **extra),
        _params(max_tokens=8, logprobs=True, **extra),
        _params(max_tokens=9),  # no controls beside them
    ]
    script = {0: [("add", f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]}
    eos = None if "min_tokens" not in extra else _engine(False)[0].model_config.eos_token_id
    eng, _ = _compare(script, eos=eos)
    assert eng.metrics()["decode_ahead_fraction"] > 0.5


def test_a_logits_processor_runs_synchronously() -> None:
    ps = _prompts(2, seed=6)
    seen: dict[str, list[int]] = {}

    def proc(reqs, logits):  # reads each request's newest token on the host
        for r in reqs:
            seen.setdefault(r.request_id, []).append(len(r.output_ids))
        return logits

    eng, _ = _engine(True)
    eng.logits_processors.append(proc)
    _drive(eng, {0: [("add", f"r{i}", p, _params(max_tokens=5)) for i, p in enumerate(ps)]})
    assert eng.metrics()["decode_ahead_fraction"] == 0.0
    assert seen == {"r0": list(range(5)), "r1": list(range(5))}  # each step saw the tokens before
    _assert_nothing_held(eng)


def test_the_option_is_checked() -> None:
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        EngineConfig(async_scheduling=1)
    with pytest.raises(ValueError, match="async_scheduling needs dp = tp = ep = 1"):
        EngineConfig(async_scheduling=True, dp=2)


def test_streams_through_the_async_engine_with_a_client_leaving() -> None:
    """The server's loop (``AsyncEngine``) over an asynchronous engine: plain streamed requests
    run ahead, one client leaves after three tokens (its abort is applied between two steps,
    with a step in flight in the runs seen; test_arrivals_and_aborts_between_steps makes that
    case deterministic), and the others get exactly the synchronous engine's tokens; afterwards
    nothing is held."""
    import asyncio

    from runtime.async_engine import AsyncEngine

    ps = _prompts(4, seed=7)
    params = [_params(max_tokens=10 + i) for i in range(4)]
    ref = _drive(
        _engine(False)[0],
        {0: [("add", f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(ps, params))]},
    )
    eng, _ = _engine(True)
    aengine = AsyncEngine(eng)

    async def one(i: int) -> list[int]:
        stream = await aengine.generate(f"r{i}", ps[i], params[i])
        ids: list[int] = []
        async for out in stream:
            ids += out.new_token_ids
            if i == 1 and len(ids) == 3:
                await stream.aclose()  # the client leaves
                break
        return ids

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        got = asyncio.run(main())
        asyncio.run(aengine.metrics())  # a command through the loop: it has applied the abort
    finally:
        aengine.shutdown()
    assert got[1] == ref["r1"]["ids"][:3]
    assert [got[i] for i in (0, 2, 3)] == [ref[f"r{i}"]["ids"] for i in (0, 2, 3)]
    assert eng.metrics()["decode_ahead_fraction"] > 0.3  # (thread timing decides the rest)
    assert eng._in_flight is None
    _assert_nothing_held(eng)


def test_aborting_the_last_request_drops_the_step_in_flight() -> None:
    ps = _prompts(2, seed=8)
    eng, _ = _engine(True)
    eng.add_request("a", ps[0], _params())
    while eng._in_flight is None:
        eng.step()
    eng.abort_request("a")
    assert eng._in_flight is None and not eng.has_unfinished()
    assert eng.discarded_rows == 1
    assert eng.decode_steps_ahead == 0  # counted when read: the dropped step never is
    steps = eng.num_decode_steps
    ref = _drive(_engine(False)[0], {0: [("add", "b", ps[1], _params(max_tokens=5))]})
    assert _drive(eng, {0: [("add", "b", ps[1], _params(max_tokens=5))]}) == ref
    assert eng.num_decode_steps == steps + 5  # the dropped step was never counted
    _assert_nothing_held(eng)
