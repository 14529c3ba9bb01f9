"""Progress bars only on a terminal: a redirected stderr (a server's log, CI) gets no redraws."""

from __future__ import annotations

import io
import re

from test_engines import make

from model.checkpoint import resolve_model
from model.loader import load_model
from runtime.progress import LoadProgress, progress_bar


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


def test_the_warmup_summary_is_logged_not_printed(capsys, caplog, monkeypatch):
    """``LLM``'s "captured N step graphs" line was a print mixed into generate()'s stdout."""
    import logging

    from echo_compile.llm import LLM
    from runtime.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "warmup", lambda self, progress=True: 1.5)  # no capture
    caplog.set_level(logging.INFO, logger="echo_compile.llm")
    llm = LLM("tiny", compile=True, progress=True, device="cpu")
    assert "captured" not in capsys.readouterr().out
    n = llm.engine.runner.num_graphs
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/the/cache")
    caplog.clear()
    llm = LLM("tiny", compile=True, progress=True, device="cpu")
    assert [r.getMessage() for r in caplog.records if "captured" in r.getMessage()] == [
        f"captured {n} step graphs in 1.5 s (compile cache: /the/cache)"
    ]


def test_the_load_bar_counts_bytes_on_a_terminal_only():
    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        loading = LoadProgress(file=stream)
        load_model(resolve_model("tiny"), progress=loading)
        line = loading.close()
        assert ("loading weights" in stream.getvalue()) == shown
        if shown:  # bytes, unit-scaled (15.9M of 15.9M; B/s): the whole tiny checkpoint read
            assert re.search(r"loading weights: 100%\|.*\| (\d+\.\dM)/\1 .*B/s", stream.getvalue())
        assert re.fullmatch(r"read \d+\.\d\d GB of weights in \d+\.\d s \(\d+\.\d\d GB/s\)", line)
    silent = LoadProgress(enabled=False, file=Terminal())
    load_model(resolve_model("tiny"), progress=silent)
    silent.close()
    assert silent.read > 0 and silent.kw["file"].getvalue() == ""


def test_the_load_summary_is_logged(caplog, capsys):
    """One INFO line when the weights are in: GB read, seconds, GB/s; no bar into a log."""
    import logging

    from echo_compile.llm import LLM

    caplog.set_level(logging.INFO, logger="echo_compile.llm")
    LLM("tiny", compile=False, progress=True, device="cpu")
    lines = [r.getMessage() for r in caplog.records if "of weights in" in r.getMessage()]
    assert len(lines) == 1 and re.fullmatch(r"read 0\.\d\d GB of weights in .* GB/s\)", lines[0])
    assert "loading weights" not in capsys.readouterr().err


def test_a_load_that_fails_midway_closes_its_bar(tmp_path, monkeypatch):
    """A tensor misshapen in the last shard (found as it is read, after the first shards): the
    bar is closed, its line ended, by the time the caller handles the error (the CLI's error
    line went on the bar's line, and the bar was drawn again below it when collected)."""
    import shutil
    import sys

    import pytest
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    from echo_compile.llm import LLM

    path = tmp_path / "ck"
    shutil.copytree(resolve_model("tiny"), path)
    last = sorted(path.glob("model-*.safetensors"))[-1]
    t = load_file(last)
    name = next(n for n in t if n.endswith("norm.weight") and ".layers." not in n)
    t[name] = t[name][:-1].clone()
    save_file(t, str(last), metadata={"format": "pt"})
    monkeypatch.setattr(sys, "stderr", Terminal())
    with pytest.raises(ValueError, match=rf"{re.escape(name)}.*shape"):
        try:
            LLM(str(path), compile=False, progress=True, device="cpu")
        except ValueError:  # as a caller handles it: the error's line is next on the terminal
            drawn = sys.stderr.getvalue()
            bars = [b for b in list(tqdm._instances) if b.desc == "loading weights"]
            raise
    assert "loading weights" in drawn and drawn.endswith("\n"), drawn
    assert bars == []
