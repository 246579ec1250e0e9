"""MoE model types of the installed transformers that cannot be teachers, with the
reason (each family module keeps its own; every reader takes this one mapping)."""

from __future__ import annotations

from hebrus_flywheel.replay.families_c import C_REFUSED as _C
from hebrus_flywheel.replay.families_hybrid import REFUSED_FAMILIES as _HYBRID
from hebrus_flywheel.replay.families_more import REFUSED_FAMILIES as _MORE
from hebrus_flywheel.replay.families_vl import VL_REFUSED, VL_REFUSED_AS_TEXT

_TEXT: dict[str, str] = {**_HYBRID, **_MORE, **_C}
REFUSED_FAMILIES: dict[str, str] = {
    **_TEXT, **VL_REFUSED,
    **{composite: f"its language model is a {text} model, which cannot be a teacher: "
                  f"{_TEXT[text]}" for composite, text in VL_REFUSED_AS_TEXT.items()},
}
"""``model_type`` → why it cannot be a teacher (``teacher families`` lists it)."""
