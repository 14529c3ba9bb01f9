"""The ``echo-compile`` command as a user drives it: --help without torch, one-line user errors
(exit 2) and flags checked before any model loads."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from echo_compile import cli, cli_args, engine_args, threads

ROOT = Path(__file__).resolve().parents[1]

# Runs the console script's module as `python -m echo_compile.cli ARGS` does, then reports whether
# torch got imported and the exit code.
HELP_PROBE = """
import runpy, sys
sys.argv = ["echo-compile", *sys.argv[1:]]
try:
    runpy.run_module("echo_compile.cli", run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code
print("TORCH" if "torch" in sys.modules else "NO-TORCH", code)
"""


@pytest.fixture(autouse=True)
def keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc: int, err: str, *parts: str) -> None:
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("echo-compile: error: "), err
    for p in parts:
        assert p in lines[0], (p, lines[0])


@pytest.mark.parametrize(
    "args",
    [[], ["demo"], ["generate"], ["serve"], ["make-checkpoint"], ["plan"], ["bench"]],
    ids=lambda a: a[:1],
)
def test_help_does_not_import_torch(args):
    r = subprocess.run(
        [sys.executable, "-c", HELP_PROBE, *args, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    *usage, verdict = r.stdout.strip().splitlines()
    assert verdict == "NO-TORCH 0"
    assert usage[0].startswith(" ".join(["usage: echo-compile", *args]))


@pytest.mark.parametrize(
    "args, error",
    [
        (["generate"], "the following arguments are required: prompts"),
        (["bench", "--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
        (["bench", "--requests", "x"], "argument --requests: invalid int value: 'x'"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_usage_errors_do_not_import_torch(args, error):
    r = subprocess.run(
        [sys.executable, "-c", HELP_PROBE, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.stdout.strip() == "NO-TORCH 2", r.stderr
    assert error in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.parametrize("argv", [["bench", "--help"], ["--", "bench", "--help"]])
def test_bench_takes_its_own_flags(argv, capsys):
    # (`-- bench` was argparse's subcommand, which took no flags: a KeyError, then a usage error)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0 and "--gpu-pools" in capsys.readouterr().out


def test_the_package_names_still_import():
    import echo_compile
    from echo_compile import LLM, SamplingParams, compile, generate
    from echo_compile.compiled import compile as compile_fn
    from echo_compile.llm import LLM as LLMClass

    assert LLM is LLMClass and compile is compile_fn and callable(generate)
    assert SamplingParams(max_tokens=3).max_tokens == 3
    assert set(echo_compile.__all__) <= set(dir(echo_compile))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        echo_compile.nope  # noqa: B018


def test_bad_model_dir_is_one_line(capsys, tmp_path):
    rc, _, err = run_main(capsys, "generate", "--model", str(tmp_path / "nope"), "hi")
    assert_one_line_error(rc, err, "nope", "existing checkpoint directory")


def test_bad_kernel_backend_is_one_line(capsys):
    rc, _, err = run_main(capsys, "generate", "--device", "cpu", "--kernel-backend", "nope", "hi")
    assert_one_line_error(rc, err, "--kernel-backend", "'nope'")


def test_kernel_backend_default_is_one_constant():
    """Every default of kernel_backend (engine, cache, compile(), the bench) is DEFAULT_BACKEND."""
    import inspect

    from custom_ops.backends.select import DEFAULT_BACKEND
    from custom_ops.cache.config import CacheConfig
    from echo_compile.bench.harness import System
    from echo_compile.compiled import compile as ec_compile
    from runtime.engine_config import EngineConfig

    assert DEFAULT_BACKEND == "auto"
    assert EngineConfig().kernel_backend == DEFAULT_BACKEND
    cache = CacheConfig(num_layers=1, host_tokens=64, gpu_tokens=64, topk=8, fmt="bf16")
    assert cache.kernel_backend == DEFAULT_BACKEND
    for fn in (ec_compile, System.__init__):
        assert inspect.signature(fn).parameters["kernel_backend"].default == DEFAULT_BACKEND


def test_corrupt_config_json_is_one_line(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 512,')
    (tmp_path / "tokenizer.json").write_text("{}")
    rc, _, err = run_main(capsys, "generate", "--model", str(tmp_path), "--device", "cpu", "hi")
    assert_one_line_error(rc, err, str(tmp_path / "config.json"), "not valid JSON")


def test_corrupt_config_json_from_the_command_line(tmp_path):
    """The whole path a user sees: stderr is one line, the exit status 2, no traceback."""
    (tmp_path / "config.json").write_text("not json")
    env = dict(os.environ, ECHO_COMPILE_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "echo_compile.cli", "generate", "--model", str(tmp_path), "hi"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 2, r.stderr
    assert_one_line_error(r.returncode, r.stderr, f"{tmp_path / 'config.json'}: not valid JSON")


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """``python -m echo_compile.cli ARGV`` as a user runs it."""
    env = dict(os.environ, ECHO_COMPILE_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "echo_compile.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


# a value a flag refuses: the whole of stderr, as the user reads it
FLAG_ERRORS = {
    "reserve-gib": (
        ["plan", "--reserve-gib", "-1"],
        "--reserve-gib must be a finite number >= 0, got -1.0",
    ),
    "max-tokens": (
        ["generate", "--device", "cpu", "--max-tokens", "0", "hi"],
        "--max-tokens must be an integer >= 1, got 0",
    ),
    "experts-tiny": (
        ["make-checkpoint", "--out", "OUT", "--experts", "16"],
        "--experts 16: the bench preset's sizes (--preset bench); the tiny preset's are fixed",
    ),
    "experts-bench": (
        ["make-checkpoint", "--preset", "bench", "--out", "OUT", "--experts", "12"],
        "--experts must be a multiple of 8 and >= 16 in the bench preset, got 12",
    ),
    # (on the CPU the fractions size nothing, which is warned about: a bad one is refused alone)
    "host-memory-fraction": (
        ["generate", "--device", "cpu", "--host-memory-fraction", "2", "hi"],
        "--host-memory-fraction must be a number in (0, 1], got 2.0",
    ),
    "gpu-memory-utilization": (
        ["generate", "--device", "cpu", "--gpu-memory-utilization", "-1", "hi"],
        "--gpu-memory-utilization must be a number in (0, 1], got -1.0",
    ),
}


@pytest.mark.parametrize("case", list(FLAG_ERRORS))
def test_an_error_names_the_flag_and_its_rule(case, tmp_path):
    """One line naming the flag (not the Python option), its rule as the command line reads it
    and the value; exit 2, no traceback, no warning before it."""
    argv, line = FLAG_ERRORS[case]
    r = run_cli(*[str(tmp_path / "ck") if x == "OUT" else x for x in argv])
    assert (r.returncode, r.stderr) == (2, f"echo-compile: error: {line}\n")
    assert not (tmp_path / "ck").exists()  # (make-checkpoint: refused before it wrote)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
@pytest.mark.parametrize("cmd", [["generate", "hi"], ["demo"], ["serve"]], ids=lambda c: c[0])
def test_cuda_without_cuda_is_one_line(capsys, monkeypatch, cmd):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    # (demo's first: patched second, its first import took the patched LLM, kept after the test)
    monkeypatch.setattr("echo_compile.demo.LLM", no_load)
    monkeypatch.setattr("echo_compile.llm.LLM", no_load)
    rc, _, err = run_main(capsys, cmd[0], "--device", "cuda", *cmd[1:])
    assert_one_line_error(rc, err, "--device cuda: CUDA is not available")


def test_unwritable_out_is_one_line(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    rc, _, err = run_main(capsys, "make-checkpoint", "--out", str(blocker / "ck"))
    assert_one_line_error(rc, err, str(blocker))
    rc, _, err = run_main(capsys, "make-checkpoint", "--out", str(blocker))
    assert_one_line_error(rc, err, "exists and is not an empty directory")
    bench = ("make-checkpoint", "--preset", "bench", "--out", str(tmp_path / "ck"))
    rc, _, err = run_main(capsys, *bench, "--layers", "0")
    assert_one_line_error(rc, err, "--layers must be at least 1, got 0")  # (blamed config.json)


def test_make_checkpoint_expands_a_tilde_in_out(capsys, monkeypatch, tmp_path):
    """``--out=~/ck`` (the shell leaves a ``~`` after ``=`` as it is) writes into the home
    directory, not into a directory named ``~`` under the current one."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    rc, out, _ = run_main(capsys, "make-checkpoint", "--out=~/ck")
    assert rc == 0 and out.strip() == f"wrote {home / 'ck'}"
    assert (home / "ck" / "config.json").is_file() and not (cwd / "~").exists()


def test_a_bug_still_tracebacks(monkeypatch, tmp_path):
    def bug(*a, **k):
        raise RuntimeError("a real bug")

    monkeypatch.setattr("model.checkpoint.make_checkpoint", bug)
    with pytest.raises(RuntimeError, match="a real bug"):
        cli.main(["make-checkpoint", "--out", str(tmp_path / "ck")])


@pytest.mark.parametrize(
    "flags, param",
    [
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
    ],
)
def test_sampling_flags_are_checked_before_the_model_loads(capsys, monkeypatch, flags, param):
    def no_load(*a, **k):
        raise AssertionError("the model loaded before the flags were checked")

    monkeypatch.setattr("echo_compile.llm.LLM", no_load)
    rc, _, err = run_main(capsys, "generate", *flags, "hi")
    assert_one_line_error(rc, err, param)


@pytest.mark.parametrize(
    "flags, what",
    [
        (["--max-tokens", "0"], "--max-tokens"),
        (["--min-len", "500", "--max-len", "100"], "--min-len"),
        (["--requests", "0"], "--requests"),
    ],
)
def test_demo_flags_are_checked_before_the_models_load(capsys, monkeypatch, flags, what):
    def no_load(*a, **k):
        raise AssertionError("a model loaded before the flags were checked")

    monkeypatch.setattr("echo_compile.demo.LLM", no_load)
    rc, _, err = run_main(capsys, "demo", "--device", "cpu", *flags)
    assert_one_line_error(rc, err, what)


def test_demo_sizes_its_context_within_the_pool_it_sizes(capsys):
    """The demo's context is its longest request drawn, within the host pool of the requests'
    pages (it was --max-len + --max-tokens + 64, past the pool of one short request: a given
    context past a given pool is refused at start-up)."""
    flags = ["--requests", "1", "--min-len", "100", "--max-len", "300", "--max-tokens", "4"]
    rc, out, err = run_main(capsys, "demo", "--device", "cpu", *flags)
    assert rc == 0 and "(tokens and logprobs bit for bit vs GPU-only): PASS" in out, err


def test_bad_thread_counts_are_one_line(capsys, monkeypatch, tmp_path):
    out = str(tmp_path / "ck")
    rc, _, err = run_main(capsys, "make-checkpoint", "--threads", "0", "--out", out)
    assert_one_line_error(rc, err, "--threads must be a positive integer")
    monkeypatch.setenv("ECHO_COMPILE_THREADS", "many")
    monkeypatch.setattr(threads, "_configured", False)  # as in a fresh process
    rc, _, err = run_main(capsys, "make-checkpoint", "--out", out)
    assert_one_line_error(rc, err, "ECHO_COMPILE_THREADS must be a positive integer", "'many'")
    assert not (tmp_path / "ck").exists()


def test_threads_flag_sets_torch_threads(capsys, monkeypatch, tmp_path):
    seen = []

    def fake_make(out, **kw):
        seen.append(torch.get_num_threads())
        return Path(out)

    monkeypatch.setattr("model.checkpoint.make_checkpoint", fake_make)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)  # (a count above them is refused)
    n = 2 if torch.get_num_threads() == 1 else 1  # differs from the current count
    rc, out, _ = run_main(capsys, "make-checkpoint", "--threads", str(n), "--out", str(tmp_path))
    assert rc == 0 and seen == [n] and out.startswith("wrote ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_bench_on_cpu_refuses_the_full_size_model(capsys, monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("started building the model")

    monkeypatch.setattr("echo_compile.bench.cli.build_model", no_build)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--preset bench needs a CUDA device" in err and "--preset tiny" in err


def test_generate_takes_generation_config_none_past_a_bad_file(capsys, tmp_path):
    """generate reads the checkpoint's generation_config.json as serve does (its EOS ids), and
    takes --generation-config none, which the refusal of a bad file names, to get past it."""
    import json
    import shutil

    from model.checkpoint import resolve_model

    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model("tiny"), ckpt)
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    base = ["generate", "hi", "--model", str(ckpt), "--max-tokens", "2", "--no-compile",
            "--device", "cpu"]  # fmt: skip
    assert cli.main(base) == 2
    assert "--generation-config none" in capsys.readouterr().err
    assert cli.main(base + ["--generation-config", "none"]) == 0
    assert "(2 tokens)" in capsys.readouterr().out


