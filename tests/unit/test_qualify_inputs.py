"""The qualification input bundle: the fixture loads, round-trips, follows the real
producers' schemas, and malformed pieces are refused with a clear InputError."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.exceptions import TrainError
from hebrus_flywheel.train.qualify import (
    DecodeEvidence,
    InputError,
    OfflineEvidence,
    QualificationError,
    QualificationInputs,
    ServiceObjective,
    dump_inputs,
    inputs_from_mapping,
    inputs_to_mapping,
    load_inputs,
)

ASSETS = Path(__file__).resolve().parents[1] / "assets"
FIXTURE = ASSETS / "qualify_inputs.json"


def _raw() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def test_errors_derive_from_train_error() -> None:
    assert issubclass(InputError, QualificationError)
    assert issubclass(QualificationError, TrainError)


def test_fixture_loads_with_every_piece() -> None:
    inputs = load_inputs(FIXTURE)
    assert isinstance(inputs, QualificationInputs)
    assert inputs.checkpoint == "ckpt-b"
    assert inputs.offline is not None and inputs.offline.candidate == "sidecar"
    assert inputs.offline.controls == ("random", "frequency", "lru", "previous_token",
                                       "adjacent_layer")
    assert inputs.offline.common_budgets == (4, 8, 12, 16)  # k..4k of top-4
    assert inputs.collection is not None and inputs.collection.tokens_per_s == 800.0
    assert inputs.parity is not None and inputs.parity.per_layer_mismatch_rate[0] == 0.0
    assert inputs.integrity is not None
    assert inputs.integrity.splits["train"].thread_ids is not None


def test_round_trip_through_json(tmp_path: Path) -> None:
    inputs = load_inputs(FIXTURE)
    path = dump_inputs(inputs, tmp_path / "inputs.json")
    again = load_inputs(path)
    assert inputs_to_mapping(again) == inputs_to_mapping(inputs)
    assert again == inputs


def test_fixture_follows_the_producers_schemas() -> None:
    """Regenerating the fixture from train.metrics / train.baselines / train.sim gives
    the same keys everywhere: the fixture matches what the real producers emit."""
    spec = importlib.util.spec_from_file_location("qualify_make_inputs",
                                                  ASSETS / "qualify_make_inputs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def keys(value: Any, path: str = "") -> set[str]:
        if isinstance(value, dict):
            return set().union(*(keys(v, f"{path}.{k}") for k, v in value.items()), {path})
        if isinstance(value, list) and value:
            return keys(value[0], f"{path}[]")
        return {path}

    assert keys(module.make()) == keys(_raw())


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.pop("snapshot_id"), "lacks required key"),
    (lambda d: d.update(surprise=1), "unknown key"),
    (lambda d: d["parity"].update(mismatches=10**6), "exceeds parity.compared"),
    (lambda d: d.update(expert_bytes=1), "geometry gives"),
    (lambda d: d["offline"].update(candidate="lru"), "training-free control"),
    (lambda d: d["offline"].update(candidate="nope"), "has no result"),
    (lambda d: d["offline"]["results"][0]["splits"].update(train={}), "train split"),
    (lambda d: d["offline"]["results"][0].update(schema="v0"), "schema"),
    (lambda d: d["shadow_io"]["metrics"].update(expert_bytes=7), "expert_bytes"),
    (lambda d: d["shadow_io"]["metrics"].pop("timely_recall"), "timely_recall"),
    (lambda d: d["integrity"]["splits"].update(holdout=d["integrity"]["splits"]["train"]),
     "splits among"),
    (lambda d: d["integrity"]["near_duplicates"].update(removed=99), "removed exceeds"),
    (lambda d: d["decode"].update(timely_recall=1.5), "decode.timely_recall"),
    (lambda d: d["geometry"].update(top_k=0), "RouteGeometry.top_k"),
    (lambda d: d["geometry"].update(experts=32), "unknown RouteGeometry fields"),
    (lambda d: d.update(dtype_bytes=1.0), "geometry gives"),
    (lambda d: d["parity"].update(position_mismatches=99), "exceeds parity.tokens_compared"),
    (lambda d: d["opaque_ids"][0].update(reused=10**6), "reused exceeds checked"),
    (lambda d: d.update(checkpoint_lineage=[]), "checkpoint_lineage"),
    (lambda d: d["parity"].update(per_layer_mismatch_rate={"x": 0.1}), "layer numbers"),
])
def test_malformed_bundles_are_refused(mutate: Any, message: str) -> None:
    data = _raw()
    mutate(data)
    with pytest.raises(InputError, match=message):
        inputs_from_mapping(data)


def test_objective_errors_are_config_errors_naming_the_field() -> None:
    data = _raw()
    data["objective"] = {"name": "x"}
    with pytest.raises(ConfigError, match="min_exposed_wait_reduction or"):
        inputs_from_mapping(data)
    with pytest.raises(ConfigError, match=r"ServiceObjective\.evidence"):
        ServiceObjective(name="x", min_throughput_gain=0.1, evidence="vibes")


def test_offline_as_a_bare_list_names_the_single_learned_method() -> None:
    data = _raw()
    data["offline"] = data["offline"]["results"]
    assert inputs_from_mapping(data).offline.candidate == "sidecar"  # type: ignore[union-attr]
    data["offline"].append(dict(copy.deepcopy(data["offline"][-1]), method="other"))
    with pytest.raises(InputError, match="bare list"):
        inputs_from_mapping(data)


def test_every_optional_piece_may_be_missing() -> None:
    data = _raw()
    for name in ("parity", "determinism", "fail_closed", "integrity", "offline", "decode",
                 "shadow_io", "objective", "throughput"):
        data.pop(name)
    inputs = inputs_from_mapping(data)
    assert inputs.offline is None and inputs.shadow_io is None


def test_decode_evidence_from_offline_uses_the_candidate_on_both_splits() -> None:
    inputs = load_inputs(FIXTURE)
    offline = inputs.offline
    assert isinstance(offline, OfflineEvidence)
    decode = DecodeEvidence.from_offline(offline, budget=4, timely_recall=0.5)
    assert decode.replay_validation_recall == offline.recall("sidecar", "validation", 4)
    assert decode.real_decode_recall == offline.recall("sidecar", "runtime_holdout", 4)
    assert decode.real_decode_rows == 720
    assert dataclasses.replace(inputs, decode=decode).decode is decode


def test_overlaps_are_recomputed_from_explicit_id_sets() -> None:
    data = _raw()
    splits = data["integrity"]["splits"]
    splits["validation"]["thread_ids"].append(splits["train"]["thread_ids"][0])
    integrity = inputs_from_mapping(data).integrity
    assert integrity is not None
    [overlap] = integrity.all_overlaps()
    assert (overlap.kind, overlap.splits, overlap.ids) == ("thread", ("train", "validation"),
                                                           ("train-t0",))


def test_python_callers_may_pass_plain_lists() -> None:
    from hebrus_flywheel.train.qualify import (
        IntegrityEvidence,
        Overlap,
        ShadowEvidence,
        SplitIntegrity,
    )

    inputs = load_inputs(FIXTURE)
    shadow = inputs.shadow_io
    assert shadow is not None and inputs.offline is not None
    rebuilt = ShadowEvidence(metrics=shadow.metrics, sweep=list(shadow.sweep),  # type: ignore[arg-type]
                             break_even=list(shadow.break_even))  # type: ignore[arg-type]
    assert isinstance(rebuilt.sweep, tuple) and isinstance(rebuilt.break_even, tuple)
    offline = OfflineEvidence(results=list(inputs.offline.results),  # type: ignore[arg-type]
                              candidate="sidecar")
    assert isinstance(offline.results, tuple)
    split = SplitIntegrity(owners=1, threads=1, thread_ids=["a"],  # type: ignore[arg-type]
                           identity_digests=["rt"])  # type: ignore[arg-type]
    assert split.thread_ids == frozenset({"a"}) and split.identity_digests == ("rt",)
    integrity = IntegrityEvidence(
        splits={"train": split, "validation": SplitIntegrity(owners=1, threads=1,
                                                             thread_ids=frozenset({"a"}))},
        overlaps=[Overlap(kind="owner", splits=["train", "validation"],  # type: ignore[arg-type]
                          ids=["o"])])  # type: ignore[arg-type]
    kinds = [(o.kind, o.ids) for o in integrity.all_overlaps()]
    assert kinds == [("owner", ("o",)), ("thread", ("a",))]
    lineage = dataclasses.replace(inputs, checkpoint_lineage=["c1"])  # type: ignore[arg-type]
    assert lineage.checkpoint_lineage == ("c1",)
