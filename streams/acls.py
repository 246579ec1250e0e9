"""Least privilege on the embedded broker: one SCRAM principal per role and its ACLs.

Every binding is an ALLOW on a PREFIXED resource pattern, so that a catalogue created
with a test prefix ``P`` (``flywheel topics create --prefix P``, the integration tests'
``TopicFactory.catalogue``) gets its own bindings: the admin that creates a catalogue
grants them (:func:`grant_catalogue`). The broker denies everything else
(``allow.everyone.if.no.acl.found=false``); ``admin`` is a super user.

=========  ==============================================================================
role       may
=========  ==============================================================================
runtime    write + describe (and describe configs of) the capture topics; read consent
streams    read the capture topics; write + read windows, quarantine and streams runs
           (and describe their configs, checked against the catalogue at start);
           everything on its own internal topics and group (``<P>flywheel-streams*``)
replay     read windows; read + write control; write quarantine (windows the teacher
           cannot replay); read candidate work items; its groups ``<P>flywheel-replay*``
           (the candidate workers' group included)
sealer     read + write control; read capture, windows, streams runs and the streams
           worker's threads topic (seal, ``rebuild --from-capture``); write candidate
           work items (``flywheel replay candidates`` plans them);
           describe the replay group (its committed offsets)
trainer    read windows, quarantine and the streams decisions and crash-ledger topics,
           describe capture
           (``flywheel qualify --bootstrap-servers`` reads the streams summary); nothing
           else
admin      super user: creates topics, grants these bindings, manages credentials,
           writes the consent ledger (``flywheel consent``)
=========  ==============================================================================

Every role but admin reads the consent ledger (``flywheel.consent.*``) and only admin
writes it. Every reading role may also use private reader groups (``flywheel-reader-*``, see
``core.kafka.make_consumer``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialAlteration,
    UserScramCredentialUpsertion,
)

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.kafka.security import ROLES, embedded_properties
from hebrus_flywheel.streams.exceptions import BrokerError
from hebrus_flywheel.streams.processors.topology import DEFAULT_APP_ID

log = logging.getLogger(__name__)

CAPTURE = "flywheel.capture."
WINDOWS = "flywheel.windows."
QUARANTINE = "flywheel.quarantine."
CONTROL = "flywheel.control."
STREAMS_RUNS = "flywheel.streams."
CONSENT = "flywheel.consent."
CANDIDATES = "flywheel.candidates."
REPLAY_GROUP = "flywheel-replay"
READER_GROUP = "flywheel-reader-"
SCRAM_ITERATIONS = 4096
"""PBKDF2 iterations of the roles' SCRAM-SHA-512 credentials: Kafka's minimum and RFC 7677's
recommendation (the admin's, set by ``kafka-storage format --add-scram``, has the same
default). Iterations slow down guessing a weak password from a stolen credential; the role
passwords are 24 random bytes (192 bits), out of reach at any count, while every client connection
pays them on both ends (measured here: about 20 ms of secure-over-plaintext connection
cost at 8192 against about 10 ms at 4096)."""

READ = ("READ", "DESCRIBE")
WRITE = ("WRITE", "DESCRIBE")
READ_WRITE = ("READ", "WRITE", "DESCRIBE")


@dataclass(frozen=True, kw_only=True)
class Grant:
    """ALLOW ``operations`` on every ``kind`` (topic/group) whose name starts ``prefix``."""

    kind: str
    prefix: str
    operations: tuple[str, ...]


def role_grants(role: str, prefix: str = "") -> tuple[Grant, ...]:
    """The bindings of ``role`` for the catalogue with topic prefix ``prefix``."""
    def topic(name: str, ops: tuple[str, ...]) -> Grant:
        return Grant(kind="topic", prefix=prefix + name, operations=ops)

    def group(name: str, ops: tuple[str, ...]) -> Grant:
        return Grant(kind="group", prefix=name, operations=ops)

    reader = group(READER_GROUP, ("READ",))
    # A role that makes sure its topics exist (capture, the streams worker) also checks
    # their configs against the catalogue: DESCRIBE_CONFIGS, read-only.
    checks = ("DESCRIBE_CONFIGS",)
    table: dict[str, tuple[Grant, ...]] = {
        # The consent ledger: the admin writes it (`flywheel consent`); every stage that
        # handles an owner's data reads it and fails closed without a live grant.
        "runtime": (topic(CAPTURE, WRITE + checks), topic(CONSENT, READ), reader),
        "streams": (topic(CAPTURE, READ + checks), topic(WINDOWS, READ_WRITE + checks),
                    topic(QUARANTINE, READ_WRITE + checks),
                    topic(STREAMS_RUNS, READ_WRITE + checks),
                    topic(DEFAULT_APP_ID, ("ALL",)), group(prefix + DEFAULT_APP_ID, ("ALL",)),
                    topic(CONSENT, READ), reader),
        # The replay worker quarantines windows the teacher cannot replay.
        "replay": (topic(WINDOWS, READ), topic(CONTROL, READ_WRITE), topic(QUARANTINE, WRITE),
                   topic(CANDIDATES, READ),
                   group(prefix + REPLAY_GROUP, ("READ", "DESCRIBE")), topic(CONSENT, READ),
                   reader),
        "sealer": (topic(CONTROL, READ_WRITE), topic(CAPTURE, READ), topic(WINDOWS, READ),
                   topic(CANDIDATES, WRITE),
                   topic(STREAMS_RUNS, READ), topic(f"{DEFAULT_APP_ID}-threads-", READ),
                   group(prefix + REPLAY_GROUP, ("DESCRIBE",)), topic(CONSENT, READ), reader),
        "trainer": (topic(WINDOWS, READ), topic(QUARANTINE, READ),
                    topic(f"{DEFAULT_APP_ID}-decisions-", READ),
                    topic(f"{DEFAULT_APP_ID}-crashes-", READ),
                    topic(CAPTURE, ("DESCRIBE",)), topic(CONSENT, READ), reader),
        "admin": (),
    }
    return table[role]


def acl_bindings(prefix: str = "", roles: Iterable[str] = ROLES) -> list[AclBinding]:
    """Every role's bindings for ``prefix`` as confluent-kafka ``AclBinding``s."""
    kinds = {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP}
    out = []
    for role in roles:
        for grant in role_grants(role, prefix):
            for op in grant.operations:
                out.append(AclBinding(kinds[grant.kind], grant.prefix, ResourcePatternType.PREFIXED,
                                      f"User:{role}", "*", AclOperation[op],
                                      AclPermissionType.ALLOW))
    return out


