"""The one CUDA-graph timer of the kernel benchmarks (bench_awq, bench_cache_ops,
bench_decode_kernels).

A kernel call of a few microseconds is dominated by its launch when timed alone, and a decode step
replays it from a CUDA graph anyway. So ``graph_time`` captures ``calls`` (R consecutive calls,
each with its own inputs where the caller wants no L2 reuse) in one graph, replays the graph
``replays`` times between CUDA events, and reports the per-call time of each replay (graph time /
R); the median is the figure the results files quote.

Order of work, fixed here so every benchmark measures the same way:
1. warm-up on a side stream (compiles Triton kernels and lets allocators settle outside the
   capture, as torch.cuda.graphs asks): the first ``warm`` calls, or all of them;
2. ``before()``, capture every call into one graph;
3. ``before()``, one untimed replay (the first replay pays one-time costs);
4. per timed replay: ``before()`` (outside the timed window: e.g. restoring state the calls
   mutate, or flushing L2), then the replay between two events, behind a spin kernel
   (``SPIN_CYCLES``) that keeps the GPU busy while the host records the first event and submits
   the replay. Without it, when the GPU was idle at that moment (each timed replay ends with a
   synchronize, so it is unless ``before()`` queues more work than the host's launch takes: no
   ``before()``, or one that synchronizes, e.g. through ``torch.unique``), the first event
   fires at once and the window also holds the host's graph launch, up to ~20 µs, divided by the
   calls per graph. On an H100 the staging clear's kernel, 3.7-3.9 µs of device time
   (profiler), timed at 24.7-25.9 µs after a ``before()`` that synchronizes and at 6.5-10.0 µs
   after ones that left work queued (benchmarks/results/gpu_session26/call1_staged_recall_h100
   .json). In a decode step the ops replay inside one graph and pay no such launch each.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class GraphTiming:
    per_call_us: list[float]  # one value per timed replay: replay time / calls
    calls: int
    graph: object | None = None  # the captured graph (callers replay it once more to check)

    @property
    def median_us(self) -> float:
        return statistics.median(self.per_call_us)

    def summary(self) -> dict:
        """The fields a results file records."""
        return {
            "median_us": self.median_us,
            "min_us": min(self.per_call_us),
            "max_us": max(self.per_call_us),
            "calls_per_graph": self.calls,
            "replays": len(self.per_call_us),
        }


class Backend(Protocol):
    def warm(self, calls: Sequence[Callable[[], object]]) -> None: ...

    def capture(self, calls: Sequence[Callable[[], object]]) -> tuple[object, Callable[[], None]]:
        """Capture ``calls`` into one graph: (the graph, a function that replays it)."""
        ...

    def time_ms(self, replay: Callable[[], None]) -> float:
        """Milliseconds ``replay()`` takes on the device."""
        ...


# ~100 µs at the H100's / H200's 1.98 GHz: longer than the host takes to record an event and
# submit a graph launch, so the replay is queued before the first event fires
SPIN_CYCLES = 200_000


class CudaGraphs:
    """The real backend: side-stream warm-up, torch.cuda.graph capture, CUDA-event timing."""

    def __init__(self) -> None:
        import torch

        self.torch = torch

    def warm(self, calls) -> None:
        torch = self.torch
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()

    def capture(self, calls):
        g = self.torch.cuda.CUDAGraph()
        with self.torch.cuda.graph(g):
            for c in calls:
                c()
        return g, g.replay

    def time_ms(self, replay) -> float:
        ev = self.torch.cuda.Event
        start, end = ev(enable_timing=True), ev(enable_timing=True)
        self.torch.cuda._sleep(SPIN_CYCLES)  # the module docstring, 4.
        start.record()
        replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def graph_time(
    calls: Sequence[Callable[[], object]],
    replays: int,
    before: Callable[[], object] | None = None,
    warm: int | None = None,
    backend: Backend | None = None,
) -> GraphTiming:
    """Per-call time of ``calls`` captured in one CUDA graph (see the module docstring).
    ``warm``: how many of the calls to run for the warm-up (default all; calls that mutate state
    may want 1)."""
    if not calls or replays < 1:
        raise ValueError(f"graph_time needs calls and replays >= 1, got {len(calls)}, {replays}")
    backend = backend or CudaGraphs()
    before = before or (lambda: None)
    before()
    backend.warm(list(calls) if warm is None else list(calls)[:warm])
    before()
    graph, replay = backend.capture(calls)
    before()
    replay()  # untimed
    times = []
    for _ in range(replays):
        before()
        times.append(backend.time_ms(replay) * 1e3 / len(calls))
    return GraphTiming(times, len(calls), graph)
