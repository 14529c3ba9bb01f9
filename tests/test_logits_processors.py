"""Engine.logits_processors, the hook on each decode step's logits (the benchmark's locality knob
uses it), and sampler.force_tokens, which makes rows choose given tokens."""

from __future__ import annotations

import random
import re

import pytest
import torch

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.engine import Engine, EngineConfig
from runtime.sampler import bad_stage, force_tokens, prepare_batch, sample, unusable_rows
from runtime.sampling_params import SamplingParams
from runtime.server_streams import failure

PARAMS = (
    SamplingParams(max_tokens=6, temperature=0.8, seed=11, ignore_eos=True, logprobs=True),
    SamplingParams(max_tokens=6, temperature=1.0, top_k=5, seed=5, ignore_eos=True, logprobs=True),
)


@pytest.fixture(scope="module")
def model():
    return load_model(resolve_model("tiny"))[0]


def _run(
    model, procs, errors: list | None = None, finals: dict | None = None, stats: dict | None = None
) -> dict[str, tuple[list[int], list[float]]]:
    """Both requests to the end with ``procs``; ``errors``: a step's ValueError is appended there
    and the loop goes on (else it propagates); ``finals``: each request's last StepOutput;
    ``stats``: filled with ``engine.metrics()`` at the end."""
    # prefill first: both requests decode in every decode step (what `seen` checks)
    cfg = EngineConfig(max_batch=2, host_tokens=64 * 12, gpu_tokens=2 * model.config.index_topk,
                       decode_during_prefill=False)  # fmt: skip
    eng = Engine(model, model.config, None, cfg)
    eng.logits_processors.extend(procs)
    rng = random.Random(3)
    for i, sp in enumerate(PARAMS):
        prompt = [rng.randrange(2, model.config.vocab_size) for _ in range(100 + 50 * i)]
        eng.add_request(f"r{i}", prompt, sp)
    out: dict[str, tuple[list[int], list[float]]] = {}
    while eng.has_unfinished():
        try:
            outs = eng.step()
        except ValueError as e:
            if errors is None:
                raise
            errors.append(e)
            continue
        for o in outs:
            if o.finished and finals is not None:
                finals[o.request_id] = o
            toks, lps = out.setdefault(o.request_id, ([], []))
            toks += o.new_token_ids
            lps += o.new_logprobs or []
    if stats is not None:
        stats.update(eng.metrics())
    return out


def test_force_tokens_wins_over_greedy_and_sampling() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, seed=1),
        SamplingParams(temperature=1.0, top_k=3, top_p=0.5, seed=2),
        SamplingParams(temperature=0.0),
    ]
    sb = prepare_batch(params, [1, 2, 3, 4], [0] * 4)
    free, _ = sample(logits.clone(), *sb[:5], filters=sb.filters)
    forced = force_tokens(logits.clone(), [0, 1, 2], [7, 8, 9])
    assert torch.isinf(forced[:3]).sum() == 3 * 49 and torch.equal(forced[3], logits[3])
    tok, lp = sample(forced, *sb[:5], filters=sb.filters)
    assert tok.tolist() == [7, 8, 9, int(free[3])]
    assert lp[:3].tolist() == [0.0, 0.0, 0.0]
    assert force_tokens(logits, [], []) is logits
    with pytest.raises(ValueError, match="2 rows but 1 tokens"):
        force_tokens(logits, [0, 1], [3])


def test_logits_processors_steer_sampling(model) -> None:
    """A processor that forces token 7 on r0's row: r0 generates only 7 (logprob 0), r1 what it
    generates without the processor; the processor sees the batch's requests every step."""
    seen = []

    def force_r0(reqs, logits):
        seen.append([r.request_id for r in reqs])
        rows = [i for i, r in enumerate(reqs) if r.request_id == "r0"]
        return force_tokens(logits, rows, [7] * len(rows))

    free, forced = _run(model, []), _run(model, [force_r0])
    assert forced["r0"] == ([7] * 6, [0.0] * 6) and free["r0"][0] != [7] * 6
    assert forced["r1"] == free["r1"]
    assert seen and all(ids == ["r0", "r1"] for ids in seen)  # one call per decode step

    with pytest.raises(ValueError, match="must return a floating-point tensor of shape"):
        _run(model, [lambda reqs, logits: logits[:, :3]])


