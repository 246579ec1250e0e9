"""Consent when sealing and reading a snapshot: the seal's measurement, and rows of
owners without a live grant of their split's scope excluded by every reader."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from hebrus_flywheel.consumers.consent_seal import measure
from hebrus_flywheel.streams.consent import ConsentLedger, grant
from hebrus_flywheel.train.consent import check_ledger, owner_rows
from hebrus_flywheel.train.data import Snapshot
from tests.support.planted import PlantedSnapshot, make_writable, write_planted_snapshot
from tests.unit.test_train_trainer import SMALL

T0 = 1_767_225_600_000


def _ledger(owners: dict[str, str]) -> ConsentLedger:
    ledger = ConsentLedger()
    for owner, scopes in owners.items():
        ledger.entries[owner] = grant(owner, scopes, granted_at_ms=0, expires_at_ms=2 * T0,
                                      policy_version="p", granted_by="t")
    return ledger


def test_seal_measurement_counts_rows_by_split_scope() -> None:
    rows = Counter({("train", "a"): 5, ("validation", "a"): 2, ("train", "b"): 3,
                    ("runtime_holdout", "c"): 4})
    block = measure(rows, _ledger({"a": "capture,train,evaluate", "b": "capture,evaluate",
                                   "c": "evaluate"}), at_ms=T0, ledger="L")
    assert block["rows"] == 14 and block["rows_refused"] == 3 and block["rows_granted"] == 11
    assert block["refused"] == {"train": {"b": 3}}  # b may be evaluated, not trained on
    assert block["owners"] == 3 and block["owners_refused"] == 1
    assert block["authorized_fraction"] == pytest.approx(11 / 14)
    assert measure(Counter(), ConsentLedger(), at_ms=T0, ledger="L")["authorized_fraction"] == 1.0


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlantedSnapshot]:
    root = tmp_path_factory.mktemp("consent-small")
    yield write_planted_snapshot(root, SMALL)
    make_writable(root)


def test_readers_skip_owners_without_a_live_grant(small: PlantedSnapshot) -> None:
    snapshot = Snapshot(small.directory)
    assert snapshot.consent["rows_excluded"] == 0  # no seal refusals recorded
    rows = owner_rows(snapshot, ["train", "validation"])
    owners = sorted({o for _, o in rows})
    dropped = owners[0]
    ledger = _ledger({o: "train,evaluate" for o in owners[1:]})
    report = check_ledger(snapshot, ["train", "validation"], ledger, at_ms=T0)
    assert report["rows_excluded"] == sum(n for (_, o), n in rows.items() if o == dropped) > 0
    assert report["rows_checked"] == sum(rows.values()) and report["owners_excluded"] == 1
    for split in ("train", "validation"):
        for unit in snapshot.units([split]):
            kept = snapshot.read(unit, ["owner", "token_ordinal"])
            assert dropped not in kept.column("owner").to_pylist()
            assert kept.column_names == ["owner", "token_ordinal"]
            assert "owner" not in snapshot.read(unit, ["token_ordinal"]).column_names
    assert snapshot.lineage()["consent"]["rows_excluded"] == report["rows_excluded"]


def test_a_split_left_without_any_consented_row_is_a_clear_error(
        small: PlantedSnapshot) -> None:
    from hebrus_flywheel.train.exceptions import SnapshotError

    snapshot = Snapshot(small.directory)
    with pytest.raises(SnapshotError, match="flywheel consent list"):
        check_ledger(snapshot, ["train"], ConsentLedger(), at_ms=T0)
