"""The cache state the ``echo::`` ops run on: ``CacheConfig``, the host pool, the per-layer GPU
pools, ``KVCache`` and the invariant checker."""
