"""Where each partition lives: leader and in-sync replicas of every topic, and which
nodes answer (``flywheel broker status``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from confluent_kafka import KafkaException

from hebrus_flywheel.core import kafka
from hebrus_flywheel.streams.exceptions import BrokerError


@dataclass(frozen=True, kw_only=True)
class PartitionState:
    """One partition as the cluster's metadata describes it."""

    topic: str
    partition: int
    leader: int
    """Node id of the leader; -1 when none (every replica down)."""
    replicas: tuple[int, ...]
    isr: tuple[int, ...]

    @property
    def under_replicated(self) -> bool:
        return len(self.isr) < len(self.replicas)


@dataclass(frozen=True, kw_only=True)
class ClusterView:
    """The live brokers and the partitions of the topics asked for."""

    brokers: tuple[int, ...]
    partitions: tuple[PartitionState, ...]

    def lines(self, expected_nodes: Iterable[int] = ()) -> list[str]:
        """Human lines: nodes up/down, then one line per partition."""
        expected = sorted(set(expected_nodes) | set(self.brokers))
        nodes = ", ".join(f"{n} {'up' if n in self.brokers else 'DOWN'}" for n in expected)
        under = sum(p.under_replicated for p in self.partitions)
        out = [f"nodes:       {nodes}",
               f"partitions:  {len(self.partitions)} ({under} under-replicated)"]
        for p in self.partitions:
            flag = "  UNDER-REPLICATED" if p.under_replicated else ""
            out.append(f"  {p.topic}[{p.partition}] leader {p.leader} replicas "
                       f"{_ids(p.replicas)} isr {_ids(p.isr)}{flag}")
        return out


def _ids(ids: Iterable[int]) -> str:
    return ",".join(str(i) for i in ids) or "-"


def cluster_view(target: kafka.KafkaTarget, topics: Iterable[str] | None = None, *,
                 prefix: str = "", timeout_s: float = 10.0) -> ClusterView:
    """Leader, replicas and ISR of every partition of ``topics`` (default: every topic
    whose name starts with ``prefix``, internal ``__`` topics left out)."""
    config = kafka.client_config(target)
    try:
        metadata = kafka.make_admin(config, settings={"log_level": 0}).list_topics(
            timeout=timeout_s)
    except KafkaException as exc:
        raise BrokerError(f"cannot read the cluster metadata from {config.bootstrap_servers}: "
                          f"{exc}") from exc
    wanted = set(topics) if topics is not None else None
    states = []
    for name, topic in sorted(metadata.topics.items()):
        if wanted is not None and name not in wanted:
            continue
        if wanted is None and (name.startswith("__") or not name.startswith(prefix)):
            continue
        for pid, part in sorted(topic.partitions.items()):
            states.append(PartitionState(topic=name, partition=pid, leader=part.leader,
                                         replicas=tuple(part.replicas), isr=tuple(part.isrs)))
    return ClusterView(brokers=tuple(sorted(metadata.brokers)), partitions=tuple(states))
