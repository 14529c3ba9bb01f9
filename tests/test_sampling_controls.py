"""runtime.sampling_controls against a straightforward per-token reference (same logits, same seed
-> same tokens), its device-side state against a rebuild from scratch, and through the tiny engine:
logit_bias and min_tokens steer it, and offloading on/off stays bit-identical with every control
on."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch
from engine_records import random_prompts, run, tiny

from runtime.engine import EngineConfig
from runtime.sampler import prepare_batch, sample
from runtime.sampling_controls import SamplingControls
from runtime.sampling_params import SamplingParams, SamplingParamsError

V, EOS = 64, 1


@dataclass
class Req:  # the fields SamplingControls reads from a runtime.request.Request
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)


def reference(x: torch.Tensor, r: Req, eos: int) -> torch.Tensor:
    """One row, token by token, as the parameters are documented."""
    p, x = r.params, x.clone()
    counts = [r.output_ids.count(v) for v in range(V)]
    for v in range(V):
        if p.repetition_penalty != 1 and (counts[v] or v in r.prompt_ids):
            x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
    for v in range(V):
        x[v] = x[v] - p.frequency_penalty * counts[v] - p.presence_penalty * (counts[v] > 0)
    for t, b in p.logit_bias:
        x[t] += b
    if len(r.output_ids) < p.min_tokens:
        for t in ([] if p.ignore_eos else [eos]) + list(p.stop_token_ids):
            x[t] = -math.inf
    if p.min_p > 0 and not p.greedy:
        probs = torch.softmax(x / p.temperature, dim=-1)
        x[probs < p.min_p * probs.max()] = -math.inf
    return x


def random_params(rng: random.Random) -> SamplingParams:
    pick = rng.random
    return SamplingParams(
        max_tokens=40,
        temperature=rng.choice([0.0, 0.7, 1.3]),
        seed=rng.randrange(1000),
        presence_penalty=rng.choice([0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.3, 2.0]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        logit_bias={rng.randrange(V): rng.uniform(-5, 5) for _ in range(rng.randrange(3))},
        min_p=rng.choice([0.0, 0.05, 0.2]) if pick() < 0.7 else 0.0,
        min_tokens=rng.choice([0, 3, 10]),
        stop_token_ids=(rng.randrange(V),) if pick() < 0.5 else (),
        ignore_eos=pick() < 0.2,
    )


def test_controls_equal_the_reference_over_steps() -> None:
    rng = random.Random(0)
    controls = SamplingControls({EOS})
    reqs = [
        Req(f"r{i}", [rng.randrange(V) for _ in range(rng.randrange(1, 12))], random_params(rng))
        for i in range(12)
    ]
    reqs[0].params = SamplingParams(max_tokens=40, temperature=0.8, frequency_penalty=1.5, seed=1)
    reqs.append(Req("plain", [3, 4], SamplingParams(max_tokens=40)))  # no controls: untouched
    gen = torch.Generator().manual_seed(0)
    for step in range(9):
        batch = [r for r in reqs if step % 3 != 1 or r.request_id != "r0"]  # r0 leaves, returns
        logits = torch.randn(len(batch), V, generator=gen) * 3
        ref = torch.stack([reference(x, r, EOS) for x, r in zip(logits, batch, strict=True)])
        given = logits.clone()
        out = controls(batch, given)
        assert torch.equal(given, logits)  # never written: it may be a CUDA graph's output
        fresh = SamplingControls({EOS})(batch, logits.clone())  # state rebuilt from the lists
        assert torch.allclose(out, ref, atol=1e-5, rtol=0, equal_nan=False), step
        assert torch.equal(torch.isinf(out), torch.isinf(ref))
        assert torch.equal(out, fresh), "incremental device state != state rebuilt from scratch"
        plain = [i for i, r in enumerate(batch) if r.request_id == "plain"][0]
        assert torch.equal(out[plain], logits[plain])
        sb = prepare_batch([r.params for r in batch], [r.params.seed or 0 for r in batch],
                           [len(r.output_ids) for r in batch])  # fmt: skip
        args = (sb.temperature, sb.top_k, sb.top_p, sb.seeds, sb.steps)
        tok, _ = sample(out, *args)
        tok_ref, _ = sample(ref, *args)
        assert torch.equal(tok, tok_ref), step  # same logits, same seed -> same tokens
        for r, t in zip(batch, tok.tolist(), strict=True):
            r.output_ids.append(t)
    with_controls = {r.request_id for r in reqs if r.params.has_controls}
    assert set(controls.slots) == with_controls and "r0" in with_controls  # never "plain"
    assert controls.counts is not None and controls.counts.shape[0] >= 12  # grew past 8


def test_no_controls_costs_nothing() -> None:
    controls = SamplingControls({EOS})
    logits = torch.randn(3, V)
    reqs = [
        Req(f"r{i}", [1], SamplingParams(max_tokens=4, min_p=0.5, temperature=0)) for i in range(3)
    ]
    assert controls(reqs, logits) is logits and controls.counts is None  # min_p off when greedy


def test_min_tokens_holds_back_eos_and_stop_ids() -> None:
    params = SamplingParams(max_tokens=10, temperature=0, min_tokens=2, stop_token_ids=(7,))
    r = Req("a", [5], params)
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 7] = 10.0, 9.0
    controls = SamplingControls({EOS})
    out = controls([r], logits.clone())
    assert out[0, EOS] == -math.inf and out[0, 7] == -math.inf
    r.output_ids = [3, 3]
    out = controls([r], logits.clone())
    assert out[0].argmax() == EOS  # min_tokens reached: EOS may end it


@pytest.mark.parametrize("penalty", [1e-308, 1e-40, 1e39, 1e308])
def test_extreme_repetition_penalty_stays_finite(penalty: float) -> None:
    # fp32 makes 1e-308 a 0 (x / 0 = +inf) and 1e39 an inf (0 * inf = NaN): the sampled row was
    # NaN, the token garbage, and a request with logprobs a 500 (JSON has no NaN).
    logits = torch.randn(2, V) * 4
    logits[:, [3, 5, 9, 11]] = torch.tensor([0.0, 2.0, -math.inf, -1.0])  # 9: masked (a grammar)
    r = Req("a", [3, 5, 9, 11], SamplingParams(max_tokens=4, repetition_penalty=penalty))
    out = SamplingControls({EOS})([r, r], logits.clone())
    assert not out.isnan().any() and not (out == math.inf).any()
    assert (out[:, 9] == -math.inf).all()  # still masked
    sb = prepare_batch([r.params] * 2, [0, 1], [0, 0])
    ids, lp = sample(out, sb.temperature, sb.top_k, sb.top_p, sb.seeds, sb.steps)
    assert lp.isfinite().all() and (ids != 9).all()
    if penalty < 1:  # a seen positive logit dominates
        assert (ids == 5).all()


def test_params_validation_names_the_field() -> None:
    for kw, name in [
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 20}, "min_tokens"),
        ({"top_k": 2**63}, "top_k"),  # past int64: the sampler's tensor cannot hold it
        # a finished grammar allows only EOS: these would leave no token to sample
        ({"grammar": "start: /x/", "min_tokens": 2}, "min_tokens"),
        ({"grammar": "start: /x/", "ignore_eos": True}, "ignore_eos"),
    ]:
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(max_tokens=16, **kw)
        assert e.value.param == name and name in str(e.value)
    assert SamplingParams(logit_bias={9: 1, 2: -1.5}).logit_bias == ((2, -1.5), (9, 1.0))


# ---- through the tiny engine ---------------------------------------------------------------------
def _cfg(offload: bool, n: int, topk: int) -> EngineConfig:
    # prefill first: every request decodes from the first decode step on, in one batch
    return EngineConfig(max_batch=n, host_tokens=64 * 16, gpu_tokens=n * topk, offload=offload,
                        max_model_len=192, prefill_chunk=64, device="cpu",
                        decode_during_prefill=False)  # fmt: skip


def test_engine_logit_bias_and_min_tokens() -> None:
    model, _ = tiny("cpu")
    vocab, eos = model.config.vocab_size, model.config.eos_token_id
    prompts = random_prompts([20, 40], vocab, seed=3)
    forced = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={17: 100.0})
    # EOS at +100 would end at once; min_tokens holds it back for 4 tokens
    late_eos = SamplingParams(max_tokens=8, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=4)
    _, _, out = run(_cfg(True, 2, model.config.index_topk), prompts, [forced, late_eos])
    assert out["r0"] == [17] * 5
    assert len(out["r1"]) == 5 and out["r1"][-1] == eos and eos not in out["r1"][:4]


def test_engine_refuses_stop_token_ids_past_the_vocab() -> None:
    """An id past the vocabulary was accepted, then indexed out of bounds in the decode step
    (min_tokens' mask), which failed every request in the batch."""
    from runtime.engine import Engine

    model, tok = tiny("cpu")
    mc = model.config
    engine = Engine(model, mc, tok, _cfg(True, 1, mc.index_topk))
    bad = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=(mc.vocab_size,))
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids in \[0, "):
        engine.add_request("r", [1, 2, 3], bad)
    assert not engine.has_unfinished()


def test_engine_offload_on_off_identical_with_controls() -> None:
    model, _ = tiny("cpu")
    topk = model.config.index_topk
    lens = [30, 90, 150]
    prompts = random_prompts(lens, model.config.vocab_size, seed=11)
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3,
                       frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, seed=5, presence_penalty=1.0, min_p=0.05,
                       logit_bias={100: 2.0}, min_tokens=10),
        SamplingParams(max_tokens=10, temperature=1.2, seed=6, top_k=50, repetition_penalty=0.9),
    ]  # fmt: skip
    runs = {off: run(_cfg(off, len(lens), topk), prompts, params) for off in (True, False)}
    (eng_off, rec_off, out_off), (_, rec_gpu, out_gpu) = runs[True], runs[False]
    assert out_off == out_gpu
    for (d1, ids1, a), (d2, ids2, b) in zip(rec_off.logits, rec_gpu.logits, strict=True):
        assert (d1, ids1) == (d2, ids2) and torch.equal(a, b)
    assert all(len(v) == 10 for v in out_off.values())
    assert eng_off.cache.stats()["recalled_rows_per_step"] > 0  # offloading really recalled
    # and the controls changed something: the plain run of the same prompts differs
    plain = [SamplingParams(max_tokens=10, temperature=p.temperature, seed=p.seed, top_k=p.top_k,
                            ignore_eos=True) for p in params]  # fmt: skip
    assert run(_cfg(True, len(lens), topk), prompts, plain)[2] != out_off


