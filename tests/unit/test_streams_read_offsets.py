"""The streams watchdog's read offsets: what faust's consumer read, per input partition."""

from __future__ import annotations

from types import SimpleNamespace

from faust.types import TP

from hebrus_flywheel.streams.processors.liveness import read_offsets


def test_read_offsets_keep_input_partitions_that_were_read() -> None:
    app = SimpleNamespace(consumer=SimpleNamespace(_read_offset={
        TP("p.transcripts", 0): 41, TP("p.transcripts", 1): None, TP("p.ticks", 0): 9,
        TP("p.observations", 3): 7}))
    assert read_offsets(app, ("p.transcripts", "p.observations")) == {
        ("p.transcripts", 0): 41, ("p.observations", 3): 7}


def test_no_consumer_yet_reads_nothing() -> None:
    assert read_offsets(SimpleNamespace(), ("p.transcripts",)) == {}