def secure_embedded(bootstrap: str) -> bool:
    """Whether ``bootstrap`` is the embedded broker set up secure (so ACLs apply)."""
    return bool(embedded_properties(bootstrap, "admin"))


def grant_catalogue(target: kafka.KafkaTarget, prefix: str = "", *,
                    timeout_s: float = 30.0) -> int:
    """As admin, create every role's bindings for the catalogue with ``prefix`` (idempotent);
    returns how many bindings were sent. A bootstrap string that is not the secure
    embedded broker gets none (a managed cluster's ACLs are its operator's)."""
    if isinstance(target, str):
        if not secure_embedded(target):
            return 0
        target = kafka.client_config(target, role="admin")
    bootstrap = target.bootstrap_servers
    admin = kafka.make_admin(target, log_name=__name__)
    bindings = acl_bindings(prefix)
    try:
        for binding, future in admin.create_acls(bindings, request_timeout=timeout_s).items():
            future.result(timeout=timeout_s + 5)
            del binding
    except KafkaException as exc:
        raise BrokerError(f"granting the role ACLs on {bootstrap} failed: {exc}; check "
                          "`flywheel broker logs`") from exc
    _await_visible(admin, bindings, bootstrap, timeout_s)
    log.info("granted %d role ACL bindings for prefix %r", len(bindings), prefix)
    return len(bindings)


def _await_visible(admin: AdminClient, bindings: list[AclBinding], bootstrap: str,
                   timeout_s: float) -> None:
    """Wait until the broker's authorizer shows every binding (it applies them from the
    metadata log a moment after CreateAcls returns), so the next client is not refused."""
    anything: Any = None  # the stubs type the filter's wildcards as str
    every = AclBindingFilter(ResourceType.ANY, anything, ResourcePatternType.PREFIXED,
                             anything, anything, AclOperation.ANY, AclPermissionType.ANY)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            shown = set(admin.describe_acls(every, request_timeout=timeout_s)
                        .result(timeout=timeout_s + 5))
        except KafkaException as exc:
            raise BrokerError(f"listing the ACLs on {bootstrap} failed: {exc}") from exc
        if shown.issuperset(bindings):
            return
        if time.monotonic() > deadline:
            raise BrokerError(f"the role ACLs did not show up on {bootstrap} within "
                              f"{timeout_s:.0f}s; check `flywheel broker logs`")
        time.sleep(0.1)


def upsert_credentials(config: kafka.KafkaClientConfig, passwords: dict[str, str], *,
                       timeout_s: float = 30.0) -> None:
    """Create or update every role's SCRAM-SHA-512 credential (as admin, idempotent)."""
    admin = kafka.make_admin(config, log_name=__name__)
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    upserts: list[UserScramCredentialAlteration] = [
        UserScramCredentialUpsertion(user, info, password.encode())
        for user, password in passwords.items()]
    try:
        futures = admin.alter_user_scram_credentials(upserts, request_timeout=timeout_s)
        for future in futures.values():
            future.result(timeout=timeout_s + 5)
    except KafkaException as exc:
        raise BrokerError(f"storing the roles' SCRAM credentials failed: {exc}; check "
                          "`flywheel broker logs`") from exc