def _record_decode_logits(eng) -> list[torch.Tensor]:  # noqa: ANN001
    """The logits of each decode step ``eng`` runs from now on (its batch's rows), appended to
    the returned list."""
    logs: list[torch.Tensor] = []
    fwd = eng.runner.forward

    def recording(batch):  # noqa: ANN001, ANN202
        out = fwd(batch)
        if batch.is_decode:
            logs.append(out[: len(batch.requests)].float().clone())
        return out

    eng.runner.forward = recording
    return logs


def test_engine_top_logprobs_against_the_recorded_logits() -> None:
    """top_logprobs = log_softmax(logits).topk(N) of each decode row, the chosen greedy token
    first; a request that does not ask gets none."""
    model, _ = tiny("cpu")
    prompts = random_prompts([20, 40], model.config.vocab_size, seed=4)
    ask = SamplingParams(max_tokens=4, temperature=0.0, top_logprobs=5, logprobs=True)
    # NOTE: the batch is [a, b] in add order (both prompts fit one step's prefill budget)
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    from runtime.engine import Engine

    model, tok = tiny("cpu")
    eng = Engine(model, model.config, tok, _cfg(True, 2, model.config.index_topk))
    logs = _record_decode_logits(eng)
    eng.add_request("a", prompts[0], ask)
    eng.add_request("b", prompts[1], plain)
    step = 0
    while eng.has_unfinished():
        outs = {o.request_id: o for o in eng.step()}
        if not outs:
            continue
        ref = torch.log_softmax(logs[step][0], dim=-1).topk(5)
        (top,) = outs["a"].new_top_logprobs
        assert [t for t, _ in top] == ref.indices.tolist()
        assert [v for _, v in top] == ref.values.tolist()
        assert top[0][0] == outs["a"].new_token_ids[0] and top[0][1] == outs["a"].new_logprobs[0]
        assert outs["b"].new_top_logprobs is None
        step += 1
    assert step == 4


