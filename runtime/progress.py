"""Progress bars (warm-up's graph capture, ``LLM.generate``): one home of when they are drawn.

A bar is drawn only on a terminal: with stderr redirected (a server's log, a CI job) each redraw
would be a line of noise, so it is off there, tqdm's ``disable=None``. A caller that wants a record
in a log writes one summary line when done (``LLM``'s "captured N step graphs in S s", logged).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def progress_bar(iterable: Iterable | None = None, *, enabled: bool = True, **kw: Any) -> Any:
    """A ``tqdm`` bar on stderr when ``enabled`` and stderr is a terminal, else a silent one (the
    same object: ``update`` / ``close`` / iteration work either way)."""
    from tqdm import tqdm  # (imported when a bar is made: not on the engine's import path)

    return tqdm(iterable, disable=None if enabled else True, **kw)
