"""runtime.tokenizer: loading, encode/decode, chat template, incremental detokenisation, stops."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import BOS, EOS, make_tokenizer_dir

from runtime.tokenizer import IncrementalDetokenizer, StopStringChecker, Tokenizer

MIXED = "Hello wörld! 世界 🎉 ok — ñ done"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


# ---- Tokenizer ---------------------------------------------------------------------------------
def test_from_dir_special_tokens_and_round_trip(tok: Tokenizer) -> None:
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.bos_token == BOS and tok.eos_token == EOS  # eos given as an AddedToken dict
    ids = tok.encode(MIXED)
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.encode(MIXED, add_bos=False) == ids[1:]
    assert tok.decode(ids) == MIXED
    assert tok.decode(ids, skip_special_tokens=False) == BOS + MIXED
    assert all(0 <= i < tok.vocab_size for i in ids)
    # Special-token text inside the input is one token.
    assert tok.encode(f"a{EOS}b", add_bos=False).count(tok.eos_token_id) == 1


def test_token_bytes_are_the_bytes_each_token_stands_for(tok: Tokenizer) -> None:
    """Byte tokens of a split character have their own bytes (decode gives U+FFFD for them);
    a special token has its text's."""
    text = MIXED + EOS
    ids = tok.encode(text, add_bos=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_bytes(tok.eos_token_id) == EOS.encode()


def test_token_bytes_of_an_added_token_are_its_text_s(tok: Tokenizer) -> None:
    """An added token's text is not in the byte alphabet's code: "ñé" read through it would be
    the two bytes F1 E9, not its UTF-8."""
    import tokenizers

    raw = tokenizers.Tokenizer.from_str(tok._tok.to_str())
    raw.add_tokens(["ñé"])
    t = Tokenizer(raw, tok.bos_token, tok.eos_token)
    (i,) = t.encode("ñé", add_bos=False)
    assert t.token_bytes(i) == "ñé".encode()


def test_from_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    d = make_tokenizer_dir(tmp_path / "t")
    (d / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="invalid JSON"):
        Tokenizer.from_dir(d)
    # not UTF-8 (a file saved in another encoding): named, as its invalid JSON is (it was a
    # bare "'utf-8' codec can't decode byte 0xff" naming no file); chat_template.jinja alike
    (d / "tokenizer_config.json").write_bytes(b"\xff{}")
    with pytest.raises(ValueError, match=r"t/tokenizer_config\.json: invalid JSON: 'utf-8' codec"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text("{}")
    (d / "chat_template.jinja").write_bytes(b"\xff{{ messages }}")
    with pytest.raises(ValueError, match=r"t/chat_template\.jinja: not UTF-8 text: 'utf-8' codec"):
        Tokenizer.from_dir(d)
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text("[]")  # was an AttributeError ('list' ... 'get')
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: expected a JSON object"):
        Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}), encoding="utf-8")
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_dir(d)
    # an AddedToken without its content, a number: named with the file and the field (the
    # message named neither the path nor which token)
    for bad in ({"__type": "AddedToken"}, 5):
        (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": bad}))
        with pytest.raises(ValueError, match=r"t/tokenizer_config\.json field 'bos_token': exp"):
            Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    with pytest.raises(ValueError, match="chat_template"):
        Tokenizer.from_dir(d)


def test_model_config_ids_stand_in_for_a_missing_tokenizer_config(
    tmp_path: Path, tok: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    """Without tokenizer_config.json (or without its bos/eos entries) the model config's ids
    name the special tokens, so prompts still start with the BOS; a warning says so."""
    d = make_tokenizer_dir(tmp_path / "t")
    (d / "tokenizer_config.json").unlink()
    assert Tokenizer.from_dir(d).encode("Hi") == tok.encode("Hi", add_bos=False)  # no ids given
    with caplog.at_level("WARNING", logger="runtime.tokenizer"):
        t = Tokenizer.from_dir(d, tok.bos_token_id, tok.eos_token_id)
    assert (t.bos_token, t.eos_token) == (BOS, EOS) and t.encode("Hi") == tok.encode("Hi")
    assert "names no bos_token" in caplog.text and "names no eos_token" in caplog.text
    with pytest.raises(ValueError, match="bos_token id 100000 is not in"):
        Tokenizer.from_dir(d, 100000, None)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": EOS}))  # named: it wins
    assert Tokenizer.from_dir(d, tok.bos_token_id, None).bos_token == EOS
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))  # null: none
    assert Tokenizer.from_dir(d, tok.bos_token_id, None).bos_token is None


