"""The topic catalogue: every Kafka topic the flywheel uses, and idempotent creation.

Topics are named ``flywheel.<stage>.<name>.v<N>`` and keyed by ``owner/thread`` (the
identities topic is keyed by identity id). How long each topic keeps its records is the
operator's retention policy per topic class (:mod:`streams.retention`: capture and window
topics 7 days, quarantine 24 hours, control and streams-runs forever by default); the
identities topic is compacted. An existing topic whose retention differs from the policy
is accepted and reported as its effective retention; a different partition count or
cleanup policy, or a retention under the class minimum, is refused.

Integration tests use :func:`catalogue` with a unique ``prefix`` so that each run gets
its own uuid-named copies of the real topics.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.settings import topic_partitions
from hebrus_flywheel.streams.exceptions import TopicError
from hebrus_flywheel.streams.limits import QUARANTINE_MAX_MESSAGE_BYTES
from hebrus_flywheel.streams.retention import (
    CONFIGURABLE,
    DEFAULT_POLICY,
    RETAIN_FOREVER,
    RetentionPolicy,
    load_policy,
    min_retention_ms,
    topic_class,
)

log = logging.getLogger(__name__)

TOPIC_NAME_PATTERN = (
    r"flywheel\.(?P<stage>[a-z][a-z0-9_]*)\.(?P<name>[a-z][a-z0-9_]*)\.v(?P<version>[1-9][0-9]*)"
)
TOPIC_NAME_RE = re.compile(rf"^{TOPIC_NAME_PATTERN}$")
_KAFKA_LEGAL_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_KAFKA_MAX_NAME = 249
CLEANUP_POLICIES = ("delete", "compact", "compact,delete")

IDENTITIES_TOPIC = "flywheel.capture.identities.v1"
TRANSCRIPTS_TOPIC = "flywheel.capture.transcripts.v1"
OBSERVATIONS_TOPIC = "flywheel.capture.observations.v1"
QUARANTINE_TOPIC = "flywheel.quarantine.records.v1"
CONTROL_TOPIC = "flywheel.control.epochs.v1"
STREAMS_RUNS_TOPIC = "flywheel.streams.runs.v1"
CONSENT_TOPIC = "flywheel.consent.ledger.v1"
CANDIDATE_BLOCKS_TOPIC = "flywheel.candidates.blocks.v1"
CANDIDATE_CONTROL_TOPIC = "flywheel.control.candidates.v1"
SPLITS: tuple[str, ...] = (
    "train",
    "validation",
    "temporal_holdout",
    "stress_holdout",
    "runtime_holdout",
)

TopicState = Literal["created", "exists"]


def window_topic(split: str) -> str:
    """The window topic of one split, e.g. ``flywheel.windows.train.v1``."""
    if split not in SPLITS:
        raise TopicError(
            f"unknown split {split!r}; use one of {', '.join(SPLITS)} "
            "(streams.topics.SPLITS lists the splits that have window topics)"
        )
    return f"flywheel.windows.{split}.v1"


def validate_topic_name(name: str, *, prefix: str = "") -> str:
    """Return ``name`` if it is ``<prefix>flywheel.<stage>.<name>.v<N>``, else raise TopicError."""
    if not name.startswith(prefix):
        raise TopicError(
            f"topic {name!r} lacks the expected prefix {prefix!r}; "
            f"name it {prefix}flywheel.<stage>.<name>.v<N>"
        )
    if not TOPIC_NAME_RE.match(name[len(prefix) :]):
        raise TopicError(
            f"topic {name!r} breaks the naming convention; name it "
            f"{prefix}flywheel.<stage>.<name>.v<N> (lower-case stage and name, N >= 1)"
        )
    _check_kafka_legal(name)
    return name


def _check_kafka_legal(name: str) -> None:
    if (
        not name
        or len(name) > _KAFKA_MAX_NAME
        or not _KAFKA_LEGAL_RE.match(name)
        or name in {".", ".."}
    ):
        raise TopicError(
            f"{name!r} is not a legal Kafka topic name; use 1-{_KAFKA_MAX_NAME} characters "
            "from [A-Za-z0-9._-]"
        )


@dataclass(frozen=True, kw_only=True)
class TopicSpec:
    """One topic of the catalogue and the configuration it is created with."""

    name: str
    """Full topic name (``flywheel.<stage>.<name>.v<N>``, possibly with a test prefix)."""
    partitions: int
    """Number of partitions; records with the same key always land in the same one."""
    retention_ms: int = RETAIN_FOREVER
    """``retention.ms``: -1 keeps data forever; catalogue topics get their class's value
    from the retention policy (:func:`apply_retention`)."""
    cleanup_policy: str = "delete"
    """``cleanup.policy``: ``delete``, ``compact`` or ``compact,delete``."""
    key: str = "owner/thread"
    """What the message key is, for humans (``owner/thread`` for almost every topic)."""
    doc: str
    """One sentence saying what the topic carries."""
    configs: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Extra topic-level configs (e.g. ``{"max.message.bytes": "8388608"}``)."""

    def __post_init__(self) -> None:
        try:
            _check_kafka_legal(self.name)
        except TopicError as exc:
            raise ConfigError(f"TopicSpec.name: {exc}") from exc
        if (
            isinstance(self.partitions, bool)
            or not isinstance(self.partitions, int)
            or self.partitions < 1
        ):
            raise ConfigError(
                f"TopicSpec.partitions must be an integer >= 1, "
                f"got {self.partitions!r} for {self.name}"
            )
        if self.retention_ms != RETAIN_FOREVER and self.retention_ms <= 0:
            raise ConfigError(
                f"TopicSpec.retention_ms must be -1 (forever) or > 0, "
                f"got {self.retention_ms} for {self.name}"
            )
        if self.cleanup_policy not in CLEANUP_POLICIES:
            raise ConfigError(
                f"TopicSpec.cleanup_policy must be one of {CLEANUP_POLICIES}, "
                f"got {self.cleanup_policy!r}"
            )
        if not self.doc.strip():
            raise ConfigError(f"TopicSpec.doc must describe what {self.name} carries")
        reserved = {"cleanup.policy", "retention.ms"} & set(self.configs)
        if reserved:
            raise ConfigError(
                f"TopicSpec.configs must not set {sorted(reserved)}; "
                "use the cleanup_policy/retention_ms fields"
            )
        object.__setattr__(
            self, "configs", MappingProxyType({str(k): str(v) for k, v in self.configs.items()})
        )

    def topic_configs(self) -> dict[str, str]:
        """Every topic-level config this spec creates the topic with."""
        return {
            "cleanup.policy": self.cleanup_policy,
            "retention.ms": str(self.retention_ms),
            **self.configs,
        }

    def with_prefix(self, prefix: str) -> TopicSpec:
        """The same spec under ``prefix + name`` (used by tests for uuid-named topics)."""
        return replace(self, name=f"{prefix}{self.name}", configs=dict(self.configs))


