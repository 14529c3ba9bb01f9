"""echo-compile's ``echo::`` custom ops: FP8 helpers, KV row formats, the host KV pool, the
per-layer GPU cache manager and the attention/indexer kernels. Depends on torch and triton only."""
