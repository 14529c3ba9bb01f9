"""What an engine reads from a checkpoint directory besides the weights, read and checked
before them (``LLM``, each rank of a dp/tp job, ``Engine.from_loaded``)."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.detokenize import eos_ids
from runtime.engine_config import EngineConfig
from runtime.sampling_params import SamplingParams, generation_defaults
from runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineInputs:
    """What an engine reads from a checkpoint directory besides the weights."""

    tokenizer: Tokenizer
    sampling_defaults: SamplingParams  # the request defaults of its generation config
    eos_token_ids: frozenset[int]  # the ids that end a request (runtime.detokenize.eos_ids)


def read_engine_inputs(path, config: EngineConfig, generation_config: str = "auto") -> EngineInputs:
    """Read and check, before the weights load (seconds, where a real checkpoint's weights take
    minutes), what an engine needs besides them: the engine options against the model config
    (the cache geometry: ``gpu_tokens`` against ``index_topk``, ...), the tokenizer (the model
    config's bos/eos ids standing in for tokens its tokenizer_config.json has no entry for; a
    BOS or EOS past the model's vocabulary refused) and,
    with ``generation_config`` "auto", the request defaults and EOS ids its generation_config.json
    sets (``runtime.sampling_params.generation_defaults``; "none": the file is not read).
    ``path``: the checkpoint directory, or its ``model.checkpoint_meta.CheckpointMeta`` already
    read."""
    from model.checkpoint_meta import checkpoint_meta

    path, mc, generation = checkpoint_meta(path)
    config.cache_config(mc)  # raises ValueError naming the option
    tokenizer = Tokenizer.from_dir(path, mc.bos_token_id, mc.eos_token_id)
    tokenizer.check_vocab(mc.vocab_size)
    defaults = generation_defaults(generation, generation_config)
    gen = generation if generation_config == "auto" else None
    return EngineInputs(tokenizer, defaults, eos_ids(mc, tokenizer, gen))