SCALED = 4
"""Placeholder partition count of the keyed topics below; :func:`scale_partitions`
gives them ``$FLYWHEEL_TOPIC_PARTITIONS`` (default 12) when the catalogue is built.
Single-partition topics (ledgers, control, identities) stay at 1: their order matters."""


def scale_partitions(specs: Iterable[TopicSpec], partitions: int | None = None
                     ) -> tuple[TopicSpec, ...]:
    """``specs`` with every keyed (multi-partition) topic at ``partitions`` (default
    :func:`core.settings.topic_partitions`)."""
    n = topic_partitions() if partitions is None else partitions
    return tuple(replace(s, partitions=n, configs=dict(s.configs)) if s.partitions > 1 else s
                 for s in specs)


def _window_spec(split: str) -> TopicSpec:
    return TopicSpec(
        name=window_topic(split),
        partitions=SCALED,
        doc=f"Causal windows of {split} threads, cut after split and dedup; input of replay.",
    )


_BASE_CATALOGUE: tuple[TopicSpec, ...] = (
    TopicSpec(
        name=IDENTITIES_TOPIC,
        partitions=1,
        cleanup_policy="compact",
        key="identity id",
        doc="Pinned runtime identities (model, tokenizer, template, dtype, tie-break rule).",
    ),
    TopicSpec(
        name=TRANSCRIPTS_TOPIC,
        partitions=SCALED,
        doc="Captured conversation turns (token ids and text) from live decode.",
    ),
    TopicSpec(
        name=OBSERVATIONS_TOPIC,
        partitions=SCALED,
        doc="Native top-k routing observations captured during live decode.",
    ),
    TopicSpec(
        name=QUARANTINE_TOPIC,
        partitions=SCALED,
        doc="Records refused by validation, with a reason code; never reach a shard.",
        # explicit, and the quarantine producers' maximum request size: every quarantine
        # record is cut and size-checked against it (streams.quarantine)
        configs={"max.message.bytes": str(QUARANTINE_MAX_MESSAGE_BYTES)},
    ),
    *(_window_spec(split) for split in SPLITS),
    TopicSpec(
        name=CONTROL_TOPIC,
        partitions=1,
        key="epoch id",
        doc="Epoch seal control records (seal requests and sealed manifests).",
    ),
    TopicSpec(
        name=STREAMS_RUNS_TOPIC,
        partitions=1,
        key="streams app id",
        doc="One record per streams worker start: its full config and capture start offsets.",
    ),
    TopicSpec(
        name=CONSENT_TOPIC,
        partitions=1,
        cleanup_policy="compact",
        key="owner pseudonym",
        doc="The consent ledger: the latest grant or revocation per owner (streams.consent).",
    ),
    TopicSpec(
        name=CANDIDATE_BLOCKS_TOPIC,
        partitions=SCALED,
        key="job/topic/partition/first offset",
        doc="Candidate-path work: one clean-epoch block per record, window offsets only "
            "(consumers.candidate_jobs); input of candidate workers.",
    ),
    TopicSpec(
        name=CANDIDATE_CONTROL_TOPIC,
        partitions=1,
        key="epoch id",
        doc="Candidate-path plans, written candidate shards and sealed candidate epochs.",
    ),
)


