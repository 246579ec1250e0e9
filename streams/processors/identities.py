"""Runtime identities known to a worker: the compacted identities topic, read into memory.

Every worker needs every identity (capture records of any partition may name any of
them), so each worker reads the whole identities topic itself at start and again, at
most once per ``refresh_interval_s`` per unknown id, when a record names an identity it
has not seen. The runtime publishes an identity before any record that uses it, so a
refresh that reaches the topic's end either finds it or proves it unknown.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping

from hebrus_flywheel.core import kafka
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.schemas.exceptions import SchemaError
from hebrus_flywheel.streams.exceptions import PublishValidationError
from hebrus_flywheel.streams.processors.exceptions import WorkerError
from hebrus_flywheel.streams.rules import IdentityRules
from hebrus_flywheel.streams.validation import validate_identity

log = logging.getLogger(__name__)
_LOG = "streams.librdkafka"


class IdentityBook:
    """``identity_id -> IdentityRules`` (None for a published but refused identity)."""

    def __init__(
        self,
        *,
        bootstrap: kafka.KafkaTarget,
        topic: str,
        refresh_interval_s: float = 5.0,
        timeout_s: float = 10.0,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.refresh_interval_s = refresh_interval_s
        self.timeout_s = timeout_s
        self.identities: MutableMapping[str, IdentityRules | None] = {}
        self._misses: dict[str, float] = {}

    def load(self) -> int:
        """Read the identities topic from the beginning to its end at the time of the call."""
        read = 0
        try:
            for msg in kafka.read_to_end(kafka.client_config(self.bootstrap), [self.topic],
                                         timeout_s=self.timeout_s, log_name=_LOG):
                read += self._apply(msg.value())
        except kafka.MissingTopicError as exc:
            raise WorkerError(f"identities topic {self.topic} does not exist; create the topics "
                              "(`flywheel topics create`)") from exc
        except kafka.KafkaIOError as exc:
            raise WorkerError(
                f"cannot read identities from {self.topic} on {self.bootstrap}: {exc}"
            ) from exc
        return read

    def _apply(self, value: bytes | None) -> int:
        if not value:
            return 0
        try:
            _, record = codec.decode(value)
            geometry = validate_identity(record)
        except (SchemaError, PublishValidationError, KeyError, TypeError):
            record_id = locals().get("record", {}).get("identity_id")
            if isinstance(record_id, str):
                self.identities.setdefault(record_id, None)
            return 0
        self.identities[geometry.identity_id] = geometry
        return 1

    def resolve(self, identity_id: str) -> None:
        """Re-read the topic for an unknown id (rate-limited per id)."""
        now = time.monotonic()
        if now - self._misses.get(identity_id, -1e9) < self.refresh_interval_s:
            return
        self._misses[identity_id] = now
        log.info("identity %s not known yet; re-reading %s", identity_id, self.topic)
        self.load()
