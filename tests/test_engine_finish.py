"""When a request finishes, driven through the REAL Engine (tiny checkpoint, CPU, offloading on):
stop_token_ids, EOS (and ignore_eos), max_tokens and stop strings split across tokens.

Each request runs alone on a fresh engine, with a fixed seed: a seeded request reproduces exactly
and a batch of one decodes the same batches every run, so a run with a finish rule must be the
prefix of the unrestricted reference run, up to the token where the rule fires."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from engine_records import tiny
from stop_cases import min_tokens_stops

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.detokenize import eos_ids
from runtime.engine import Engine, EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.step_output import StepOutput

N = 16
CFG = EngineConfig(max_batch=2, host_tokens=64 * 4, gpu_tokens=64, max_model_len=128)
PROMPT = "The cache holds"


def _run(
    params: SamplingParams, eos: int | None = None, eng: Engine | None = None
) -> tuple[list[int], list[str], str]:
    """(token ids, per-step text deltas, finish reason) of PROMPT decoded alone (on ``eng``, a
    fresh engine)."""
    ids, texts, last = _run_to_end(params, eos, eng)
    return ids, texts, last.finish_reason


def _run_to_end(
    params: SamplingParams, eos: int | None = None, eng: Engine | None = None
) -> tuple[list[int], list[str], StepOutput]:
    """``_run``'s token ids and text deltas, and the request's last (finished) output."""
    model, tok = tiny()
    mc = model.config if eos is None else dataclasses.replace(model.config, eos_token_id=eos)
    eng = eng or Engine(model, mc, tok, CFG)
    eng.add_request("r", tok.encode(PROMPT), params)
    ids, texts, finished = [], [], []
    while eng.has_unfinished():
        for o in eng.step():
            ids += o.new_token_ids
            texts.append(o.new_text)
            if o.finished:
                finished.append(o)
    assert len(finished) == 1, finished  # exactly one finished output
    assert eng.scheduler.pages.num_free == eng.scheduler.pages.num_pages
    assert eng.cache.stats()["gpu_pool_usage"] == 0.0
    return ids, texts, finished[0]


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": N, "temperature": 1.0, "seed": 11, **kw})


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], list[str]]:
    ids, texts, reason = _run(_params(ignore_eos=True))
    assert reason == "length" and len(ids) == N
    assert len(set(ids)) >= 6, "the reference must vary for the stop choices below"
    return ids, texts


def _first_new(ids: list[int], start: int) -> int:
    """Index of the first token at or after ``start`` that did not occur before it."""
    return next(i for i in range(start, len(ids)) if ids[i] not in ids[:i])


def test_max_tokens(reference):
    ids, _, reason = _run(_params(max_tokens=5, ignore_eos=True))
    assert (ids, reason) == (reference[0][:5], "length")


def test_stop_token_ids(reference):
    ref = reference[0]
    k = _first_new(ref, 3)
    ids, _, reason = _run(_params(stop_token_ids=(ref[k], 511 if ref[k] != 511 else 510)))
    assert (ids, reason) == (ref[: k + 1], "stop")  # the stop token is generated, then it ends


def test_eos_and_ignore_eos(reference):
    ref = reference[0]
    k = _first_new(ref, 4)
    ids, _, reason = _run(_params(), eos=ref[k])
    assert (ids, reason) == (ref[: k + 1], "stop")
    ids, _, reason = _run(_params(ignore_eos=True), eos=ref[k])
    assert (ids, reason) == (ref, "length")


@pytest.mark.parametrize(
    "file", ["generation_config.json", "config.json", "tokenizer_config.json"]
)
def test_every_eos_id_of_the_checkpoint_ends_a_request(reference, tmp_path, file):
    """As vLLM: generation_config.json's eos_token_id (an id or a list), all of config.json's
    list and the tokenizer's EOS each end a request (only config.json's first id did), with
    ignore_eos and min_tokens applying to each; --generation-config none does not read the file."""
    ref = reference[0]
    k = _first_new(ref, 4)
    path = tmp_path / "ck"
    shutil.copytree(resolve_model("tiny"), path)
    d = json.loads((path / file).read_text())
    if file == "tokenizer_config.json":
        d["eos_token"] = tiny()[1]._tok.id_to_token(ref[k])
    else:
        d["eos_token_id"] = [1, ref[k]] if file == "config.json" else ref[k]
    (path / file).write_text(json.dumps(d))
    model, extras = load_model(path, keep_mtp=False)

    def engine(mode: str = "auto") -> Engine:
        return Engine.from_loaded(model, extras, CFG, generation_config=mode)

    ids, _, reason = _run(_params(), eng=engine())
    assert (ids, reason) == (ref[: k + 1], "stop")
    ids, _, reason = _run(_params(ignore_eos=True), eng=engine())
    assert (ids, reason) == (ref, "length")
    ids, _, reason = _run(_params(min_tokens=k + 1), eng=engine())
    assert ref[k] not in ids[: k + 1]  # held back
    if file == "generation_config.json":
        ids, _, reason = _run(_params(), eng=engine("none"))
        assert (ids, reason) == (ref, "length")
        for bad in ([1, "2"], [1, model.config.vocab_size], -1):  # past the vocabulary: it
            # failed every decode step that masked EOS (min_tokens), for the whole batch
            with pytest.raises(ValueError, match="generation_config.json field 'eos_token_id'"):
                eos_ids(model.config, None, {"eos_token_id": bad})


def test_a_tokenizer_eos_past_the_model_vocabulary_is_refused():
    """tokenizer.json may add tokens past config.json's vocab_size: such an eos_token loaded, and
    every decode step masking EOS (min_tokens) then failed with an IndexError."""
    import tokenizers

    from runtime.tokenizer import Tokenizer

    model, tok = tiny()
    raw = tokenizers.Tokenizer.from_str(tok._tok.to_str())
    raw.add_special_tokens(["<|im_end|>"])
    t = Tokenizer(raw, tok.bos_token, "<|im_end|>")
    assert t.eos_token_id == model.config.vocab_size
    with pytest.raises(ValueError, match="tokenizer_config.json field 'eos_token'"):
        eos_ids(model.config, t, {})
    assert eos_ids(model.config, tok, {}) == {1}


def test_stop_string_split_across_tokens(reference):
    ref, deltas = reference
    full = "".join(deltas)
    # a stop string made of the last character of one token's text and the first of the next's
    for i in range(1, len(deltas) - 1):
        a, b = deltas[i], deltas[i + 1]
        if not a or not b:
            continue
        stop = a[-1] + b[0]
        cut = full.find(stop)
        if cut == len("".join(deltas[: i + 1])) - 1:  # its first occurrence is this boundary
            break
    else:
        pytest.fail("no token boundary usable as a split stop string")
    ids, texts, reason = _run(_params(stop=(stop,)))
    assert reason == "stop"
    assert "".join(texts) == full[:cut]  # cut before the stop string, nothing of it streamed
    assert ids == ref[: i + 2]  # ends on the token that completed the stop string


def test_min_tokens_stop_string_inside_them_then_later(reference):
    """With min_tokens, a stop string whose first occurrence ends in the first min_tokens tokens'
    text does not stop the request; the first one to end after them does, and the output names
    it (``stop_string``, the server's stop_reason), not the one that occurs first in the text."""
    ref, deltas = reference
    case = min_tokens_stops(deltas)
    full = "".join(deltas)
    for stop, want, cut, n in [
        ((case.inside,), case.inside, case.again, case.again_tokens),
        ((case.inside, case.later), case.later, case.cut, case.cut_tokens),
    ]:
        params = _params(stop=stop, ignore_eos=True, min_tokens=case.min_tokens)
        ids, texts, last = _run_to_end(params)
        assert (last.finish_reason, last.stop_string) == ("stop", want), stop
        assert "".join(texts) == full[:cut]  # cut before the occurrence after min_tokens
        assert ids == ref[:n]  # ends on the token that completed it
    # without min_tokens the first occurrence stops it, and is the one named
    ids, texts, last = _run_to_end(_params(stop=(case.later, case.inside), ignore_eos=True))
    assert (last.stop_string, "".join(texts)) == (case.inside, full[: full.find(case.inside)])


def test_recover_frees_every_page_when_release_raises(monkeypatch):
    """Engine.recover after a failed step: even if forgetting a request's rows in the GPU pools
    raises (the maps a failed recall left), every host page is free again."""
    model, tok = tiny()
    eng = Engine(model, model.config, tok, CFG)
    for rid in ("a", "b"):
        eng.add_request(rid, tok.encode(PROMPT * 3), _params())
    eng.step()  # admitted, pages held
    assert eng.scheduler.pages.num_used > 0

    def broken(host_slots):  # noqa: ANN001, ANN202
        raise RuntimeError("inconsistent pool maps")

    monkeypatch.setattr(eng.cache, "release", broken)
    eng.recover()
    assert not eng.requests and not eng.has_unfinished()
    assert eng.scheduler.pages.num_used == 0


def test_recover_with_a_group_before_its_fork_when_release_raises(monkeypatch):
    """The same for n sequences sharing a prefill that has not forked yet: recover ends, every
    request is gone, every page free, the group's hidden head too."""
    model, tok = tiny()
    eng = Engine(model, model.config, tok, CFG)
    eng.add_request_group(["a", "b"], tok.encode(PROMPT * 3), [_params(), _params()])
    eng.step()  # the head's first prefill chunk: pages held, no fork yet
    assert eng.scheduler.groups and eng.scheduler.pages.num_used > 0

    def broken(host_slots):  # noqa: ANN001, ANN202
        raise RuntimeError("inconsistent pool maps")

    monkeypatch.setattr(eng.cache, "release", broken)
    eng.recover()
    assert not eng.requests and not eng.has_unfinished() and not eng.scheduler.groups
    assert eng.scheduler.pages.num_used == 0


def test_a_finish_releases_exactly_the_slots_of_its_pages(monkeypatch):
    """The engine sends the finished request's page ids to the device and expands them there:
    the GPU pools must forget exactly those pages' host slots, each once, in page order."""
    model, tok = tiny()
    eng = Engine(model, model.config, tok, CFG)
    seen, real = [], eng.cache.release
    monkeypatch.setattr(eng.cache, "release", lambda s: (seen.append(s.clone()), real(s)))
    eng.add_request("r", tok.encode(PROMPT), _params(max_tokens=66, ignore_eos=True))  # 2 pages
    eng.step()
    pages = list(eng.requests["r"].pages)
    assert len(pages) >= 2 and not seen  # a request of several pages, nothing released yet
    while eng.has_unfinished():
        eng.step()
    assert len(seen) == 1
    want = torch.tensor([p * 64 + i for p in pages for i in range(64)])
    assert seen[0].dtype == torch.int64 and torch.equal(seen[0].cpu(), want)
    assert eng.cache.stats()["gpu_pool_usage"] == 0.0


def test_a_finish_checks_the_pools_for_an_overflowed_recall():
    """Every finish checks that no recall overflowed a GPU pool (a capacity-check bug): here a
    count planted in one layer's meta makes the finishing step raise, naming it."""
    from custom_ops import cache_layout as C

    model, tok = tiny()
    eng = Engine(model, model.config, tok, CFG)
    eng.add_request("r", tok.encode(PROMPT), _params(max_tokens=3, ignore_eos=True))
    eng.step()  # the prefill chunk
    eng.step()  # a first token: nothing finished, nothing checked
    eng.cache.layers[-1].pool.meta[C.OVERFLOW] = 2
    eng.step()
    with pytest.raises(RuntimeError, match="GPU pool overflow in 2 recall"):
        eng.step()  # r's last token: its finish checks