@pytest.mark.parametrize(
    ("bad", "got"),
    [
        (lambda logits: logits.long(), r"torch.int64 \(2, 512\) on cpu"),  # was truncated
        (lambda logits: logits > 0, r"torch.bool \(2, 512\) on cpu"),  # was 0/1 logits
        (lambda logits: logits.to("meta"), r"torch.float32 \(2, 512\) on meta"),
        (lambda logits: None, "got NoneType"),
    ],
)
def test_a_bad_processor_output_is_refused_and_the_engine_goes_on(model, bad, got) -> None:
    """A processor's output of the wrong dtype or device is a ValueError naming it (integer or
    bool logits were sampled from silently, another device failed in the sampler); the step can
    be run again once the processor is gone, and gives what a run without it gives."""
    calls = []

    def once(reqs, logits):  # bad on the first decode step only
        calls.append(1)
        return bad(logits) if len(calls) == 1 else logits

    errors: list[ValueError] = []
    out = _run(model, [once], errors)
    assert len(errors) == 1, errors
    msg = str(errors[0])
    assert "must return a floating-point tensor of shape (2, 512) on cpu" in msg
    assert re.search(got, msg), msg
    assert out == _run(model, [])


def test_bad_stage_names_the_processor_after_the_last_usable_logits() -> None:
    ok = torch.zeros(5, 4)
    nan, inf, masked = ok.clone(), ok.clone(), ok.clone()
    nan[1, 2] = float("nan")
    inf[2, 0] = float("inf")
    masked[3] = -float("inf")  # no token left
    masked[4, 1:] = -float("inf")  # one left: usable
    assert unusable_rows(ok).tolist() == [False] * 5
    assert unusable_rows(nan).tolist() == [False, True, False, False, False]
    assert unusable_rows(masked).tolist() == [False, False, False, True, False]

    def code(*stages):
        return bad_stage([unusable_rows(x) for x in stages]).tolist()

    assert code(ok) == [0] * 5
    assert code(ok, nan, inf, masked) == [0, 0, 0, 4, 0]  # processor 2 left row 3 nothing
    assert code(ok, nan, nan) == [0, 2, 0, 0, 0]  # processor 0 spoilt row 1
    assert code(nan, inf) == [0, 0, 2, 0, 0]  # processor 0 mended row 1, spoilt row 2
    assert code(nan, nan) == [0, 1, 0, 0, 0]  # row 1 came in unusable


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_processor_that_spoils_a_row_fails_that_request_only(model, value) -> None:
    """A processor that writes NaN or +inf into r0's row, or -inf over all of it, on the third
    decode step: r0 ends there with finish_reason "error" and a message naming the processor, its
    tokens before that kept; r1 generates what it generates without the processor."""
    calls = []

    class Spoil:
        def __repr__(self) -> str:
            return "Spoil()"

        def __call__(self, reqs, logits):
            calls.append(1)
            rows = [i for i, r in enumerate(reqs) if r.request_id == "r0"]
            if len(calls) == 3:
                logits[rows, :] = value if value < 0 else logits[rows, :]
                logits[rows, 5] = value
            return logits

    finals: dict = {}
    stats: dict = {}
    out = _run(model, [lambda reqs, logits: logits, Spoil()], finals=finals, stats=stats)
    free = _run(model, [])
    # (r1 alone from then on: its logprobs may move in the last bits, batch 1 against 2)
    assert out["r1"][0] == free["r1"][0] and finals["r1"].finish_reason == "length"
    assert out["r1"][1] == pytest.approx(free["r1"][1], abs=1e-5)
    r0 = finals["r0"]
    assert r0.finish_reason == "error" and r0.new_token_ids == [] and r0.completion_tokens == 2
    assert out["r0"] == (free["r0"][0][:2], free["r0"][1][:2])
    assert "logits processor Spoil() returned NaN or +inf logits" in r0.error, r0.error
    assert "request 'r0'" in r0.error
    # the server's 500 says it (runtime.server_streams.failure)
    assert r0.error in failure(r0.finish_reason, r0.error).message
    # the failed row generated nothing: the counters (the server's token counter) skip it
    assert stats["generated_tokens"] == len(out["r0"][0]) + len(out["r1"][0])
