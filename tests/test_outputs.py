"""A request's output text is accumulated in time linear in its length: the server's and
``generate()``'s ``RequestOutput`` and the incremental detokenizer's ``text``."""

from __future__ import annotations

from pathlib import Path

from server_utils import make_tokenizer_dir
from text_copies import Piece

from runtime.engine import StepOutput
from runtime.outputs import RequestOutput
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer


def _step(text: str, n: int) -> StepOutput:
    return StepOutput("r", [n], None, text, False, None, 1, n)


def test_request_output_text_is_the_steps_text_in_linear_time() -> None:
    Piece.copied = 0
    out, steps = RequestOutput(), [Piece(f"w{i} ") for i in range(2000)]
    for n, t in enumerate(steps, start=1):
        out.add(_step(t, n))
        if n == 1000:  # read in the middle: the rest is still added to it
            assert out.text == "".join(steps[:1000])
    out.add(_step("", 2001))  # (a step without text)
    assert out.text == "".join(steps) and out.text == out.text
    # += would copy the text so far per step: ~ 2000**2 / 2 * 5 characters
    assert Piece.copied <= 2 * len(out.text), Piece.copied
    assert RequestOutput().text == ""


def test_detokenizer_text_is_its_deltas_in_linear_time(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(make_tokenizer_dir(tmp_path))
    detok = IncrementalDetokenizer(tok)
    # NOTE: the deltas are its own slices of decoded text; made Pieces where the stop checker
    # hands them out, so that a copy of the text so far per delta is counted
    feed = detok._stop.feed
    detok._stop.feed = lambda text, check=True: Piece(feed(text, check))  # type: ignore[method-assign]
    Piece.copied = 0
    ids = tok.encode("Hello world. " * 300, add_bos=False)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert detok.text == "".join(deltas) == "Hello world. " * 300
    assert Piece.copied <= 2 * len(detok.text), Piece.copied
