"""Where the slowest engine steps of a bench run spend their host time.

    python -m benchmarks.diag_slow_steps [--top N] -- BENCH-ARGS...

runs ``echo-compile bench BENCH-ARGS`` with every ``Engine.step`` under cProfile and prints, for
the N slowest steps and the median one, their wall time net of prompt-KV injection (as the bench
counts it) and the functions with the most cumulative time. A diagnosis tool: the profiler slows
every step's host work alike, so the bench's own numbers from such a run are not results."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

from echo_compile.cli import main as cli_main
from runtime.engine import Engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--top", type=int, default=3, help="how many of the slowest steps to print")
    p.add_argument("--lines", type=int, default=25, help="profile lines per step")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the bench's arguments")
    a = p.parse_args(argv)
    bench = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    steps: list[tuple[float, int, cProfile.Profile]] = []
    count = [0]
    step = Engine.step

    def profiled(self):
        prof = cProfile.Profile()
        t0, loaded = time.perf_counter(), self.prompt_kv_load_s
        prof.enable()
        try:
            return step(self)
        finally:
            prof.disable()
            count[0] += 1
            # net of prompt-KV injection, like the bench's step times
            net = time.perf_counter() - t0 - (self.prompt_kv_load_s - loaded)
            steps.append((net, count[0], prof))

    Engine.step = profiled  # type: ignore[method-assign]
    try:
        rc = cli_main(["bench", *bench])
    finally:
        Engine.step = step  # type: ignore[method-assign]
    if not steps:
        print("no engine step ran")
        return rc
    ranked = sorted(steps, key=lambda s: -s[0])
    # the slowest, then the median step for comparison
    for what, (wall, i, prof) in [("slow", s) for s in ranked[: a.top]] + [
        ("median", ranked[len(ranked) // 2])
    ]:
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s).sort_stats("cumulative")
        st.print_stats(a.lines)  # everything, then the project's own functions alone
        st.print_stats(r"(runtime|custom_ops|model|echo_compile)/", a.lines)
        print(f"==== {what}: step {i} of {len(steps)}, {wall * 1e3:.1f} ms net of injection")
        print(s.getvalue())
    return rc


if __name__ == "__main__":
    sys.exit(main())