def test_engine_chosen_token_logprob_in_the_top_logprobs_distribution() -> None:
    """``new_top_chosen``: each token's logprob in its top_logprobs' distribution (the raw
    log-softmax of the recorded logits), for a sampled row too, whose reported logprob is of the
    top-k-renormalised distribution it was sampled from; a greedy row's equals its logprob; a
    request without top_logprobs gets none."""
    from runtime.engine import Engine

    model, tok = tiny("cpu")
    prompts = random_prompts([20, 30, 40], model.config.vocab_size, seed=5)
    sampled = SamplingParams(max_tokens=8, temperature=1.0, top_k=2, seed=3, top_logprobs=1,
                             logprobs=True, ignore_eos=True)  # fmt: skip
    greedy = SamplingParams(max_tokens=8, temperature=0.0, top_logprobs=1, logprobs=True,
                            ignore_eos=True)  # fmt: skip
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng = Engine(model, model.config, tok, _cfg(True, 3, model.config.index_topk))
    logs = _record_decode_logits(eng)
    for rid, p, params in zip("abc", prompts, [sampled, greedy, plain]):
        eng.add_request(rid, p, params)  # NOTE: the batch is [a, b, c] in add order
    step, outside = 0, 0
    while eng.has_unfinished():
        outs = {o.request_id: o for o in eng.step()}
        if not outs:
            continue
        for row, rid in enumerate("ab"):
            o = outs[rid]
            (t,), (own,), (raw,) = o.new_token_ids, o.new_logprobs, o.new_top_chosen
            want = float(torch.log_softmax(logs[step][row], dim=-1)[t])
            assert raw == pytest.approx(want, abs=1e-6), (rid, step)
            (top,) = o.new_top_logprobs
            if rid == "b":
                assert raw == own
            elif t != top[0][0]:  # sampled second of the top 2: below the top one, and below
                outside += 1  # its own logprob, of the two tokens' renormalised distribution
                assert raw <= top[0][1] and raw < own, (step, raw, own, top)
        assert outs["c"].new_top_chosen is None
        step += 1
    assert step == 8 and outside > 0  # (a sampled token outside the top 1 came up)


