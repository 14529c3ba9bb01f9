"""``prompt_logprobs`` (runtime.prompt_logprobs): the prefill's logits of every prompt token
against the independent implementation's full-forward logits (tests/independent_ref.py,
log-softmax), over chunked prefills; the generated tokens unchanged by asking; and vLLM's response
shape through the server with the official openai client, streamed and not."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from engine_records import random_prompts, run, tiny
from independent_ref import IndependentDeepSeekV32
from server_utils import running_server

from model.checkpoint import resolve_model
from model.prefill_ref import explicit_prefill_in
from runtime.engine import Engine, EngineConfig
from runtime.prompt_logprobs import prompt_logprobs
from runtime.sampling_params import SamplingParams, SamplingParamsError

CHUNK = 16
# the explicit prefill form's logits are within 1e-4 of the golden ones (test_golden_logits), so
# log-softmax values (a logit minus the log-sum-exp, which moves at most as much) within twice that
ATOL = 2e-4


@pytest.fixture(scope="module")
def independent() -> IndependentDeepSeekV32:
    return IndependentDeepSeekV32(resolve_model("tiny"))


def test_prompt_logprobs_against_a_per_row_reference() -> None:
    g = torch.Generator().manual_seed(0)
    for n, v, top in [(1, 7, 0), (5, 50, 3), (9, 300, 20)]:
        logits = torch.randn(n, v, generator=g) * 4
        nxt = torch.randint(0, v, (n,), generator=g).tolist()
        got = prompt_logprobs(logits, nxt, top)
        for row, tok, (lp, rank, alts) in zip(logits, nxt, got, strict=True):
            ref = [float(x) for x in torch.log_softmax(row.double(), 0)]
            order = sorted(range(v), key=lambda i: -ref[i])
            assert lp == pytest.approx(ref[tok], abs=1e-5)
            assert rank == order.index(tok) + 1  # random logits: no ties
            assert [t for t, _ in alts] == order[:top]
            assert [x for _, x in alts] == pytest.approx([ref[t] for t in order[:top]], abs=1e-5)
    with pytest.raises(ValueError, match="must be"):
        prompt_logprobs(torch.zeros(2, 4), [1], 0)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def _generate(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    out: dict[str, dict] = {f"r{i}": {"ids": [], "prompt": None} for i in range(len(prompts))}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id]["ids"] += o.new_token_ids
            if o.prompt_logprobs is not None:
                assert out[o.request_id]["prompt"] is None  # once, with the first token
                out[o.request_id]["prompt"] = o.prompt_logprobs
    return out


def test_engine_prompt_logprobs_match_the_full_forward(independent) -> None:
    """Explicit prefill form (the reference's own, within 1e-4 of the golden logits), chunks of
    16: prompts of 1 (no entries), 5 (one chunk) and 40 tokens (three chunks)."""
    model, tok = tiny()
    topk = model.config.index_topk
    prompts = random_prompts([1, 5, 40], model.config.vocab_size, seed=31)
    cfg = EngineConfig(max_batch=2, host_tokens=64 * 8, gpu_tokens=2 * topk, max_model_len=128,
                       prefill_chunk=CHUNK)  # fmt: skip
    top = 4
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with explicit_prefill_in(model):
        asked = _generate(Engine(model, model.config, tok, cfg), prompts,
                          dataclasses.replace(greedy, prompt_logprobs=top))  # fmt: skip
        plain = _generate(Engine(model, model.config, tok, cfg), prompts, greedy)
    for i, p in enumerate(prompts):
        got = asked[f"r{i}"]
        assert got["ids"] == plain[f"r{i}"]["ids"]  # asking changes nothing generated
        assert plain[f"r{i}"]["prompt"] is None and len(got["prompt"]) == len(p)
        assert got["prompt"][0] is None
        ref = torch.log_softmax(independent.logits(p).double(), -1)  # [n, V]
        for pos in range(1, len(p)):
            lp, rank, alts = got["prompt"][pos]
            row = ref[pos - 1]  # position pos - 1 predicts token pos
            assert abs(lp - float(row[p[pos]])) <= ATOL, (pos, lp, float(row[p[pos]]))
            assert (
                rank == int((row > row[p[pos]] + ATOL).sum()) + 1
                or abs(float(row.sort(descending=True).values[rank - 1]) - lp) <= ATOL
            )  # the rank, up to near-ties
            vals = [v for _, v in alts]
            assert len(alts) == top and vals == sorted(vals, reverse=True)
            # each alternative's logprob is the reference's for that token, and the top-N values
            # are the reference's (ids may swap only within a near-tie)
            assert all(abs(v - float(row[t])) <= ATOL for t, v in alts)
            ref_top = row.topk(top).values.tolist()
            assert max(abs(a - b) for a, b in zip(vals, ref_top, strict=True)) <= ATOL


def test_served_form_agrees_with_the_normal_prefill_logits() -> None:
    """The served (sparse absorbed) prefill: each chunk's last entry is the log-softmax of the
    logits a normal prefill of that chunk computes (the only ones it computes)."""
    model, tok = tiny()
    topk = model.config.index_topk
    prompt = random_prompts([40], model.config.vocab_size, seed=32)[0]
    cfg = EngineConfig(max_batch=1, host_tokens=64 * 4, gpu_tokens=topk, max_model_len=128,
                       prefill_chunk=CHUNK)  # fmt: skip
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    got = _generate(Engine(model, model.config, tok, cfg), [prompt],
                    dataclasses.replace(greedy, prompt_logprobs=0))["r0"]  # fmt: skip
    _, rec, _ = run(cfg, [prompt], [greedy])
    ends = [CHUNK, 2 * CHUNK, len(prompt) - 1]  # prefill covers [0, len - 1) in chunks of 16
    lasts = [lg[0] for d, _, lg in rec.logits if not d]
    assert len(lasts) == len(ends)
    for end, lg in zip(ends, lasts, strict=True):
        want = float(torch.log_softmax(lg.double(), -1)[prompt[end]])
        assert abs(got["prompt"][end][0] - want) <= 1e-5, end
        assert got["prompt"][end][2] == []  # prompt_logprobs=0: no alternatives


# ---- through the server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from echo_compile.llm import LLM
    from runtime.async_engine import AsyncEngine
    from runtime.server import build_app

    opts = dict(max_batch=4, host_tokens=16 * 64, gpu_tokens=4 * 32, max_model_len=256)
    llm = LLM("tiny", device="cpu", compile=False, offload=True, progress=False, **opts)
    engine = AsyncEngine(llm.engine)
    try:
        with running_server(build_app(engine, "tiny")) as base:
            yield base
    finally:
        engine.shutdown()


def test_server_prompt_logprobs_vllm_shape(url: str) -> None:
    import openai  # not at the top: the GPU machine that runs the cuda tests has none

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    prompt = [0, *random_prompts([11], 512, seed=5)[0]]
    kw = dict(model="tiny", prompt=prompt, max_tokens=2, temperature=0.0)
    r = client.completions.create(**kw, extra_body={"prompt_logprobs": 3})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == len(prompt) and got[0] is None
    # the engine's own entries for the same prompt (same checkpoint, same served prefill)
    model, tok = tiny()
    cfg = EngineConfig(max_batch=1, host_tokens=64 * 4, gpu_tokens=32, max_model_len=128)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    want = _generate(Engine(model, model.config, tok, cfg), [prompt], params)["r0"]["prompt"]
    for pos in range(1, len(prompt)):
        entry, (lp, rank, alts) = got[pos], want[pos]
        mine = entry[str(prompt[pos])]  # the prompt token itself is always there
        assert abs(mine["logprob"] - lp) <= 1e-5 and mine["rank"] == rank
        for k, (t, v) in enumerate(alts, 1):
            assert entry[str(t)]["rank"] == k and abs(entry[str(t)]["logprob"] - v) <= 1e-5
        assert len(entry) == 3 + (rank > 3)
        assert all(e["decoded_token"] == tok.decode([int(t)], skip_special_tokens=False)
                   for t, e in entry.items())  # fmt: skip
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"prompt_logprobs": 3}))
    streamed = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
    assert [s for s in streamed if s is not None] == [got]  # once, equal to the non-streamed
    plain = client.completions.create(**kw)
    assert "prompt_logprobs" not in (plain.choices[0].model_extra or {})
    assert plain.choices[0].text == r.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs"


def _echo_want(prompt: list[int], plp: list, n: int) -> tuple[list, list]:
    """The prompt part echo + logprobs=n should have, from the served ``prompt_logprobs``
    (id-keyed, ranked): token_logprobs, and top_logprobs keyed by token string (the top n, then
    the prompt token itself when its string is not among theirs)."""
    _, tok = tiny()
    lps, tops = [None], [None]
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        own = entry[str(prompt[pos])]["logprob"]
        alts = sorted((e["rank"], int(t), e["logprob"]) for t, e in entry.items() if e["rank"] <= n)
        top = {tok.decode([t], skip_special_tokens=False): v for _, t, v in alts}
        top.setdefault(tok.decode([prompt[pos]], skip_special_tokens=False), own)
        lps.append(own)
        tops.append(top)
    return lps, tops


@pytest.mark.parametrize("n, plp_n", [(2, 3), (4, 1)])
def test_echo_with_logprobs_puts_the_prompt_first(url: str, n: int, plp_n: int) -> None:
    """Completions echo + logprobs (how lm-eval scores a prompt): the prompt's tokens come first
    in the logprobs (None for the first), their entries those prompt_logprobs gives, then the
    generated tokens' as without echo; streamed equal to non-streamed; prompt_logprobs asked
    beside it keeps its own N."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    _, tok = tiny()
    prompt = [0, *random_prompts([9], 512, seed=6)[0]]
    kw = dict(model="tiny", prompt=prompt, max_tokens=3, temperature=0.0, logprobs=n)
    extra = {"prompt_logprobs": plp_n}
    ref = client.completions.create(**kw, extra_body=extra).choices[0]  # no echo
    plp = ref.model_extra["prompt_logprobs"]
    r = client.completions.create(**kw, echo=True, extra_body=extra).choices[0]
    assert r.text == tok.decode(prompt, skip_special_tokens=False) + ref.text
    assert r.model_extra["prompt_logprobs"] == plp
    assert all(len(e) == plp_n + (e[str(t)]["rank"] > plp_n)
               for t, e in zip(prompt[1:], plp[1:], strict=True))  # fmt: skip
    lp, want_lps, want_tops = r.logprobs, *_echo_want(prompt, plp, min(n, plp_n))
    strings = [tok.decode([t], skip_special_tokens=False) for t in prompt]
    assert lp.tokens == strings + ref.logprobs.tokens
    assert lp.token_logprobs[: len(prompt)] == want_lps
    assert lp.token_logprobs[len(prompt) :] == ref.logprobs.token_logprobs
    assert lp.top_logprobs[len(prompt) :] == ref.logprobs.top_logprobs
    offsets = [sum(len(t) for t in lp.tokens[:k]) for k in range(len(lp.tokens))]
    assert lp.text_offset == offsets
    if n <= plp_n:  # prompt_logprobs shows every alternative echo returns
        assert lp.top_logprobs[: len(prompt)] == want_tops
    else:  # it shows the first plp_n of them, each among echo's, and the prompt token's string
        assert lp.top_logprobs[0] is None
        for pos in range(1, len(prompt)):
            d = lp.top_logprobs[pos]
            assert strings[pos] in d
            for t, e in plp[pos].items():
                if e["rank"] <= plp_n:
                    assert d[tok.decode([int(t)], skip_special_tokens=False)] == e["logprob"]
        assert all(len(d) > len(w) for d, w in zip(lp.top_logprobs[1:], want_tops[1:]))
    # without prompt_logprobs: the same logprobs, and no prompt_logprobs field
    alone = client.completions.create(**kw, echo=True).choices[0]
    assert "prompt_logprobs" not in (alone.model_extra or {})
    assert (alone.text, alone.logprobs) == (r.text, r.logprobs)
    # streamed: the prompt comes with its logprobs in the first chunk, then as non-streamed
    chunks = [c.choices[0] for c in client.completions.create(**kw, echo=True, stream=True)
              if c.choices]  # fmt: skip
    assert chunks[0].text.startswith(tok.decode(prompt, skip_special_tokens=False))
    assert "".join(c.text for c in chunks) == alone.text
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        got = [x for c in chunks if c.logprobs for x in getattr(c.logprobs, field)]
        assert got == getattr(alone.logprobs, field), field


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(url: str) -> None:
    """echo, max_tokens 0, logprobs: the prompt's text and its tokens' logprobs alone, the same
    entries as the prompt part of a response that generates, streamed or not."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    _, tok = tiny()
    prompt = [0, *random_prompts([9], 512, seed=7)[0]]
    kw = dict(model="tiny", prompt=prompt, temperature=0.0, logprobs=2, echo=True)
    full = client.completions.create(**kw, max_tokens=3).choices[0].logprobs
    r = client.completions.create(**kw, max_tokens=0)
    c, n = r.choices[0], len(prompt)
    assert c.text == tok.decode(prompt, skip_special_tokens=False) and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert getattr(c.logprobs, field) == getattr(full, field)[:n], field
    chunks = [x.choices[0] for x in client.completions.create(**kw, max_tokens=0, stream=True)
              if x.choices]  # fmt: skip
    assert "".join(x.text for x in chunks) == c.text
    assert [t for x in chunks if x.logprobs for t in x.logprobs.tokens] == c.logprobs.tokens


def test_chat_prompt_logprobs(url: str) -> None:
    """vLLM's prompt_logprobs on chat: once per response (the choices share the prompt), equal to
    the completions' for the same ids; streamed once, on one chunk."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "Hello there, how are you?"}]
    ids = httpx.post(url + "/tokenize", json={"messages": msgs}, timeout=30).json()["tokens"]
    kw = dict(model="tiny", max_tokens=2, temperature=0.0)
    want = client.completions.create(prompt=ids, **kw, extra_body={"prompt_logprobs": 2})
    want = want.choices[0].model_extra["prompt_logprobs"]
    assert len(want) == len(ids) and want[0] is None
    r = client.chat.completions.create(messages=msgs, n=2, **kw, extra_body={"prompt_logprobs": 2})
    assert r.model_extra["prompt_logprobs"] == want
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in r.choices)
    chunks = list(client.chat.completions.create(messages=msgs, stream=True, **kw,
                                                 extra_body={"prompt_logprobs": 2}))  # fmt: skip
    streamed = [c.model_extra.get("prompt_logprobs") for c in chunks]
    assert [s for s in streamed if s is not None] == [want]
    plain = client.chat.completions.create(messages=msgs, **kw)
    assert "prompt_logprobs" not in (plain.model_extra or {})
    assert plain.choices[0].message.content == r.choices[0].message.content


