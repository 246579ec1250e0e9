"""``core.liveness.Monitor``: the health file it writes and removes (no broker needed)."""

from __future__ import annotations

from pathlib import Path

from hebrus_flywheel.core import kafka
from hebrus_flywheel.core.liveness import Monitor, MonitorTarget
from hebrus_flywheel.core.progress import WatchdogConfig, health_path, read_health


def _monitor(home: Path) -> Monitor:
    target = MonitorTarget(kind="replay", name="g", topics=("t",), home=home)
    return Monitor(target, WatchdogConfig(), kafka.client_config("127.0.0.1:1"),
                   on_verdict=lambda verdict: None)


def test_remove_health_deletes_the_record_of_a_clean_exit(tmp_path: Path) -> None:
    monitor = _monitor(tmp_path)
    monitor.write_health()
    [record] = read_health(tmp_path, "replay")
    assert record["name"] == "g" and health_path(tmp_path, "replay", "g").is_file()
    assert monitor.remove_health() is True
    assert read_health(tmp_path, "replay") == []
    assert monitor.remove_health() is True  # idempotent: nothing left to delete


def test_remove_health_keeps_the_record_while_the_thread_runs(tmp_path: Path) -> None:
    monitor = _monitor(tmp_path)
    monitor.write_health()
    monitor.is_alive = lambda: True  # type: ignore[method-assign]
    monitor.join = lambda timeout=None: None  # type: ignore[method-assign]
    assert monitor.remove_health(timeout_s=0.01) is False
    assert len(read_health(tmp_path, "replay")) == 1
