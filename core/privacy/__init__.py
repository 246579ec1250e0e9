"""Privacy primitives shared by every stage: pseudonymous ids, owner data keys in a key
store, and fields sealed under those keys so that destroying a key erases an owner.

Stages import from here; nothing in this package talks to Kafka or touches data files.
"""

from hebrus_flywheel.core.privacy.envelope import (
    DataKey,
    keyed_digest,
    open_sealed,
    pack_int32,
    seal,
    seal_deterministic,
    unpack_int32,
)
from hebrus_flywheel.core.privacy.errors import (
    KeyStoreError,
    OwnerKeyDestroyedError,
    OwnerKeyMissingError,
    PrivacyError,
    SealedFieldError,
)
from hebrus_flywheel.core.privacy.keystore import (
    Destruction,
    LocalOwnerKeyStore,
    OwnerKeyStore,
    default_owner_keys_dir,
    fingerprint,
)
from hebrus_flywheel.core.privacy.pseudonyms import Pseudonymizer, is_pseudonym

__all__ = [
    "DataKey", "Destruction", "KeyStoreError", "LocalOwnerKeyStore", "OwnerKeyDestroyedError",
    "OwnerKeyMissingError", "OwnerKeyStore", "PrivacyError", "Pseudonymizer",
    "SealedFieldError", "default_owner_keys_dir", "fingerprint", "is_pseudonym",
    "keyed_digest", "open_sealed", "pack_int32", "seal", "seal_deterministic", "unpack_int32",
]
