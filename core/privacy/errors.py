"""Errors of the privacy layer: pseudonyms, owner data keys, sealed fields."""

from __future__ import annotations

from hebrus_flywheel.core.errors import FlywheelError


class PrivacyError(FlywheelError):
    """Base class for every privacy-layer error."""


class KeyStoreError(PrivacyError):
    """The key store cannot be used: missing, damaged, or not private."""


class OwnerKeyMissingError(PrivacyError):
    """No data key exists for this owner (never created here, or another key store)."""


class OwnerKeyDestroyedError(OwnerKeyMissingError):
    """The owner's data key was destroyed by an erasure: what it sealed is unreadable
    for good. Callers treat the record as erased, never as a transient failure."""


class SealedFieldError(PrivacyError):
    """A sealed field does not open: wrong key, wrong context, or damaged bytes."""
