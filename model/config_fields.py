"""A config.json value's type check: the value as the type its field takes, or one ``ValueError``
naming the field. Shared by the parsers of ``config.json``
(model/config.py) and of its ``quantization_config`` and ``rope_scaling`` blocks
(model/quant_config.py, model/rope_scaling.py).
"""

from __future__ import annotations

import math
from typing import Any


def expect(ok: bool, name: str, what: str, value: Any) -> None:
    """A config.json field of the wrong type: one error naming it (not a traceback later)."""
    if not ok:
        raise ValueError(f"config.json field {name!r}: expected {what}, got {value!r}")


def typed(name: str, v: Any, typ: type) -> Any:
    """A config.json value as ``typ``: int takes an integral number (7168.0 too), float any
    finite number, bool and str only themselves; else one error naming the field."""
    if typ in (int, float):
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (typ is float or float(v).is_integer())
        expect(ok, name, "an integer" if typ is int else "a number", v)
        return typ(v)
    expect(isinstance(v, typ), name, "a boolean" if typ is bool else "a string", v)
    return v
