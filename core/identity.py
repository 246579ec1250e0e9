"""Runtime identity digests.

An identity id is the hex SHA-256 of the canonical JSON (sorted keys, no whitespace,
UTF-8) of every ``RuntimeIdentity`` field except ``identity_id`` itself, so any
change to the model artifact, tokenizer, template, dtype, geometry or tie-break rule
yields a different id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from hebrus_flywheel.core.jsonio import canonical_json

TIE_BREAK_SCORE_DESC_ID_ASC = "score_desc_then_expert_id_asc"
DEFAULTED_FIELDS: dict[str, Any] = {"routed_layers": [], "layer_count": 0, "kernel_path": ""}
"""Fields added to the schema with a default: left out of the digest while they hold it,
so records written before the field existed (and decoded with the default) keep their id."""


def compute_identity_id(fields: Mapping[str, Any]) -> str:
    """Digest of an identity record, ignoring any ``identity_id`` already present and
    the :data:`DEFAULTED_FIELDS` that hold their default."""
    body = {
        k: v for k, v in fields.items()
        if k != "identity_id" and not (k in DEFAULTED_FIELDS and _is_default(k, v))
    }
    return hashlib.sha256(canonical_json(body)).hexdigest()


def _is_default(name: str, value: Any) -> bool:
    default = DEFAULTED_FIELDS[name]
    if isinstance(default, list):
        return isinstance(value, list | tuple) and len(value) == 0
    return bool(value == default)


def with_identity_id(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``fields`` with ``identity_id`` set to its digest."""
    record = {k: v for k, v in fields.items() if k != "identity_id"}
    return {"identity_id": compute_identity_id(record), **record}
