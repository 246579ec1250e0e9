"""The fault benchmark's short run (issue 15): ``bench/faults.py`` on its own 3-node
cluster (ports ``$FLYWHEEL_BROKER_PORT + 40`` onward, its own home), capture -> streams ->
replay -> seal once without faults and once while it kill -9s a stream worker, a broker
node and a replay worker mid-stream; nothing lost, duplicated or changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hebrus_flywheel.core.settings import EMBEDDED_BROKER_PORT

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_kill9_of_a_worker_a_broker_and_a_replay_worker_loses_no_row(tmp_path: Path) -> None:
    port = int(os.environ.get("FLYWHEEL_FAULTS_TEST_PORT") or EMBEDDED_BROKER_PORT + 40)
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "faults.py"), "--threads", "6", "--base-port",
         str(port), "--keep", str(tmp_path)],
        capture_output=True, text=True, timeout=2400, check=False, cwd=ROOT)
    figures = {line["figure"]: line for line in map(json.loads, (
        raw for raw in out.stdout.splitlines() if raw.startswith('{"figure"')))}
    print(out.stdout[-4000:])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert figures["lost_rows"]["value"] == 0 and figures["lost_rows"]["rows"] > 0
    assert figures["duplicated_rows"]["value"] == 0
    assert figures["changed_rows"]["value"] == 0 and figures["extra_rows"]["value"] == 0
    # every fault happened mid-stream: part of the windows, then part of the shards
    kills = figures["lost_rows"]
    assert 0 < kills["stream_worker_killed_at_windows"] < figures["faults_bench_seconds"][
        "windows"]
    assert kills["broker_node_killed"] == 2 and kills["replay_worker_killed_at_shards"] >= 1
    assert figures["shards_byte_identical"]["row_identical"] is True
