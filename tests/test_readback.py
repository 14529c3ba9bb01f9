"""runtime/readback.py: a finish's pool-overflow check read without a host sync. On a GPU the
count arrives behind an event; here a stand-in event (passed or not, as the test says) takes the
place of CUDA's, so the order of checks is what is tested: a count is checked only once its event
has passed, every pending count is checked when the engine goes idle, and a pool reset forgets
them."""

from __future__ import annotations

import pytest
import torch
from engine_records import random_prompts, tiny

from custom_ops import cache_layout as C
from runtime import readback
from runtime.engine import Engine, EngineConfig
from runtime.readback import PoolChecks
from runtime.sampling_params import SamplingParams


class _Event:
    """A CUDA event's query/synchronize, passed when the test says so."""

    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.passed = True


@pytest.fixture
def events(monkeypatch) -> list[_Event]:
    made: list[_Event] = []

    def to_host(x, timed=False):  # noqa: ANN001, ANN202  (as readback.to_host, on a "GPU")
        made.append(_Event())
        return x.clone(), made[-1]

    monkeypatch.setattr(readback, "to_host", to_host)
    return made


def test_a_count_is_checked_once_its_event_has_passed(events) -> None:
    checks = PoolChecks()
    checks.add(torch.tensor(0, dtype=torch.int32))
    checks.add(torch.tensor(3, dtype=torch.int32))
    checks.poll()  # neither copy has passed: nothing checked, nothing raised
    events[0].passed = True
    checks.poll()  # the first (0) is checked; the second still waits
    events[1].passed = True
    with pytest.raises(RuntimeError, match="GPU pool overflow in 3 recall"):
        checks.poll()


def test_drain_waits_for_every_pending_count_and_clear_forgets_them(events) -> None:
    checks = PoolChecks()
    checks.add(torch.tensor(2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="overflow in 2"):
        checks.drain()
    checks.add(torch.tensor(5, dtype=torch.int32))
    checks.clear()
    checks.drain()  # nothing left to check


def test_the_engine_checks_pending_counts_when_it_goes_idle(events) -> None:
    """An overflow seen by a finish whose count has not arrived yet is still reported: the last
    finish of a workload drains the checks; and a reset (recover) drops counts that the reset
    made meaningless."""
    model, tok = tiny()
    cfg = EngineConfig(max_batch=2, host_tokens=64 * 8, gpu_tokens=2 * model.config.index_topk,
                       max_model_len=256)  # fmt: skip
    eng = Engine(model, model.config, tok, cfg)
    prompts = random_prompts([40, 50], model.config.vocab_size, seed=1)
    for i, (p, n) in enumerate(zip(prompts, (2, 4))):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0))
    eng.cache.layers[0].pool.meta[C.OVERFLOW] = 1
    with pytest.raises(RuntimeError, match="GPU pool overflow in 1 recall"):
        while eng.has_unfinished():
            eng.step()
    assert len(events) == 2  # r0's finish (not passed: left pending), then r1's (drained)
    eng.recover()
    assert int(eng.cache.overflow()) == 0
    eng.add_request("r2", prompts[0], SamplingParams(max_tokens=2, temperature=0.0))
    while eng.has_unfinished():
        eng.step()  # no stale count from before the reset
