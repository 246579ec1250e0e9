"""SsdQueue: latency, bandwidth, queue depth and strict preemptive priority."""

from __future__ import annotations

import math

import pytest

from hebrus_flywheel.train.sim.ssd import CANCELLED, DONE, PENDING, Read, SsdQueue


def _read(rid: int, priority: int, nbytes: int = 100, at: float = 0.0) -> Read:
    return Read(rid=rid, key=rid, nbytes=nbytes, priority=priority, submit_time=at,
                expire_key=0, rejected=False)


def _run(ssd: SsdQueue) -> list[Read]:
    landed: list[Read] = []
    while not math.isinf(ssd.next_event_time()):
        landed += ssd.advance(ssd.next_event_time())
    return landed


def test_one_read_costs_latency_plus_transfer() -> None:
    ssd = SsdQueue(bandwidth=100.0, latency=0.5, depth=4)
    read = _read(1, 0)
    ssd.submit(read)
    assert _run(ssd) == [read]
    assert read.landed_at == pytest.approx(1.5)
    assert read.state == DONE
    assert read.transferred == 100.0


def test_latencies_overlap_up_to_the_queue_depth() -> None:
    deep = SsdQueue(bandwidth=100.0, latency=1.0, depth=2)
    reads = [_read(i, 1) for i in range(2)]
    for read in reads:
        deep.submit(read)
    _run(deep)
    # both latencies overlap; transfers share one channel: 1+1, then 1+1+1
    assert [r.landed_at for r in reads] == pytest.approx([2.0, 3.0])

    shallow = SsdQueue(bandwidth=100.0, latency=1.0, depth=1)
    reads = [_read(i, 1) for i in range(2)]
    for read in reads:
        shallow.submit(read)
    _run(shallow)
    assert [r.landed_at for r in reads] == pytest.approx([2.0, 4.0])


@pytest.mark.parametrize("depth", [1, 2, 8])
def test_p0_is_never_delayed_by_queued_p2(depth: int) -> None:
    ssd = SsdQueue(bandwidth=100.0, latency=0.25, depth=depth)
    for i in range(10):
        ssd.submit(_read(i, 2))
    ssd.advance(0.5)  # P2 reads hold the slots and the channel
    p0 = _read(99, 0, at=0.5)
    ssd.submit(p0)
    while p0.state != DONE:
        ssd.advance(ssd.next_event_time())
    assert p0.landed_at == pytest.approx(0.5 + 0.25 + 1.0)
    assert ssd.starvation_attempts[0] >= 1


def test_p1_preempts_p2_but_yields_to_p0() -> None:
    ssd = SsdQueue(bandwidth=100.0, latency=0.0, depth=1)
    p2, p1, p0 = _read(2, 2), _read(1, 1), _read(0, 0)
    ssd.submit(p2)
    ssd.advance(0.5)
    ssd.submit(p1)
    ssd.advance(0.6)
    ssd.submit(p0)
    _run(ssd)
    assert p0.landed_at == pytest.approx(1.6)
    assert p1.landed_at == pytest.approx(2.5)  # 0.1 done before P0, 0.9 after
    assert p2.landed_at == pytest.approx(3.0)  # kept its 0.5 progress
    assert ssd.starvation_attempts == [1, 1]


def test_elevating_a_pending_read_moves_it_ahead() -> None:
    ssd = SsdQueue(bandwidth=100.0, latency=0.0, depth=1)
    first, second = _read(1, 2), _read(2, 2)
    ssd.submit(first)
    ssd.submit(second)
    assert second.state == PENDING
    ssd.elevate(second, 0)
    _run(ssd)
    assert second.landed_at == pytest.approx(1.0)
    assert first.landed_at == pytest.approx(2.0)


def test_cancel_keeps_partial_bytes_and_frees_the_slot() -> None:
    ssd = SsdQueue(bandwidth=100.0, latency=0.0, depth=1)
    first, second = _read(1, 2), _read(2, 2)
    ssd.submit(first)
    ssd.submit(second)
    ssd.advance(0.25)
    ssd.cancel(first)
    assert first.state == CANCELLED
    assert first.transferred == pytest.approx(25.0)
    assert _run(ssd) == [second]
    assert second.landed_at == pytest.approx(1.25)


def test_idle_queue_has_no_next_event() -> None:
    ssd = SsdQueue(bandwidth=1.0, latency=0.0, depth=1)
    assert math.isinf(ssd.next_event_time())
    assert ssd.advance(math.inf) == []
    assert ssd.advance(3.0) == []
    assert ssd.now == 3.0
