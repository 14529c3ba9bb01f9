"""The ``echo-compile`` command line's parser: its subcommands, demo's and make-checkpoint's
flags; the other commands' flags and the options they give are in their own modules (engine_args,
serve_args, generate_args, plan_args, process_args; cli.py runs the commands, bench has its own
parser in bench/flags.py)."""

from __future__ import annotations

import argparse

from echo_compile.engine_args import DEVICE_HELP, KV_FORMAT_HELP, KV_FORMATS, MODEL_HELP
from echo_compile.generate_args import add_generate_args
from echo_compile.plan_args import add_plan_args
from echo_compile.process_args import add_process_args
from echo_compile.serve_args import add_serve_args

# NOTE: nothing here (nor in the flag modules above) imports torch at module level:
# `echo-compile --help` (and a subcommand's --help) must answer without the seconds torch takes
# to import.
# Every option's help says what it does and, unless it is a switch, its default, as
# "(default: %(default)s)" where argparse holds it, in words where it is chosen later (the bench's
# parser too; tests/test_cli_help.py walks them all).

DESCRIPTION = "The echo-compile command: demo, generate, serve, make-checkpoint, plan, bench."


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="echo-compile", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser(
        "demo", help="offloaded long-context decode on the tiny model, lossless check"
    )
    _demo_args(d)

    g = sub.add_parser("generate", help="generate text for prompts given as arguments")
    add_generate_args(g)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(s)

    m = sub.add_parser("make-checkpoint", help="write a random DeepSeek-V3.2 HF checkpoint")
    _make_checkpoint_args(m)

    pl = sub.add_parser("plan", help="per-GPU memory plan of a dp/tp deployment of V3.2")
    add_plan_args(pl)

    sub.add_parser("bench", help="end-to-end offloading vs GPU-only benchmark (see bench --help)")
    return ap


def valued_flags(ap: argparse.ArgumentParser, cmd: str) -> dict[str, str]:
    """The options of subcommand ``cmd`` that take a value, as their flag by their option name
    (``max_batch``: ``--max-batch``), for errors that name the option (``cli._user_error``)."""
    sub = next(x for x in ap._actions if isinstance(x, argparse._SubParsersAction))
    acts = sub.choices[cmd]._actions
    return {x.dest: x.option_strings[0] for x in acts if x.option_strings and x.nargs != 0}


def _demo_args(p: argparse.ArgumentParser) -> None:
    """demo's flags: the tiny model's random prompts and how they run."""
    p.add_argument("--model", default="tiny", help=MODEL_HELP)
    p.add_argument(
        "--requests",
        type=int,
        default=4,
        help="requests of random prompts, decoded as one batch (default: %(default)s)",
    )
    p.add_argument(
        "--min-len", type=int, default=200, help="shortest prompt in tokens (default: %(default)s)"
    )
    p.add_argument(
        "--max-len", type=int, default=400, help="longest prompt in tokens (default: %(default)s)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="tokens each request generates (default: %(default)s)",
    )
    p.add_argument("--kv-format", choices=KV_FORMATS, default="bf16", help=KV_FORMAT_HELP)
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--compile", action="store_true", help="compile the steps (CUDA graphs on CUDA)")
    add_process_args(p)


def _make_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """make-checkpoint's flags: the preset, its sizes, the format and where to write it."""
    p.add_argument(
        "--preset",
        choices=("tiny", "bench"),
        default="tiny",
        help="tiny: the small CPU model of the tests; bench: V3.2's attention, indexer and vocab "
        "sizes with --layers layers and --experts experts (default: %(default)s)",
    )
    p.add_argument("--out", required=True, help="the new or empty directory to write (required)")
    q = p.add_mutually_exclusive_group()
    q.add_argument("--fp8", action="store_true", help="official FP8 format (weight_scale_inv)")
    q.add_argument("--awq", action="store_true", help="AutoAWQ 4-bit gemm format")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random weights: the same seed writes the same files (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="bench preset: number of layers (default: 4)"
    )
    p.add_argument(
        "--experts",
        type=int,
        default=None,
        help="bench preset: routed experts, a multiple of 8, at least 16 (default: 16)",
    )
    add_process_args(p)
