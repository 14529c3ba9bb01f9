"""vLLM's ``vllm serve`` flags on ``echo-compile`` (echo_compile/vllm_flags.py): a launch line
copied from vLLM's DeepSeek-V3.2 recipe parses; aliases set our options, vLLM's parallel sizes are
translated, flags that say what the server does are no-ops named in one log line, and any other
value or a flag not honoured is a one-line error naming it, before any model loads."""

from __future__ import annotations

import logging

import pytest
import torch

from echo_compile import cli, cli_args, engine_args, serve_args
from echo_compile.vllm_flags import apply_vllm_flags

# vLLM's recipe for V3.2 (docs.vllm.ai, DeepSeek-V3_2), the model a directory here
RECIPE = ["--tensor-parallel-size", "8", "--tokenizer-mode", "deepseek_v32",
          "--tool-call-parser", "deepseek_v32", "--enable-auto-tool-choice",
          "--reasoning-parser", "deepseek_v3"]  # fmt: skip


@pytest.fixture(autouse=True)
def keep_process_settings():
    n = torch.get_num_threads()
    levels = {n: logging.getLogger(n).level for n in cli.LOGGED_PACKAGES}
    yield
    torch.set_num_threads(n)
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def parsed(*argv: str):
    a = cli_args.parser().parse_args(list(argv))
    apply_vllm_flags(a)
    return a


def test_the_v32_recipe_parses_and_is_logged(caplog):
    caplog.set_level(logging.INFO, logger="echo_compile")
    a = parsed("serve", "/models/DeepSeek-V3.2", *RECIPE)
    assert (a.model, a.dp, a.tp, a.ep) == ("/models/DeepSeek-V3.2", 1, 8, 1)
    lines = [r.getMessage() for r in caplog.records if r.name == "echo_compile.vllm_flags"]
    assert lines == [
        "vLLM's --tensor-parallel-size 8 runs as --dp 1 --tp 8 --ep 1",
        "vLLM flags taken as what this server does anyway: --tokenizer-mode deepseek_v32, "
        "--enable-auto-tool-choice, --tool-call-parser deepseek_v32, --reasoning-parser "
        "deepseek_v3",  # (in the table's order)
    ]


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_aliases_set_our_engine_options(cmd):
    base = [cmd] + (["x"] if cmd == "generate" else [])
    flags = ["--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--kv-cache-dtype",
             "fp8", "--trust-remote-code", "--enable-chunked-prefill"]  # fmt: skip
    opts = engine_args.engine_options(parsed(*base, *flags))
    assert (opts["max_batch"], opts["prefill_chunk"], opts["kv_format"]) == (64, 4096, "fp8")
    for value, ours in (("auto", "bf16"), ("bfloat16", "bf16"), ("fp8_ds_mla", "fp8")):
        a = parsed(*base, "--kv-format", "fp8" if ours == "bf16" else "bf16",
                   "--kv-cache-dtype", value)  # fmt: skip
        assert a.kv_format == ours


@pytest.mark.parametrize(
    "flags, ours",
    [
        (["--tensor-parallel-size", "8"], (1, 8, 1)),
        (["--tensor-parallel-size", "8", "--enable-expert-parallel"], (1, 1, 8)),
        (["--data-parallel-size", "8"], (8, 8, 1)),  # vLLM: experts TP over the dp ranks
        (["--data-parallel-size", "8", "--enable-expert-parallel"], (8, 1, 8)),
        (["--enable-expert-parallel"], (1, 1, 1)),
        (["--tensor-parallel-size", "1", "--data-parallel-size", "1"], (1, 1, 1)),
    ],
)
def test_vllm_parallel_sizes_are_translated(flags, ours):
    a = parsed("serve", *flags)
    assert (a.dp, a.tp, a.ep) == ours


def test_serve_takes_the_model_as_vllm_does():
    assert parsed("serve").model == "tiny"
    assert parsed("serve", "/m", "--port", "1").model == "/m"
    assert parsed("serve", "--port", "1", "/m").model == "/m"
    assert parsed("serve", "--model", "/a", "/b").model == "/b"  # the later, as a repeated flag


def _no_load(*a, **k):
    raise AssertionError("the model loaded before the flags were checked")


