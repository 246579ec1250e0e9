"""The consent ledger: who allowed what, until when; every stage fails closed on it.

The ledger is the compacted topic ``flywheel.consent.ledger.v1`` (:data:`CONSENT_TOPIC`),
keyed by owner: each record (``schemas/ConsentRecord.v1.avsc``) is a **grant** of
scopes (:data:`SCOPES`: ``capture``, ``train``, ``evaluate``) from ``granted_at_ms``
until ``expires_at_ms`` under a policy version, or a **revoke**. Compaction keeps the
latest record per owner, and the latest record *is* the owner's consent: a revoke
replaces the grant, a new grant replaces a revoke, a tombstone (null value) leaves no
consent at all.

An owner is named by whatever string the capture records carry in ``owner`` (the owner
pseudonym ``o…`` once the publisher pseudonymizes; the CLI pseudonymizes raw ids with
the local key store), so the ledger never holds a raw id.

:meth:`Consent.allows` is the one rule, used everywhere: a grant that names the scope
and covers the moment (``granted_at_ms <= at_ms < expires_at_ms``); a revoke, an
unknown owner, an expired or not-yet-valid grant allow nothing. Stages ask at these
moments (so a missing ledger entry fails closed at each of them):

===========  =========  ===================================================================
stage        scope      moment
===========  =========  ===================================================================
publisher    capture    the record's ``wall_time_ms`` (refused records are not published)
streams      capture    the record's ``wall_time_ms`` (quarantined ``no_consent``)
replay       by split   when the window is replayed (``train`` split: train; others:
                        evaluate; the window is quarantined ``no_consent``)
seal         by split   seal time (rows without a live grant are refused and counted)
train/eval   by split   when the snapshot is read (rows are excluded and counted)
===========  =========  ===================================================================
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.schemas.exceptions import SchemaError
from hebrus_flywheel.streams.exceptions import ConsentError
from hebrus_flywheel.streams.limits import ID_MAX_BYTES
from hebrus_flywheel.streams.topics import CONSENT_TOPIC

CONSENT_SCHEMA = "hebrus.flywheel.v1.ConsentRecord.v1"
SCOPES: tuple[str, ...] = ("capture", "train", "evaluate")
TRAIN_SPLIT = "train"
NEVER_MS = 2**63 - 1
Action = Literal["grant", "revoke"]

__all__ = ["CONSENT_SCHEMA", "CONSENT_TOPIC", "SCOPES", "Consent", "ConsentCheck",
           "ConsentLedger", "grant", "parse_scopes", "revoke", "scope_for_split"]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def scope_for_split(split: str) -> str:
    """The scope a window or row of ``split`` needs downstream of capture: ``train`` for
    the train split (what the model learns from), ``evaluate`` for every other split
    (validation and the holdouts only measure the model)."""
    return "train" if split == TRAIN_SPLIT else "evaluate"


def parse_scopes(text: str | Iterable[str]) -> tuple[str, ...]:
    """``"capture,train"`` (or an iterable) as a sorted, checked tuple of scopes."""
    items = text.split(",") if isinstance(text, str) else list(text)
    scopes = sorted({s.strip() for s in items if s.strip()})
    unknown = [s for s in scopes if s not in SCOPES]
    if not scopes or unknown:
        raise ConfigError(f"consent scopes must be a non-empty subset of {', '.join(SCOPES)}; "
                          f"got {unknown or 'none'}")
    return tuple(scopes)


def _text(name: str, value: str | None, *, required: bool) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"Consent.{name} must be a non-empty string, got {value!r}")
    if len(value.encode()) > ID_MAX_BYTES:
        raise ConfigError(f"Consent.{name} must be at most {ID_MAX_BYTES} UTF-8 bytes")


@dataclass(frozen=True, kw_only=True)
class Consent:
    """One ledger entry (a grant or a revoke) for ``owner``."""

    owner: str
    action: Action
    recorded_at_ms: int
    scopes: tuple[str, ...] = ()
    granted_at_ms: int | None = None
    expires_at_ms: int | None = None
    policy_version: str | None = None
    granted_by: str | None = None
    revoked_at_ms: int | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        _text("owner", self.owner, required=True)
        if self.action not in ("grant", "revoke"):
            raise ConfigError(f"Consent.action must be grant or revoke, got {self.action!r}")
        if self.action == "grant":
            self._check_grant()
        else:
            self._check_revoke()

    def _check_grant(self) -> None:
        object.__setattr__(self, "scopes", parse_scopes(self.scopes))
        if not isinstance(self.granted_at_ms, int) or not isinstance(self.expires_at_ms, int):
            raise ConfigError("Consent.granted_at_ms and Consent.expires_at_ms must be set "
                              "(Unix ms) on a grant")
        if self.expires_at_ms <= self.granted_at_ms:
            raise ConfigError(f"Consent.expires_at_ms ({self.expires_at_ms}) must be after "
                              f"granted_at_ms ({self.granted_at_ms})")
        _text("policy_version", self.policy_version, required=True)
        _text("granted_by", self.granted_by, required=True)

    def _check_revoke(self) -> None:
        if self.scopes:
            raise ConfigError("Consent.scopes must be empty on a revoke (it revokes all)")
        if not isinstance(self.revoked_at_ms, int):
            raise ConfigError("Consent.revoked_at_ms must be set (Unix ms) on a revoke")
        _text("reason", self.reason, required=True)

    def allows(self, scope: str, at_ms: int) -> bool:
        """Whether this entry is a grant of ``scope`` that covers ``at_ms``."""
        return (self.action == "grant" and scope in self.scopes
                and self.granted_at_ms is not None and self.expires_at_ms is not None
                and self.granted_at_ms <= at_ms < self.expires_at_ms)

    def status(self, at_ms: int) -> str:
        """``live``, ``pending`` (not yet valid), ``expired`` or ``revoked`` at ``at_ms``."""
        if self.action == "revoke":
            return "revoked"
        if at_ms < (self.granted_at_ms or 0):
            return "pending"
        return "live" if at_ms < (self.expires_at_ms or 0) else "expired"

    def to_record(self) -> dict[str, Any]:
        return {"owner": self.owner, "action": self.action, "scopes": list(self.scopes),
                "granted_at_ms": self.granted_at_ms, "expires_at_ms": self.expires_at_ms,
                "policy_version": self.policy_version, "granted_by": self.granted_by,
                "revoked_at_ms": self.revoked_at_ms, "reason": self.reason,
                "recorded_at_ms": self.recorded_at_ms}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Consent:
        fields_: dict[str, Any] = {k: record.get(k) for k in (
            "owner", "action", "recorded_at_ms", "granted_at_ms", "expires_at_ms",
            "policy_version", "granted_by", "revoked_at_ms", "reason")}
        return cls(**fields_, scopes=tuple(record.get("scopes") or ()))

    def encode(self) -> bytes:
        """The Avro single-object bytes of this entry (the ledger record's value)."""
        return codec.encode(CONSENT_SCHEMA, self.to_record())

    @classmethod
    def decode(cls, value: bytes) -> Consent:
        """An entry from a ledger record's value; ConsentError when it is not one."""
        try:
            schema, record = codec.decode(value)
            if schema.name != CONSENT_SCHEMA.rsplit(".v", 1)[0]:
                raise ConsentError(f"a {schema} record is not a consent entry")
            return cls.from_record(record)
        except (SchemaError, ConfigError, TypeError) as exc:
            raise ConsentError(f"not a valid consent entry: {exc}") from exc


def grant(owner: str, scopes: str | Iterable[str], *, expires_at_ms: int, policy_version: str,
          granted_by: str, granted_at_ms: int | None = None,
          recorded_at_ms: int | None = None) -> Consent:
    """A grant entry (``granted_at_ms`` defaults to now)."""
    now = now_ms() if recorded_at_ms is None else recorded_at_ms
    return Consent(owner=owner, action="grant", recorded_at_ms=now,
                   scopes=parse_scopes(scopes),
                   granted_at_ms=now if granted_at_ms is None else granted_at_ms,
                   expires_at_ms=expires_at_ms, policy_version=policy_version,
                   granted_by=granted_by)


def revoke(owner: str, *, reason: str, revoked_at_ms: int | None = None) -> Consent:
    """A revoke entry (``revoked_at_ms`` defaults to now)."""
    now = now_ms() if revoked_at_ms is None else revoked_at_ms
    return Consent(owner=owner, action="revoke", recorded_at_ms=now, revoked_at_ms=now,
                   reason=reason)


class ConsentCheck(Protocol):
    """What every stage asks: may ``owner``'s data be used for ``scope`` at ``at_ms``?"""

    def allows(self, owner: str, scope: str, at_ms: int) -> bool: ...


@dataclass
class ConsentLedger:
    """The ledger in memory: the latest entry per owner, built from the topic's records
    in offset order (:meth:`apply`). Pure; :class:`streams.consent_book.ConsentBook`
    reads it from Kafka."""

    entries: dict[str, Consent] = field(default_factory=dict)
    invalid: int = 0
    """Records on the topic that are not consent entries (ignored: they allow nothing)."""

    def apply(self, key: bytes | None, value: bytes | None) -> None:
        """One ledger record: an entry replaces the owner's, a tombstone removes it."""
        owner = key.decode("utf-8", "replace") if key else None
        if value is None:
            if owner is not None:
                self.entries.pop(owner, None)
            return
        try:
            entry = Consent.decode(value)
        except ConsentError:
            self.invalid += 1
            if owner is not None:  # an unreadable latest entry: the owner has no consent
                self.entries.pop(owner, None)
            return
        if owner is not None and owner != entry.owner:
            self.invalid += 1
            self.entries.pop(owner, None)
            return
        self.entries[entry.owner] = entry

    def allows(self, owner: str, scope: str, at_ms: int) -> bool:
        entry = self.entries.get(owner)
        return entry is not None and entry.allows(scope, at_ms)

    def get(self, owner: str) -> Consent | None:
        return self.entries.get(owner)