def apply_retention(specs: Iterable[TopicSpec], policy: RetentionPolicy) -> tuple[TopicSpec, ...]:
    """``specs`` with the policy's retention for their class; compacted-only topics and
    topics of a class the policy does not configure are left as they are."""
    out = []
    for spec in specs:
        cls = topic_class(spec.name)
        if spec.cleanup_policy != "compact" and cls in CONFIGURABLE:
            spec = replace(spec, retention_ms=policy.retention_ms(cls), configs=dict(spec.configs))
        out.append(spec)
    return tuple(out)


CATALOGUE: tuple[TopicSpec, ...] = apply_retention(scale_partitions(_BASE_CATALOGUE),
                                                   DEFAULT_POLICY)
"""The catalogue with the default retention policy."""


def catalogue(prefix: str = "", policy: RetentionPolicy | None = None) -> tuple[TopicSpec, ...]:
    """The catalogue, with every name prefixed by ``prefix`` (e.g. ``"t-<uuid>."`` in tests)
    and the retention of ``policy`` (default: :func:`streams.retention.load_policy`, i.e.
    ``$FLYWHEEL_RETENTION_CONFIG`` or the defaults)."""
    if prefix:
        _check_kafka_legal(prefix)
    policy = load_policy() if policy is None else policy
    return apply_retention(scale_partitions(spec.with_prefix(prefix) for spec in _BASE_CATALOGUE),
                           policy)


def spec_for(name: str, specs: Iterable[TopicSpec] = CATALOGUE) -> TopicSpec:
    """The spec named ``name``, or TopicError listing what exists."""
    for spec in specs:
        if spec.name == name:
            return spec
    raise TopicError(
        f"{name!r} is not in the topic catalogue; known topics: {[s.name for s in CATALOGUE]}"
    )


def _where(target: kafka.KafkaTarget) -> str:
    """The bootstrap list for messages (never a config's credentials)."""
    return target if isinstance(target, str) else target.bootstrap_servers


