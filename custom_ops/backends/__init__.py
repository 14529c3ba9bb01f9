"""Kernel-library backends of the indexer (DeepGEMM decode and prefill scores, FlashInfer
top-k), each call an ``echo::`` custom op with a fake so the compiled steps capture it in their
CUDA graphs; the libraries are optional (``pip install -e '.[kernels]'``) and imported on first
CUDA use. ``select`` decides which backend serves which half; docs/backends.md describes the
whole.
"""

from custom_ops.backends import (  # noqa: F401  (registers)
    deep_gemm_gemm,
    deep_gemm_ops,
    deep_gemm_prefill,
    flashinfer_ops,
    split_ops,
)
