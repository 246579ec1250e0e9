"""The runtime publisher through a broker outage: nothing lost, or every loss counted.

The embedded broker of this FLYWHEEL_HOME (never an external cluster) is stopped while
records are being published and started again. An outage shorter than the delivery
timeout loses nothing: every record is delivered once and none counts as failed. A
longer one counts every undelivered record as failed with a clear first error, so
delivered + failed = published and the topic holds exactly the delivered records.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest

from hebrus_flywheel.consumers.kafka_io import end_offsets
from hebrus_flywheel.core.identity import with_identity_id
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV
from hebrus_flywheel.streams.broker import BrokerConfig, EmbeddedBroker
from hebrus_flywheel.streams.publisher import PublisherConfig, PublisherStats, RuntimePublisher
from tests.support.consent import ledger_allowing

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(bool(os.environ.get(BOOTSTRAP_ENV)),
                                 reason="stops the embedded broker; never an external cluster")]

PER_BATCH = 20


IDENTITY = with_identity_id({
    "model_family": "qwen3_next", "model_artifact_digest": "a" * 64,
    "tokenizer_digest": "b" * 64, "chat_template_digest": "c" * 64, "dtype": "float32",
    "quantization": "none", "routed_layer_count": 6, "expert_count": 32, "top_k": 4,
    "tie_break_rule": "score_desc_then_expert_id_asc",
    "weight_rule": "softmax_topk_renormalized", "hidden_size": 64,
    "routed_intermediate_size": 32, "runtime_name": "hebrus", "runtime_version": "0.1",
})


def _turn(thread: str, index: int) -> dict[str, Any]:
    return {
        "owner": "outage", "thread": thread, "turn_index": index, "generation": 0,
        "sequence_id": f"{thread}-r{index}", "role": "user" if index == 0 else "assistant",
        "token_offset": index * 4, "token_ids": [1, 2, 3, 4],
        "segments": [{"kind": "content", "start": 0, "end": 4, "generated": index > 0}],
        "sampling": {"mode": "forced", "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                     "seed": 0, "max_new_tokens": 4},
        "identity_id": IDENTITY["identity_id"], "domain_tags": ["test"],
        "closes_thread": False,
    }


def _publish(pub: RuntimePublisher, batch: int) -> None:
    for i in range(PER_BATCH):
        assert pub.publish_turn(_turn(f"t{i}", batch))


def _on_topic(bootstrap: str, topic: str) -> int:
    return sum(end_offsets(bootstrap, [topic], timeout_s=60)[topic].values())


def _outage(bootstrap: str, topic: str, *, delivery_timeout_s: float,
            outage_s: float) -> tuple[PublisherStats, PublisherStats]:
    """Batch 0 before, batch 1 during the outage, batch 2 after; stats after the outage
    (flushed) and at the end."""
    broker = EmbeddedBroker(BrokerConfig())
    assert broker.config.bootstrap == bootstrap
    config = PublisherConfig(
        bootstrap_servers=bootstrap, transcripts_topic=topic, identities_topic=topic,
        producer_id=f"outage-{uuid.uuid4().hex[:8]}", max_block_ms=1000,
        delivery_timeout_ms=int(delivery_timeout_s * 1000), linger_ms=5,
        producer_overrides={"request.timeout.ms": int(delivery_timeout_s * 1000) // 2})
    # Consent from memory: the ledger topic is unreadable during the outage (a real
    # ConsentBook would refuse, fail closed); this test is about delivery.
    with RuntimePublisher(config, identity=IDENTITY,
                          consent=ledger_allowing(["outage"])) as pub:
        _publish(pub, 0)
        assert pub.flush(30) == 0 and pub.stats().delivered == PER_BATCH
        broker.down()
        try:
            _publish(pub, 1)
            time.sleep(outage_s)
        finally:
            broker.up()
        assert pub.flush(delivery_timeout_s + 60) == 0, "records neither delivered nor failed"
        after = pub.stats()
        _publish(pub, 2)
        assert pub.flush(60) == 0
        end = pub.stats()
    print(f"publisher outage {outage_s:g}s, delivery timeout {delivery_timeout_s:g}s: "
          f"after the outage delivered={after.delivered} failed={after.failed}; "
          f"at the end delivered={end.delivered} failed={end.failed} "
          f"first_error={end.first_error}")
    return after, end


def test_outage_shorter_than_the_delivery_timeout_loses_nothing(topic_factory: Any) -> None:
    topic = topic_factory("short", partitions=3)
    after, end = _outage(topic_factory.bootstrap, topic, delivery_timeout_s=40, outage_s=8)
    assert after.failed == 0 and after.delivered == 2 * PER_BATCH, after
    assert end.enqueued == end.delivered == 3 * PER_BATCH and end.failed == 0, end
    assert end.first_error is None
    assert _on_topic(topic_factory.bootstrap, topic) == 3 * PER_BATCH  # once each


def test_outage_longer_than_the_delivery_timeout_counts_every_loss(topic_factory: Any) -> None:
    topic = topic_factory("long", partitions=3)
    after, end = _outage(topic_factory.bootstrap, topic, delivery_timeout_s=4, outage_s=12)
    assert after.delivered == PER_BATCH and after.failed == PER_BATCH, after
    assert end.delivered + end.failed == end.enqueued == 3 * PER_BATCH, end
    assert end.failed == PER_BATCH and end.failed_by_topic == {topic: PER_BATCH}
    assert end.first_error is not None and "timed out" in end.first_error.lower(), end
    assert _on_topic(topic_factory.bootstrap, topic) == end.delivered