def admin_client(bootstrap: kafka.KafkaTarget, **extra: Any) -> AdminClient:
    """An AdminClient (see :func:`core.kafka.make_admin`) with the process's Kafka config."""
    return kafka.make_admin(kafka.client_config(bootstrap), settings=extra,
                            log_name="streams.librdkafka")


def create_topics(
    bootstrap: kafka.KafkaTarget,
    specs: Sequence[TopicSpec] = CATALOGUE,
    *,
    timeout_s: float = 30.0,
    strict: bool = True,
) -> dict[str, TopicState]:
    """Create ``specs`` on the cluster; existing topics are left alone and reported ``exists``.

    With ``strict`` (the default), an existing topic whose partition count, cleanup policy
    or extra configs differ from its spec, or whose retention is under its class minimum,
    raises :class:`TopicError` (:func:`check_topics`); a retention the operator set on the
    broker is accepted and logged as the effective retention.
    """
    if not specs:
        return {}
    admin = admin_client(bootstrap)
    known = _require_reachable(admin, bootstrap, min(timeout_s, 10.0))
    # Existing topics are not created again: a role that may use a topic but not create it
    # (the streams worker and the catalogue topics) then never asks for CREATE.
    result: dict[str, TopicState] = {s.name: "exists" for s in specs if s.name in known}
    new = [
        NewTopic(
            s.name, num_partitions=s.partitions, replication_factor=-1, config=s.topic_configs()
        )
        for s in specs
        if s.name not in known
    ]
    if new:
        result.update(create_retrying(
            lambda topics: admin.create_topics(topics, operation_timeout=timeout_s,
                                               request_timeout=timeout_s),
            new, policy=kafka.client_config(bootstrap).retry, where=_where(bootstrap),
            timeout_s=timeout_s))
    existing = [s for s in specs if result.get(s.name) == "exists"]
    if strict and existing:
        problems = check_topics(bootstrap, existing, timeout_s=timeout_s)
        if problems:
            raise TopicError(
                "existing topics differ from the catalogue: "
                + "; ".join(problems)
                + ". Delete and recreate them (data is lost) or alter their configs to match."
            )
    log.info("topics on %s: %s", _where(bootstrap), result)
    return result


def _require_reachable(admin: AdminClient, bootstrap: kafka.KafkaTarget,
                       timeout_s: float) -> set[str]:
    """The topics the cluster shows this client; TopicError when it does not answer."""
    try:
        metadata = kafka.client_config(bootstrap).retry.call(
            lambda: admin.list_topics(timeout=timeout_s),
            what=f"metadata request to {_where(bootstrap)}")
    except (KafkaException, kafka.KafkaRetryError) as exc:
        raise TopicError(
            f"cannot reach Kafka at {_where(bootstrap)}: {exc}; start the broker "
            "(`flywheel broker up`) "
            "or point --bootstrap-servers / FLYWHEEL_BOOTSTRAP_SERVERS at a running cluster"
        ) from exc
    return set(metadata.topics)


_CREATE_TRANSIENT_CODES = frozenset({
    # what a node answers while the KRaft controller it forwards to dies or moves
    KafkaError.UNKNOWN,
    KafkaError.NOT_CONTROLLER,
})


def is_transient_create_error(err: KafkaError) -> bool:
    """Whether a topic creation that failed with ``err`` is worth asking for again: the
    Kafka layer's retriable errors, plus the unknown-server and not-controller answers of a
    cluster whose controller is changing (the topic's fate is then unknown; asking again
    answers TOPIC_ALREADY_EXISTS if it was made)."""
    return kafka.is_retriable(err) or (not err.fatal() and err.code() in _CREATE_TRANSIENT_CODES)


