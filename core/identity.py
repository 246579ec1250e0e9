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


def compute_identity_id(fields: Mapping[str, Any]) -> str:
    """Digest of an identity record, ignoring any ``identity_id`` already present."""
    body = {k: v for k, v in fields.items() if k != "identity_id"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def with_identity_id(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``fields`` with ``identity_id`` set to its digest."""
    record = {k: v for k, v in fields.items() if k != "identity_id"}
    return {"identity_id": compute_identity_id(record), **record}
