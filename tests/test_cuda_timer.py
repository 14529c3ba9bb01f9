"""benchmarks.cuda_timer, the kernel benchmarks' one CUDA-graph timer: its order of work and
arithmetic on CPU through a scripted backend, and the real thing on a GPU."""

from __future__ import annotations

import pytest

from benchmarks.cuda_timer import GraphTiming, graph_time


class Scripted:
    """A backend that logs what it is asked to do and reports scripted replay times (ms)."""

    def __init__(self, times_ms: list[float]):
        self.times = list(times_ms)
        self.log: list[str] = []

    def warm(self, calls) -> None:
        self.log.append(f"warm {len(calls)}")
        for c in calls:
            c()

    def capture(self, calls):
        self.log.append(f"capture {len(calls)}")

        def replay() -> None:
            self.log.append("replay")

        return "graph", replay

    def time_ms(self, replay) -> float:
        self.log.append("timed:")
        replay()
        return self.times.pop(0)


def test_order_of_work_and_per_call_median() -> None:
    be = Scripted([4.0, 1.0, 2.0])
    ran: list[int] = []
    calls = [lambda i=i: ran.append(i) for i in range(4)]
    t = graph_time(calls, 3, before=lambda: be.log.append("before"), warm=1, backend=be)
    assert be.log == [
        "before", "warm 1", "before", "capture 4",
        "before", "replay",  # the untimed first replay
        "before", "timed:", "replay", "before", "timed:", "replay", "before", "timed:", "replay",
    ]  # fmt: skip
    assert ran == [0]  # only the warm-up runs a call here: capture records, replays re-run
    assert t.per_call_us == [1000.0, 250.0, 500.0]  # ms -> us, / 4 calls per graph
    assert t.median_us == 500.0 and t.graph == "graph"
    assert t.summary() == {
        "median_us": 500.0, "min_us": 250.0, "max_us": 1000.0, "calls_per_graph": 4, "replays": 3,
    }  # fmt: skip


def test_warm_defaults_to_every_call_and_bad_arguments_are_refused() -> None:
    be = Scripted([1.0])
    graph_time([lambda: None] * 3, 1, backend=be)
    assert be.log[0] == "warm 3"
    with pytest.raises(ValueError, match="needs calls and replays >= 1"):
        graph_time([], 1, backend=be)
    with pytest.raises(ValueError, match="needs calls and replays >= 1"):
        graph_time([lambda: None], 0, backend=be)
    assert GraphTiming([3.0, 1.0, 2.0, 10.0], 1).median_us == 2.5


@pytest.mark.cuda
def test_times_a_real_graph() -> None:
    import torch

    x = torch.zeros(1 << 24, device="cuda")  # 64 MB: well above launch overhead
    t = graph_time([lambda: x.add_(1.0)] * 4, 5)
    torch.cuda.synchronize()
    # warm-up 4 + untimed 4 + timed 5 x 4 calls, each adding 1
    assert float(x[0]) == 4 + 4 + 20
    assert len(t.per_call_us) == 5 and all(v > 0 for v in t.per_call_us)


@pytest.mark.cuda
def test_host_launch_is_outside_the_window() -> None:
    """A one-call graph of a tiny kernel times the same whether ``before()`` leaves the GPU idle
    (it synchronizes) or busy: the host's submission of the replay is not in the window."""
    import torch

    x = torch.zeros(1024, device="cuda")
    big = torch.zeros(1 << 26, device="cuda")
    idle = graph_time([lambda: x.add_(1.0)], 30, before=torch.cuda.synchronize).median_us
    busy = graph_time([lambda: x.add_(1.0)], 30, before=lambda: big.add_(1.0)).median_us
    assert idle < busy + 3.0, (idle, busy)
