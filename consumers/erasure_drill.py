"""The demo's erasure drill: erase one synthetic owner and measure what is left.

The drill works on a *copy* of the demo's sealed snapshot, of the owner's data key (alone,
in a throw-away key store deleted afterwards) and of the checkpoint lineage under
``RUN/erasure-drill/``, so the demo's live dataset, keys and stream state stay as they
were (later demo runs rebuild and retrain from them). On the copy it runs the real
``flywheel erase`` code (:func:`consumers.erasure.erase_owner`: key destroyed,
superseding snapshot, tainted checkpoint; the changelog step is skipped because the
stream state is not copied), then

* counts the owner's rows in the live (superseding) snapshot with the keys;
* scans every byte under ``$FLYWHEEL_HOME`` (the broker's log dirs included, the Kafka
  jars excluded) for a canary: the owner's longest run of consecutive token ids in the
  snapshot (at least 4), as int32/int64 little-endian, Avro zigzag varints and text.

``erasure-receipt.json`` (beside the qualification report) holds the figures Gate 2 and
falsifier 8 read: ``owner_rows_before``, ``owner_rows_after``, ``plaintext_canary_hits``
(per place), ``superseding_snapshot`` (id, verifies), ``tainted_checkpoints`` and what
the drill does not establish. It never holds the raw owner id or the canary tokens.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa

from hebrus_flywheel.consumers.erasure import EraseConfig, erase_owner
from hebrus_flywheel.core.canary import CanaryScanner
from hebrus_flywheel.core.files import atomic_write_json, make_dirs
from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, default_owner_keys_dir, is_pseudonym
from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.core.snapshot import load_manifest, open_snapshot

DRILL_FORMAT = "hebrus-flywheel-erasure-drill/v1"
DOES_NOT_ESTABLISH = (
    "legal approval of capture, retention or replay",
    "key management in production (the local file key store stands in for a KMS)",
    "erasure from backups, replicas or copies outside $FLYWHEEL_HOME and the broker",
    "that the live demo dataset was changed: the drill erased a copy",
)
MIN_CANARY = 4
MAX_CANARY = 8


def _rows(snapshot: Path) -> pa.Table:
    sealed = open_snapshot(snapshot)
    tables = [sealed.read_shard(i, ["owner", "thread", "token_ordinal", "token_id"])
              for i in range(len(sealed.manifest.shards))]
    return pa.concat_tables(tables) if tables else pa.table({})


def choose_owner(table: pa.Table) -> str | None:
    """The pseudonymous owner with the most rows (None when owners are not pseudonyms)."""
    counts = Counter(o for o in table.column("owner").to_pylist() if is_pseudonym(o, "o"))
    return max(sorted(counts), key=lambda o: counts[o]) if counts else None


def canary_of(table: pa.Table, owner: str) -> list[int]:
    """The owner's longest run of consecutive token ordinals in one thread (<= 8 ids)."""
    rows = sorted((t, o, tok) for w, t, o, tok in zip(
        *(table.column(c).to_pylist() for c in ("owner", "thread", "token_ordinal",
                                                 "token_id")), strict=True) if w == owner)
    ids = {(t, o): tok for t, o, tok in rows}
    best: list[int] = []
    for thread, ordinal, _ in rows:
        if (thread, ordinal - 1) in ids:
            continue
        run: list[int] = []
        while (thread, ordinal + len(run)) in ids and len(run) < MAX_CANARY:
            run.append(ids[(thread, ordinal + len(run))])
        if len(run) > len(best):
            best = run
    return best


def _scan_roots(home: Path) -> tuple[list[Path], Path]:
    from hebrus_flywheel.streams.broker import BrokerConfig

    broker = BrokerConfig(home=home)
    roots = [p for p in sorted(home.iterdir()) if p != broker.kafka_dir]
    roots += [broker.data_dir, broker.logs_dir]
    return [p for p in roots if p.exists()], broker.data_dir