def test_add_bos_token_false_encodes_text_without_the_bos(tmp_path: Path, tok: Tokenizer) -> None:
    """tokenizer_config.json's ``add_bos_token: false`` (transformers and vLLM then add none to a
    text prompt) was ignored: every prompt got a BOS."""
    d = make_tokenizer_dir(tmp_path / "t")
    cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    t = Tokenizer.from_dir(d)
    assert t.bos_token_id == tok.bos_token_id  # still the chat template's bos_token
    assert t.encode("Hi") == tok.encode("Hi", add_bos=False)
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": None}))
    assert Tokenizer.from_dir(d).encode("Hi") == tok.encode("Hi")  # null: unset (a BOS)
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": "no"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: add_bos_token must be"):
        Tokenizer.from_dir(d)


def test_chat_template_and_jinja_file(tmp_path: Path, tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == f"{BOS}<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|assistant|>")
    ids = tok.encode(text, add_bos=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    d = make_tokenizer_dir(tmp_path / "j")
    (d / "chat_template.jinja").write_text("{{ messages | length }}", encoding="utf-8")
    assert Tokenizer.from_dir(d).apply_chat_template(msgs) == "2"


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be an object .*, got string$"),
        ([{"role": "tool", "content": "x"}], r"messages\[0\]\.role .*, got 'tool'$"),
        ([{"role": "user"}], r"messages\[0\]\.content must be a string, got no content$"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": 3}],
            r"^messages\[1\]\.content must be a string, got integer$",
        ),
        # a role absent or no string, in JSON's words (it was "got None", "got 5")
        ([{"content": "x"}], r"^messages\[0\]\.role must be one of .*, got no role$"),
        ([{"role": None, "content": "x"}], r"^messages\[0\]\.role must be one of .*, got null$"),
        ([{"role": 5, "content": "x"}], r"^messages\[0\]\.role must be one of .*, got integer$"),
        ([{"role": "assistant", "content": "x"}], "must not start with an assistant"),
    ],
)
def test_chat_template_rejects_bad_messages(tok: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_chat_template_is_sandboxed(tmp_path: Path) -> None:
    d = make_tokenizer_dir(tmp_path / "s")
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": evil}))
    t = Tokenizer.from_dir(d)
    with pytest.raises(ValueError, match="chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])
    assert t.bos_token_id is None
    with pytest.raises(ValueError, match="no chat_template"):
        Tokenizer(t._tok).apply_chat_template([{"role": "user", "content": "x"}])


# ---- IncrementalDetokenizer --------------------------------------------------------------------
def test_incremental_multibyte_utf8(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED, add_bos=False)
    # The test tokenizer never saw non-ASCII text: each such character spans several tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, ids)
    assert "".join(deltas) == MIXED == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # something was held back until its character completed


def test_incremental_skips_special_tokens_and_uses_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("Hello")
    out = tok.encode(" world! 🎉", add_bos=False) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(_stream(detok, out)) == " world! 🎉"


def test_incremental_invalid_utf8_is_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("é", add_bos=False)
    assert len(ids) == 2
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[0]) == ""  # the first byte of a two-byte character
    assert detok.flush() == "\ufffd"  # generation ended mid-character: show the replacement


def test_stop_string_completed_by_the_final_flush(tok: Tokenizer) -> None:
    """A request whose last token (by max_tokens) leaves a held-back tail that completes a stop
    string only when flushed: its text is cut there, so it finished on the stop string."""
    from runtime.detokenize import RequestDetokenizer
    from runtime.sampling_params import SamplingParams

    ab = tok.encode("ab", add_bos=False)
    half = tok.encode("é", add_bos=False)[:1]  # the first byte of a two-byte character
    for stop, reason, text in (("\ufffd", "stop", "ab"), ("zz", "length", "ab\ufffd")):
        params = SamplingParams(max_tokens=len(ab) + 1, stop=(stop,))
        rd = RequestDetokenizer(tok, params, [], {tok.eos_token_id})
        outs = [rd.add(t, n) for n, t in enumerate(ab + half, start=1)]
        assert [r for _, r in outs] == [None] * len(ab) + [reason]
        assert "".join(t for t, _ in outs) == text


def test_stop_string_across_tokens(tok: Tokenizer) -> None:
    text = "Hello world. The end is near"
    detok = IncrementalDetokenizer(tok, stop=("end is", "zzz"))
    deltas = []
    for i in tok.encode(text, add_bos=False):
        deltas.append(detok.add(i))
        if detok.stopped:
            break
    assert detok.stopped and detok.stop_string == "end is"
    assert "".join(deltas) == "Hello world. The " == detok.text
    assert detok.add(5) == "" and detok.flush() == ""  # nothing after a hit


def test_stop_string_prefix_is_held_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, stop=("world!!",))
    deltas = _stream(detok, tok.encode("Hello world! bye", add_bos=False))
    assert not detok.stopped
    assert "".join(deltas) == "Hello world! bye"
    seen = ""
    for d in deltas[:-1]:
        seen += d
        assert not seen.endswith("world!")  # held until it can no longer be the stop string
    # Ending on a partial stop string: flush releases it.
    detok = IncrementalDetokenizer(tok, stop=("world!!",))
    deltas = _stream(detok, tok.encode("Hello world!", add_bos=False))
    assert deltas[-1].endswith("world!") and "".join(deltas) == "Hello world!"


