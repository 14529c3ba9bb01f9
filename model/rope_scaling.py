"""RopeScaling: the YaRN parameters of a ``config.json``, parsed and checked.

Both forms are read here: transformers v4's ``rope_scaling`` block (key ``type`` or
``rope_type``) and v5's ``rope_parameters`` (``rope_theta`` and the YaRN fields in one object);
a config that gives both must say the same. Values the YaRN formulas cannot take, and scalings
the model would serve differently from transformers and vLLM, raise ``ValueError`` naming the
field. ``ModelConfig.from_dict`` (model/config.py) reads them through ``with_rope_parameters``
and ``parse_rope_scaling``; docs/model_notes.md, "config.json".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from model.config_fields import expect, typed


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (``rope_scaling`` with type ``yarn``)."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


# rope_scaling's fields: (type, default when absent or null)
_ROPE_FIELDS: dict[str, tuple[type, Any]] = {
    "factor": (float, 40.0),
    "original_max_position_embeddings": (int, 4096),
    "beta_fast": (float, 32.0),
    "beta_slow": (float, 1.0),
    "mscale": (float, 1.0),
    "mscale_all_dim": (float, 1.0),
}


def parse_rope_scaling(rs: Any, name: str) -> RopeScaling | None:
    """config.json's ``name`` (``rope_scaling``, or transformers v5's ``rope_parameters``) as
    YaRN parameters; None where there is none (absent, or v5's ``rope_type: default``)."""
    if rs is None:
        return None
    expect(isinstance(rs, dict), name, "an object", rs)
    key = "type" if "type" in rs else "rope_type"
    kind = rs.get(key)
    if kind == "default" and name == "rope_parameters":
        return None
    if kind != "yarn":
        kinds = "'yarn' or 'default'" if name == "rope_parameters" else "'yarn'"
        raise ValueError(
            f"config.json field '{name}.{key}': only {kinds} is supported, got {kind!r}"
        )
    out = RopeScaling(**{
        k: default if rs.get(k) is None else typed(f"{name}.{k}", rs[k], typ)
        for k, (typ, default) in _ROPE_FIELDS.items()
    })  # fmt: skip
    # Values the YaRN formulas cannot take (log(factor), log(original / beta): a bare "math
    # domain error" or ZeroDivisionError later), and a factor below 1, for which transformers
    # and vLLM scale nothing while 0.1 * ln(factor) + 1 would shrink the softmax scale.
    for k, low in (("factor", 1), ("original_max_position_embeddings", 1)):
        expect(getattr(out, k) >= low, f"{name}.{k}", f"a number >= {low}", rs.get(k))
    for k in ("beta_fast", "beta_slow"):
        expect(getattr(out, k) > 0, f"{name}.{k}", "a positive number", rs.get(k))
    # NOTE: cos/sin keep unit magnitude (model/rope.py); transformers and vLLM scale them by
    # mscale(mscale) / mscale(mscale_all_dim), 1 only where the two are equal: others would be
    # served silently different
    if out.factor > 1 and out.mscale != out.mscale_all_dim:  # (factor 1: both scale by 1)

        def given(k: str) -> str:
            return str(rs[k]) if rs.get(k) is not None else f"absent: the default {getattr(out, k)}"

        raise ValueError(
            f"config.json fields '{name}.mscale' ({given('mscale')}) and '{name}.mscale_all_dim' "
            f"({given('mscale_all_dim')}) differ: only equal ones are supported"
        )
    return out


def with_rope_parameters(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with transformers v5's ``rope_parameters`` (``rope_theta``, ``rope_type`` and the
    YaRN fields in one object) read as v4's ``rope_theta`` and ``rope_scaling``. Where a v4 field
    is given too it must say the same (one of them silently winning would change the outputs)."""
    rp = d.get("rope_parameters")
    if rp is None:
        return d
    expect(isinstance(rp, dict), "rope_parameters", "an object", rp)
    d = dict(d)
    if rp.get("rope_theta") is not None:
        theta = typed("rope_parameters.rope_theta", rp["rope_theta"], float)
        top = d.get("rope_theta")
        if top is not None and typed("rope_theta", top, float) != theta:
            raise ValueError(
                f"config.json fields 'rope_theta' ({top!r}) and 'rope_parameters.rope_theta' "
                f"({rp['rope_theta']!r}) disagree"
            )
        d["rope_theta"] = theta
    v5 = parse_rope_scaling(rp, "rope_parameters")
    v4 = d.get("rope_scaling")
    if v4 is not None and parse_rope_scaling(v4, "rope_scaling") != v5:
        raise ValueError(
            "config.json fields 'rope_scaling' and 'rope_parameters' disagree: "
            f"{d['rope_scaling']!r} against {rp!r}"
        )
    d["rope_scaling"] = None if v5 is None else {"type": "yarn", **asdict(v5)}
    return d
