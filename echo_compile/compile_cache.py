"""Where the ``echo-compile`` command keeps torch.compile's on-disk cache: Inductor's compiled
graphs (and the Triton kernels it generates, under it) in ``$ECHO_COMPILE_CACHE/inductor``
(default ``~/.cache/echo-compile/inductor``, beside the built-in checkpoints) unless
``TORCHINDUCTOR_CACHE_DIR`` says where. Torch's own default is under ``/tmp``, which a
container's restart empties, and a first warm-up of a 61-layer model takes minutes a graph
(docs/compile.md, "Warm-up time and the layer count") where a warm cache takes a fraction of it
(vLLM keeps its compile cache under ``~/.cache/vllm`` for the same reason). The command's
choice, not the library's: an application embedding ``LLM`` keeps torch's default or its own.
"""

from __future__ import annotations

import logging
import os

ENV = "TORCHINDUCTOR_CACHE_DIR"


def configure_compile_cache() -> str:
    """Set ``TORCHINDUCTOR_CACHE_DIR`` to the project's cache when it is not set (one INFO line
    says which directory is used); the directory in use."""
    from model.checkpoint import cache_dir

    given = ENV in os.environ
    path = os.environ.setdefault(ENV, str(cache_dir() / "inductor"))
    logging.getLogger(__name__).info(
        "compile cache: %s (%s)", path, f"${ENV}" if given else f"${ENV} to move it"
    )
    return path
