"""The report renders: report.json round-trips, report.html parses and is
self-contained (every <img> a data URI), the PNG files exist and are valid, text is
escaped, and the same inputs give the same bytes."""

from __future__ import annotations

import base64
import io
import json
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, ClassVar

import matplotlib.image
import pytest

from hebrus_flywheel.core.jsonio import pretty_json
from hebrus_flywheel.train.qualify import (
    CLAIM_BOUNDARY,
    PLOT_TITLES,
    ReportError,
    evaluate_falsifiers,
    evaluate_gates,
    inputs_from_mapping,
    load_inputs,
    qualify,
    render_plots,
    write_report,
)

FIXTURE = Path(__file__).resolve().parents[1] / "assets" / "qualify_inputs.json"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIXTURE_PLOTS = [name for name in PLOT_TITLES if name != "governor"]
"""Every figure but Model C's: the fixture has no candidate-path evidence (the governor
plot is tested in test_candidate_falsifiers)."""


class _Walker(HTMLParser):
    """Collects section ids, <img> sources, headings and text, and checks nesting."""

    VOID: ClassVar[frozenset[str]] = frozenset({"meta", "img", "br", "hr", "link", "input"})

    def __init__(self) -> None:
        super().__init__()
        self.sections: list[str] = []
        self.images: list[str] = []
        self.text: list[str] = []
        self.stack: list[str] = []
        self.scripts = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "section":
            self.sections.append(values.get("id") or "")
        if tag == "img":
            self.images.append(values.get("src") or "")
        if tag == "script":
            self.scripts += 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            raise AssertionError(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _walk(html: str) -> _Walker:
    walker = _Walker()
    walker.feed(html)
    walker.close()
    assert walker.stack == []
    return walker


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report")
    outcome = qualify(load_inputs(FIXTURE), out)
    assert outcome.report_json == out / "report.json"
    assert outcome.report_html == out / "report.html"
    assert outcome.promoted
    return out


def test_report_json_round_trips_with_every_verdict(report_dir: Path) -> None:
    text = (report_dir / "report.json").read_text(encoding="utf-8")
    report = json.loads(text)
    assert pretty_json(report) == text
    assert report["schema"] == "flywheel.qualify.report.v1"
    assert [g["gate"] for g in report["gates"]] == [1, 2, 3, 4, 5, 6]
    assert [f["number"] for f in report["falsifiers"]] == list(range(1, 11))
    assert report["decision"]["promote"] is True
    assert report["claim_boundary"] == list(CLAIM_BOUNDARY)
    assert set(report["plots"]) == set(FIXTURE_PLOTS)
    assert report["gates"][2]["figures"]["byte_budget"] == 4 * 12288
    again = inputs_from_mapping(report["inputs"])
    assert again == load_inputs(FIXTURE)


def test_report_html_parses_and_is_self_contained(report_dir: Path) -> None:
    walker = _walk((report_dir / "report.html").read_text(encoding="utf-8"))
    assert walker.sections == ["summary", "collection", *(f"gate-{n}" for n in range(1, 7)),
                               "falsifiers",
                               "claim-boundary", "configuration"]
    assert len(walker.images) == len(FIXTURE_PLOTS)
    for src in walker.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_SIGNATURE)
    assert walker.scripts == 0
    text = " ".join(walker.text)
    assert "Verdict summary" in text and "PROMOTE" in text
    assert "Replay makes examples, not evidence" in text
    assert "validation: sidecar recall@4 0.856" in text


def test_png_files_exist_and_are_valid(report_dir: Path) -> None:
    for name in FIXTURE_PLOTS:
        data = (report_dir / f"{name}.png").read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        image = matplotlib.image.imread(io.BytesIO(data), format="png")
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_same_inputs_same_bytes(tmp_path: Path) -> None:
    inputs = load_inputs(FIXTURE)
    verdicts, falsifiers = evaluate_gates(inputs), evaluate_falsifiers(inputs)
    first = write_report(inputs, verdicts, falsifiers, tmp_path / "a")
    second = write_report(inputs, verdicts, falsifiers, tmp_path / "b")
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(
        ["report.json", "report.html", *(f"{n}.png" for n in FIXTURE_PLOTS)])


