"""Usage checks of ``echo-compile bench``'s options, before any model is built: the device, the
workload's sizes, the model's index top-k a pool must hold, the dp/tp/ep ranks (cli.py's ``main``
checks the systems, formats, pools and rates with them)."""

from __future__ import annotations

import argparse

import torch

from echo_compile.bench.workload import sharegpt_like
from echo_compile.devices import check_device


def number_list(ap: argparse.ArgumentParser, flag: str, s: str, kind: type) -> list:
    """A comma-separated list of ``kind``; a bad item is a usage error naming ``flag``."""
    try:
        return [kind(x) for x in s.split(",") if x]
    except ValueError:
        ap.error(f"{flag}: {s!r} is not a comma-separated list of {kind.__name__}s")


def check_sizes(a: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """The device, the workload's sizes and the model options, as usage errors."""
    try:
        torch.device(a.device)
    except RuntimeError as e:
        ap.error(f"--device {a.device!r}: {e}")
    try:
        check_device(a.device)
    except ValueError as e:
        ap.error(str(e))
    for flag in ("max_batch", "output_len", "min_ctx"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(a, flag)}")
    if a.max_ctx < a.min_ctx:
        ap.error(f"--max-ctx {a.max_ctx} is below --min-ctx {a.min_ctx}")
    if a.breakdown_steps < 0:  # (it meant no breakdown, as 0 says)
        ap.error(f"--breakdown-steps must be at least 0, got {a.breakdown_steps}")
    for flag in ("eager_prefill", "prefill_first"):  # (ignored by decode-only runs)
        if getattr(a, flag) and a.mode != "full":
            ap.error(f"--{flag.replace('_', '-')} applies to --mode full only")
    given = [f for f in ("min_ctx", "max_ctx", "output_len") if getattr(a, f) != ap.get_default(f)]
    if a.workload == "sharegpt" and given:
        own = sharegpt_like(1)
        ap.error(
            f"--workload sharegpt has its own lengths ({own.min_ctx}-{own.max_ctx} prompt tokens, "
            f"{own.output_len} generated): "
            + ", ".join(f"--{f.replace('_', '-')}" for f in given)
            + " would be ignored"
        )
    if a.preset == "tiny" and (a.layers, a.experts) != (
        ap.get_default("layers"),
        ap.get_default("experts"),
    ):
        ap.error("--layers / --experts size the bench preset; --preset tiny is fixed")


def index_topk(a: argparse.Namespace) -> int:
    """The index top-k of the model ``build_model`` builds for these options (its config only)."""
    from model.presets import preset_config

    if a.preset == "tiny":
        return preset_config("tiny").index_topk
    return preset_config("bench", num_layers=a.layers, n_experts=a.experts).index_topk


def parallel_config(a: argparse.Namespace, ap: argparse.ArgumentParser):
    """The dp/tp/ep options checked (an ``EngineConfig`` holding them), or None for one
    process."""
    from runtime.engine_config import EngineConfig

    if (a.dp, a.tp, a.ep) == (1, 1, 1):  # (0 or less: EngineConfig's error below)
        return None
    try:
        return EngineConfig(
            dp=a.dp,
            tp=a.tp,
            ep=a.ep,
            collective_timeout_s=a.collective_timeout,
            async_scheduling="on" in a.async_scheduling.split(","),
        )
    except ValueError as e:
        ap.error(str(e))
