"""Fixtures for integration tests against a real Kafka broker.

``kafka_bootstrap`` uses ``$FLYWHEEL_BOOTSTRAP_SERVERS`` when set; otherwise it starts the
embedded broker of ``$FLYWHEEL_HOME`` (default ``./.flywheel``) if it is not running yet and
leaves it running afterwards (``.ci/run`` / ``flywheel broker down`` stops it).

``topic_factory`` (module-scoped) makes uuid-named topics (plain ones, or a prefixed copy
of the whole catalogue) and deletes them when the module's tests are done.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import pytest

from hebrus_flywheel.core.kafka.security import insecure_marker, role_properties_path
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV, KAFKA_CONFIG_ENV
from hebrus_flywheel.streams.acls import grant_catalogue
from hebrus_flywheel.streams.broker import BrokerConfig, EmbeddedBroker, probe_metadata
from hebrus_flywheel.streams.consent import CONSENT_TOPIC
from hebrus_flywheel.streams.exceptions import BrokerError
from hebrus_flywheel.streams.processors.topology import DEFAULT_APP_ID, StreamTopics
from hebrus_flywheel.streams.topics import (
    TopicSpec,
    catalogue,
    create_topics,
    delete_topics,
    spec_for,
)
from tests.support.consent import grant_owners

# faust's changelog topics of the stream worker's tables (streams.processors.app)
STREAMS_TABLES = ("capture-state", "dedup-state", "dedup-bands", "dedup-homes")


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    """Bootstrap servers of a running broker (external, or the embedded one started here)."""
    external = os.environ.get(BOOTSTRAP_ENV)
    if external:
        if not probe_metadata(external, 15.0):
            pytest.fail(f"{BOOTSTRAP_ENV}={external} does not answer metadata requests")
        return external
    broker = EmbeddedBroker(BrokerConfig(insecure_plaintext=insecure_marker().is_file()))
    try:
        broker.up()
    except BrokerError:
        # Another session may own a broker on the same address (e.g. another FLYWHEEL_HOME).
        if not probe_metadata(broker.config.bootstrap, 5.0):
            raise
    admin = role_properties_path("admin")
    if not os.environ.get(KAFKA_CONFIG_ENV) and not broker.config.insecure_plaintext:
        # Tests (and the worker processes they start) run as the admin; the role tests in
        # test_security.py build each role's clients from its own properties file.
        os.environ[KAFKA_CONFIG_ENV] = str(admin)
    return broker.config.bootstrap


class TopicFactory:
    """Creates uniquely named topics on the test broker and remembers them for deletion."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.prefix = f"t-{uuid.uuid4().hex[:12]}."
        self.created: list[str] = []

    def __call__(
        self, name: str = "topic", *, partitions: int = 1, configs: Mapping[str, str] | None = None
    ) -> str:
        """Create ``<prefix><name>-<uuid>`` with ``partitions``; returns the full name."""
        full = f"{self.prefix}{name}-{uuid.uuid4().hex[:8]}"
        spec = TopicSpec(
            name=full, partitions=partitions, doc="integration test topic", configs=configs or {}
        )
        self.create([spec])
        return full

    def catalogue(self) -> tuple[TopicSpec, ...]:
        """Create (idempotently) a prefixed copy of the whole catalogue; returns its specs."""
        specs = catalogue(self.prefix)
        self.create(specs)
        grant_catalogue(self.bootstrap, self.prefix)  # the roles' ACLs for this copy
        return specs

    def streams_namespace(self, name: str, app_id: str = DEFAULT_APP_ID
                          ) -> tuple[str, StreamTopics]:
        """A fresh prefix ``<prefix><name><6 hex>.`` with the whole catalogue created, and
        every topic a stream worker of ``app_id`` makes there (its internal topics, table
        changelogs, faust's assignor topic) tracked for deletion; returns (prefix, topics)."""
        prefix = f"{self.prefix}{name}{uuid.uuid4().hex[:6]}."
        self.create(catalogue(prefix))
        topics, full_app = StreamTopics.from_prefix(prefix, app_id), prefix + app_id
        self.track([topics.threads, topics.decisions, topics.ticks, topics.crashes,
                    topics.homes, topics.bands,
                    *(f"{full_app}-{table}-changelog" for table in STREAMS_TABLES),
                    f"{full_app}-__assignor-__leader"])
        return prefix, topics

    def grant_consent(self, owners: Iterable[str], **kwargs: Any) -> str:
        """Grant consent (every scope unless ``scopes=``) to ``owners`` on this prefix's
        consent ledger, creating the ledger topic if needed; returns its name. Every test
        that captures data calls this (or ``tests.support.consent``) first."""
        spec = spec_for(self.prefix + CONSENT_TOPIC, catalogue(self.prefix))
        self.create([spec])
        grant_owners(self.bootstrap, owners, prefix=self.prefix, **kwargs)
        return spec.name

    def create(self, specs: Sequence[TopicSpec]) -> dict[str, str]:
        """Create ``specs`` (tracked for deletion); returns name -> created|exists."""
        self.track(s.name for s in specs)
        return dict(create_topics(self.bootstrap, specs))

    def track(self, names: Iterable[str]) -> None:
        """Delete ``names`` at teardown too (for topics created by the code under test)."""
        for name in names:
            if name not in self.created:
                self.created.append(name)

    def cleanup(self) -> None:
        delete_topics(self.bootstrap, self.created)
        self.created.clear()


@pytest.fixture(scope="module")
def topic_factory(kafka_bootstrap: str) -> Iterator[TopicFactory]:
    """One factory (one prefix) per test module, so module-scoped fixtures can use it too;
    every topic it made or tracked is deleted when the module finishes."""
    factory = TopicFactory(kafka_bootstrap)
    yield factory
    factory.cleanup()


@pytest.fixture(scope="session")
def s3_root() -> Iterator[str]:
    """``s3://flywheel-snapshots/t-<uuid>`` on the embedded SeaweedFS of ``$FLYWHEEL_HOME``
    (started here if it is not running yet and left running, like the broker; ``make
    test`` starts it first); every object under the prefix is deleted afterwards."""
    from hebrus_flywheel.core.storage import WRITE_ROLE, S3Store, s3_target
    from hebrus_flywheel.core.storage.config import DEFAULT_BUCKET
    from hebrus_flywheel.streams.storage_server import EmbeddedStorage

    EmbeddedStorage().up()
    root = f"s3://{DEFAULT_BUCKET}/t-{uuid.uuid4().hex[:12]}"
    yield root
    store = S3Store(root, s3_target(WRITE_ROLE))
    store.delete(list(store.objects("")))
