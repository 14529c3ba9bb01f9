"""echo-compile: DeepSeek-V3.2 serving with the KV cache offloaded to host memory,
torch.compile-native.

Public API:
- ``LLM(model, **engine options)`` with ``generate``, ``generate_stream`` and ``chat``;
- ``generate(prompts, params, model=...)``: the one-call convenience;
- ``SamplingParams``;
- ``compile(model, ...)``: the compiled model object (see ``echo_compile.compiled``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# NOTE: the names load on first use (PEP 562), so that `import echo_compile.cli` (the console
# script) does not import torch: `echo-compile --help` answers at once.
_EXPORTS = {
    "LLM": "echo_compile.llm",
    "GenerationResult": "echo_compile.generation_result",
    "generate": "echo_compile.llm",
    "CompiledModel": "echo_compile.compiled",
    "compile": "echo_compile.compiled",
    "SamplingParams": "runtime.sampling_params",
}

if TYPE_CHECKING:
    from echo_compile.compiled import CompiledModel, compile  # noqa: A004
    from echo_compile.generation_result import GenerationResult
    from echo_compile.llm import LLM, generate
    from runtime.sampling_params import SamplingParams

__all__ = ["LLM", "CompiledModel", "GenerationResult", "SamplingParams", "compile", "generate"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'echo_compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
