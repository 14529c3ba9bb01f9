"""echo-compile: DeepSeek-V3.2 serving with the KV cache offloaded to host memory,
torch.compile-native.

Public API:
- ``LLM(model, **engine options)`` with ``generate``, ``generate_stream`` and ``chat``;
- ``generate(prompts, params, model=...)``: the one-call convenience;
- ``SamplingParams``;
- ``compile(model, ...)``: the compiled model object (see ``echo_compile.compiled``).
"""

from echo_compile.compiled import CompiledModel, compile  # noqa: A004
from echo_compile.llm import LLM, GenerationResult, generate
from runtime.sampling_params import SamplingParams

__all__ = ["LLM", "CompiledModel", "GenerationResult", "SamplingParams", "compile", "generate"]
