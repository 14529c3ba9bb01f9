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

import os

ENV = "TORCHINDUCTOR_CACHE_DIR"


def configure_compile_cache() -> str:
    """Set ``TORCHINDUCTOR_CACHE_DIR`` to the project's cache when it is not set; the directory
    in use (``LLM``'s "captured N step graphs" line names the one the compile used)."""
    from model.checkpoint import cache_dir

    return os.environ.setdefault(ENV, str(cache_dir() / "inductor"))
