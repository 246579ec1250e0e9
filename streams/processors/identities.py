"""Runtime identities known to a worker: the compacted identities topic, read into memory.

Every worker needs every identity (capture records of any partition may name any of
them), so each worker reads the whole identities topic itself at start and again, at
most once per ``refresh_interval_s`` per unknown id, when a record names an identity it
has not seen.

The runtime publishes an identity before any record that uses it, but Kafka does not
order writes across topics: a producer's batch of transcripts or observations may be
appended before the batch holding the identity it enqueued first (a full batch is sent
before a lingering one). So a refresh that misses waits up to ``grace_s`` for the
identity to land, re-reading the topic, before the id counts as unknown (its records are
then quarantined as ``unknown_identity``). The wait happens at most once per
``refresh_interval_s`` across all ids, so records naming made-up identities cannot stall
the worker for longer than that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.errors import ConfigError
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
        grace_s: float = 2.0,
        grace_poll_s: float = 0.2,
    ) -> None:
        for name, value in (("refresh_interval_s", refresh_interval_s), ("timeout_s", timeout_s),
                            ("grace_s", grace_s), ("grace_poll_s", grace_poll_s)):
            if value < 0 or (value == 0 and name in ("timeout_s", "grace_poll_s")):
                raise ConfigError(f"IdentityBook.{name} must be > 0 seconds (grace_s and "
                                  f"refresh_interval_s may be 0), got {value!r}")
        self.bootstrap = bootstrap
        self.topic = topic
        self.refresh_interval_s = refresh_interval_s
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.grace_poll_s = grace_poll_s
        self.identities: MutableMapping[str, IdentityRules | None] = {}
        self._misses: dict[str, float] = {}
        self._last_grace = -1e9

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
        """Re-read the topic for an unknown id (rate-limited per id); if it is still missing,
        keep re-reading for up to ``grace_s`` (at most once per ``refresh_interval_s``)."""
        now = time.monotonic()
        if now - self._misses.get(identity_id, -1e9) < self.refresh_interval_s:
            return
        self._misses[identity_id] = now
        log.info("identity %s not known yet; re-reading %s", identity_id, self.topic)
        self.load()
        if identity_id in self.identities or now - self._last_grace < self.refresh_interval_s:
            return
        self._last_grace = now
        deadline = now + self.grace_s
        while identity_id not in self.identities and time.monotonic() < deadline:
            time.sleep(self.grace_poll_s)  # its producer may still be delivering it
            self.load()
        if identity_id in self.identities:
            log.info("identity %s landed %.2f s after a record naming it", identity_id,
                     time.monotonic() - now)