@pytest.mark.parametrize(
    "flags, parts",
    [
        (["--tool-call-parser", "hermes"], ["--tool-call-parser hermes", "deepseek_v32"]),
        (["--reasoning-parser", "deepseek_r1"], ["--reasoning-parser deepseek_r1", "deepseek_v3"]),
        (["--tokenizer-mode", "mistral"], ["--tokenizer-mode mistral", "deepseek_v32 / auto"]),
        (["--kv-cache-dtype", "fp8_e5m2"], ["--kv-cache-dtype must be one of", "fp8_e5m2"]),
        (["--chat-template", "t.jinja"], ["--chat-template is not supported", "DeepSeek-V3.2"]),
        (["--seed", "0"], ["--seed is not supported", "its own seed"]),
        (["--dtype", "float16"], ["--dtype float16", "auto / bfloat16", "bfloat16"]),
        (["--quantization", "gptq"], ["--quantization must be one of fp8, awq", "'gptq'"]),
        (["--block-size", "16"], ["--block-size 16", "only 64", "64 tokens"]),
        (["--no-enable-chunked-prefill"], ["--no-enable-chunked-prefill is not", "in chunks"]),
        (["--download-dir", "/d"], ["--download-dir is not supported", "local checkpoint"]),
        (["--load-format", "dummy"], ["--load-format dummy", "auto / safetensors"]),
        (["--tensor-parallel-size", "4", "--data-parallel-size", "2"], ["never by heads"]),
        (["--tp", "2", "--tensor-parallel-size", "2"], ["--tensor-parallel-size", "not both"]),
        # one setting in both spellings, two values (the vLLM one silently won once)
        (["--kv-format", "fp8", "--kv-cache-dtype", "auto"],
         ["--kv-cache-dtype auto and --kv-format fp8 say different things"]),
        (["--max-batch=8", "--max-num-seqs", "16"], ["--max-num-seqs 16 and --max-batch 8"]),
        # ours abbreviated, as argparse takes it (the vLLM one silently won over --max-ba 8)
        (["--max-ba", "8", "--max-num-seqs", "16"], ["--max-num-seqs 16 and --max-batch 8"]),
        (["--kv-f=fp8", "--kv-cache-dtype", "auto"], ["--kv-cache-dtype auto and --kv-format"]),
        (["--fp8-weights", "bf16", "--quantization", "fp8"],
         ["--quantization fp8 and --fp8-weights bf16 say different things"]),
    ],
)
def test_flags_not_honoured_are_one_line_before_the_model_loads(flags, parts, capsys, monkeypatch):
    monkeypatch.setattr("echo_compile.llm.LLM", _no_load)
    assert cli.main(["serve", "--device", "cpu", "--port", "0", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("echo-compile: error: "), lines
    for p in parts:
        assert p in lines[0], (p, lines[0])


def test_a_launch_line_with_vllms_model_flags_parses(caplog):
    caplog.set_level(logging.INFO, logger="echo_compile")
    flags = ["--dtype", "bfloat16", "--block-size", "64", "--load-format", "safetensors",
             "--quantization", "awq", "--max-model-len", "8192"]  # fmt: skip
    a = parsed("serve", "/m", *flags)
    assert (a.fp8_weights, a.max_model_len) == ("auto", 8192)
    lines = [r.getMessage() for r in caplog.records if r.name == "echo_compile.vllm_flags"]
    assert lines == [
        "vLLM flags taken as what this server does anyway: --dtype bfloat16, --quantization awq, "
        "--block-size 64, --load-format safetensors"
    ]
    # fp8: an FP8 checkpoint's weights kept FP8 (check_quantization refuses another checkpoint)
    for cmd in (["serve"], ["generate", "x"]):
        assert parsed(*cmd, "--quantization", "fp8", "--dtype", "auto").fp8_weights == "fp8"
    assert parsed("serve", "--fp8-weights", "fp8", "--quantization", "awq").fp8_weights == "fp8"


@pytest.mark.parametrize("cmd", [["serve"], ["generate", "x"]])
def test_vllms_prefix_caching_switches_are_ours(cmd):
    """vLLM's --enable-prefix-caching / --no-enable-prefix-caching are our own flags (not in the
    table), with vLLM's default: left out, LLM's default (on) stands."""
    from echo_compile.vllm_flags import VLLM_FLAGS

    assert not {"--enable-prefix-caching", "--no-enable-prefix-caching"} & set(VLLM_FLAGS)
    assert "enable_prefix_caching" not in engine_args.engine_options(parsed(*cmd, *RECIPE[:2]))
    for flag, on in (("--no-enable-prefix-caching", False), ("--enable-prefix-caching", True)):
        opts = engine_args.engine_options(parsed(*cmd, *RECIPE[:2], flag))
        assert opts["enable_prefix_caching"] is on


def test_block_size_is_the_kv_page():
    from custom_ops.kv_format import PAGE
    from echo_compile.vllm_flags import VLLM_FLAGS

    assert VLLM_FLAGS["--block-size"].values == (str(PAGE),)


def test_generate_takes_the_engines_flags_only():
    with pytest.raises(ValueError, match="--download-dir is not supported"):
        parsed("generate", "x", "--download-dir", "/d")
    with pytest.raises(SystemExit):  # a server's flag: argparse's usage error
        cli_args.parser().parse_args(["generate", "x", "--tool-call-parser", "deepseek_v32"])
    # generate's own --seed (its prompts' sampling seed), not vLLM's refused one
    assert parsed("generate", "x", "--seed", "3").seed == 3


def test_uvicorn_log_level_reaches_uvicorn(monkeypatch):
    """--uvicorn-log-level (vLLM's flag) through serve_options and serve to uvicorn's config."""
    from runtime import server, server_lifecycle

    seen = []

    class Server:  # uvicorn's server, not run
        def __init__(self, config, async_engine, grace_s):
            seen.append(config.log_level)

        def run(self, sockets):
            pass

    class Engine:
        def shutdown(self):
            pass

    monkeypatch.setattr(server_lifecycle, "DrainingServer", Server)
    monkeypatch.setattr(server, "build_app", lambda *a, **k: "app")
    monkeypatch.setattr(server, "startup_summary", lambda *a: "")
    for flags, level in (([], "info"), (["--uvicorn-log-level", "WARNING"], "warning")):
        server.serve(Engine(), "m", **serve_args.serve_options(parsed("serve", *flags)))
        assert seen.pop() == level


@pytest.mark.parametrize(
    "model, method, parts",
    [
        ("tiny", "awq", ["--quantization awq needs an AWQ checkpoint", "bf16", "drop the flag"]),
        ("tiny-fp8", "awq_marlin", ["awq_marlin", "'fp8'", "served FP8", "--fp8-weights bf16"]),
        ("tiny", "fp8", ["--quantization fp8 needs an FP8", "bf16", "at load; not here"]),
        ("tiny-awq", "fp8", ["--quantization fp8", "'awq'", "drop the flag"]),
    ],
)
@pytest.mark.parametrize("cmd", [["serve", "--port", "0"], ["generate", "x"]])
def test_quantization_must_match_the_checkpoint(cmd, model, method, parts, capsys, monkeypatch):
    """--quantization awq on a checkpoint that is not AWQ passed silently, fp8 on one that is
    not FP8 failed at load: one line naming the flag and the checkpoint's format, no load."""
    monkeypatch.setattr("echo_compile.llm.LLM", _no_load)
    argv = [*cmd, "--model", model, "--device", "cpu", "--quantization", method]
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("echo-compile: error: "), lines
    for p in parts:
        assert p in lines[0], (p, lines[0])


def test_quantization_of_the_checkpoints_own_format_is_taken():
    from echo_compile.vllm_flags import check_quantization

    for model, method in (("tiny-awq", "awq"), ("tiny-awq", "awq_marlin"), ("tiny-fp8", "fp8")):
        check_quantization(method, model)  # no error
    check_quantization(None, "tiny")


def test_one_setting_in_both_spellings_with_one_value_is_taken():
    argv = ["serve", "--max-batch", "16", "--max-num-seqs", "16", "--kv-format=fp8",
            "--kv-cache-dtype", "fp8"]  # fmt: skip
    a = cli_args.parser().parse_args(argv)
    apply_vllm_flags(a, argv)
    assert (a.max_batch, a.kv_format) == (16, "fp8")
    # --quantization fp8 beside --fp8-weights auto: both keep the FP8 checkpoint FP8
    argv = ["serve", "--quantization", "fp8", "--fp8-weights", "auto"]
    a = cli_args.parser().parse_args(argv)
    apply_vllm_flags(a, argv)
    assert a.fp8_weights == "fp8"
    # a value or positional that merely starts like one of ours is not it
    argv = ["serve", "--max-num-seqs", "16", "--", "--max-b"]
    a = cli_args.parser().parse_args(argv)
    apply_vllm_flags(a, argv)
    assert a.max_batch == 16