def _copy(snapshot: Path, checkpoint: Path | None, drill: Path,
          owner: str) -> tuple[Path, Path, Path]:
    """The drill's copies: the snapshot, a key store holding only the owner's data key
    (no other owner's key and no pseudonym key leave the real store), the lineage."""
    shutil.rmtree(drill, ignore_errors=True)
    dataset = make_dirs(drill / "dataset")
    shutil.copytree(snapshot, dataset / snapshot.name)
    keys = drill / "owner-keys"
    LocalOwnerKeyStore(keys, create=True)  # a fresh pseudonym key, unused by the drill
    key_file = default_owner_keys_dir() / f"{owner}.json"
    if key_file.is_file():
        shutil.copy2(key_file, keys / key_file.name)
    checkpoints = make_dirs(drill / "checkpoints")
    if checkpoint is not None and (Path(checkpoint) / "lineage.json").is_file():
        target = make_dirs(checkpoints / Path(checkpoint).name)
        shutil.copy2(Path(checkpoint) / "lineage.json", target / "lineage.json")
    return dataset, keys, checkpoints


def run_drill(snapshot: Path, checkpoint: Path | None, run_dir: Path) -> dict[str, Any]:
    """Run the drill (module doc); writes and returns ``RUN/erasure-receipt.json``."""
    snapshot = Path(snapshot).resolve()
    table = _rows(snapshot)
    owner = choose_owner(table)
    out = Path(run_dir) / "erasure-receipt.json"
    base = {"format": DRILL_FORMAT, "snapshot": load_manifest(snapshot).snapshot_id,
            "scope": "a copy of the sealed snapshot, key store and checkpoint lineage",
            "does_not_establish": list(DOES_NOT_ESTABLISH)}
    if owner is None:
        body = {**base, "state": "not run",
                "reason": "the snapshot's owner ids are not pseudonyms (the capture does not "
                "pseudonymize owners), so no owner can be named to `flywheel erase`"}
        atomic_write_json(out, body)
        return body
    canary = canary_of(table, owner)
    drill = Path(run_dir) / "erasure-drill"
    dataset, keys, checkpoints = _copy(snapshot, checkpoint, drill, owner)
    try:
        receipt = erase_owner(EraseConfig(
            owner=owner, datasets=(dataset,), checkpoints=(checkpoints,), bootstrap=None,
            grace_ms=0, home=drill, key_store=keys))
    finally:
        shutil.rmtree(keys, ignore_errors=True)
    body = {**base, **_measure(receipt, canary, drill)}
    atomic_write_json(out, body)
    return body


def _measure(receipt: dict[str, Any], canary: list[int], drill: Path) -> dict[str, Any]:
    roots, broker_data = _scan_roots(flywheel_home())
    if len(canary) >= MIN_CANARY:
        scan = CanaryScanner(canary).scan(roots)
        in_broker = sum(1 for h in scan.hits if h.path.startswith(str(broker_data)))
        hits: dict[str, Any] = {"total": len(scan.hits), "broker_logs": in_broker,
                                "elsewhere": len(scan.hits) - in_broker,
                                "by_form": scan.by_form(), "files": scan.files,
                                "bytes": scan.bytes, "canary_tokens": len(canary)}
    else:
        hits = {"total": None, "reason": f"the owner has no run of {MIN_CANARY} consecutive "
                "tokens in the snapshot to use as a canary"}
    snap = receipt["snapshots"][0] if receipt["snapshots"] else None
    return {
        "state": "run", "owner": receipt["owner"],
        "owner_rows_before": receipt["owner_rows_before"],
        "owner_rows_after": receipt["owner_rows_after"],
        "plaintext_canary_hits": hits["total"], "plaintext_canary_scan": hits,
        "superseding_snapshot": None if snap is None else {
            "id": snap["superseded_by"], "supersedes": snap["snapshot_id"],
            "verifies": snap["verifies"], "rows_removed": snap["rows_removed"]},
        "keys_destroyed": receipt["keys_destroyed"]["generations_destroyed"],
        "tainted_checkpoints": [t["checkpoint_id"] for t in receipt["tainted_checkpoints"]],
        "receipt": str(drill / "erasure" / receipt["owner"] / "receipt.json"),
    }
