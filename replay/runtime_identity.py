"""The RuntimeIdentity record of a loaded teacher (``schemas/RuntimeIdentity.v3.avsc``).

Every field is derived from what is actually loaded: the model artifact digest over
config and weights, the tokenizer and chat-template digests of the tokenizer directory,
the compute dtype and kernel path (device type, attention and expert kernels: parity is
established per path, :mod:`core.execution`), the route geometry and the routing rules
of :mod:`replay.routing`.
``identity_id`` is the SHA-256 of the canonical JSON of the other fields
(:func:`schemas.identity.with_identity_id`), so any change yields a different id.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hebrus_flywheel.core import __version__
from hebrus_flywheel.core.identity import compute_identity_id, with_identity_id
from hebrus_flywheel.replay.exceptions import IdentityMismatchError
from hebrus_flywheel.replay.routing import TIE_BREAK_RULE
from hebrus_flywheel.replay.teacher import Teacher

RUNTIME_NAME = "hebrus-flywheel-reference"
# a teacher loaded with exact_tie_break=False executes torch.topk's (unspecified) tie order
NATIVE_TOPK_SUFFIX = "+native-topk"
QUANTIZATION_NONE = "none"
IDENTITY_FIELDS: tuple[str, ...] = (
    "identity_id", "model_family", "model_artifact_digest", "tokenizer_digest",
    "chat_template_digest", "dtype", "quantization", "routed_layer_count", "expert_count",
    "top_k", "tie_break_rule", "weight_rule", "hidden_size", "routed_intermediate_size",
    "runtime_name", "runtime_version", "routed_layers", "layer_count", "kernel_path",
)


def build_runtime_identity(
    teacher: Teacher, tokenizer_dir: str | Path | None = None, *,
    runtime_name: str | None = None, runtime_version: str = __version__,
) -> dict[str, Any]:
    """The identity record (all .avsc fields, ``identity_id`` set) of ``teacher``.

    ``tokenizer_dir`` defaults to the teacher's own directory, where
    :func:`replay.teacher.init_teacher` writes the tokenizer. ``runtime_name`` defaults
    to :data:`RUNTIME_NAME`, suffixed with :data:`NATIVE_TOPK_SUFFIX` when the teacher's
    gates do not execute the tie-break rule, so the two never share an identity.
    """
    if runtime_name is None:
        suffix = "" if teacher.exact_tie_break else NATIVE_TOPK_SUFFIX
        runtime_name = RUNTIME_NAME + suffix
    from hebrus_flywheel.replay.tokenizer import chat_template_digest, tokenizer_digest

    directory = Path(tokenizer_dir) if tokenizer_dir is not None else teacher.path
    geometry = teacher.geometry
    fields = {
        "model_family": geometry.family,
        "model_artifact_digest": teacher.artifact_digest,
        "tokenizer_digest": tokenizer_digest(directory),
        "chat_template_digest": chat_template_digest(directory),
        "dtype": teacher.dtype,
        "quantization": QUANTIZATION_NONE,
        "routed_layer_count": geometry.routed_layer_count,
        "expert_count": geometry.expert_count,
        "top_k": geometry.top_k,
        "tie_break_rule": TIE_BREAK_RULE,
        "weight_rule": geometry.weight_rule,
        "hidden_size": geometry.hidden_size,
        "routed_intermediate_size": geometry.routed_intermediate_size,
        "runtime_name": runtime_name,
        "runtime_version": runtime_version,
        "routed_layers": list(geometry.routed_layers),
        "layer_count": geometry.layer_count,
        "kernel_path": teacher.kernel_path,
    }
    return with_identity_id(fields)


def identity_differences(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """Names of identity fields whose values differ (``identity_id`` excluded)."""
    names = [f for f in IDENTITY_FIELDS if f != "identity_id"]
    return [f for f in names if expected.get(f) != actual.get(f)]


def require_identity(record_identity: Mapping[str, Any], loaded: Mapping[str, Any]) -> None:
    """Fail closed unless ``record_identity`` is exactly the ``loaded`` runtime identity.

    Checks that the record's ``identity_id`` matches its own fields (no tampering or
    partial records) and equals the loaded one; IdentityMismatchError names the fields.
    """
    claimed = record_identity.get("identity_id")
    if claimed != compute_identity_id(record_identity):
        raise IdentityMismatchError(
            f"identity_id {claimed!r} does not match the record's own fields; the record is "
            "corrupt or partial and must be quarantined"
        )
    if claimed == loaded.get("identity_id"):
        return
    differing = identity_differences(record_identity, loaded)
    detail = ", ".join(
        f"{f}: record={record_identity.get(f)!r} loaded={loaded.get(f)!r}" for f in differing
    )
    raise IdentityMismatchError(
        f"record identity {claimed} differs from the loaded teacher's "
        f"{loaded.get('identity_id')} ({detail or 'unknown fields'}); load the teacher, "
        "tokenizer, dtype and kernel path (--device, --attention) the record was captured "
        "with, or quarantine the record"
    )
