"""One rank of a multi-process engine, with ``Engine``'s interface (``add_request``, ``step``,
``abort_request``, ``has_unfinished``), so ``echo_compile.LLM`` drives it unchanged.

SPMD: every rank runs the same front-end code with the same calls (torchrun runs the same
script everywhere); rank 0's arguments are the ones used (broadcast), so the ranks cannot drift.
- ``dp > 1`` (data-parallel attention, ``dp == tp`` or ``tp == 1``): each rank owns the requests
  the balancer (``runtime.distributed.balance``) gives it, its own KV cache and scheduler; each
  step's outputs of all ranks are gathered so every rank's front end sees every request.
- ``dp == 1`` (tensor-parallel only): every rank holds every request and runs the same batches
  (the same seeds, the same all-reduced logits), so every rank samples the same tokens.
A rank whose step raises leaves its error in the job's store (``failure_note``) and aborts the
process group, so that the other ranks' next collective fails at once with a ``RankFailure``
naming that rank and its error (``rank 1: RuntimeError: ...``) instead of waiting for the timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from custom_ops.kv_format import pages_for
from model.parallel import TPGroup
from runtime.distributed.balance import RankLoad, assign
from runtime.distributed.failure_note import leave_note
from runtime.distributed.metrics import aggregate
from runtime.distributed.process import (
    DistContext,
    RankFailure,
    guarded,
    init_distributed,
    shutdown,
)
from runtime.distributed.rank_errors import rank_errors
from runtime.distributed.step_sync import agree
from runtime.engine import Engine, StepOutput
from runtime.engine_config import EngineConfig
from runtime.engine_inputs import EngineInputs, read_engine_inputs
from runtime.model_runner import StepCompiler, next_bucket
from runtime.progress import LoadProgress
from runtime.prompt_kv import check_uncut
from runtime.request import Request
from runtime.sampling_params import SamplingParams, fill_max_tokens, truncate_prompt
from runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from model.fp8_choice import FP8Choice


class DistributedEngine:
    def __init__(self, engine: Engine, ctx: DistContext, dp: int):
        if dp not in (1, ctx.world_size):
            raise ValueError(f"dp={dp} must be 1 or the world size {ctx.world_size}")
        self.engine, self.ctx, self.dp = engine, ctx, dp
        self.dp_rank = ctx.rank if dp > 1 else 0
        self.owner: dict[str, int] = {}  # request id -> DP rank, the same on every rank

    # the parts of Engine that the front ends read
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def runner(self):
        return self.engine.runner

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def sampling_defaults(self) -> SamplingParams:
        return self.engine.sampling_defaults

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    # ---- collectives of the control plane (gloo) -----------------------------------------------
    def _broadcast(self, obj, what: str):
        box = [obj]
        with guarded(self.ctx, what):
            dist.broadcast_object_list(box, src=0, group=self.ctx.cpu_group)
        return box[0]

    def _gather(self, obj, what: str) -> list:
        out: list = [None] * self.ctx.world_size
        with guarded(self.ctx, what):
            dist.all_gather_object(out, obj, group=self.ctx.cpu_group)
        return out

    def load(self, prompt_ids: list[int], params: SamplingParams, has_kv: bool) -> RankLoad:
        """This rank's load and host capacity for the balancer, and how much of the request's
        prompt its prefix cache holds (``Scheduler.placement``)."""
        sched = self.engine.scheduler
        takes = params.prompt_logprobs is None and not has_kv  # as Scheduler._takes_prefix
        left, free, cached = sched.placement(prompt_ids, takes)
        return RankLoad(left, free, sched.pages.num_pages, cached)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt_kv=None
    ) -> None:
        """Place a request on a DP rank (every rank calls this with the same arguments).
        ``prompt_kv`` is not broadcast: every rank passes its own source of the same rows (SPMD,
        as the benchmark's seeded ``RandomPromptKV``), and the rank that owns the request (every
        rank with dp == 1) writes it."""
        if params.seed is None:  # one seed for the request on every rank (TP ranks must agree)
            params = replace(params, seed=random.SystemRandom().getrandbits(63))
        request_id, ids, params = self._broadcast(
            (request_id, list(prompt_token_ids), params), "the request broadcast"
        )
        # NOTE: the checks below run on every rank alike, but one may still fail on one rank
        # alone (its own prompt_kv, its placement): that rank raised here while the others
        # waited for it in the load exchange, or met its next command there (a follower goes on
        # after a refused add). Its error travels with its load: refused on every rank.
        load = error = None
        try:
            ids, params, load = self._checked(request_id, ids, params, prompt_kv)
        except Exception as e:  # noqa: BLE001 (every rank must reach the load exchange)
            error = e
        every = self._gather((load, _refusal(error)), "the load exchange")
        refusals = [(r, text) for r, (_, text) in enumerate(every) if text is not None]
        if refusals:
            if isinstance(error, ValueError):
                raise error  # this rank's own refusal (every rank's, for the checks made alike)
            r, text = refusals[0]
            raise ValueError(f"rank {r}: {text}") from error
        loads = [rank_load for rank_load, _ in every][: self.dp]
        target = assign(
            pages_for(len(ids) + params.max_tokens), len(ids) + params.max_tokens, loads
        )
        err = None
        if target == self.dp_rank:
            try:
                self.engine.add_request(request_id, ids, params, prompt_kv=prompt_kv)
            except Exception as e:  # noqa: BLE001 (every rank must reach the gather below)
                err = _refusal(e)
        errors = [e for e in self._gather(err, "the admission result") if e is not None]
        if errors:  # refused on its rank: refused everywhere, with that rank's reason
            raise ValueError(errors[0])
        self.owner[request_id] = target

    def _checked(
        self, request_id: str, ids: list[int], params: SamplingParams, prompt_kv
    ) -> tuple[list[int], SamplingParams, RankLoad]:
        """``add_request``'s checks of the broadcast request, on this rank: its prompt truncated,
        its ``max_tokens`` filled, and this rank's load for the balancer."""
        if request_id in self.owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        kept = truncate_prompt(ids, params, self.max_model_len)  # before the checks that read it
        if prompt_kv is not None:
            check_uncut(len(ids), len(kept))
        ids = kept
        params = fill_max_tokens(params, len(ids), self.max_model_len)  # (every rank's limit)
        if params.prompt_logprobs is not None and self.engine.config.ffn_ranks > 1:
            # its prefill runs eagerly with every position's logits; the lockstep sub-steps of a
            # tp / ep run (the same padded shapes on every rank) have no such form yet
            raise ValueError(
                "prompt_logprobs (asked, or implied by echo with logprobs) is not supported with "
                "tp or ep > 1 (dp only)"
            )
        # the context limit first, as one GPU checks it (every rank has the same limits and
        # refuses alike): past the host pool, the balancer's refusal named pages instead
        self.engine.scheduler.check(Request(request_id, ids, params))
        return ids, params, self.load(ids, params, prompt_kv is not None)

    def abort_request(self, request_id: str) -> None:
        if self.owner.pop(request_id, None) == self.dp_rank:
            self.engine.abort_request(request_id)

    def has_unfinished(self) -> bool:
        """Whether any rank has requests left: a collective, so every rank gets the same answer
        and a ``while engine.has_unfinished(): engine.step()`` loop ends on all ranks at once."""
        return any(self._gather(self.engine.has_unfinished(), "the unfinished check"))

    def metrics(self) -> dict[str, Any]:
        """The deployment's ``engine.metrics()``: with dp > 1 every rank's snapshot gathered (a
        collective: every rank calls it, as the driver's ``metrics`` command makes them) and
        combined (``runtime.distributed.metrics.aggregate``; the ranks' own under ``"engines"``,
        by DP rank). With dp == 1 every rank holds every request and the same pools: this rank's
        own, with no collective.

        Why on request and not with the step: a snapshot is a few KB a rank (61 layers' totals)
        and a scrape comes every few seconds, while a decode step is tens of ms; adding it to the
        step's output gather would cost every step for a reader that is rarely there, and every
        K steps would serve stale numbers. Between two steps every follower waits in ``follow``
        for rank 0's next command, so one more command (a broadcast and an all-gather, as
        ``has_unfinished``) cannot deadlock: all ranks meet it in the same order."""
        own = self.engine.metrics()
        if self.dp == 1:
            return own
        return aggregate(self._gather(own, "the metrics gather"))

    def reset_stats(self) -> None:
        """This rank's ``Engine.reset_stats`` (no collective: the driver's ``reset_stats``
        command makes every rank call it)."""
        self.engine.reset_stats()

    # ---- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        try:
            return self._step()
        except Exception as e:
            if not isinstance(e, RankFailure):  # this rank's own error: the others name it
                leave_note(self.ctx, e, "its step")
            shutdown()  # the others' next collective fails now instead of at the timeout
            raise

    def _lockstep(self, batch, want_p: int, want_d: int, plan) -> torch.Tensor | None:
        """The agreed sub-steps (runtime.distributed.step_sync): this rank's batch in the one of
        its kind, an empty padded batch in the other, so every rank's collectives line up."""
        runner, logits = self.engine.runner, None
        if plan.prefill_bucket:
            if want_p:
                req = batch.requests[0]
                inputs = runner.prefill_inputs(
                    req, batch.chunk_start, batch.chunk_end, plan.prefill_bucket
                )
                logits = runner.prefill_fn(*inputs)
            else:
                runner.prefill_fn(*runner.padding_inputs(False, plan.prefill_bucket))
        if plan.decode_bucket:
            if want_d:
                n = len(batch.requests)
                logits = runner.decode_fn(*runner.decode_inputs(batch.requests, plan.decode_bucket))
                logits = logits[:n]
            else:
                runner.decode_fn(*runner.padding_inputs(True, plan.decode_bucket))
        return logits

    def _step(self) -> list[StepOutput]:
        eng, runner = self.engine, self.engine.runner
        batch = eng._schedule()  # received prompt KV is written here, on this rank alone
        want_p = want_d = 0
        if batch is not None and batch.is_decode:
            want_d = next_bucket(len(batch.requests), runner.decode_buckets)
        elif batch is not None:
            want_p = next_bucket(batch.chunk_end - batch.chunk_start, runner.prefill_buckets)
        plan = agree(self.ctx, want_p, want_d, eng.has_unfinished())
        if not plan.any_unfinished:
            return []  # no rank has work (every rank sees the same plan)
        logits = None
        if eng.config.ffn_ranks == 1:  # no collective inside the model: no padded sub-steps
            if batch is not None:
                logits = runner.forward(batch)
        else:  # the model's own collectives: a peer that fails here is a RankFailure too
            with guarded(self.ctx, "the model step's collectives", only_collectives=True):
                logits = self._lockstep(batch, want_p, want_d, plan)
        outs = eng._postprocess(batch, logits) if batch is not None else []
        if self.dp > 1:
            gathered = self._gather([dataclasses.astuple(o) for o in outs], "the output gather")
            outs = [StepOutput(*o) for rank_outs in gathered for o in rank_outs]
        for o in outs:  # every rank sees every output: a finished id is free again everywhere
            if o.finished:
                self.owner.pop(o.request_id, None)
        return outs