def test_generate_takes_the_unset_fields_from_the_generation_config(monkeypatch, tmp_path):
    """The sampling fields generate's flags leave unset come from generation_config.json (its
    help says so), the flags' values over them; greedy and 32 tokens unless asked."""
    import json
    import shutil

    from echo_compile.llm import LLM
    from model.checkpoint import resolve_model
    from runtime.sampling_params import SamplingParams

    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model("tiny"), ckpt)
    gen = {"repetition_penalty": 1.5, "top_k": 5, "min_p": 0.1, "top_p": 0.9, "temperature": 0.7}
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    seen = []
    monkeypatch.setattr(
        LLM, "generate", lambda self, prompts, params, progress: seen.append(params) or []
    )
    base = ["generate", "hi", "--model", str(ckpt), "--no-compile", "--device", "cpu"]
    assert cli.main(base) == 0
    assert cli.main(base + ["--top-p", "0.5", "--temperature", "1", "--max-tokens", "3"]) == 0
    assert cli.main(base + ["--generation-config", "none"]) == 0
    file = dict(repetition_penalty=1.5, top_k=5, min_p=0.1)
    assert seen == [
        SamplingParams(max_tokens=32, temperature=0.0, top_p=0.9, **file),
        SamplingParams(max_tokens=3, temperature=1.0, top_p=0.5, **file),
        SamplingParams(max_tokens=32, temperature=0.0),
    ]


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_engine_flags_reach_the_engine_options(cmd):
    """Each scheduling and memory flag sets its EngineConfig field (defaults otherwise)."""
    parse = cli_args.parser().parse_args
    base = ["--model", "tiny"] + (["x"] if cmd == "generate" else [])
    keys = ("prefill_buffer", "decode_during_prefill", "async_scheduling")
    opts = engine_args.engine_options(parse([cmd, *base]))
    assert [opts[k] for k in keys] == [True, True, False]
    # prefix caching left out: LLM's default (on, as vLLM's), not EngineConfig's (off)
    assert "enable_prefix_caching" not in opts
    flags = ["--no-prefill-buffer", "--prefill-first", "--async-scheduling"]
    opts = engine_args.engine_options(parse([cmd, *base, *flags]))
    assert [opts[k] for k in keys] == [False, False, True]
    for flag, on in (("--enable-prefix-caching", True), ("--no-enable-prefix-caching", False)):
        assert engine_args.engine_options(parse([cmd, *base, flag]))["enable_prefix_caching"] is on


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_prefetch_flags_reach_the_engine_options(cmd):
    """--prefetch and its limits set EngineConfig's fields; left out, the engine's defaults
    stand (the options do not name them)."""
    parse = cli_args.parser().parse_args
    base = ["--model", "tiny"] + (["x"] if cmd == "generate" else [])
    keys = ("prefetch", "prefetch_cap", "prefetch_ratio", "prefetch_margin")
    assert not set(keys) & set(engine_args.engine_options(parse([cmd, *base])))
    flags = ["--prefetch", "global", "--prefetch-cap", "128", "--prefetch-ratio", "0.01",
             "--prefetch-margin", "0"]  # fmt: skip
    opts = engine_args.engine_options(parse([cmd, *base, *flags]))
    assert [opts[k] for k in keys] == ["global", 128, 0.01, 0.0]