def test_text_is_escaped(tmp_path: Path) -> None:
    data: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
    data["snapshot_id"] = '<script>alert("x")</script>'
    data["parity"]["override_reason"] = "<b>trust me</b> & more"
    data["parity"]["authoritative"] = False
    inputs = inputs_from_mapping(data)
    _, html_path = write_report(inputs, evaluate_gates(inputs), evaluate_falsifiers(inputs),
                                tmp_path)
    html = html_path.read_text(encoding="utf-8")
    assert "<script>" not in html and "<b>trust me</b>" not in html
    assert "&lt;script&gt;" in html and "&lt;b&gt;trust me&lt;/b&gt; &amp; more" in html
    walker = _walk(html)
    assert walker.scripts == 0


def test_a_bare_bundle_still_renders_with_not_measurable_gates(tmp_path: Path) -> None:
    data = {k: v for k, v in json.loads(FIXTURE.read_text(encoding="utf-8")).items()
            if k in ("snapshot_id", "checkpoint_lineage", "identity", "geometry",
                     "expert_bytes")}
    outcome = qualify(inputs_from_mapping(data), tmp_path)
    report = json.loads(outcome.report_json.read_text(encoding="utf-8"))
    assert {g["status"] for g in report["gates"]} == {"not_measurable"}
    assert report["decision"]["promote"] is False
    assert report["decision"]["train_on_snapshot"] is False
    assert "do not train" in report["decision"]["summary"]
    assert report["plots"] == {}
    walker = _walk(outcome.report_html.read_text(encoding="utf-8"))
    assert walker.images == [] and "claim-boundary" in walker.sections


def test_decision_lists_failures_and_falsifiers(tmp_path: Path) -> None:
    data = json.loads(FIXTURE.read_text(encoding="utf-8"))
    data["parity"]["mismatches"] = 5
    outcome = qualify(inputs_from_mapping(data), tmp_path)
    decision = json.loads(outcome.report_json.read_text(encoding="utf-8"))["decision"]
    assert decision["summary"].startswith("DO NOT PROMOTE; do not train")
    assert "stop or redesign" in decision["summary"]
    assert any(r.startswith("Gate 1 (replay correctness) fail") for r in decision["reasons"])
    assert any(r.startswith("Falsifier #1 falsified") for r in decision["reasons"])


def test_missing_data_leaves_plots_out() -> None:
    inputs = load_inputs(FIXTURE)
    assert set(render_plots(replace(inputs, shadow_io=None))) == {
        "recall_curves", "layer_heatmap", "reliability"}
    assert set(render_plots(replace(inputs, offline=None))) == {"byte_amplification",
                                                                "bandwidth"}


def test_unwritable_directory_is_a_report_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    inputs = load_inputs(FIXTURE)
    with pytest.raises(ReportError, match="cannot write the report"):
        write_report(inputs, evaluate_gates(inputs), evaluate_falsifiers(inputs),
                     blocker / "out")


def test_report_carries_the_simulator_geometry_and_the_collection_projection(
        report_dir: Path) -> None:
    """The fixture's measured 800 replay tokens/s (200 labelled tokens/s) become the
    design note's table; the candidate path has no snapshot: "not measured"."""
    report = json.loads((report_dir / "report.json").read_text(encoding="utf-8"))
    geometry = report["simulator_geometry"]
    assert geometry["expert_bytes"] == report["expert_bytes"] == 3 * 64 * 32 * 2
    assert geometry["budgets"] == [4, 8, 12, 16]
    assert geometry["streamed_bytes_per_token"] == 4 * 4 * geometry["expert_bytes"]
    rows = {r["tokens"]: r for r in report["collection_projection"]["rows"]}
    assert rows[100_000]["clean_replay_hours"] == round(100_000 / 800 / 3600, 3)
    assert rows[10_000_000]["clean_replay_hours"] == round(10_000_000 / 800 / 3600, 3)
    assert rows[1_000_000]["clean_labelled_hours"] == round(1_000_000 / 200 / 3600, 3)
    assert all(r["candidate_replay_hours"] is None for r in rows.values())
    html = (report_dir / "report.html").read_text(encoding="utf-8")
    assert "Collection-time projection" in html and "not measured" in html
    assert "10,000,000" in html and f"{10_000_000 / 800 / 3600:,.3g} h" in html
