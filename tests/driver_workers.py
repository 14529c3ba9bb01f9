"""Per-rank functions for the gloo tests of the multi-rank driver protocol
(``runtime.distributed.driver``: ``DriverEngine`` and ``follow``) over a fake engine, no model:
module-level so that ``runtime.distributed.process.spawn`` can start them in fresh processes.
Each writes what it saw to ``out``. The workers that run the tiny model are
tests/distributed_workers.py's."""

from __future__ import annotations

import os
import time
from pathlib import Path


class _FakeEngine:
    """What the driver and the follower call, with the DistributedEngine's ``ctx``."""

    def __init__(self, ctx):
        self.ctx, self.calls = ctx, []

    def step(self):
        self.calls.append("step")
        return []

    def add_request(self, request_id, ids, params):
        self.calls.append(("add", request_id))
        if request_id == "bad":
            raise ValueError("refused")


def heartbeat_worker(rank: int, out: str) -> None:
    """Rank 0 drives a fake engine and stays idle past the collective timeout (its heartbeat
    must keep rank 1 waiting), then sends a refused add and a step; rank 1 follows."""
    from runtime.distributed.driver import DriverEngine, follow
    from runtime.distributed.process import finish, init_distributed

    ctx = init_distributed("cpu", timeout_s=2.0)
    eng = _FakeEngine(ctx)
    if rank == 0:
        driver = DriverEngine(eng)  # a ping after 0.5 s of silence
        time.sleep(3.0)  # idle longer than the collective timeout
        try:
            driver.add_request("bad", [1], None)
            raise AssertionError("the refused add did not raise")
        except ValueError as e:
            assert str(e) == "refused"
        driver.step()
        driver.close()
        (Path(out) / "rank0.txt").write_text(f"{driver.pings}")
    else:
        n = follow(eng)
        (Path(out) / "rank1.txt").write_text(f"{n} {eng.calls}")
    finish()


def driver_failure_worker(rank: int, out: str) -> None:
    """Rank 1 follows and dies at its first step (a crash); rank 0 steps until its driver sees
    the failure, then records what the driver reports and what a later add raises."""
    from runtime.distributed.driver import DriverEngine, follow
    from runtime.distributed.process import init_distributed

    ctx = init_distributed("cpu", timeout_s=10.0)
    eng = _FakeEngine(ctx)
    if rank == 1:
        eng.step = lambda: os._exit(3)  # no cleanup, no goodbye to the process group
        follow(eng)
        return
    told: list[str] = []
    driver = DriverEngine(eng, on_failure=lambda: told.append("stop"))
    t0, first = time.perf_counter(), ""
    while not first and time.perf_counter() - t0 < 30:
        try:
            driver.step()
        except Exception as e:  # noqa: BLE001  (the test checks which)
            first = f"{type(e).__name__}: {e}"
    try:
        driver.add_request("later", [1], None)
        later = "accepted"
    except Exception as e:  # noqa: BLE001
        later = f"{type(e).__name__}: {e}"
    driver.close()
    lines = [first, str(driver.failure), later, f"{told}"]
    (Path(out) / "rank0.txt").write_text("\n".join(x.replace("\n", " ") for x in lines))


def metrics_error_worker(rank: int, out: str) -> None:
    """Every rank's ``metrics`` fails (a metric without an aggregation rule): rank 0's driver
    raises it to the scrape, and rank 1 keeps following (the step after it is applied)."""
    from runtime.distributed.driver import DriverEngine, follow
    from runtime.distributed.process import finish, init_distributed

    ctx = init_distributed("cpu", timeout_s=10.0)
    eng = _FakeEngine(ctx)
    eng.dp = 2

    def metrics():
        eng.calls.append("metrics")
        raise ValueError("engine metric 'x' has no rule")

    eng.metrics = metrics
    if rank == 0:
        driver = DriverEngine(eng)
        try:
            driver.metrics()
            raise AssertionError("the failed metrics did not raise")
        except ValueError as e:
            assert "has no rule" in str(e)
        driver.step()
        driver.close()
    else:
        n = follow(eng)
        (Path(out) / "rank1.txt").write_text(f"{n} {eng.calls}")
    finish()


def reset_stats_worker(rank: int, out: str) -> None:
    """Rank 0 resets the driver's stats then steps; every rank records what its engine got.
    ``engine`` stands for rank 0's own engine (what the driver hands unknown attributes to)."""
    from runtime.distributed.driver import DriverEngine, follow
    from runtime.distributed.process import finish, init_distributed

    ctx = init_distributed("cpu", timeout_s=10.0)
    eng = _FakeEngine(ctx)
    eng.engine = eng
    eng.reset_stats = lambda: eng.calls.append("reset_stats")
    if rank == 0:
        driver = DriverEngine(eng)
        driver.reset_stats()
        driver.step()
        driver.close()
    else:
        follow(eng)
    (Path(out) / f"rank{rank}.txt").write_text(f"{eng.calls}")
    finish()