def create_retrying(create: Callable[[list[NewTopic]], Mapping[str, Any]],
                    new: Sequence[NewTopic], *, policy: kafka.RetryPolicy, where: str,
                    timeout_s: float) -> dict[str, TopicState]:
    """Ask ``create`` (one CreateTopics request; name -> future) for ``new``, then again
    for those that failed transiently, backing off by ``policy``. Raises
    :class:`TopicError` for a refusal at once, and for a topic still failing transiently
    after ``policy.attempts`` requests."""
    pending = {topic.topic: topic for topic in new}
    result: dict[str, TopicState] = {}
    attempt = 0
    while True:
        attempt += 1
        transient: dict[str, KafkaError] = {}
        for name, fut in create(list(pending.values())).items():
            outcome = _creation_state(name, fut, where, timeout_s)
            if isinstance(outcome, KafkaError):
                transient[name] = outcome
            else:
                result[name] = outcome
        if not transient:
            return result
        name, err = next(iter(transient.items()))
        what = f"creating topic{'s' if len(transient) > 1 else ''} {', '.join(transient)}"
        if attempt == policy.attempts:
            raise TopicError(f"could not create topic {name} on {where}: "
                             f"{policy.give_up(what, err)}") from KafkaException(err)
        policy.wait(attempt, what, err)
        pending = {n: pending[n] for n in transient}


def _creation_state(name: str, fut: Any, where: str,
                    timeout_s: float) -> TopicState | KafkaError:
    """The topic's state, or the KafkaError of a transient failure (to ask again)."""
    try:
        fut.result(timeout=timeout_s + 5)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return "exists"
        if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            raise TopicError(
                f"topic {name} is missing on {where} and this process's Kafka "
                "principal may not create it; create the catalogue as the admin "
                "(`flywheel topics create`) and run again") from exc
        if isinstance(err, KafkaError) and is_transient_create_error(err):
            return err
        raise TopicError(
            f"could not create topic {name} on {where}: {exc}; check that the "
            "broker is "
            "running (`flywheel broker status`) and accepts topic creation"
        ) from exc
    return "created"


@dataclass(frozen=True, kw_only=True)
class TopicInfo:
    """What the cluster says about one topic."""

    name: str
    partitions: int
    configs: Mapping[str, str] = field(hash=False)
    replication: int = 1
    """Replicas of the topic's partitions (the largest count: a partition whose leader is
    down still lists its replicas)."""


def describe_topics(
    bootstrap: kafka.KafkaTarget, names: Iterable[str] | None = None, *, timeout_s: float = 15.0
) -> dict[str, TopicInfo]:
    """Partitions and configs of ``names`` (all non-internal topics when None).

    Names that do not exist on the cluster are left out of the result.
    """
    admin = admin_client(bootstrap)
    _require_reachable(admin, bootstrap, timeout_s)
    metadata = kafka.client_config(bootstrap).retry.call(
        lambda: admin.list_topics(timeout=timeout_s),
        what=f"metadata request to {_where(bootstrap)}")
    wanted = (
        [n for n in metadata.topics if not n.startswith("__")] if names is None else list(names)
    )
    present = [n for n in wanted if n in metadata.topics and metadata.topics[n].error is None]
    configs = _topic_configs(admin, bootstrap, present, timeout_s)
    return {
        n: TopicInfo(name=n, partitions=len(metadata.topics[n].partitions), configs=configs[n],
                     replication=max((len(p.replicas) for p in
                                      metadata.topics[n].partitions.values()), default=1))
        for n in sorted(present)
    }


def _topic_configs(
    admin: AdminClient, bootstrap: kafka.KafkaTarget, names: list[str], timeout_s: float
) -> dict[str, dict[str, str]]:
    if not names:
        return {}
    retry = kafka.client_config(bootstrap).retry
    out: dict[str, dict[str, str]] = {}
    for name in names:
        resource = ConfigResource(ConfigResource.Type.TOPIC, name)

        def describe(resource: ConfigResource = resource) -> Any:
            futures = admin.describe_configs([resource], request_timeout=timeout_s)
            return futures[resource].result(timeout=timeout_s + 5)

        try:  # retried: a controller election (a node just died) times out for a while
            entries = retry.call(describe, what=f"configs of {name}")
        except (KafkaException, kafka.KafkaRetryError) as exc:
            raise TopicError(
                f"cannot describe configs of {name} on {_where(bootstrap)}: {exc}; "
                "retry once the broker is healthy (`flywheel broker status`)"
            ) from exc
        out[name] = {k: str(e.value) for k, e in entries.items() if e.value is not None}
    return out