def test_masked_tokens_report_a_finite_logprob_floor() -> None:
    """min_p masks all but the likeliest tokens to -inf; JSON cannot carry -inf, so reported
    logprobs are floored at LOGPROB_FLOOR (the server returned 500 before)."""
    from runtime.engine import LOGPROB_FLOOR

    model, _ = tiny("cpu")
    prompts = random_prompts([20], model.config.vocab_size, seed=4)
    ask = SamplingParams(max_tokens=3, seed=1, min_p=0.9, top_logprobs=5, logprobs=True)
    from runtime.engine import Engine

    model, tok = tiny("cpu")
    eng = Engine(model, model.config, tok, _cfg(True, 1, model.config.index_topk))
    eng.add_request("a", prompts[0], ask)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.new_top_logprobs]
    vals = [v for o in outs for top in o.new_top_logprobs for _, v in top]
    assert vals and all(math.isfinite(v) and v >= LOGPROB_FLOOR for v in vals)
    assert LOGPROB_FLOOR in vals  # min_p really masked some of the top 5


def test_benchmark_cli_on_cpu(tmp_path) -> None:  # noqa: ANN001
    """``--help`` answers without a GPU, and the benchmark refuses to run without one."""
    from benchmarks import bench_sampling_controls as bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    if not torch.cuda.is_available():
        assert bench.main(["--out", str(tmp_path / "x.json")]) == 2
    reqs = bench.make_requests(3, 100, 10, seed=0)
    assert all(r.params.has_controls and len(r.output_ids) == 10 for r in reqs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_request_whose_parameters_mask_every_token_ends_with_an_error(temperature) -> None:
    """min_tokens holds back EOS and every stop_token_ids token: with every id a stop token (the
    server takes it: the tiny tokenizer's ids cover the model's vocabulary) no token is left to
    sample. It was sampled anyway from all -inf, silently (token 0, a NaN logprob: JSON has no
    NaN); that request now ends with finish_reason "error" saying why, and the other goes on."""
    from runtime.engine import Engine
    from runtime.openai_protocol import CompletionRequest, sampling_params

    model, tok = tiny("cpu")
    mc = model.config
    assert tok.vocab_size == mc.vocab_size
    req = CompletionRequest(
        model="m",
        prompt="x",
        max_tokens=4,
        min_tokens=2,
        logprobs=1,
        temperature=temperature,
        stop_token_ids=list(range(mc.vocab_size)),
    )
    masked = sampling_params(req, 4, True, tok.vocab_size)  # (no APIError: accepted)
    free = SamplingParams(max_tokens=4, temperature=temperature, seed=1, ignore_eos=True)
    eng = Engine(model, mc, tok, _cfg(True, 2, mc.index_topk))
    prompts = random_prompts([20, 30], mc.vocab_size, seed=5)
    eng.add_request("masked", prompts[0], masked)
    eng.add_request("free", prompts[1], free)
    finals, toks = {}, {"masked": [], "free": []}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                finals[o.request_id] = o
    m = finals["masked"]
    assert (m.finish_reason, m.completion_tokens, toks["masked"]) == ("error", 0, []), m
    assert "request 'masked'" in m.error and "every token" in m.error, m.error
    assert "min_tokens" in m.error and "stop_token_ids" in m.error, m.error
    assert finals["free"].finish_reason == "length" and len(toks["free"]) == 4
    assert eng.metrics()["generated_tokens"] == 4


@pytest.mark.parametrize("processor", [False, True])
def test_an_unusable_row_is_told_its_own_cause(processor: bool) -> None:
    """Every row of a checked step is checked (a logits processor on, or another row that may
    mask every token): a row that sets none of the masking parameters, made unusable by the
    model's logits (NaN here), is told that, not that min_tokens, a grammar or a
    repetition_penalty masked it; the row that does set min_tokens is told min_tokens."""
    from runtime.engine import Engine

    model, tok = tiny("cpu")
    mc = model.config
    masked = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=tuple(range(mc.vocab_size)))
    plain = SamplingParams(max_tokens=4, seed=1, ignore_eos=True)
    eng = Engine(model, mc, tok, _cfg(True, 2, mc.index_topk))
    if processor:
        eng.logits_processors = [lambda reqs, logits: logits]
    real = eng.runner.forward

    def nan_for_plain(batch, *a, **k):
        out = real(batch, *a, **k)
        if batch.is_decode:
            for i, r in enumerate(batch.requests):
                if r.request_id == "plain":
                    out[i] = float("nan")
        return out

    eng.runner.forward = nan_for_plain
    prompts = random_prompts([20, 30], mc.vocab_size, seed=5)
    eng.add_request("masked", prompts[0], masked)
    eng.add_request("plain", prompts[1], plain)
    finals = {}
    while eng.has_unfinished():
        finals.update((o.request_id, o) for o in eng.step() if o.finished)
    assert {k: o.finish_reason for k, o in finals.items()} == {"masked": "error", "plain": "error"}
    assert "min_tokens 2 holding back EOS" in finals["masked"].error, finals["masked"].error
    err = finals["plain"].error
    assert "the model's logits were unusable" in err, err
    for name in ("min_tokens", "grammar", "repetition_penalty"):
        assert name not in err, err


