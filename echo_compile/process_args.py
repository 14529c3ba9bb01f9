"""The process's flags, which every ``echo-compile`` command but bench (its own parser) takes:
``--threads`` and ``--log-level``, and the log level they give."""

from __future__ import annotations

import argparse

# NOTE: no torch here either: the flags are in every --help (cli_args.py says why).

LOG_LEVEL_ENV = "ECHO_COMPILE_LOGGING_LEVEL"
VLLM_LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"  # vLLM's, read after ours, as the API key is
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch, at most the usable cores (default: $ECHO_COMPILE_THREADS, "
        "else $OMP_NUM_THREADS, else 1 on up to 2 usable cores and half the cores above; see "
        "echo_compile/threads.py)",
    )


def _log_level_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=None,
        help=f"level of echo-compile's own log lines on stderr (default: ${LOG_LEVEL_ENV}, else "
        f"${VLLM_LOG_LEVEL_ENV}, else info); other libraries' stay at warning",
    )


def add_process_args(p: argparse.ArgumentParser) -> None:
    """The process's settings, which every command but bench (its own parser) takes."""
    _threads_arg(p)
    _log_level_arg(p)


def log_level(a: argparse.Namespace) -> str:
    """The ``--log-level`` flag, else the environment's level, else ``"info"`` (checked: a bad
    value in the environment is a ValueError naming the variable)."""
    import os

    if getattr(a, "log_level", None) is not None:
        return a.log_level
    for env in (LOG_LEVEL_ENV, VLLM_LOG_LEVEL_ENV):
        value = os.environ.get(env)
        if value:
            if value.lower() not in LOG_LEVELS:
                raise ValueError(f"${env} must be one of {', '.join(LOG_LEVELS)}, got {value!r}")
            return value.lower()
    return "info"