@dataclass(frozen=True, kw_only=True)
class TopicCheck:
    """How the cluster's topics compare with their specs."""

    problems: list[str]
    """Differences that break a guarantee (missing topic, partitions, cleanup policy,
    extra configs, retention under the class minimum): startup must fail."""
    notes: list[str]
    """Accepted differences: the effective retention the operator configured."""


def spec_differences(spec: TopicSpec, info: TopicInfo) -> tuple[list[str], list[str]]:
    """(problems, notes) of one existing topic against its spec (see :class:`TopicCheck`)."""
    problems: list[str] = []
    notes: list[str] = []
    if info.partitions != spec.partitions:
        problems.append(
            f"{spec.name} has {info.partitions} partitions, catalogue wants {spec.partitions} "
            f"(a keyed topic cannot change its count under existing keys: keep this cluster's "
            f"with FLYWHEEL_TOPIC_PARTITIONS={info.partitions}, or start on fresh topics)"
        )
    for key, want in spec.topic_configs().items():
        have = info.configs.get(key)
        if have == want:
            continue
        if key != "retention.ms":
            problems.append(f"{spec.name} has {key}={have}, catalogue wants {want}")
        elif (problem := _retention_problem(spec.name, have)) is not None:
            problems.append(problem)
        elif spec.cleanup_policy != "compact":
            notes.append(f"{spec.name}: effective retention.ms={have} (set on the broker; "
                         f"the policy default is {want})")
    return problems, notes


def _retention_problem(name: str, have: str | None) -> str | None:
    floor = min_retention_ms(topic_class(name))
    try:
        value = int(have) if have is not None else None
    except ValueError:
        value = None
    if value is None or (value != RETAIN_FOREVER and value <= 0):
        return f"{name} has retention.ms={have}, which is not a retention Kafka accepts"
    if value != RETAIN_FOREVER and value < floor:
        return (f"{name} has retention.ms={value}, under the minimum {floor} for "
                f"{topic_class(name)} topics (streams.retention.MIN_DATA_RETENTION_MS); "
                "raise it with kafka-configs or recreate the topic")
    return None


def compare_topics(
    bootstrap: kafka.KafkaTarget, specs: Sequence[TopicSpec], *, timeout_s: float = 15.0,
    log_notes: bool = True,
) -> TopicCheck:
    """Problems and accepted differences between ``specs`` and the cluster (the accepted
    ones logged at INFO unless ``log_notes`` is false)."""
    infos = describe_topics(bootstrap, [s.name for s in specs], timeout_s=timeout_s)
    problems: list[str] = []
    notes: list[str] = []
    for spec in specs:
        info = infos.get(spec.name)
        if info is None:
            problems.append(f"{spec.name} is missing")
            continue
        bad, accepted = spec_differences(spec, info)
        problems += bad
        notes += accepted
    for note in notes if log_notes else []:
        log.info("%s", note)
    return TopicCheck(problems=problems, notes=notes)


def check_topics(
    bootstrap: kafka.KafkaTarget, specs: Sequence[TopicSpec], *, timeout_s: float = 15.0
) -> list[str]:
    """Human-readable differences between ``specs`` and the cluster that break a guarantee
    (missing topics included); accepted retention differences are only logged."""
    return compare_topics(bootstrap, specs, timeout_s=timeout_s).problems


def delete_topics(
    bootstrap: kafka.KafkaTarget, names: Iterable[str], *, timeout_s: float = 30.0
) -> dict[str, str]:
    """Delete ``names``; returns name -> ``deleted`` | ``missing``. Used by test teardown."""
    names = list(names)
    if not names:
        return {}
    admin = admin_client(bootstrap)
    result: dict[str, str] = {}
    for name, fut in admin.delete_topics(
        names, operation_timeout=timeout_s, request_timeout=timeout_s
    ).items():
        try:
            fut.result(timeout=timeout_s + 5)
            result[name] = "deleted"
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                result[name] = "missing"
                continue
            raise TopicError(
                f"could not delete topic {name} on {_where(bootstrap)}: {exc}; check the broker log"
            ) from exc
    return result
