"""``LLM``'s memory checks before the weights load: a deployment that cannot fit is refused in
seconds, naming what does not, not after minutes of reading weights (on CUDA ``check_fits``,
on the CPU ``check_host_pool``)."""

from __future__ import annotations

import logging

from model.config import ModelConfig
from runtime.engine_config import EngineConfig


def rank_weights(model_config: ModelConfig, config: EngineConfig, fp8_weights: str) -> int | None:
    """On CUDA, this rank's weight bytes (``plan.rank_weight_bytes``), counted once for the KV
    sizing and the memory check, which both take them; None on the CPU (neither reads them) or
    where the planner cannot count them (the sizing and the check then try and say why they
    step aside)."""
    if not config.device.startswith("cuda"):
        return None
    from runtime.distributed import plan

    try:
        return plan.rank_weight_bytes(model_config, config, fp8_weights)
    except Exception:  # noqa: BLE001
        return None


def check_fits(
    path,
    config: EngineConfig,
    fp8_weights: str,
    weights: int | None = None,
    memory_device: tuple[str, int] | None = None,
) -> None:
    """The memory plan of this rank (runtime/distributed/plan.py) against its GPU and host,
    before the weights load: a deployment that cannot fit is refused in seconds, naming what
    does not. Anything else the check meets (a bad checkpoint or option: the loader says so
    next; a config the planner cannot count) makes it step aside with a warning, but a bad
    LOCAL_RANK / LOCAL_WORLD_SIZE (``plan.rank_memory_device``'s ValueError). ``path``: the
    checkpoint directory, or its ``model.checkpoint_meta.CheckpointMeta`` already read; ``weights``:
    ``rank_weights`` (None: counted here); ``memory_device``: ``plan.rank_memory_device``'s
    (None: found here)."""
    from model.checkpoint_meta import checkpoint_meta
    from runtime.distributed import plan

    # (torchrun: this rank's GPU; a bad LOCAL_RANK / LOCAL_WORLD_SIZE raises, as in the sizing)
    device, local_ranks = memory_device or plan.rank_memory_device(config)
    try:
        _, model_config, _ = checkpoint_meta(path)
        gpu, host = plan.device_memory_gib(device)
        plan.check_fits(model_config, config, gpu, host, fp8_weights, local_ranks, weights)
    except plan.DoesNotFit:
        raise
    except Exception as e:  # noqa: BLE001
        logging.getLogger(__name__).warning("memory check skipped: %s: %s", type(e).__name__, e)


def check_host_pool(path, config: EngineConfig) -> None:
    """On the CPU: the KV pool against this machine's memory before any weight is read (the
    refusal ``allocate_host_rows`` makes when the engine allocates it, minutes later for a real
    checkpoint), naming ``--host-tokens`` and the bytes. ``path``: as ``check_fits``'."""
    from custom_ops.cache.host_pool import check_host_rows
    from model.checkpoint_meta import checkpoint_meta

    _, model_config, _ = checkpoint_meta(path)
    cc = config.cache_config(model_config)
    check_host_rows(cc.num_layers, cc.host_tokens, cc.row_bytes, config.device, cc.offload)
