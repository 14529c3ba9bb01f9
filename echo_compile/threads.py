"""How many CPU threads torch uses for offline work (the CLI, ``LLM``, the test suite).

torch starts one intra-op thread per CPU it sees. On a small or shared machine that oversubscribes
the cores: OpenMP threads spin waiting for each other while another process holds a core, and the
tiny model's ops are too small to gain from threads anyway. Measured on a 2-core VM shared with
other jobs (load 1-7), ``echo-compile demo`` took 6-19 s wall and ~6 s CPU with one thread, 50-114 s
wall and 26-38 s CPU with two: the second thread only spins. So: one thread on up to 2 usable cores;
above that half of them (not measured: about the physical cores where CPUs are hyperthreads, and
headroom for the server's and the tokenizer's threads).

Override with ``--threads N`` on the command line or ``ECHO_COMPILE_THREADS=N`` (at most the usable
cores); a set ``OMP_NUM_THREADS`` (which torch already honours) is left alone.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

THREADS_ENV = "ECHO_COMPILE_THREADS"

_configured = False  # mirrors torch's own process-wide thread count: the policy is applied once


def _cgroup_cpu_limit() -> float | None:
    """CPUs allowed by a cgroup v2 quota (``cpu.max``, e.g. a container's ``--cpus 2``), or None."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return max(1, n)


def default_threads(cores: int) -> int:
    """The policy: 1 thread on up to 2 cores (measured), half the cores above that."""
    return 1 if cores <= 2 else cores // 2


def _positive_int(value: object, what: str) -> int:
    """``value`` as a thread count: a positive integer, at most the usable cores (more only spin,
    see above; tens of thousands crashed the process in torch.set_num_threads, SIGSEGV)."""
    try:
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if n < 1 or isinstance(value, bool):
        raise ValueError(f"{what} must be a positive integer (CPU threads), got {value!r}")
    if n > (cores := usable_cores()):
        raise ValueError(f"{what} must be at most the {cores} usable CPU cores, got {value!r}")
    return n


def choose_threads(
    requested: int | None = None, environ: Mapping[str, str] | None = None
) -> int | None:
    """The thread count to use, or None to leave torch's (``OMP_NUM_THREADS`` is set).
    Precedence: ``requested`` (``--threads``), ``$ECHO_COMPILE_THREADS``, ``$OMP_NUM_THREADS``,
    then ``default_threads(usable_cores())``."""
    env = os.environ if environ is None else environ
    if requested is not None:
        return _positive_int(requested, "--threads")
    if env.get(THREADS_ENV, "").strip():
        return _positive_int(env[THREADS_ENV], THREADS_ENV)
    if env.get("OMP_NUM_THREADS", "").strip():
        return None
    return default_threads(usable_cores())


def configure_threads(requested: int | None = None) -> int:
    """Apply ``choose_threads(requested)`` to torch; returns torch's thread count.

    Without ``requested`` this acts once per process, so a later ``torch.set_num_threads`` by the
    caller (or an earlier ``--threads``) is not undone by constructing another ``LLM``.
    """
    global _configured
    import torch

    if requested is None and _configured:
        return torch.get_num_threads()
    n = choose_threads(requested)
    if n is not None:
        torch.set_num_threads(n)
    _configured = True
    return torch.get_num_threads()
