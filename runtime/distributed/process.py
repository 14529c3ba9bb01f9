"""The process model: one process per GPU (or per CPU worker under gloo), launched by torchrun
(its RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT environment) or by ``spawn``.

NCCL on CUDA, gloo on CPU. Every collective runs under the group's timeout, so a rank that died
or hangs makes the others fail with ``RankFailure`` (a clear message) instead of waiting forever.
Control messages (request placement, the step agreement, outputs) go over a gloo group in both
cases: they are small Python objects and must not enter a CUDA graph.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from runtime.distributed.failure_note import clear_note, job_store, read_note

DEFAULT_TIMEOUT_S = 300.0  # model loading on a real checkpoint takes minutes: keep it generous


class RankFailure(RuntimeError):
    """Another rank failed, exited or stopped answering: this rank stops serving too."""


@dataclass(frozen=True)
class DistContext:
    """What one rank knows about the job (passed in; nothing process-wide is read later)."""

    rank: int
    world_size: int
    local_rank: int
    device: str  # "cuda:<local_rank>" or "cpu"
    backend: str  # "nccl" | "gloo"
    group_name: str  # the default group's name (the functional collectives' key)
    cpu_group: Any  # gloo ProcessGroup for control messages (the default group under gloo)
    timeout_s: float
    # the job's key-value store (failure_note: a failing rank's error for the others); None: none
    store: Any = None


def env_int(name: str, default: int) -> int:
    """The torchrun variable ``name`` as an integer (``default`` when unset); a value that is
    not one is a ``ValueError`` naming the variable and its value."""
    v = os.environ.get(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from e


def init_distributed(
    device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None
) -> DistContext:
    """Join (or create) the default process group from the torchrun environment.

    ``device`` None: ``cuda:<LOCAL_RANK>`` when CUDA is available, else cpu; ``backend`` None:
    nccl for CUDA, gloo for CPU. NOTE: a group that already exists keeps the timeout it was
    created with; ``timeout_s`` then only names it in error messages."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    local = env_int("LOCAL_RANK", rank)
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world})")
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    is_cuda = device.startswith("cuda")
    backend = backend or ("nccl" if is_cuda else "gloo")
    if is_cuda:
        torch.cuda.set_device(torch.device(device))
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        # one process alone (not under torchrun): a port of its own, so a job holding the default
        # one cannot hide the world-size error its caller gives next behind EADDRINUSE
        os.environ.setdefault("MASTER_PORT", "29500" if world > 1 else str(free_port()))
        kw = {"device_id": torch.device(device)} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
        if rank == 0:  # (a new job: an earlier job's failure note in the same store is not ours)
            clear_note(job_store())
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return DistContext(
        rank,
        world,
        local,
        device,
        backend,
        dist.group.WORLD.group_name,
        cpu_group if cpu_group is not None else dist.group.WORLD,
        timeout_s,
        job_store(),
    )


# What a collective's transport says when a peer is gone or silent (gloo raises plain
# RuntimeErrors naming itself; NCCL's are DistBackendErrors, also matched by type)
_TRANSPORT = ("gloo", "nccl", "c10d", "connection closed", "connection reset", "timed out")


def is_collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing (a peer gone or silent), not this rank's own error
    (out of memory, a bug) met in code that also runs collectives."""
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(t in text for t in _TRANSPORT)


@contextmanager
def guarded(ctx: DistContext, what: str, only_collectives: bool = False) -> Iterator[None]:
    """Turn a collective's failure (peer gone, timeout) into one ``RankFailure`` that says so,
    naming the failing rank's own error when it left one (``failure_note``: ``rank <r>:
    <ExceptionType>: <message>``).
    ``only_collectives``: around code that does more than communicate (the model step), any other
    error passes unchanged (this rank's own, blamed on nobody else)."""
    try:
        yield
    except RankFailure:
        raise
    except (RuntimeError, dist.DistError) as e:
        if only_collectives and not is_collective_failure(e):
            raise
        note = read_note(ctx)
        if note is not None:  # the rank that failed left its error: name it, not the transport
            where, text = note
            here = f"rank {ctx.rank}/{ctx.world_size}"
            raise RankFailure(f"{text} (raised in {where}; {here} stops: {what} failed)") from e
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RankFailure(
            f"rank {ctx.rank}/{ctx.world_size}: {what} failed (timeout {ctx.timeout_s:g} s): "
            f"another rank failed, exited or stopped answering; stopping. Cause: {first[:300]}"
        ) from e


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def ended_on_error(joined: bool) -> Iterator[None]:
    """Around a rank's start-up after it joined the process group (``joined``: the group is its
    own, created by that join; a caller's group is the caller's to end): an error destroys the
    group (``shutdown``) before it propagates, so the rank does not exit with the group up, left
    to the interpreter's finalization (where gloo's teardown aborted a rank now and then), and
    the other ranks' next collective fails at once."""
    try:
        yield
    except BaseException:
        if joined:
            shutdown()
        raise


def finish() -> None:
    """The clean end of a multi-process job: wait for every rank, then destroy the group. A rank
    that tears gloo down while a peer still uses its connections can abort the peer ("terminate
    called without an active exception", SIGABRT at exit: the 2-rank server test, about half the
    runs without the barrier). Not for a failure: there ``shutdown`` alone makes the others' next
    collective fail at once."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    fn(rank, *args)
    # objects in reference cycles that hold the process group (an engine and a closure over it)
    # are freed here, not by the interpreter's exit, where the group's destructor aborted the
    # process ("terminate called without an active exception") in a few runs in ten under load
    gc.collect()


def spawn(fn: Callable, world_size: int, *args: Any, join: bool = True):
    """Run ``fn(rank, *args)`` in ``world_size`` fresh processes with the torchrun environment set
    (``fn`` must be importable: a module-level function). ``join=False`` returns the context."""
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return mp.start_processes(
        _child,
        (world_size, free_port(), fn, args),
        nprocs=world_size,
        join=join,
        start_method="spawn",
    )
