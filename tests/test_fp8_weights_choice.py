"""How an FP8 checkpoint's weights are served (``model.fp8_weights.resolve_fp8_weights``): kept
FP8 by default, as vLLM serves them, on the CPU and on CUDA; ``bf16`` the explicit opt-in to
dequantise at load; other checkpoints unaffected. Every reader of the choice (the KV sizing, the
memory check, the loader, the distributed build) gets the one resolved value."""

from __future__ import annotations

import inspect
import logging

import pytest

from echo_compile import cli_args
from model.checkpoint import resolve_model
from model.config import ModelConfig
from model.fp8_weights import FP8_WEIGHTS, resolve_fp8_weights


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_json(resolve_model(name) / "config.json")


def test_the_rule():
    fp8, bf16, awq = _config("tiny-fp8"), _config("tiny"), _config("tiny-awq")
    assert resolve_fp8_weights("auto", fp8) == "fp8"  # the default: kept FP8
    assert resolve_fp8_weights("fp8", fp8) == "fp8"
    assert resolve_fp8_weights("bf16", fp8) == "bf16"  # the opt-in: dequantised at load
    for other in (bf16, awq):  # nothing to choose: the default is not an error
        assert resolve_fp8_weights("auto", other) == "bf16"
        assert resolve_fp8_weights("bf16", other) == "bf16"
        with pytest.raises(
            ValueError,
            match=r"fp8_weights='fp8' needs an FP8 checkpoint; /x is "
            r"not one \(its config.json has no fp8 quantization",
        ):
            resolve_fp8_weights("fp8", other, "/x")
    with pytest.raises(
        ValueError,
        match=r"fp8_weights must be one of 'auto', 'bf16', 'fp8', "
        r"got 'int8'",
    ):
        resolve_fp8_weights("int8", fp8)


@pytest.mark.parametrize("cmd", [["generate", "x"], ["serve"], ["plan"]])
def test_the_flag_defaults_to_the_rule(cmd):
    parse = cli_args.parser().parse_args
    assert parse(cmd).fp8_weights == "auto"
    # (cli_args imports no torch, so it spells the choices: the rule's)
    for v in FP8_WEIGHTS:
        assert parse([*cmd, "--fp8-weights", v]).fp8_weights == v
    with pytest.raises(SystemExit):
        parse([*cmd, "--fp8-weights", "int8"])


class Loaded(Exception):
    """The load was reached (the test stops there)."""


def _spy(monkeypatch, module, name, seen, stop=False):
    """Record the ``fp8_weights`` each call of ``module.name`` gets (its default if none)."""
    real = getattr(module, name)
    sig = inspect.signature(real)

    def spy(*a, **k):
        bound = sig.bind(*a, **k)
        bound.apply_defaults()
        seen.append((name, bound.arguments["fp8_weights"]))
        if stop:
            raise Loaded(name)
        return real(*a, **k)

    monkeypatch.setattr(module, name, spy)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    ("name", "option", "want", "log"),
    [
        ("tiny-fp8", {}, "fp8", "FP8 checkpoint: weights kept FP8 (--fp8-weights bf16 "),
        ("tiny-fp8", {"fp8_weights": "bf16"}, "bf16", "weights dequantised to bf16 at load"),
        ("tiny-fp8", {"fp8_weights": "fp8"}, "fp8", "FP8 checkpoint: weights kept FP8"),
        ("tiny", {}, "bf16", None),
        ("tiny-awq", {}, "bf16", None),
    ],
)
@pytest.mark.parametrize("dp", [1, 2])
def test_llm_resolves_the_choice_once_for_every_reader(
    monkeypatch, caplog, device, name, option, want, log, dp
):
    """LLM's default on the CPU and on a (pretended) GPU: an FP8 checkpoint kept FP8, and the
    sizing, the memory check and the load (one process's or a dp rank's) all get that value,
    named in one start-up line; other checkpoints load as they are, with no line."""
    import echo_compile.startup
    import model.fp8_choice
    import model.loader
    from echo_compile.llm import LLM
    from runtime.distributed import dist_engine, plan

    if device == "cuda":  # a GPU, pretended: 139.8 GiB free, 1000 GiB of host
        monkeypatch.setattr(echo_compile.startup, "check_device", lambda *a, **k: None)
        monkeypatch.setattr(plan, "device_memory_gib", lambda d: (139.8, 1000.0))
        monkeypatch.setattr(plan, "gpu_total_bytes", lambda d: int(139.8 * 2**30))
    seen: list[tuple[str, str]] = []
    for reader in ("weight_bytes", "check_fits"):
        _spy(monkeypatch, plan, reader, seen)
    _spy(monkeypatch, model.loader, "load_model", seen, stop=True)
    _spy(monkeypatch, dist_engine, "build_distributed_engine", seen, stop=True)
    caplog.set_level(logging.INFO, logger="echo_compile.llm")
    with pytest.raises(Loaded, match="build_distributed_engine" if dp > 1 else "load_model"):
        LLM(name, device=device, dp=dp, compile=False, progress=False, **option)
    readers = {n for n, _ in seen}
    if device == "cuda":
        assert {"weight_bytes", "check_fits"} <= readers, seen
    else:
        assert readers.isdisjoint({"weight_bytes", "check_fits"}), seen
    # (the load gets the choice made, FP8Choice: the modules kept FP8 with the value)
    served = [v.weights if isinstance(v, model.fp8_choice.FP8Choice) else v for _, v in seen]
    assert seen and all(v == want for v in served), seen
    lines = [r.getMessage() for r in caplog.records if "FP8 checkpoint" in r.getMessage()]
    assert (lines == []) if log is None else (len(lines) == 1 and log in lines[0]), lines


def test_fp8_on_a_checkpoint_that_is_not_fp8_is_refused_before_loading(monkeypatch):
    import model.loader
    from echo_compile.llm import LLM

    seen: list = []
    _spy(monkeypatch, model.loader, "load_model", seen, stop=True)
    for name in ("tiny", "tiny-awq"):
        with pytest.raises(
            ValueError,
            match=rf"fp8_weights='fp8' needs an FP8 checkpoint; "
            rf".*{name}.* is not one",
        ):
            LLM(name, device="cpu", fp8_weights="fp8", compile=False, progress=False)
    assert seen == []
