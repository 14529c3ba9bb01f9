"""echo-compile's ``echo::`` custom ops (FP8 helpers, KV row formats, the cache-manager, indexer,
attention and AWQ ops) and, in ``custom_ops.cache``, the cache state they run on. Depends on torch
and triton only.

Importing the package registers every ``echo::`` op with its reference (the CPU kernel) and its
fake implementation, like any torch extension; the Triton modules are imported on an op's first
CUDA call.
"""

from custom_ops import (  # noqa: F401  (registers the echo:: ops)
    attention,
    awq,
    awq_pairs,
    awq_repack,
    backends,
    cache_ops,
    fp8_linear,
    indexer,
    prefetch,
    prefill,
    prefill_gather,
)
