"""Progress bars (warm-up's graph capture, ``LLM.generate``, the weights' load): one home of when
they are drawn.

A bar is drawn only on a terminal: with stderr redirected (a server's log, a CI job) each redraw
would be a line of noise, so it is off there, tqdm's ``disable=None``. A caller that wants a record
in a log writes one summary line when done (``LLM``'s "captured N step graphs in S s", logged).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True, **kw: Any) -> Any:
    """A ``tqdm`` bar on stderr when ``enabled`` and stderr is a terminal, else a silent one (the
    same object: ``update`` / ``close`` / iteration work either way)."""
    from tqdm import tqdm  # (imported when a bar is made: not on the engine's import path)

    return tqdm(iterable, disable=None if enabled else True, **kw)


class LoadProgress:
    """The loaders' ``progress(n, total)`` callback (``model.loader.load_weights``): a bar of the
    bytes read, made at the first call (the loader knows ``total`` only then), and the load's
    summary line. Timed from its creation: make it just before the load, as a ``with`` block
    around it, which closes the bar however the load ends (one that fails midway leaves no bar
    open on the line the error is written to)."""

    def __init__(self, enabled: bool = True, **kw: Any):
        self.enabled = enabled
        self.kw = kw  # more of tqdm's arguments (``file``)
        self.bar: Any = None
        self.read = 0  # bytes
        self.start = time.perf_counter()
        self.seconds: float | None = None  # the load's, once closed

    def __enter__(self) -> LoadProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, n: int, total: int) -> None:
        if self.bar is None:
            self.bar = progress_bar(
                total=total, enabled=self.enabled, desc="loading weights", unit="B",
                unit_scale=True, **self.kw,
            )  # fmt: skip
        self.bar.update(n)
        self.read += n

    def close(self) -> str:
        """Close the bar (again: a no-op); the summary line to log: "read G GB of weights in S s
        (R GB/s)", timed to the first close."""
        if self.bar is not None:
            self.bar.close()
        if self.seconds is None:
            self.seconds = time.perf_counter() - self.start
        s = self.seconds
        gb = self.read / 1e9
        return f"read {gb:.2f} GB of weights in {s:.1f} s ({gb / max(s, 1e-9):.2f} GB/s)"