def test_stop_checker_first_completed_match_wins() -> None:
    c = StopStringChecker(("cd", "bcde"))
    assert c.feed("ab") == "a"  # "b" may start "bcde"
    # "cd" is complete before "bcde" is: text arriving a character at a time would stop there
    assert c.feed("cdef") == "b" and c.hit == "cd"
    c = StopStringChecker(("b", "aba"))  # found by hypothesis: the answer must not depend on chunks
    assert c.feed("aab") + c.feed("a") == "aa" and c.hit == "b"
    c = StopStringChecker(("b", "aba"))
    assert c.feed("aaba") == "aa" and c.hit == "b"
    c = StopStringChecker(("bc", "abc"))  # same end: the longer one, which starts first
    assert c.feed("xabcd") == "x" and c.hit == "abc"
    c = StopStringChecker(("de", "bcx"))
    assert c.feed("abcdef") == "abc" and c.hit == "de"
    with pytest.raises(ValueError, match="non-empty"):
        StopStringChecker(("",))


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=30),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_stop_checker_matches_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    c = StopStringChecker(stops)
    bounds = sorted({0, len(text), *(min(x, len(text)) for x in cuts)})
    out = ""
    for a, b in itertools.pairwise(bounds):
        out += c.feed(text[a:b])
        # Never shows text that turns out to be (part of) a stop string.
        assert not any(s in out for s in stops)
    out += c.flush()
    # generation stops where a stop string is first complete (earliest end, then earliest start)
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    expected = text[: min(hits)[1]] if hits else text
    assert out == expected
    assert (c.hit is not None) == bool(hits)


# ---- against the tokenizers library (what HF's fast tokenizer and vLLM call) ------------------
_PIECES = [" ", "  ", "\n", "\t", "\r\n", "a", "the", " the", "é", "世界", "🎉", "👨\u200d👧",
           "Ġ", "▁", BOS, EOS, "<|user|>", "<|", "|>"]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from(_PIECES), max_size=14), data=st.data())
def test_encode_and_incremental_decode_agree_with_the_library(
    tok: Tokenizer, parts: list[str], data: st.DataObject
) -> None:
    """encode() is HF's ``encode(text)`` (the BOS, special-token text as its token, a BOS
    already in the text kept: two), the text round-trips, and the streamed deltas after any
    prompt split at a character boundary join to the full decode (special tokens skipped)."""
    import tokenizers

    text = "".join(parts)
    ref = tokenizers.Tokenizer.from_str(tok._tok.to_str())
    ref.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.bos_token_id)]
    )
    ids = tok.encode(text)
    assert ids == ref.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == BOS + text
    k = data.draw(st.integers(1, len(ids)))
    gen = tok.decode(ids[k:])
    if tok.decode(ids[:k]) + gen == tok.decode(ids):  # (not inside a character)
        assert "".join(_stream(IncrementalDetokenizer(tok, prompt_ids=ids[:k]), ids[k:])) == gen


# ---- the tiny checkpoint's tokenizer (model/checkpoint.py) -------------------------------------
def test_tiny_checkpoint_tokenizer(tmp_path: Path) -> None:
    from model import checkpoint as ck
    from model.presets import preset_config

    # Only the tokenizer files of the checkpoint: the same functions make_checkpoint writes with.
    (tmp_path / "tokenizer.json").write_text(ck.train_tokenizer(512).to_str(), encoding="utf-8")
    cfg = ck.tokenizer_config(preset_config("tiny"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(msgs)
    assert text == f"{ck.BOS}S{ck.USER}Hi there{ck.ASSISTANT}"
    ids = tok.encode(text, add_bos=False)
    assert ids[0] == 0 and ids[-1] == tok.encode(ck.ASSISTANT, add_bos=False)[0]
    # The post-processor of tokenizer.json also adds a BOS; encode() must not add a second one.
    assert tok.encode("Hi").count(0) == 1
    detok = IncrementalDetokenizer(tok, stop=("the",), prompt_ids=ids)
    out = "".join(_stream(detok, tok.encode(" The morning train 🚂 left the station", False)))
    assert out == " The morning train 🚂 left " and detok.stopped


def test_bench_detokenize_streams_the_same_text(tmp_path) -> None:
    """benchmarks/bench_detokenize.py: both ways stream the training text identically and each
    has a time per token."""
    import json

    from benchmarks import bench_detokenize as B

    out = tmp_path / "detok.json"
    B.main(["--reps", "1", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["same_text"] and r["tokens"] > 500
    assert r["incremental"]["us_per_token"] > 0 and r["decode_stream"]["us_per_token"] > 0