def _refusal(error: Exception | None) -> str | None:
    """A request's refusal as the other ranks say it: a ``ValueError``'s message (the user's
    request), anything else with its type."""
    if error is None:
        return None
    return str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"


def check_same_options(ctx: DistContext, options: dict) -> None:
    """Every rank must be built with rank 0's engine options: a rank with another ``tp``,
    ``max_batch`` or ``kv_format`` meets other collectives (gloo aborted it with "collective
    mismatch", blamed on its peers; NCCL may hang or mix buffers) or samples from other numbers;
    one given another checkpoint of the same shapes (``checkpoint``: its
    ``model.checkpoint_meta.checkpoint_fingerprint``, not its path) builds and mixes its weights
    with the others'. A ``ValueError`` on every rank naming each option that differs, before any
    weight loads."""
    every = [None] * ctx.world_size
    with guarded(ctx, "the engine options check"):
        dist.all_gather_object(every, options, group=ctx.cpu_group)
    diff = [
        f"{k}: rank 0 has {every[0].get(k)!r}, rank {r} has {o.get(k)!r}"
        for r, o in enumerate(every)
        for k in sorted(every[0].keys() | o.keys())
        if every[0].get(k) != o.get(k)
    ]
    if diff:
        raise ValueError(
            "every rank of a dp/tp/ep job must be given the same engine options (torchrun runs "
            "the same command on each) and the same checkpoint (compared by its fingerprint: "
            "config, generation config when read, shard listing; one path may hold other files "
            "on other hosts): " + "; ".join(diff)
        )