@pytest.mark.cuda
def test_cuda_compiled_engine_prompt_logprobs_no_recompile() -> None:
    """On the GPU, a compiled engine (prefill graphs too): a prompt_logprobs request takes the
    eager prefill, the graphs see no recompile or skip, and its entries equal an eager engine's
    (the same eager prefill code on the same inputs)."""
    import torch._dynamo
    from test_compile import make_engine
    from torch._dynamo.utils import counters

    from model.checkpoint import resolve_model
    from model.loader import load_model
    from runtime.tokenizer import Tokenizer

    path = resolve_model("tiny")
    model, _ = load_model(path, device="cuda")
    tiny_cuda = (model, Tokenizer.from_dir(path))
    prompts = random_prompts([150, 40], model.config.vocab_size, seed=9)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=5)
    torch._dynamo.reset()
    counters.clear()
    eng = make_engine(tiny_cuda, True, compiled=True, strict=True, compile_prefill=True)
    eng.runner.warmup(calls=3, progress=False)
    with torch.compiler.set_stance("fail_on_recompile"):
        got = _generate(eng, prompts, params)
        # a plain request after it still runs the compiled prefill
        plain = _generate(eng, prompts[:1], dataclasses.replace(params, prompt_logprobs=None))
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert plain["r0"]["prompt"] is None and len(plain["r0"]["ids"]) == 4
    want = _generate(make_engine(tiny_cuda, True), prompts, params)
    for rid, out in got.items():
        entries, ref = out["prompt"][1:], want[rid]["prompt"][1:]
        assert len(entries) == len(ref) == len(prompts[int(rid[1:])]) - 1
        for (lp, rank, alts), (lp_r, rank_r, alts_r) in zip(entries, ref, strict=True):
            assert abs(lp - lp_r) <= 1e-6 and rank == rank_r
            assert [t for t, _ in alts] == [t for t, _ in alts_r]


