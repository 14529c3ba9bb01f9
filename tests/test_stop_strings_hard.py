"""Stop strings, steered to the hard cases the plain hypothesis test rarely draws: a stop string
split across feed chunks (and across tokens), overlapping stop strings, one a prefix or suffix of
another, a partial match that fails just before completing, a hit at the very end."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from server_utils import make_tokenizer_dir
from text_copies import Piece

from runtime.tokenizer import IncrementalDetokenizer, StopStringChecker, Tokenizer

ALPHA = "ab"  # two letters: partial matches and overlaps are the common case


def expected_output(text: str, stops: list[str], unchecked: int = 0) -> str:
    """Written from the rule: stop where a stop string is first complete (earliest end, then the
    earliest start, i.e. the longest of those ending there); the text before it is the output.
    ``unchecked``: no stop string ending in the first that many characters counts (the text of
    a request's first ``min_tokens`` tokens, vLLM's rule)."""
    best = None
    for end in range(unchecked + 1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            best = min(starts)
            break
    return text if best is None else text[:best]


@st.composite
def split_case(draw) -> tuple[str, list[str], list[int]]:
    """Text that contains a stop string (maybe after a near miss), chunk cuts inside it."""
    stop = draw(st.text(alphabet=ALPHA, min_size=2, max_size=5))
    others = draw(st.lists(st.text(alphabet=ALPHA, min_size=1, max_size=5), max_size=2))
    # relatives of the stop string: a prefix, a suffix, an overlapping shift
    rel = draw(st.sampled_from(["none", "prefix", "suffix", "shift"]))
    if rel == "prefix":
        others.append(stop[: draw(st.integers(1, len(stop) - 1))] + "a")
    elif rel == "suffix":
        others.append("b" + stop[draw(st.integers(1, len(stop) - 1)) :])
    elif rel == "shift":
        others.append(stop[1:] + stop[:1])
    near_miss = stop[:-1] + ("a" if stop[-1] == "b" else "b")  # all but the last character
    before = draw(st.text(alphabet=ALPHA, max_size=6))
    after = draw(st.text(alphabet=ALPHA, max_size=6))
    text = before + draw(st.sampled_from(["", near_miss])) + stop + after
    at = len(text) - len(after) - len(stop)  # where the planted stop starts
    inside = draw(st.lists(st.integers(at + 1, at + len(stop) - 1), min_size=1, max_size=3))
    free = draw(st.lists(st.integers(0, len(text)), max_size=4))
    return text, [stop, *others], inside + free


def _feed(stops: list[str], text: str, cuts: list[int]) -> tuple[str, StopStringChecker]:
    c = StopStringChecker(stops)
    bounds = sorted({0, len(text), *cuts})
    out = ""
    for a, b in itertools.pairwise(bounds):
        out += c.feed(text[a:b])
        assert not any(s in out for s in stops)  # never shows (part of) a hit
    return out + c.flush(), c


@settings(max_examples=300, deadline=None)
@given(split_case())
@example(("abab", ["bab", "ab"], [1, 3]))  # both end at 2..3: "ab" is complete first
@example(("aab", ["ab", "aab"], [1, 2]))  # same end: the longer one, which starts first
@example(("abaab", ["aab"], [1, 2, 4]))  # a near miss, then the hit
@example(("ba", ["a", "ba"], [1]))  # a hit in the last chunk
@example(("aaaa", ["aaab"], [1, 2, 3]))  # a prefix held to the end, then released
def test_stop_string_split_across_chunks(case):
    text, stops, cuts = case
    out, c = _feed(stops, text, cuts)
    want = expected_output(text, stops)
    assert out == want
    assert (c.hit is not None) == any(s in text for s in stops)


@settings(max_examples=300, deadline=None)
@given(split_case(), st.integers(0, 20))
@example(("abab", ["ab"], [1, 2, 3]), 2)  # the first hit unchecked: the second one counts
@example(("abab", ["bab", "ab"], [1, 3]), 2)  # "bab" straddles the boundary: it counts
@example(("aab", ["b", "aab"], [2]), 2)  # unchecked "aa" held as a prefix of "aab", then a hit
@example(("abc", ["b", "abc"], [2]), 2)  # "b" ended unchecked inside the held "ab": not a hit
def test_stop_string_not_matched_in_unchecked_text(case, unchecked: int) -> None:
    """Text fed with ``check=False`` (a request's first ``min_tokens`` tokens) ends no stop string;
    one that starts there and ends in later text does, whatever the chunks (it stopped on the
    first "ab" of "abab" with min_tokens past it, vLLM's rule being the second)."""
    text, stops, cuts = case
    unchecked = min(unchecked, len(text))
    c = StopStringChecker(stops)
    bounds = sorted({0, len(text), unchecked, *cuts})
    out = "".join(c.feed(text[a:b], check=b > unchecked) for a, b in itertools.pairwise(bounds))
    out += c.flush()
    assert out == expected_output(text, stops, unchecked)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


WORDS = ["The ", "quick ", "brown ", "fox ", "hello ", "world", "!", ". ", "0123", "(a) "]


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.sampled_from(WORDS), min_size=3, max_size=10), data=st.data())
@example(words=["hello ", "world", "!", "The "], data=None)
def test_stop_string_split_across_tokens(tok: Tokenizer, words: list[str], data) -> None:
    """A stop string that starts inside one token and ends inside a later one: the detokenizer
    stops on the token completing it, and the text ends just before it."""
    text = "".join(words)
    ids = tok.encode(text, add_bos=False)
    # token boundaries in the text
    ends = list(itertools.accumulate(len(tok.decode([i])) for i in ids))
    assert ends[-1] == len(text)
    inner = [e for e in ends[:-1] if 0 < e < len(text) - 1]
    if not inner:
        return
    b = data.draw(st.sampled_from(inner)) if data is not None else inner[len(inner) // 2]
    lo = data.draw(st.integers(1, min(3, b))) if data is not None else 1
    hi = data.draw(st.integers(1, min(3, len(text) - b))) if data is not None else 1
    stop = text[b - lo : b + hi]  # straddles the boundary at b
    detok = IncrementalDetokenizer(tok, stop=(stop,))
    out, n = "", 0
    for i in ids:
        out += detok.add(i)
        n += 1
        if detok.stopped:
            break
    cut = text.find(stop)
    assert detok.stopped and out == text[:cut]
    # it stopped on the token whose text completes the first occurrence
    assert ends[n - 1] >= cut + len(stop) and (n == 1 or ends[n - 2] < cut + len(stop))


def test_feed_in_time_linear_in_the_text() -> None:
    # near misses of every stop string all along, then a hit: each feed may look at its chunk and
    # the held-back tail (shorter than the longest stop string) only
    stops = ["</answer>", "STOP", "ab"]
    words = ["</ans", "wer", " STO", "</answe", "r ", "a", "c", "S"]
    chunks = [Piece(words[i % len(words)]) for i in range(3000)]
    chunks += [Piece("xxSTO"), Piece("P tail")]
    text = "".join(chunks)
    Piece.copied = 0
    out, c = _feed_chunks(stops, chunks)
    assert out == text[: -len("STOP tail")] == expected_output(text, stops) and c.hit == "STOP"
    # text += chunk copied the text so far per chunk: ~ 3000**2 / 2 * 4 characters
    assert Piece.copied <= len(text) + len(chunks) * max(map(len, stops)), Piece.copied


def _feed_chunks(stops: list[str], chunks: list[str]) -> tuple[str, StopStringChecker]:
    c = StopStringChecker(stops)
    return "".join(c.feed(ch) for ch in chunks) + c.flush(), c


def test_min_tokens_holds_back_stop_strings(tok: Tokenizer) -> None:
    """A request's stop strings do not end it within its first ``min_tokens`` tokens, as vLLM's
    ``min_tokens`` (EOS and ``stop_token_ids`` are held back on the device): the first stop
    string that ends in a later token's text does. It stopped on the first "l" of "hello"."""
    from runtime.detokenize import RequestDetokenizer
    from runtime.sampling_params import SamplingParams

    text = "hello world! The quick brown fox "
    ids = tok.encode(text, add_bos=False)
    ends = list(itertools.accumulate(len(tok.decode([i])) for i in ids))
    assert ends[-1] == len(text) and len(ids) > 4
    for m in range(len(ids)):
        params = SamplingParams(max_tokens=len(ids), min_tokens=m, stop=("l", "o w", "fox"))
        rd = RequestDetokenizer(tok, params, [], {tok.eos_token_id})
        out, reason, n = "", None, 0
        while reason is None:
            delta, reason = rd.add(ids[n], n + 1)
            out, n = out + delta, n + 1
        unchecked = ends[m - 1] if m else 0
        want = expected_output(text, list(params.stop), unchecked)
        assert (out, reason) == (want, "stop" if want != text else "length"), m
        if reason == "stop":  # on the token that completes the stop string
            hit = len(want) + len(rd.detok.stop_string)
            assert ends[n - 1] >= hit and (n == 1 or ends[n - 2] < hit) and n > m, m