def tp_group(ctx: DistContext, config: EngineConfig) -> TPGroup:
    """The group the feed-forward blocks reduce over: every rank when tp or ep > 1."""
    if config.ffn_ranks == 1:
        return TPGroup(0, 1, "", gather=False)
    return TPGroup(ctx.rank, ctx.world_size, ctx.group_name, gather=config.dp > 1)


def join(config: EngineConfig) -> DistContext:
    """This rank's place in the job: the process group joined (collectives time out after
    ``config.collective_timeout_s``), a bare ``cuda`` / ``cuda:0`` read as ``cuda:<LOCAL_RANK>``.
    ``LLM`` joins before the KV sizing, whose automatic sizes the ranks agree on
    (runtime/kv_sizing.py), and passes the context on to ``build_distributed_engine``."""
    dev = None if config.device in ("cuda", "cuda:0") else config.device
    return init_distributed(dev, config.collective_timeout_s)


def build_distributed_engine(
    path,
    config: EngineConfig,
    model_name: str = "model",
    compiler_factory=None,
    ctx: DistContext | None = None,
    fp8_weights: str | FP8Choice = "auto",
    generation_config: str = "auto",
    inputs: EngineInputs | None = None,
    progress: bool = True,
) -> DistributedEngine:
    """Join the process group (``join``; ``ctx``: already joined), load this rank's shard and
    build its engine. ``path``: the checkpoint directory, or its
    ``model.checkpoint_meta.CheckpointMeta`` already read. ``config.device`` "cuda" becomes this
    rank's ``cuda:<LOCAL_RANK>``.
    ``compiler_factory(device)``: a ``StepCompiler`` for the rank's device, or None for eager.
    ``fp8_weights``: as ``load_model``'s, the option or the ``FP8Choice`` already made (FP8
    kept per shard); ``generation_config``: as
    ``LLM``'s; ``inputs``: ``read_engine_inputs``'s, when the caller read them (else they are
    read here, before the weights); ``progress``: rank 0 draws the bar of its load (one bar on
    the launcher's terminal), every rank logs its load's summary line. An error of one rank's
    checks or load (a shard its host cannot read, out of memory) is raised on every rank, named
    with that rank (``rank_errors``), once all of them have run that step."""
    from model.checkpoint_meta import checkpoint_fingerprint, checkpoint_meta
    from model.fp8_choice import FP8Choice, fp8_choice
    from model.loader import load_model
    from model.shard_loader import load_sharded_model
    from model.shards import shard_files

    ctx = ctx or join(config)
    # NOTE: every step a rank can fail alone (a checkpoint file its host lacks, its own option,
    # out of memory) runs inside rank_errors, with no collective inside: a rank that raised
    # there alone ended its group and left the others a RankFailure naming no cause (or minutes
    # of loading first); now every rank raises that rank's error, named, at the exchange
    with rank_errors(ctx, "the start-up checks"):
        if ctx.world_size != config.world_size:
            raise ValueError(
                f"dp={config.dp}, tp={config.tp}, ep={config.ep} need {config.world_size} "
                f"processes, but this job has {ctx.world_size}: launch with torchrun "
                f"--nproc-per-node {config.world_size}"
            )
        asked = fp8_weights.weights if isinstance(fp8_weights, FP8Choice) else fp8_weights
        # the shard listing read once, here: the checkpoint's fingerprint hashes it, the FP8
        # choice and the load take it (a choice already made may hold it)
        meta = checkpoint_meta(path)
        made = fp8_weights.shards if isinstance(fp8_weights, FP8Choice) else None
        shards = made or shard_files(meta.path)
        fingerprint = checkpoint_fingerprint(meta, shards, generation_config)
    check_same_options(
        ctx,
        dict(dataclasses.asdict(config), device=config.device.split(":")[0],
             fp8_weights=asked, generation_config=generation_config,
             compiled=compiler_factory is not None, checkpoint=fingerprint),
    )  # fmt: skip
    with rank_errors(ctx, "the weight load"):
        # (the FP8 choice after the check: with the options and the checkpoint the same
        # everywhere, the choice, and any error of it, is the same on every rank)
        choice = fp8_choice(meta.path, meta.config, fp8_weights, shards)
        choice = choice._replace(shards=choice.shards or shards)
        config = replace(config, device=ctx.device)
        inputs = inputs or read_engine_inputs(meta, config, generation_config)
        g = tp_group(ctx, config)
        with LoadProgress(enabled=progress and ctx.rank == 0) as loading:
            if g.size > 1:
                net, extras = load_sharded_model(
                    meta, g, device=ctx.device, ep=config.ep > 1, fp8_weights=choice,
                    progress=loading,
                )  # fmt: skip
            else:
                net, extras = load_model(
                    meta, device=ctx.device, keep_mtp=False, fp8_weights=choice,
                    progress=loading,
                )  # fmt: skip
        logging.getLogger(__name__).info("rank %d: %s", ctx.rank, loading.close())
        compiler: StepCompiler | None = compiler_factory(ctx.device) if compiler_factory else None
        engine = Engine.from_loaded(
            net, extras, config, model_name=model_name, compiler=compiler, inputs=inputs
        )
    return DistributedEngine(engine, ctx, config.dp)
