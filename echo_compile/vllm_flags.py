"""vLLM's ``vllm serve`` flags that ``echo-compile`` takes, so a launch line copied from vLLM runs
here: one table of each flag and what it is here (docs/server.md, "vLLM's flags").

Four kinds: vLLM's name for one of our flags (its values mapped to ours, or to a no-op);
vLLM's parallel sizes, translated together (vLLM splits the model its way, flag by flag not
ours); a flag that says what this server always does (accepted for the values that say so, a
no-op named in one log line at start-up, any other value an error); a flag (or switch) this
engine cannot honour (an error saying what to use instead). vLLM's ``vllm serve MODEL``
positional is serve's ``MODEL`` (serve_args.py)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# NOTE: no torch here either: the flags are in every --help (cli_args.py says why).

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alias:
    """vLLM's name for our flag ``ours``; ``values``: vLLM's values as ours (None: the same); a
    value mapped to None leaves ours as it is, a no-op logged as one, for the reason ``noop``;
    ``agrees``: per value of ours, other values of ours that say the same (given beside it, no
    conflict)."""

    ours: str
    type: Callable = str
    values: dict[str, str | None] | None = None
    noop: str = ""
    agrees: dict[str, tuple[str, ...]] | None = None
    switch = False


@dataclass(frozen=True)
class Parallel:
    """One of vLLM's parallel settings; ``parallel_split`` translates them together."""

    switch: bool = False
    type = int


@dataclass(frozen=True)
class Always:
    """A flag that says what this server always does; ``values``: those that say so (none: a
    switch)."""

    what: str
    values: tuple[str, ...] = ()
    type = str

    @property
    def switch(self) -> bool:
        return not self.values


@dataclass(frozen=True)
class Refused:
    """A flag (with a value, or a ``switch``) this engine cannot honour; ``instead``: what to
    use."""

    instead: str
    switch: bool = False
    type = str


KV_DTYPES = {
    "auto": "bf16",
    "bfloat16": "bf16",
    "fp8": "fp8",
    "fp8_e4m3": "fp8",
    "fp8_ds_mla": "fp8",
}
# vLLM's --quantization: fp8 serves an FP8 checkpoint's weights as FP8 (vLLM's does, and would
# quantise a bf16 one), as --fp8-weights' default already does; AWQ is read from the config.
# Each needs a checkpoint of its format (config.json's quantization_config.quant_method):
# check_quantization, before the load.
QUANTIZATIONS: dict[str, str | None] = {"fp8": "fp8", "awq": None, "awq_marlin": None}
QUANT_FORMATS = {"fp8": "fp8", "awq": "awq", "awq_marlin": "awq"}

VLLM_FLAGS: dict[str, Alias | Parallel | Always | Refused] = {
    "--max-num-seqs": Alias("--max-batch", int),  # the cap on running requests
    "--max-num-batched-tokens": Alias("--prefill-chunk", int),  # a prefill step's prompt tokens
    # (fp8: FlashMLA's 656-byte row, vLLM's fp8_ds_mla, which its fp8 is for V3.2)
    "--kv-cache-dtype": Alias("--kv-format", values=KV_DTYPES),
    "--tensor-parallel-size": Parallel(),
    "--data-parallel-size": Parallel(),
    "--enable-expert-parallel": Parallel(switch=True),
    "--trust-remote-code": Always("no checkpoint code runs here"),
    "--enable-chunked-prefill": Always("long prompts are always prefilled in chunks"),
    "--tokenizer-mode": Always(
        "prompts use DeepSeek-V3.2's own encoding", ("deepseek_v32", "auto")
    ),
    "--enable-auto-tool-choice": Always("tool_choice auto is always served"),
    "--tool-call-parser": Always(
        "tool calls are parsed from DeepSeek-V3.2's DSML", ("deepseek_v32",)
    ),
    "--reasoning-parser": Always(
        "thinking-mode replies are split as vLLM's deepseek_v3 splits them (deepseek_r1 would "
        "make a reply without thinking all reasoning)",
        ("deepseek_v3",),
    ),
    "--disable-log-requests": Always("requests are not logged"),
    "--disable-log-stats": Always("no stats are logged (GET /metrics has them)"),
    "--dtype": Always(
        "the model computes in bfloat16 (FP8 / AWQ weights as the checkpoint and --fp8-weights "
        "say)",
        ("auto", "bfloat16"),
    ),
    "--quantization": Alias(
        "--fp8-weights",
        values=QUANTIZATIONS,
        noop="an AWQ checkpoint is read as AWQ from its config.json (checked to be AWQ)",
        agrees={"fp8": ("auto",)},  # auto keeps the FP8 checkpoint --quantization fp8 checks
    ),
    # NOTE: 64 is custom_ops.kv_format.PAGE (not imported: it imports torch); a test ties them
    "--block-size": Always("the KV cache's page is 64 tokens, FlashMLA's (fixed)", ("64",)),
    "--load-format": Always(
        "weights are read from the checkpoint's safetensors shards", ("auto", "safetensors")
    ),
    # (--gpu-memory-utilization is ours too, the same knob: engine_args.py; so are
    # --enable-prefix-caching and --no-enable-prefix-caching, on by default as vLLM's)
    "--chat-template": Refused(
        "the chat template is DeepSeek-V3.2's encoding (runtime/chat_template.py); no other "
        "template is read"
    ),
    "--no-enable-chunked-prefill": Refused(
        "long prompts are always prefilled in chunks of --prefill-chunk tokens (vLLM's "
        "--max-num-batched-tokens); drop the flag",
        switch=True,
    ),
    "--download-dir": Refused(
        "nothing is downloaded: MODEL is a local checkpoint directory; drop the flag"
    ),
    "--seed": Refused(
        "a request without a seed draws a fresh random one here (runtime/sampler.request_seed), "
        "so no server-wide seed makes it repeat; give a request its own seed (it then "
        "reproduces exactly, whatever else is batched) and drop the flag"
    ),
}
# the flags only `serve` takes (the others are the engine's: `generate` takes them too;
# generate's own --seed is its prompts' sampling seed)
SERVER_ONLY = frozenset(
    ("--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser",
     "--disable-log-requests", "--disable-log-stats", "--chat-template", "--seed")
)  # fmt: skip


