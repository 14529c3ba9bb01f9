"""Where a new request goes among the data-parallel ranks: by load, within host capacity.

Each DP rank has its own host KV pool, and a request reserves pages for its whole lifetime
(prompt + max_tokens) at admission. A request goes to the rank whose pool has the pages free now
and whose load would be least with it, counting as work only the tokens that rank has not cached
(its prefix cache, when on: a request on a document goes where the document is); if no rank has
the pages free, to the least-loaded rank whose pool could ever hold it (it waits there for
pages, as on one GPU); if no rank's pool is large enough, it is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from custom_ops.kv_format import PAGE


@dataclass
class RankLoad:
    """One DP rank's state as the front end sees it."""

    load_tokens: int  # tokens still to compute for its running and waiting requests
    # host pool pages it could give the request now: free ones and those only its prefix cache
    # holds, waiting requests' reservations subtracted
    free_pages: int
    total_pages: int  # host pool pages in all
    cached_tokens: int = 0  # prompt tokens of the request being placed this rank has cached


def assign(pages: int, tokens: int, loads: list[RankLoad]) -> int:
    """The DP rank for a request of ``pages`` host pages and ``tokens`` tokens of work; updates
    ``loads[rank]`` as if it were admitted there (so a batch of requests spreads)."""
    if not loads:
        raise ValueError("no data-parallel ranks to place the request on")
    now = [r for r, s in enumerate(loads) if s.free_pages >= pages - s.cached_tokens // PAGE]
    later = [r for r, s in enumerate(loads) if s.total_pages >= pages]
    pool = now or later
    if not pool:
        biggest = max(s.total_pages for s in loads)
        raise ValueError(
            f"the request needs {pages} host KV pages, more than any data-parallel rank's host "
            f"pool holds ({biggest} pages)"
        )
    rank = min(pool, key=lambda r: (loads[r].load_tokens + tokens - loads[r].cached_tokens, r))
    loads[rank].load_tokens += tokens - loads[rank].cached_tokens
    # may go negative: the request waits for pages there
    loads[rank].free_pages -= pages - loads[rank].cached_tokens // PAGE
    return rank
