"""``flywheel qualify`` end to end without a broker: a sealed ``train.testing`` snapshot
(every split, runtime_holdout included), a tiny P1 checkpoint trained on it, then the
command on both; the report has six gate verdicts and ten falsifiers and its HTML
parses. The rebuild report and streams summary are hand-written stand-ins in the
formats `flywheel rebuild --json` and `flywheel streams inspect --json` print (this
test checks the plumbing, not those commands)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from hebrus_flywheel.train.qualify_cli import qualify_command
from tests.support.planted import (
    PlantedConfig,
    PlantedSnapshot,
    make_writable,
    write_planted_snapshot,
)

PLANTED = PlantedConfig(threads={"train": 6, "validation": 2, "temporal_holdout": 2,
                                 "runtime_holdout": 2},
                        tokens_per_thread=32, anchors_per_window=8, layers=4, experts=64,
                        top_k=8, hidden_dim=16, feature_dim=32)
TRAIN_TOML = """
seed = 3
method = "p1_sidecar"
threads = 1
[model]
offsets = [[0, 0], [0, 1]]
rank = 16
hidden = 32
[data]
batch_size = 128
num_workers = 0
[optim]
max_steps = 30
lr = 3e-3
[schedule]
eval_every = 10
progress = false
"""
QUALIFY_TOML = """
[objective]
min_exposed_wait_reduction = 0.1
[sim]
cache_capacity_experts = 64
[sweep]
bandwidths = [3e9, 6e9]
[break_even]
tau = { "1" = 1.0, "2" = 1.5 }
[throughput]
loader_examples_per_s = 5000.0
trainer_examples_per_s = 3000.0
device = "2-core CPU"
"""


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[PlantedSnapshot, Path]]:
    from hebrus_flywheel.train.config import load_config
    from hebrus_flywheel.train.trainer import train

    root = tmp_path_factory.mktemp("qualify")
    snapshot = write_planted_snapshot(root / "data", PLANTED)
    (root / "train.toml").write_text(TRAIN_TOML, encoding="utf-8")
    train(snapshot.directory, root / "ckpt", load_config(root / "train.toml"))
    yield snapshot, root
    make_writable(root / "data")


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(qualify_command)
    return app


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.sections: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in ("meta", "img", "br"):
            self.open.append(tag)
        if tag == "section":
            self.sections.append(dict(attrs).get("id") or "")

    def handle_endtag(self, tag: str) -> None:
        assert self.open and self.open.pop() == tag, f"unbalanced </{tag}>"


def _check_files(out: Path) -> None:
    parser = _Tags()
    parser.feed((out / "report.html").read_text())
    assert not parser.open and "falsifiers" in parser.sections
    assert list(out.glob("*.png"))
    sources = json.loads((out / "collection.json").read_text())["sources"]
    assert {"offline", "shadow_io", "decode", "streams", "determinism"} <= set(sources)


def test_qualify_writes_every_verdict(artefacts: tuple[PlantedSnapshot, Path],
                                      tmp_path: Path) -> None:
    snapshot, root = artefacts
    rebuild = tmp_path / "rebuild.json"
    rebuild.write_text(json.dumps({"snapshot_id": snapshot.snapshot_id,
                                   "rebuilt_snapshot_id": snapshot.snapshot_id, "shards": 3,
                                   "rows": 0, "identical": True, "differences": []}))
    summary = tmp_path / "inspect.json"
    summary.write_text(json.dumps({"quarantine": {"wrong_k": 1}, "capture": {"records": 40},
                                   "dedup": {"by_reason": {"unique": 12},
                                             "late_eval_conflicts": 0}}))
    config = tmp_path / "qualify.toml"
    config.write_text(QUALIFY_TOML, encoding="utf-8")
    out = tmp_path / "report"
    done = CliRunner().invoke(_app(), [
        "--snapshot", str(snapshot.directory), "--checkpoint", str(root / "ckpt"),
        "--out", str(out), "--config", str(config), "--rebuild-report", str(rebuild),
        "--streams-summary", str(summary)])
    assert done.exit_code == 0, done.output
    assert "Qualification gates" in done.output and "Falsifiers" in done.output
    assert str(out / "report.html") in done.output.replace("\n", "")
    report = json.loads((out / "report.json").read_text())
    assert [g["gate"] for g in report["gates"]] == [1, 2, 3, 4, 5, 6]
    assert [f["number"] for f in report["falsifiers"]] == list(range(1, 11))
    assert all(g["status"] in ("pass", "fail", "not_measurable") for g in report["gates"])
    inputs = report["inputs"]
    assert inputs["snapshot_id"] == snapshot.snapshot_id
    assert inputs["determinism"]["rebuild_digest"] == snapshot.snapshot_id
    assert inputs["fail_closed"]["records_seen"] == 40
    assert inputs["decode"]["captures_regenerated"] is True  # planted parity compared nothing
    shadow = inputs["shadow_io"]
    assert shadow["budget"] == 8 and len(shadow["sweep"]) == 2 * 4  # 2 bandwidths x k..4k
    assert [r["block_size"] for r in shadow["break_even"]] == [1, 2]
    assert set(shadow["controls"]) == {"previous_token"} and shadow["oracle"] is not None
    assert inputs["expert_bytes"] == shadow["sim_config"]["expert_bytes"]
    assert inputs["integrity"]["authorization"]["policy"] == "synthetic-threads"
    _check_files(out)


def test_errors_exit_2_with_a_message(artefacts: tuple[PlantedSnapshot, Path],
                                      tmp_path: Path) -> None:
    snapshot, root = artefacts
    missing = CliRunner().invoke(_app(), [
        "--snapshot", str(snapshot.directory), "--checkpoint", str(tmp_path / "nope"),
        "--out", str(tmp_path / "r")])
    assert missing.exit_code == 2
    assert "does not exist" in missing.output
    wrong = tmp_path / "rebuild.json"
    wrong.write_text(json.dumps({"snapshot_id": "other", "rebuilt_snapshot_id": "other"}))
    refused = CliRunner().invoke(_app(), [
        "--snapshot", str(snapshot.directory), "--checkpoint", str(root / "ckpt"),
        "--out", str(tmp_path / "r"), "--rebuild-report", str(wrong)])
    assert refused.exit_code == 2 and "rebuild this snapshot" in refused.output