def test_benchmark_script_runs_its_cli_on_cpu() -> None:
    from benchmarks import bench_prompt_logprobs as bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    if not torch.cuda.is_available():
        assert bench.main(["--out", "/dev/null"]) == 2  # says it needs CUDA, writes nothing


def test_completion_top_logprobs_hold_the_chosen_token(url: str) -> None:
    """Completions ``logprobs: N`` (OpenAI's legacy rule, vLLM's): each generated position's
    top_logprobs are the top N and the chosen token, up to N + 1 entries, as the echoed prompt's
    positions are; ``logprobs: 0``: the chosen token alone, with its own logprob. Sampled at a
    high temperature, so chosen tokens outside the top N come up, their entry the logprob of the
    top N's distribution (before temperature), below theirs; streamed equal to not."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny", prompt="Hello", max_tokens=12, temperature=1.5, seed=1)
    for n in (0, 2):
        lp = client.completions.create(**kw, logprobs=n).choices[0].logprobs
        outside = 0
        for tok, own, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert tok in alts and len(alts) <= n + 1, (tok, alts)
            ranked = sorted(alts.values(), reverse=True)
            if n == 0:
                assert alts == {tok: own}
            elif len(alts) == n + 1:  # the chosen token came after the top N
                outside += 1
                assert alts[tok] == ranked[-1] < ranked[-2], (tok, own, alts)
        assert outside > 0 or n == 0  # (the case the rule is about came up)
        chunks = client.completions.create(**kw, logprobs=n, stream=True)
        streamed = [t for c in chunks if c.choices[0].logprobs
                    for t in c.choices[0].logprobs.top_logprobs]  # fmt: skip
        assert streamed == lp.top_logprobs


def test_completion_chosen_token_entry_is_of_the_top_ones_distribution(url: str) -> None:
    """top_k 2, ``logprobs: 1``: a chosen token outside the top 1 is the second likeliest, and its
    top_logprobs entry is its logprob in the top one's distribution (the raw log-softmax), below
    the top one's, with the two together at most probability 1; its token_logprobs value stays
    that of the distribution it was sampled from (the two tokens renormalised: higher). The entry
    took the token_logprobs value, and looked likelier than the top one."""
    import math

    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny", prompt="Hello", max_tokens=16, temperature=1.0, seed=2, logprobs=1,
              extra_body={"top_k": 2})  # fmt: skip
    lp = client.completions.create(**kw).choices[0].logprobs
    outside = 0
    for tok, own, alts in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert tok in alts
        if len(alts) < 2:  # the chosen token is the top one (or a byte piece reading as it)
            continue
        outside += 1
        (top,) = (v for t, v in alts.items() if t != tok)
        assert alts[tok] <= top and math.exp(alts[tok]) + math.exp(top) <= 1 + 1e-6, alts
        assert alts[tok] < own, (tok, own, alts)
        # of two tokens, renormalised: log p2 - log(p1 + p2)
        assert own == pytest.approx(alts[tok] - math.log(math.exp(top) + math.exp(alts[tok])),
                                    abs=1e-4)  # fmt: skip
    assert outside > 0  # (a sampled token outside the top 1 came up)
    chunks = client.completions.create(**kw, stream=True)
    streamed = [t for c in chunks if c.choices[0].logprobs
                for t in c.choices[0].logprobs.top_logprobs]  # fmt: skip
    assert streamed == lp.top_logprobs


def test_completion_chosen_token_never_overwrites_a_top_one() -> None:
    """A chosen token outside the top N whose string is one of theirs (byte-level pieces of
    characters all read "\ufffd": the tiny model, sampled, gives them): the top N keep their own
    logprobs under that string, as vLLM writes them (the chosen token first, the top N over it).
    The chosen one's logprob overwrote the likelier token's, and N + 1 entries became N."""
    from runtime.server_completions import top_entries

    text = {7: "\ufffd", 8: "\ufffd", 9: "a"}.__getitem__
    assert top_entries([(7, -3.4), (9, -3.5)], 8, -5.1, text) == {"\ufffd": -3.4, "a": -3.5}
    assert top_entries([(9, -3.5)], 8, -5.1, text) == {"a": -3.5, "\ufffd": -5.1}  # N + 1
    assert top_entries([(7, -3.4), (9, -3.5)], 9, -3.5, text) == {"\ufffd": -3.4, "a": -3.5}
    assert top_entries([], 8, -5.1, text) == {"\ufffd": -5.1}  # logprobs 0