def test_masking_names_only_what_can_mask_at_this_token() -> None:
    p = SamplingParams(max_tokens=8, min_tokens=2, repetition_penalty=1e31)
    assert p.may_mask_every_token(2)
    assert [w.split()[0] for w in p.masking(1)] == ["min_tokens", "repetition_penalty"]
    assert [w.split()[0] for w in p.masking(2)] == ["repetition_penalty"]  # min_tokens reached
    assert SamplingParams().masking(0) == [] and not SamplingParams().may_mask_every_token(0)


def test_a_min_tokens_row_is_checked_only_until_min_tokens() -> None:
    """The unusable-row check (a few [B, V] ops and a readback column for the whole batch)
    runs while a row's min_tokens holds EOS back, not for every later step of that request."""
    from runtime.engine import Engine

    model, tok = tiny("cpu")
    mc = model.config
    eng = Engine(model, mc, tok, _cfg(True, 2, mc.index_topk))
    checked = []
    real = eng._complete
    eng._complete = lambda s: (checked.append(s.checked), real(s))[1]
    prompts = random_prompts([20, 30], mc.vocab_size, seed=5)
    eng.add_request("min", prompts[0], SamplingParams(max_tokens=5, min_tokens=2, ignore_eos=True))
    eng.add_request("free", prompts[1], SamplingParams(max_tokens=5, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert checked == [True, True, False, False, False]
