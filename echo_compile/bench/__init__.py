"""The benchmark harness behind ``echo-compile bench``: not part of the serving product.

It drives the engine through its public API only (``Engine.add_request(..., prompt_kv=...)`` for
the decode-only runs, ``Engine.logits_processors`` for the locality knob) and profiles eager
decode steps. ``experiment`` is the experiment's description (the command's ``--help``) and its
systems' names, ``harness`` the systems under test, ``workload`` what they serve,
``model_builder`` the model they serve, ``result`` what a run records; ``cli`` the command line's
run loop (its flags in ``flags``, their usage checks in ``checks``), ``breakdown`` the
per-category profile of a decode step, ``locality`` the measured top-k overlap. Nothing in the
product imports it.
"""
