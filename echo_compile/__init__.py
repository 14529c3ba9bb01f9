"""echo-compile: the public API (filled in as the runtime lands)."""