def _dest(flag: str) -> str:
    return "vllm_" + flag[2:].replace("-", "_")


def _spelled(flag: str, value: object) -> str:
    return flag if value is True else f"{flag} {value}"


def _help(kind: Alias | Parallel | Always | Refused) -> str:
    if isinstance(kind, Alias):
        if kind.values is None:
            return f"vLLM's name for {kind.ours}"
        ours = {o: [v for v in kind.values if kind.values[v] == o] for o in kind.values.values()}
        pairs = [f"{' / '.join(vs)} = {o}" for o, vs in ours.items() if o is not None]
        if None in ours:
            pairs.append(f"{' / '.join(ours[None])}: a no-op, {kind.noop}")
        return f"vLLM's name for {kind.ours} ({'; '.join(pairs)})"
    if isinstance(kind, Parallel):
        return 'translated to --dp / --tp / --ep (docs/server.md, "vLLM\'s flags")'
    if isinstance(kind, Always):
        return f"accepted{' as ' + ' / '.join(kind.values) if kind.values else ''}: {kind.what}"
    return f"refused: {kind.instead}"


def _metavar(kind: Alias | Parallel | Always | Refused) -> str:
    values = getattr(kind, "values", None)
    return "{" + ",".join(values) + "}" if values else "N" if kind.type is int else "VALUE"


def add_vllm_args(p: argparse.ArgumentParser, serve: bool) -> None:
    """vLLM's flags of ``VLLM_FLAGS`` on ``p`` (``serve``: the server's too)."""
    g = p.add_argument_group("vLLM's flags (docs/server.md)")
    for flag, kind in VLLM_FLAGS.items():
        if flag in SERVER_ONLY and not serve:
            continue
        if kind.switch:
            g.add_argument(flag, dest=_dest(flag), action="store_true", default=None,
                           help=_help(kind))  # fmt: skip
        else:
            g.add_argument(flag, dest=_dest(flag), type=kind.type, default=None,
                           metavar=_metavar(kind), help=_help(kind))  # fmt: skip


def parallel_split(tp: int | None, dp: int | None, ep: bool) -> dict[str, int]:
    """vLLM's ``--tensor-parallel-size tp --data-parallel-size dp [--enable-expert-parallel]`` as
    our ``dp`` / ``tp`` / ``ep``. vLLM splits the routed experts over all dp x tp ranks (by
    expert with EP), attention by data with dp, by heads with tp; attention is never split by
    heads here (MLA's one latent row is every head's: vLLM's tp keeps the whole KV cache on each
    rank too), so its tp is ours, every rank running the same batch, and both at once is
    refused."""
    tp, dp = tp or 1, dp or 1
    if tp > 1 and dp > 1:
        raise ValueError(
            f"--tensor-parallel-size {tp} with --data-parallel-size {dp}: attention here is split "
            "by requests or not at all, never by heads; give one of them (the routed experts are "
            "split over its ranks either way)"
        )
    n = max(tp, dp)
    return {"dp": dp, "tp": 1 if ep else n, "ep": n if ep else 1}


def _spelled_in(flag: str, argv: Sequence[str], exact: set[str]) -> bool:
    """Whether the command line gives ``flag``: ``--x v``, ``--x=v``, or an abbreviation that
    argparse took for it (``--max-ba 8`` is ``--max-batch 8``): a prefix of it that is not
    ``exact``ly another option (argparse takes an exact name first and refuses an ambiguous
    prefix before we get here)."""
    for t in argv:
        if t == "--":  # the rest are positionals
            return False
        name = t.split("=", 1)[0]
        if name == flag or (
            name.startswith("--") and len(name) > 2 and flag.startswith(name) and name not in exact
        ):
            return True
    return False


