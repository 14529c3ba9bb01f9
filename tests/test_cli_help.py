"""Every option of every ``echo-compile`` subcommand (the bench's own parser too) says in its
--help what it does and, unless it is a switch, its default."""

import argparse

import pytest

from echo_compile import cli_args
from echo_compile.bench import flags as bench_flags


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    ap = cli_args.parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    # (`bench` there is a placeholder: the bench's flags are its own parser's)
    return {**sub.choices, "bench": bench_flags.parser()}


SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction)


@pytest.mark.parametrize("name", list(_subcommands()))
def test_every_option_has_help_with_its_default(name):
    p = _subcommands()[name]
    p.format_help()  # a stray % in a help string fails here, as `--help` would
    for action in p._actions:
        flag = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS and action.help.strip(), (
            f"{name} {flag}: no help"
        )
        # a valued option the user may leave out says what it is then (vLLM's flags: ours)
        optional_value = action.option_strings and not action.required
        if optional_value and not isinstance(action, SWITCHES):
            if not action.dest.startswith("vllm_"):
                assert "default" in action.help, f"{name} {flag}: help names no default"


def test_every_subcommand_has_help():
    ap = cli_args.parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    assert {c.dest for c in sub._choices_actions} == set(sub.choices)
    assert all(c.help for c in sub._choices_actions)


def test_the_bench_flags_spell_the_engines_defaults():
    """bench/flags.py imports no torch, so it spells the defaults of modules that do: theirs."""
    from custom_ops.backends import select
    from custom_ops.cache.config import PREFETCH_MARGIN
    from echo_compile.bench.harness import SYSTEMS
    from model.locality import BENCH_LOCALITY

    ap = bench_flags.parser()
    kernel_backend = next(a for a in ap._actions if a.dest == "kernel_backend")
    assert kernel_backend.choices == select.BACKENDS
    assert ap.get_default("kernel_backend") == select.DEFAULT_BACKEND
    assert ap.get_default("prefetch_margin") == PREFETCH_MARGIN
    assert ap.get_default("locality") == BENCH_LOCALITY
    assert ap.get_default("systems") == ",".join(SYSTEMS)