def test_generate_with_prefetch_prints_the_text_without_it(capsys, monkeypatch):
    """Lossless from the command line: a GPU pool of two pages (the recall misses every step),
    prefetch on with a budget that stages rows (counted), the same greedy text as prefetch off."""
    from echo_compile.llm import LLM

    built = []
    init = LLM.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(LLM, "__init__", keep)
    base = ["generate", "a long prompt " * 40, "--max-tokens", "8", "--no-compile", "--device",
            "cpu", "--gpu-tokens", "128"]  # fmt: skip
    out = {}
    for flags in ([], ["--prefetch", "global", "--prefetch-ratio", "0.5"]):
        assert cli.main(base + flags) == 0
        out[bool(flags)] = capsys.readouterr().out
    assert out[True] == out[False] and "length (8 tokens)" in out[True]
    off, on = (llm.engine.metrics() for llm in built)
    assert built[1].engine.config.prefetch == "global" and sum(on["prefetched_per_step"]) > 0
    assert sum(off["prefetched_per_step"]) == 0 and max(on["prefetch_coverage"]) > 0


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_chunk_and_bucket_flags_reach_the_engine_options(cmd):
    parse = cli_args.parser().parse_args
    base = ["--model", "tiny"] + (["x"] if cmd == "generate" else [])
    opts = engine_args.engine_options(parse([cmd, *base]))
    assert "prefill_chunk" not in opts and "decode_buckets" not in opts  # EngineConfig's
    opts = engine_args.engine_options(parse([cmd, *base, "--prefill-chunk", "512",
                                      "--decode-buckets", "1,3,8"]))  # fmt: skip
    assert (opts["prefill_chunk"], opts["decode_buckets"]) == (512, (1, 3, 8))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--decode-buckets", "1,x"], "--decode-buckets must be comma-separated integers"),
        (["--decode-buckets", "2,1,8"], "--decode-buckets must be increasing and end at max_batch"),
        (["--prefill-chunk", "100"], "--prefill-chunk must be a multiple of 16"),
        (["--prefetch", "request", "--no-offload"], "prefetch='request' needs offloading"),
        (["--prefetch", "request", "--prefetch-cap", "0"], "--prefetch-cap must be a positive"),
        (["--prefetch", "request", "--prefetch-cap", "10000000"], "cap must be at most host_tok"),
        (["--prefetch", "global", "--prefetch-ratio", "-1"], "--prefetch-ratio must be in (0, 1]"),
        (["--prefetch", "global", "--prefetch-ratio", "inf"], "--prefetch-ratio must be in (0, 1]"),
        (["--prefetch-margin", "inf"], "--prefetch-margin must be a finite number >= 0"),
    ],
)
def test_generate_refuses_bad_engine_options_in_one_line(flags, message, capsys):
    assert cli.main(["generate", "hi", "--max-tokens", "1", "--no-compile", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("echo-compile: error:") and message in err and "\n" not in err


GEN = ["generate", "hi", "--device", "cpu", "--no-compile"]


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*GEN, "--max-batch", "0"], "--max-batch must be a positive integer, got 0"),
        ([*GEN, "--host-tokens", "100"], "--host-tokens must be a multiple of 64, got 100"),
        ([*GEN, "--collective-timeout", "-1"], "--collective-timeout must be a positive"),
        ([*GEN, "--kernel-backend", "foo"], "--kernel-backend must be one of auto,"),
        ([*GEN, "--max-tokens", "0"], "--max-tokens must be an integer >= 1"),
        (["demo", "--device", "cpu", "--max-tokens", "-1"], "--max-tokens must be an integer >= 1"),
        (["plan", "--max-batch", "-1"], "--max-batch must be a positive integer, got -1"),
        (["plan", "--gpus", "0"], "--gpus must be at least 1, got 0"),
    ],
)
def test_an_option_refused_by_the_engine_is_named_by_its_flag(argv, message, capsys):
    """A value the engine's configuration refuses is named by the flag that gave it, as the
    flags checked by the CLI itself are (it named the option's Python name, ``max_batch``; plan
    --gpus 0 named dp, which was not given)."""
    rc, _, err = run_main(capsys, *argv)
    assert_one_line_error(rc, err, message)


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*GEN, "--max-num-seqs", "0"], "--max-num-seqs must be a positive integer, got 0"),
        ([*GEN, "--max-num-batched-tokens", "100"], "--max-num-batched-tokens must be a multiple"),
        (["serve", "tiny", "--device", "cpu", "--max-num-seqs", "0"], "--max-num-seqs must be"),
    ],
)
def test_an_option_set_by_a_vllm_flag_is_named_by_that_flag(argv, message, capsys):
    """A value a vLLM flag gave one of our options (``--max-num-seqs``: ``max_batch``) is named
    by the vLLM flag when the engine refuses it: it named ``--max-batch``, which was not given."""
    rc, _, err = run_main(capsys, *argv)
    assert_one_line_error(rc, err, message)


