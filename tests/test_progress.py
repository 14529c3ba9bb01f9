"""Progress bars only on a terminal: a redirected stderr (a server's log, CI) gets no redraws."""

from __future__ import annotations

import io

from test_engines import make

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.progress import progress_bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def drawn(stream: io.StringIO, enabled: bool) -> str:
    for _ in progress_bar(range(3), enabled=enabled, desc="capturing graphs", file=stream):
        pass
    return stream.getvalue()


def test_a_bar_is_drawn_on_a_terminal_only():
    assert "capturing graphs" in drawn(Terminal(), enabled=True)
    assert drawn(Terminal(), enabled=False) == ""
    assert drawn(io.StringIO(), enabled=True) == ""  # not a terminal: no bar, asked or not


def test_warmup_draws_no_bar_into_a_log(capsys):
    eng = make(load_model(resolve_model("tiny"))[0], compiled=False)
    capsys.readouterr()
    eng.runner.warmup(progress=True)  # stderr captured: not a terminal
    assert "capturing graphs" not in capsys.readouterr().err
