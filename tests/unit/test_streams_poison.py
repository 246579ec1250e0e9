"""The crash ledger's pure parts: keys, the fault-injection hook, crash hooks."""

from __future__ import annotations

import pytest

from hebrus_flywheel.streams.processors import poison
from hebrus_flywheel.streams.processors.poison import (
    FAULT_ENV,
    InjectedFault,
    _parse_key,
    injected_fault,
    ledger_key,
)


def test_ledger_keys_round_trip_topic_names_with_separators() -> None:
    where = ("p.x|y.flywheel.capture.observations.v1", 3, 1234)
    assert _parse_key(ledger_key(where)) == where
    assert _parse_key(b"garbage") is None


def test_injected_fault_raises_only_for_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FAULT_ENV, raising=False)
    injected_fault(b"o/t")
    monkeypatch.setenv(FAULT_ENV, "crash_on_key:o/t")
    injected_fault(b"o/other")
    injected_fault(None)
    with pytest.raises(InjectedFault, match="o/t"):
        injected_fault(b"o/t")


def test_ledger_counts_and_threshold_without_a_broker() -> None:
    ledger = poison.CrashLedger.__new__(poison.CrashLedger)
    ledger.threshold, ledger._producer = 3, None
    ledger.counts = {("t", 0, 5): {"crashes": 3}, ("t", 0, 9): {"crashes": 2}}
    assert ledger.entry(("t", 0, 5)) == {"crashes": 3}
    assert ledger.entry(("t", 0, 9)) is None
    assert list(ledger.poisoned()) == [("t", 0, 5)]
    assert ledger.record_crash(("t", 0, 9), "x") == 0  # not loaded: nothing written, no count


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_worker_config_refuses_a_bad_poison_threshold(bad: object) -> None:
    from hebrus_flywheel.core.errors import ConfigError
    from hebrus_flywheel.streams.processors.app import WorkerConfig

    with pytest.raises(ConfigError, match="poison_after_crashes"):
        WorkerConfig(bootstrap="127.0.0.1:1", poison_after_crashes=bad)  # type: ignore[arg-type]
    assert WorkerConfig(bootstrap="127.0.0.1:1").poison_after_crashes == 3