def apply_vllm_flags(a: argparse.Namespace, argv: Sequence[str] = ()) -> None:
    """Puts the vLLM flags given into ``a``'s own options: a ValueError for a value or flag not
    honoured here, naming it, or for one of ours given too (in ``argv``, the command line) with
    another value; one info line lists those taken as what this server does."""
    given = {f: getattr(a, _dest(f)) for f in VLLM_FLAGS if getattr(a, _dest(f), None) is not None}
    # every option's full name (ours are --dest; the vLLM ones above), for _spelled_in
    exact = set(VLLM_FLAGS) | {"--" + d.replace("_", "-") for d in vars(a)}
    noops = []
    for flag, v in given.items():
        kind = VLLM_FLAGS[flag]
        if isinstance(kind, Refused):
            raise ValueError(f"{flag} is not supported: {kind.instead}")
        if isinstance(kind, Always):
            if kind.values and v not in kind.values:
                raise ValueError(
                    f"{flag} {v}: only {' / '.join(kind.values)} is accepted: {kind.what}"
                )
            noops.append(_spelled(flag, v))
        elif isinstance(kind, Alias):
            if kind.values is not None:
                if v not in kind.values:
                    raise ValueError(f"{flag} must be one of {', '.join(kind.values)}, got {v!r}")
                if kind.values[v] is None:
                    noops.append(_spelled(flag, v))
                    continue
                v = kind.values[v]
            dest = kind.ours[2:].replace("-", "_")
            same = (v, *(kind.agrees or {}).get(v, ()))
            if _spelled_in(kind.ours, argv, exact) and getattr(a, dest) not in same:
                raise ValueError(
                    f"{flag} {given[flag]} and {kind.ours} {getattr(a, dest)} say different "
                    "things: give one"
                )
            setattr(a, dest, v)
    parallel = [f for f in given if isinstance(VLLM_FLAGS[f], Parallel)]
    if parallel:
        if (a.dp, a.tp, a.ep) != (1, 1, 1):
            raise ValueError(
                f"{parallel[0]} is vLLM's: give vLLM's parallel flags or --dp / --tp / --ep, "
                "not both"
            )
        ours = parallel_split(a.vllm_tensor_parallel_size, a.vllm_data_parallel_size,
                              bool(a.vllm_enable_expert_parallel))  # fmt: skip
        a.dp, a.tp, a.ep = ours["dp"], ours["tp"], ours["ep"]
        spelled = " ".join(_spelled(f, given[f]) for f in parallel)
        logger.info("vLLM's %s runs as --dp %d --tp %d --ep %d", spelled, a.dp, a.tp, a.ep)
    if noops:
        logger.info("vLLM flags taken as what this server does anyway: %s", ", ".join(noops))


def aliased_flags(a: argparse.Namespace) -> dict[str, str]:
    """The vLLM flags given that set one of our options, by that option's name (``max_batch``:
    ``--max-num-seqs``): an error about the option names the flag that gave its value
    (``cli._user_error``). A value mapped to a no-op sets nothing, and is left out."""
    out = {}
    for flag, kind in VLLM_FLAGS.items():
        v = getattr(a, _dest(flag), None)
        if isinstance(kind, Alias) and v is not None:
            if kind.values is None or kind.values.get(v) is not None:
                out[kind.ours[2:].replace("-", "_")] = flag
    return out


def check_quantization(method: str | None, model: str) -> None:
    """vLLM's ``--quantization method`` against MODEL's config.json, before any weight loads: a
    one-line ValueError naming the flag, the checkpoint's format and what to do when they differ
    (an AWQ flag on another checkpoint passed silently; fp8 on a bf16 one failed at load)."""
    if method is None:
        return
    # NOTE: imported here, not at the top: they import torch (see the NOTE above)
    from model.checkpoint import resolve_model
    from model.config import ModelConfig

    q = ModelConfig.from_json(resolve_model(model) / "config.json").quantization
    has = q.method if q is not None else None
    want = QUANT_FORMATS[method]
    if has == want:
        return
    actual = f"quant_method {has!r}" if has else "bf16: no quantization_config"
    todo = "drop the flag (the checkpoint's own format is served)"
    if want == "fp8" and has is None:
        todo = "drop the flag to serve its bf16 weights (vLLM quantises them at load; not here)"
    elif has == "fp8":
        todo = "drop the flag (its weights are served FP8, as --quantization fp8 says; "
        todo += "--fp8-weights bf16 dequantises them)"
    raise ValueError(
        f"--quantization {method} needs an {want.upper()} checkpoint; {model} is not one (its "
        f"config.json: {actual}): {todo}"
    )
