"""The qualification evidence builders on real artefacts: a sealed ``train.testing``
snapshot (verified, read back through its lineage columns), hand-written shards with a
leak between splits, the parity result's own schema, the decode trace order and the
prediction timing rules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.core.snapshot import read_parquet
from hebrus_flywheel.replay.parity import ParityResult
from hebrus_flywheel.train.qualify import collect_data as data
from hebrus_flywheel.train.qualify import collect_model as model
from hebrus_flywheel.train.qualify import gate2_integrity
from hebrus_flywheel.train.qualify.collect import (
    checkpoint_lineage,
    load_settings,
    settings_from_mapping,
)
from hebrus_flywheel.train.qualify.config import IntegrityGateConfig
from hebrus_flywheel.train.qualify.errors import InputError
from hebrus_flywheel.train.qualify.inputs import Identity, QualificationInputs
from tests.support.planted import PlantedConfig, make_writable, write_planted_snapshot

GEOMETRY = RouteGeometry(family="qwen3_next", routed_layers=(0,), layer_count=1,
                         expert_count=4, top_k=2, hidden_size=8, routed_intermediate_size=4)
PLANTED = PlantedConfig(threads={"train": 3, "validation": 2, "runtime_holdout": 3},
                        tokens_per_thread=20, anchors_per_window=6, layers=3, experts=16,
                        top_k=4, hidden_dim=8, feature_dim=8)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[data.SnapshotInfo]:
    root = tmp_path_factory.mktemp("planted")
    written = write_planted_snapshot(root, PLANTED)
    yield data.open_snapshot(written.directory)
    make_writable(root)


def test_snapshot_identity_and_geometry_come_from_the_manifest(
        snapshot: data.SnapshotInfo) -> None:
    identity = data.identity_evidence(snapshot)
    assert identity.runtime == snapshot.manifest["identity"]["identity_id"]
    assert identity.teacher == snapshot.manifest["identity"]["model_artifact_digest"]
    assert identity.model_family == snapshot.manifest["identity"]["model_family"]
    geometry = data.geometry_evidence(snapshot)
    assert isinstance(geometry, RouteGeometry)
    assert (geometry.routed_layer_count, geometry.expert_count, geometry.top_k) == (3, 16, 4)
    assert geometry == RouteGeometry.from_identity(snapshot.manifest["identity"])


def test_a_tampered_snapshot_is_refused(tmp_path: Path) -> None:
    written = write_planted_snapshot(tmp_path, PLANTED, read_only=False)
    shard = next(written.directory.glob("split=train/*.parquet"))
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(InputError, match="refusing to qualify"):
        data.open_snapshot(written.directory)


def test_integrity_counts_threads_windows_and_coverage(snapshot: data.SnapshotInfo) -> None:
    integrity = data.integrity_evidence(snapshot, near_duplicates=None, authorization=None)
    assert set(integrity.splits) == {"train", "validation", "runtime_holdout"}
    train = integrity.splits["train"]
    assert (train.owners, train.threads) == (3, 3)
    assert train.windows == 3 * 4  # 20 tokens in windows of 6 anchors
    assert train.identity_digests == (snapshot.identity["identity_id"],)
    assert train.teacher_digests == (snapshot.identity["model_artifact_digest"],)
    assert train.coverage["domain"] == {"code": 1, "prose": 2}
    assert train.coverage["tool_calls"] == {"with tool calls": 1, "without tool calls": 2}
    assert train.coverage["prompt_length"] == {"0-31": 3}
    assert integrity.overlaps == ()
    assert set(data.COVERAGE_MEANING) == set(train.coverage)


def _lineage_shard(path: Path, split: str, owner: str, thread: str, window: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = 3
    pq.write_table(pa.table({
        "split": [split] * rows, "owner": [owner] * rows, "thread": [thread] * rows,
        "generation": [0] * rows, "window_id": [window] * rows,
        "identity_id": ["rt"] * rows, "domain_tags": [["code", "multilingual"]] * rows,
        "token_ordinal": pa.array([40, 41, 42], pa.int64())}), path)


def test_a_thread_in_two_splits_is_found_and_fails_gate_2(tmp_path: Path) -> None:
    shards = [("train", "o1", "t1", "w1"), ("validation", "o1", "t1", "w2"),
              ("validation", "o2", "t9", "w3")]
    entries = []
    for i, (split, owner, thread, window) in enumerate(shards):
        rel = f"split={split}/s{i}.parquet"
        _lineage_shard(tmp_path / rel, split, owner, thread, window)
        entries.append({"path": rel, "split": split})
    info = data.SnapshotInfo(directory=tmp_path, dataset=None, manifest={
        "snapshot_id": "s", "shards": entries,
        "identity": {"identity_id": "rt", "model_artifact_digest": "m", "tokenizer_digest": "t"}})
    integrity = data.integrity_evidence(info, near_duplicates=None, authorization=None)
    kinds = {(o.kind, o.splits, o.ids) for o in integrity.overlaps}
    assert kinds == {("owner", ("train", "validation"), ("o1",)),
                     ("thread", ("train", "validation"), ("o1/t1",))}
    assert integrity.splits["validation"].coverage["language"] == {"tagged multilingual": 2}
    assert integrity.splits["validation"].coverage["prompt_length"] == {"32-127": 2}
    inputs = QualificationInputs(snapshot_id="s", checkpoint_lineage=("c",),
                                 identity=Identity(runtime="rt"),
                                 geometry=GEOMETRY,
                                 expert_bytes=1, integrity=integrity)
    verdict = gate2_integrity(inputs, IntegrityGateConfig())
    assert verdict.status == "fail"
    assert any("o1/t1" in r for r in verdict.reasons)


def _parity_result(**overrides: Any) -> dict[str, Any]:
    quantiles = {"q0": 1e-4, "q0.01": 1e-3, "q0.5": 0.05, "q1": 0.5}
    margins = {kind: {"overall": {"count": 8, "quantiles": quantiles, "histogram": []}}
               for kind in ("boundary", "label")}
    fields: dict[str, Any] = dict(
        authoritative=False, identity_id="rt", teacher_dtype="float32",
        tie_break_rule="r", weight_rule="w", min_sample=1, weight_atol=1e-4,
        windows_compared=2, windows_skipped={"truncated_history": 1}, anchors=4, pairs=8,
        mismatched_pairs=1, primary_mismatches=1, set_mismatches=1, rank_only_mismatches=0,
        mismatch_rate=0.125, weight_violations=0, max_weight_abs_diff=0.0,
        tokens_compared=4, token_id_mismatches=0, position_mismatches=1,
        per_layer=[{"slot": 0, "layer": 3, "pairs": 4, "mismatches": 0, "mismatch_rate": 0.0},
                   {"slot": 1, "layer": 7, "pairs": 4, "mismatches": 1,
                    "mismatch_rate": 0.25}],
        margins=margins, examples=[], first_mismatches=[])
    fields.update(overrides)
    return ParityResult(**fields).to_dict()


def _with_parity(parity: dict[str, Any] | None, override: str | None = None
                 ) -> data.SnapshotInfo:
    return data.SnapshotInfo(directory=Path("."), dataset=None, manifest={
        "snapshot_id": "s", "parity": parity, "geometry": {"layers": 2},
        "parity_override": None if override is None else {"reason": override},
        "splits": {"runtime_holdout": {"rows": 4}}})


def test_parity_maps_the_parity_result_fields() -> None:
    parity = data.parity_evidence(_with_parity(_parity_result(), override="known tie"))
    assert parity is not None
    assert (parity.authoritative, parity.compared, parity.mismatches) == (False, 8, 1)
    assert parity.per_layer_mismatch_rate == {0: 0.0, 1: 0.25}  # by routed-layer slot
    assert parity.margin_quantiles == {"min": 1e-4, "p01": 1e-3, "p50": 0.05, "max": 0.5}
    assert parity.override_reason == "known tie"
    assert parity.details["windows_skipped"] == {"truncated_history": 1}
    assert (parity.tokens_compared, parity.token_mismatches,
            parity.position_mismatches) == (4, 0, 1)
    assert not model.parity_is_exact(parity)
    assert "regenerated" in model.holdout_label_note(_with_parity(None), parity)


def test_exact_parity_makes_the_holdout_labels_decode_labels() -> None:
    info = _with_parity(_parity_result(authoritative=True, mismatched_pairs=0,
                                       primary_mismatches=0, set_mismatches=0))
    parity = data.parity_evidence(info)
    assert model.parity_is_exact(parity)
    assert "100.0%" in model.holdout_label_note(info, parity)


def test_planted_parity_compared_nothing(snapshot: data.SnapshotInfo) -> None:
    parity = data.parity_evidence(snapshot)
    assert parity is not None and parity.compared == 0 and parity.details["source"] == "planted"
    assert not model.parity_is_exact(parity)
    assert data.parity_evidence(_with_parity(None)) is None


def test_rebuild_report_maps_to_determinism() -> None:
    report = {"snapshot_id": "a", "rebuilt_snapshot_id": "a", "shards": 4, "differences": []}
    d = data.determinism_evidence(report, "a")
    assert d.identical and d.shards_compared == 4 and d.shards_differing == 0
    with pytest.raises(InputError, match="rebuild this snapshot"):
        data.determinism_evidence(report, "b")
    with pytest.raises(InputError, match="rebuilt_snapshot_id"):
        data.determinism_evidence({"snapshot_id": "a"}, "a")
    # Encrypted: fresh ciphertext gives a fresh snapshot id; the content ids must match.
    encrypted = {**report, "rebuilt_snapshot_id": "z", "content_id": "c",
                 "rebuilt_content_id": "c"}
    assert data.determinism_evidence(encrypted, "a").identical
    assert not data.determinism_evidence({**encrypted, "rebuilt_content_id": "d"}, "a").identical


def test_streams_summary_maps_to_fail_closed_and_near_duplicates() -> None:
    summary = {"quarantine": {"wrong_k": 2, "undecodable": 1},
               "dedup": {"by_reason": {"near_duplicate_of_train": 3, "unique": 9,
                                       "near_duplicate_of_evaluation": 2},
                         "late_eval_conflicts": 1, "threshold": 0.8},
               "capture": {"records": 120}}
    fail_closed = data.fail_closed_evidence(summary)
    assert fail_closed is not None
    assert (fail_closed.records_seen, fail_closed.total_quarantined) == (120, 3)
    assert fail_closed.records_accepted is None  # not in the summary: never invented
    near = data.near_duplicates_evidence(summary)
    assert near is not None and (near.found, near.removed, near.threshold) == (6, 5, 0.8)
    assert fail_closed.accounting == {}
    ledger = data.fail_closed_evidence({**summary, "accounting": {
        "totals": {"records": 100, "windowed": 97, "quarantined": 3, "unaccounted": 0}}})
    assert ledger is not None and ledger.accounting["unaccounted"] == 0
    assert data.fail_closed_evidence({"quarantine": {}}) is None
    with pytest.raises(InputError, match="quarantine"):
        data.fail_closed_evidence({"quarantine": {"x": "many"}, "capture": {"records": 1}})


def test_authorization_is_declared_or_synthetic_by_construction(
        snapshot: data.SnapshotInfo) -> None:
    planted = data.authorization_evidence(snapshot, None)
    assert planted is not None and planted.policy == "synthetic-threads"
    assert not planted.production_transcripts
    reference = data.SnapshotInfo(directory=Path("."), dataset=None, manifest={
        "identity": {"runtime_name": "hebrus-flywheel-reference"}})
    assert data.authorization_evidence(reference, None) is None
    declared = data.authorization_evidence(reference, {
        "policy": "internal-test", "approved": True, "production_transcripts": False})
    assert declared is not None and declared.policy == "internal-test"


def test_holdout_trace_follows_each_thread_in_ordinal_order(
        snapshot: data.SnapshotInfo) -> None:
    rows = model.read_holdout(snapshot)
    assert rows is not None and rows.tokens == 3 * 20 and len(rows.threads) == 3
    assert np.all(np.diff(rows.sequence_N) >= 0)  # threads one after another
    for seq in range(3):
        assert np.array_equal(rows.ordinal_N[rows.sequence_N == seq], np.arange(20))
    # the routes are the shards' own, token by token
    table = read_parquet(next(snapshot.directory.glob("split=runtime_holdout/*.parquet")),
                         columns=["owner", "thread", "token_ordinal", "expert_ids"])
    row = table.slice(5, 1).to_pylist()[0]
    seq = rows.threads.index(f"{row['owner']}/{row['thread']}#0")
    at = np.flatnonzero((rows.sequence_N == seq) & (rows.ordinal_N == row["token_ordinal"]))
    assert rows.routes_NLK[at[0]].tolist() == row["expert_ids"]
    trace = model.decode_trace(rows, 16)
    assert trace.num_rows == 60 and trace.top_k == 4 and len(np.unique(trace.sequence)) == 3


def test_predictions_are_ready_at_their_source_layer() -> None:
    rng = np.random.default_rng(0)
    own = np.stack([rng.permutation(16)[:5] for _ in range(4 * 3)]).reshape(4, 3, 5)
    nxt = np.stack([rng.permutation(16)[:5] for _ in range(4 * 3)]).reshape(4, 3, 5)
    both = model.ranked_predictions(own, nxt)
    assert len(both) == 4 * 3 * 5 + 4 * 2 * 5  # the last layer has no next layer
    same = both.ready_boundary == both.target_layer
    ahead = both.target_layer == both.ready_boundary + 1
    assert np.all(same | ahead) and same.sum() == 60 and ahead.sum() == 40
    assert np.all(both.ready_row == both.target_row) and np.all(both.priority == 1)
    first = (both.target_row == 2) & (both.target_layer == 1) & same
    assert both.expert[first].tolist() == own[2, 1].tolist()
    assert both.rank[first].tolist() == [0, 1, 2, 3, 4]
    early = (both.target_row == 2) & (both.target_layer == 1) & ahead
    assert both.expert[early].tolist() == nxt[2, 0].tolist()
    assert len(both.within_budget(2)) == 4 * 3 * 2 + 4 * 2 * 2
    routes = np.stack([rng.permutation(16)[:4] for _ in range(4 * 3)]).reshape(4, 3, 4)
    trace = model.DecodeTrace(routes=routes, num_experts=16)
    both.validate_for(trace)  # every input exists before the MoE it targets
    assert len(model.ranked_predictions(own)) == 60


def test_sidecar_ranking_is_the_model_score_order(snapshot: data.SnapshotInfo) -> None:
    import torch

    from hebrus_flywheel.train.models import RouteSidecar, p1_config

    torch.manual_seed(0)
    sidecar = RouteSidecar(p1_config(feature_dim=8, rank=4, hidden=8, layer_count=3,
                                     expert_count=16)).eval()
    rows = model.read_holdout(snapshot)
    assert rows is not None
    own, nxt = model.sidecar_ranked(SimpleNamespace(model=sidecar), rows, 6, batch_size=7)
    assert own.shape == (60, 3, 6) and nxt is not None and nxt.shape == (60, 3, 6)
    with torch.no_grad():
        scores = sidecar(torch.from_numpy(rows.features_NLD[3].astype(np.float32)),
                         torch.arange(3))
    assert own[3].tolist() == torch.argsort(scores[:, 0], dim=-1, descending=True,
                                            stable=True)[:, :6].tolist()
    assert nxt[3].tolist() == torch.argsort(scores[:, 1], dim=-1, descending=True,
                                            stable=True)[:, :6].tolist()


def test_sweep_budgets_include_top_k_and_fit_the_experts() -> None:
    assert model.sweep_budgets(10, 512) == (10, 20, 30, 40)  # the teacher's k..4k
    assert model.sweep_budgets(4, 14) == (4, 8, 12, 14)
    assert model.sweep_budgets(4, 20, (16, 32)) == (4, 16, 20)  # declared in [sweep]
    assert model.evaluation_budgets(8) == (8, 16, 24, 32)


def test_checkpoint_lineage_lists_the_checkpoint_then_its_parents() -> None:
    assert checkpoint_lineage({"checkpoint_id": "c", "parent": None}) == ("c",)
    nested = {"checkpoint_id": "c", "parent": {"checkpoint_id": "b", "parent": "a"}}
    assert checkpoint_lineage(nested) == ("c", "b", "a")


def test_settings_declare_objective_sim_sweep_and_tau(tmp_path: Path) -> None:
    path = tmp_path / "q.toml"
    path.write_text('[objective]\nmin_exposed_wait_reduction = 0.3\n'
                    '[sim]\nssd_bandwidth_bytes_per_s = 3e9\nattention_time_s = [1e-4, 2e-4]\n'
                    '[sweep]\nbandwidths = [1e9, 2e9]\nbudgets = [8]\n'
                    '[break_even]\ntau = { "1" = 1.0, "4" = 2.5 }\n'
                    '[throughput]\nloader_examples_per_s = 10.0\n'
                    '[gates.offline]\nmargin = 0.05\n', encoding="utf-8")
    s = load_settings(path)
    assert s.objective.name == "hide-ssd-wait" and s.objective.min_exposed_wait_reduction == 0.3
    assert s.sim_fields == {"ssd_bandwidth_bytes_per_s": 3e9,
                            "attention_time_s": (1e-4, 2e-4)}
    assert (s.bandwidths, s.budgets, s.tau) == ((1e9, 2e9), (8,), {1: 1.0, 4: 2.5})
    assert s.throughput is not None and s.thresholds.offline.margin == 0.05
    defaults = load_settings(None)
    assert defaults.tau is None and defaults.objective.min_exposed_wait_reduction == 0.2
    with pytest.raises(ConfigError, match="unknown table"):
        settings_from_mapping({"objectives": {}})
    with pytest.raises(ConfigError, match="ServiceObjective"):
        settings_from_mapping({"objective": {"min_exposed_wait_reduction": 2.0}})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="runtime identity"):
        settings_from_mapping({"sim": {"dtype_bytes": 0.5}})
    with pytest.raises(ConfigError, match="runtime identity"):
        settings_from_mapping({"sim": {"geometry": {"hidden_size": 2048}}})
    with pytest.raises(ConfigError, match="ssd_queue_depth"):
        settings_from_mapping({"sim": {"ssd_queue_depth": 0}})


def test_the_simulator_is_sized_from_the_snapshot_identity(
        snapshot: data.SnapshotInfo) -> None:
    """Expert bytes, experts, k and layers of the shadow simulator are the snapshot
    teacher's, read from its identity (no model load), with [sim] timing overrides."""
    geometry = data.geometry_evidence(snapshot)
    stream = data.stream_geometry(snapshot, geometry)
    ident = snapshot.identity
    element = {"float32": 4, "bfloat16": 2, "float16": 2}[ident["dtype"]]
    assert stream.expert_bytes == (3 * ident["hidden_size"] * ident["routed_intermediate_size"]
                                   * element)
    settings = settings_from_mapping({"sim": {"ssd_bandwidth_bytes_per_s": 3e9}})
    sim = settings.sim_for(stream)
    assert sim.geometry == geometry and sim.expert_bytes == stream.expert_bytes
    assert sim.ssd_bandwidth_bytes_per_s == 3e9
    assert sim.capacity_experts == round(0.125 * 3 * 16)  # 1/8 of L x E routed experts
    # the predictor figures' byte budgets use the same source (flywheel predictors)
    from hebrus_flywheel.train.cli import snapshot_expert_bytes

    assert snapshot_expert_bytes(snapshot.directory) == sim.expert_bytes


def test_window_id_reuse_is_measured_on_the_sealed_shards(
        snapshot: data.SnapshotInfo) -> None:
    from hebrus_flywheel.train.qualify import collect_ids

    found = collect_ids.opaque_id_evidence(snapshot)
    windows = found[0]
    assert windows.kind == "window_id" and windows.reused == 0
    assert windows.checked == sum(s.windows or 0 for s in data.integrity_evidence(
        snapshot, near_duplicates=None, authorization=None).splits.values())