def test_tp_without_torchrun_says_so_even_when_the_default_port_is_taken():
    """One process asked for tp=2 gets the "launch with torchrun" error, also while another job
    holds MASTER_PORT's default (29500): it joined its one-process group there and failed with
    EADDRINUSE before the world-size check."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            held.bind(("127.0.0.1", 29500))
            held.listen()
        except OSError:
            pass  # someone else holds it: the same situation
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "WORLD_SIZE")}
        r = subprocess.run(
            [sys.executable, "-m", "echo_compile.cli", "generate", "--tp", "2", "--device", "cpu",
             "--no-compile", "hi", "--max-tokens", "2"],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "need 2 processes, but this job has 1: launch with torchrun" in r.stderr
    assert "Traceback" not in r.stderr


def _no_load(*a, **k):
    raise AssertionError("the model loaded before the address was checked")


@pytest.mark.parametrize("host", ["127.0.0.1", "999.1.1.1"], ids=["port-in-use", "bad-host"])
def test_serve_checks_the_address_before_the_model_loads(capsys, monkeypatch, host):
    """A port in use or a host that cannot be bound: one line naming the address and the flags,
    exit 2, before the weights load (minutes on V3.2; uvicorn found it after them, exit 3)."""
    import socket

    monkeypatch.setattr("echo_compile.llm.LLM", _no_load)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = ["serve", "--device", "cpu", "--host", host, "--port", str(port)]
        rc, _, err = run_main(capsys, *argv)
    assert_one_line_error(rc, err, f"{host}:{port}", "--host / --port")


def test_ctrl_c_while_the_model_loads_is_one_line_and_frees_the_port(capsys, monkeypatch):
    """Ctrl-C before the server runs (loading, warm-up): one line and exit 130 (128 + SIGINT), not
    a screenful of KeyboardInterrupt traceback from wherever the load was; the port is free."""
    import socket

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr("echo_compile.llm.LLM", interrupted)
    rc, _, err = run_main(capsys, "serve", "--device", "cpu", "--port", str(port))
    assert rc == 130 and err == "echo-compile: interrupted\n", (rc, err)
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))


def test_token_counts_take_vllm_s_suffixes(capsys):
    """--max-model-len 100k, as vLLM takes it (k: 1000s, K: 1024s), and the pools' sizes alike:
    it was an argparse error, "invalid int value: '100k'"."""
    from echo_compile.cli_args import parser

    a = parser().parse_args(["serve", "--max-model-len", "100k", "--host-tokens", "128K",
                             "--gpu-tokens", "25.6k"])  # fmt: skip
    assert (a.max_model_len, a.host_tokens, a.gpu_tokens) == (100000, 131072, 25600)
    rc, out, _ = run_main(capsys, "plan", "--model", "tiny", "--gpus", "1", "--max-model-len",
                          "100k", "--host-tokens", "1M", "--gpu-tokens", "64k")  # fmt: skip
    assert rc == 0 and "--max-model-len 100000 " in out and "--host-tokens 1048576\n" in out, out
    for bad, why in (("10x", "invalid token count: '10x'"), ("1.5", "'1.5'"),
                     ("1.0001k", "is 1000.1, not whole"), ("infk", "'infk'")):  # fmt: skip
        with pytest.raises(SystemExit):
            parser().parse_args(["serve", "--max-model-len", bad])
        assert why in capsys.readouterr().err


def test_token_counts_with_decimals_are_exact():
    """A decimal with a suffix is counted exactly (in floats, 4.1 x 10**6 is 4099999.9999999995,
    and '4.1m' was refused as "not whole"); a count too large for an int64 is refused."""
    from echo_compile.engine_args import token_count

    got = [token_count(v) for v in ("4.1m", "8.2g", "25.6k", "1.5M", "1e3k", "0.3k")]
    assert got == [4100000, 8200000000, 25600, 1572864, 1000000, 300]
    for bad in ("1.0001k", "nank", "1e999999999k"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"invalid token count: '{bad}'"):
            token_count(bad)
