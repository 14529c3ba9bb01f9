"""``echo-compile generate``'s own flags (the engine's: engine_args.py) and the sampling
parameters they give."""

from __future__ import annotations

import argparse

from echo_compile.engine_args import add_engine_args, add_generation_config_arg
from echo_compile.vllm_flags import add_vllm_args

# NOTE: no torch here either: the flags are in every --help (cli_args.py says why).


def add_generate_args(p: argparse.ArgumentParser) -> None:
    """generate's flags: the engine's, the prompts, the sampling ones, the generation config's
    and vLLM's (those generate takes)."""
    add_engine_args(p)
    p.add_argument(
        "prompts", nargs="+", help="the prompts, one argument each (quote one that has spaces)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="tokens generated per prompt at most (default: %(default)s)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature, 0 is greedy (default: %(default)s)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample from the most likely tokens whose probabilities add up to this (default: the "
        "checkpoint's generation_config.json, see --generation-config, else 1.0: all tokens)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed: the same seed repeats the same tokens (default: a fresh random "
        "one per prompt)",
    )
    # (--temperature and --max-tokens always set theirs: greedy, 32 tokens by default)
    add_generation_config_arg(p, "top_p / top_k / min_p / repetition_penalty")
    add_vllm_args(p, serve=False)


def sampling_params(a: argparse.Namespace, defaults=None):
    """``generate``'s parameters: the flags' values over ``defaults`` (the engine's
    ``sampling_defaults``, the checkpoint's generation config; None: ``SamplingParams()``)."""
    import dataclasses

    from runtime.sampling_params import SamplingParams

    flags = {"max_tokens": a.max_tokens, "temperature": a.temperature, "seed": a.seed}
    if a.top_p is not None:
        flags["top_p"] = a.top_p
    return dataclasses.replace(defaults or SamplingParams(), **flags)
