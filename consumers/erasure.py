"""``flywheel erase --owner OWNER``: erase one owner everywhere, resumably, with a receipt.

Steps, each recorded as done in the journal ``$FLYWHEEL_HOME/erasure/<owner>/journal.json``
(the owner's pseudonym, never the raw id) before the next begins:

``plan``         find every live sealed snapshot holding the owner's rows (read with keys);
``keys``         destroy the owner's data key in the key store (every sealed copy in the
                 topics becomes unreadable); an owner without a key, or no key store,
                 is recorded and the erasure goes on (rows are still removed);
``changelogs``   tombstone the owner's keys in the stream tables' changelogs
                 (:mod:`consumers.tombstones`);
``snapshot:<id>`` per planned snapshot: a superseding snapshot without the owner's rows
                 (:mod:`consumers.supersede`), verified with keys;
``unsealed``     rewrite shards of epochs not sealed yet, delete staging leftovers;
``checkpoints``  mark every checkpoint trained on a planned snapshot as tainted
                 (:mod:`core.taint`);
``purge``        delete superseded files whose grace period ended (``--grace 0``: now).

A run killed at any point (kill -9 included) and run again skips the steps marked done,
repeats the interrupted one (every step is idempotent) and ends in the same receipt
``receipt.json`` beside the journal. The receipt holds no raw id and no key.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from hebrus_flywheel.consumers import faults
from hebrus_flywheel.consumers.supersede import (
    EraseError,
    ancestors,
    erase_unsealed,
    find_affected,
    purge_superseded,
    read_marker,
    sealed_epochs,
    snapshot_owner_rows,
    supersede_epoch,
    verify_live,
)
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_write_json, make_dirs
from hebrus_flywheel.core.privacy import (
    KeyStoreError,
    LocalOwnerKeyStore,
    OwnerKeyStore,
    is_pseudonym,
)
from hebrus_flywheel.core.settings import flywheel_home
from hebrus_flywheel.core.taint import add_taint, taint_published

JOURNAL_FORMAT = "hebrus-flywheel-erasure-journal/v1"
RECEIPT_FORMAT = "hebrus-flywheel-erasure-receipt/v1"
DATASET_FILE = "dataset.json"
LINEAGE_FILE = "lineage.json"


@dataclass(frozen=True, kw_only=True)
class EraseConfig:
    """One erasure.

    Fields:
        owner: the owner's pseudonym (``o`` + 32 hex digits), never a raw id.
        datasets: dataset roots whose snapshots are searched (default: every dataset
            root under ``$FLYWHEEL_HOME``).
        checkpoints: folders searched for trained checkpoints (``lineage.json``).
        bootstrap: Kafka bootstrap servers for the changelog tombstones; None skips that
            step (recorded in the receipt as skipped).
        changelog_prefix: only changelog topics whose names start with this.
        grace_ms: how long superseded snapshot files are kept (0: deleted at once).
        home: where the journal and receipt go (``home/erasure/<owner>/``), and whose
            worker health files say which stream and replay workers run here.
        key_store: the owner key store directory (None: the default one).
        allow_running_workers: go on although stream or replay workers run on this
            machine (they may write the owner's state or rows back).
    """

    owner: str
    datasets: tuple[Path, ...] = ()
    checkpoints: tuple[Path, ...] = ()
    bootstrap: str | None = None
    changelog_prefix: str = ""
    grace_ms: int = 7 * 86_400_000
    home: Path = field(default_factory=flywheel_home)
    key_store: Path | None = None
    allow_running_workers: bool = False

    def __post_init__(self) -> None:
        if not is_pseudonym(self.owner, "o"):
            raise ConfigError(f"EraseConfig.owner must be an owner pseudonym (o + 32 hex "
                              f"digits), got {self.owner!r}; pseudonymize a raw id first")
        if isinstance(self.grace_ms, bool) or not isinstance(self.grace_ms, int) \
                or self.grace_ms < 0:
            raise ConfigError(f"EraseConfig.grace_ms must be an integer >= 0, "
                              f"got {self.grace_ms!r}")
        for name in ("datasets", "checkpoints"):
            missing = [str(p) for p in getattr(self, name) if not Path(p).is_dir()]
            if missing:
                raise ConfigError(f"EraseConfig.{name}: {', '.join(missing)} is not a directory")

    @property
    def directory(self) -> Path:
        return Path(self.home) / "erasure" / self.owner


class Journal:
    """The erasure's steps done so far, rewritten atomically after each step."""

    def __init__(self, config: EraseConfig) -> None:
        self.path = config.directory / "journal.json"
        make_dirs(self.path.parent)
        if self.path.exists():
            self.body = json.loads(self.path.read_text(encoding="utf-8"))
        else:
            self.body = {"format": JOURNAL_FORMAT, "owner": config.owner,
                         "started_at_ms": int(time.time() * 1000), "steps": {},
                         "options": {"grace_ms": config.grace_ms,
                                     "checkpoints": [str(p) for p in config.checkpoints]}}
            self._save()

    def _save(self) -> None:
        atomic_write_json(self.path, self.body)

    def get(self, step: str) -> Any:
        return self.body["steps"].get(step)

    def run(self, step: str, action: Callable[[], Any]) -> Any:
        """The recorded result of ``step``, or run it, record it and return it."""
        if step in self.body["steps"]:
            return self.body["steps"][step]
        result = action()
        self.body["steps"][step] = result
        self._save()
        faults.hit(f"erase_after_{step.partition(':')[0]}")
        return result


def dataset_roots(home: Path, depth: int = 4) -> list[Path]:
    """Every directory under ``home`` (``depth`` levels) holding a ``dataset.json``."""
    found = []
    base = len(Path(home).parts)
    for dirpath, dirs, names in os.walk(home):
        if len(Path(dirpath).parts) - base >= depth:
            dirs.clear()
        dirs[:] = [d for d in dirs if not d.startswith(".") and not d.startswith("epoch=")]
        if DATASET_FILE in names:
            found.append(Path(dirpath))
    return sorted(found)


def _destroy_key(config: EraseConfig) -> dict[str, Any]:
    try:
        store: OwnerKeyStore = LocalOwnerKeyStore(config.key_store)
    except KeyStoreError as exc:
        return {"key_store": None, "generations_destroyed": [],
                "note": f"no owner key store: {exc}"}
    done = store.destroy(config.owner)
    return {"key_store": store.name, "generations_destroyed": list(done.generations),
            "note": None if done.generations else "the owner had no data key in the store"}


def _changelogs(config: EraseConfig) -> dict[str, Any]:
    if config.bootstrap is None:
        return {"skipped": "no Kafka bootstrap given (--no-changelogs)", "topics": {}}
    from hebrus_flywheel.consumers.tombstones import changelog_topics, tombstone_owner

    topics = changelog_topics(config.bootstrap, config.changelog_prefix)
    done = tombstone_owner(config.bootstrap, config.owner, topics)
    return {"skipped": None, "topics": {t: v["owner_keys"] for t, v in done.items()},
            "tombstones_written": {t: v["tombstones_written"] for t, v in done.items()}}


def _checkpoint_dirs(roots: Iterable[Path]) -> Iterable[tuple[Path, dict[str, Any]]]:
    for root in roots:
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            if LINEAGE_FILE not in names:
                continue
            try:
                lineage = json.loads((Path(dirpath) / LINEAGE_FILE).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(lineage, dict) and isinstance(lineage.get("snapshot"), dict):
                yield Path(dirpath), lineage


def _taint(config: EraseConfig, roots: list[Path], planned: list[dict[str, Any]],
           receipt: Path) -> list[dict[str, Any]]:
    # a checkpoint trained on an older snapshot that the planned one superseded (an
    # earlier erasure) saw the owner's rows too
    ids = {p["snapshot_id"] for p in planned}
    ids |= {a for p in planned for a in ancestors(Path(p["dataset"]), p["snapshot_id"])}
    out = []
    for directory, lineage in sorted(_checkpoint_dirs(roots), key=lambda pair: str(pair[0])):
        seen = lineage["snapshot"].get("snapshot_id")
        if seen not in ids:
            continue
        add_taint(directory, {"owner": config.owner, "snapshots": [seen],
                              "receipt": str(receipt)})
        published = taint_published(directory)  # the copy on an object store, if any
        out.append({"path": str(directory), "checkpoint_id": lineage.get("checkpoint_id"),
                    "snapshots": [seen], **({"published": published} if published else {})})
    return out


def _snapshot(config: EraseConfig, plan: dict[str, Any]) -> dict[str, Any]:
    root = Path(plan["dataset"])
    new = supersede_epoch(root, plan["epoch"], plan["snapshot_id"], config.owner,
                          grace_ms=config.grace_ms)
    ok, problem = verify_live(root, plan["epoch"])
    return {"superseded_by": new["snapshot_id"],
            "rows_removed": new["erasure"]["rows_removed"],
            "rows_after": new["totals"]["rows"],
            "shards_rewritten": len(new["erasure"]["shards_rewritten"]),
            "shards": new["totals"]["shards"], "verifies": ok, "verify_error": problem}


def _iso(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).isoformat(
        timespec="seconds").replace("+00:00", "Z")


def _superseded_files(plan: dict[str, Any]) -> dict[str, Any]:
    marker = read_marker(Path(plan["dataset"]), plan["snapshot_id"])
    deleted = marker.get("deleted")
    if deleted and deleted.get("complete"):
        return {"state": "deleted", "files": deleted["files"], "bytes": deleted["bytes"],
                "deleted_at": _iso(deleted["deleted_at_ms"])}
    return {"state": "kept for the grace period",
            "delete_after": _iso(marker["delete_after_ms"]),
            "where": str(Path(plan["dataset"]) / ".superseded" / plan["snapshot_id"]),
            "finish_with": "flywheel erase --finish"}


def live_owner_rows(roots: Iterable[Path], owner: str) -> int:
    """Rows of ``owner`` in every live sealed snapshot under ``roots`` (read with keys)."""
    return sum(snapshot_owner_rows(edir, owner)[0]
               for root in roots for _, edir in sealed_epochs(root))


def start_again(config: EraseConfig) -> Path | None:
    """Move a finished erasure's journal and receipt of this owner aside (under
    ``runs/<start ms>/``) so the next :func:`erase_owner` plans afresh; where they went."""
    journal = config.directory / "journal.json"
    if not journal.exists():
        return None
    body = json.loads(journal.read_text(encoding="utf-8"))
    if "purge" not in body.get("steps", {}):
        raise EraseError(f"the erasure of {config.owner} started at "
                         f"{_iso(int(body['started_at_ms']))} has not finished: run "
                         "`flywheel erase` without --again to finish it first")
    target = make_dirs(config.directory / "runs" / str(body["started_at_ms"]))
    for name in ("journal.json", "receipt.json"):
        if (config.directory / name).exists():
            os.replace(config.directory / name, target / name)
    return target


def running_workers(home: Path) -> list[str]:
    """``kind name pid`` of every stream or replay worker running on this machine (from
    the health files under ``home``)."""
    from hebrus_flywheel.core.processes import pid_alive
    from hebrus_flywheel.core.progress import read_health

    return [f"{kind} worker {r.get('name')} (pid {r.get('pid')})"
            for kind in ("streams", "replay") for r in read_health(Path(home), kind)
            if isinstance(r.get("pid"), int) and pid_alive(int(r["pid"]))]


def erase_owner(config: EraseConfig) -> dict[str, Any]:
    """Run (or resume) the erasure; the receipt (also written to ``receipt.json``)."""
    running = [] if config.allow_running_workers else running_workers(config.home)
    if running:
        raise EraseError(f"{', '.join(running)} running: a stream worker would write the "
                         "owner's state back over the tombstones and a replay worker may "
                         "write their rows again. Stop them (`flywheel streams status`, "
                         "`flywheel replay status`), run the erasure, then start them again; "
                         "or pass --allow-running-workers")
    journal = Journal(config)
    receipt_path = config.directory / "receipt.json"
    roots = [Path(p).resolve() for p in config.datasets] or dataset_roots(config.home)
    ck_roots = [Path(p).resolve() for p in config.checkpoints] or [Path(config.home)]
    plan = journal.run("plan", lambda: {"datasets": [str(r) for r in roots], "snapshots": [
        a.to_json() for r in roots for a in find_affected(r, config.owner)]})
    keys = journal.run("keys", lambda: _destroy_key(config))
    changelogs = journal.run("changelogs", lambda: _changelogs(config))
    snapshots = []
    for item in plan["snapshots"]:
        done = journal.run(f"snapshot:{item['snapshot_id']}", partial(_snapshot, config, item))
        snapshots.append({**item, **done})
    roots = [Path(r) for r in plan["datasets"]]
    unsealed = journal.run("unsealed", lambda: [
        {"dataset": str(r), **u} for r in roots for u in erase_unsealed(r, config.owner)])
    tainted = journal.run("checkpoints", lambda: _taint(
        config, ck_roots, plan["snapshots"], receipt_path))
    journal.run("purge", lambda: [len(purge_superseded(r)) for r in roots])
    receipt = _receipt(config, journal, keys, changelogs, snapshots, unsealed, tainted)
    receipt["owner_rows_after"] = live_owner_rows(roots, config.owner)
    atomic_write_json(receipt_path, receipt)
    return receipt


def _receipt(config: EraseConfig, journal: Journal, keys: dict[str, Any],
             changelogs: dict[str, Any], snapshots: list[dict[str, Any]],
             unsealed: list[dict[str, Any]], tainted: list[dict[str, Any]]) -> dict[str, Any]:
    started = int(journal.body["started_at_ms"])
    for item in snapshots:
        item["superseded_files"] = _superseded_files(item)
    return {
        "format": RECEIPT_FORMAT, "owner": config.owner, "started_at": _iso(started),
        "keys_destroyed": keys,
        "changelog_tombstones": {"skipped": changelogs.get("skipped"),
                                 "keys": sum(changelogs["topics"].values()),
                                 "topics": changelogs["topics"]},
        "snapshots": snapshots,
        "owner_rows_before": sum(s["owner_rows"] for s in snapshots),
        "rows_removed": sum(s["rows_removed"] for s in snapshots),
        "superseding_snapshots_verify": all(s["verifies"] for s in snapshots),
        "unsealed_shards": unsealed,
        "tainted_checkpoints": tainted,
        "grace_ms": journal.body.get("options", {}).get("grace_ms", config.grace_ms),
    }


def finish_erasures(roots: Iterable[Path], *, home: Path | None = None,
                    now_ms: int | None = None) -> list[dict[str, Any]]:
    """Delete superseded snapshot files whose grace period ended (``erase --finish``),
    then rewrite the receipt of every finished erasure under ``home`` to say so."""
    done = [dict(item, dataset=str(r)) for r in roots
            for item in purge_superseded(r, now_ms=now_ms)]
    base = Path(home) if home is not None else flywheel_home()
    for journal in sorted((base / "erasure").glob("o*/journal.json")):
        body = json.loads(journal.read_text(encoding="utf-8"))
        if "purge" not in body.get("steps", {}):
            continue  # unfinished: its own rerun completes it
        options = body.get("options", {})
        datasets = [Path(d) for d in body["steps"]["plan"]["datasets"] if Path(d).is_dir()]
        erase_owner(EraseConfig(owner=body["owner"], datasets=tuple(datasets), home=base,
                                grace_ms=int(options.get("grace_ms", 0)),
                                checkpoints=tuple(Path(c) for c in options.get("checkpoints", [])
                                                  if Path(c).is_dir())))
    return done


__all__ = ["EraseConfig", "EraseError", "Journal", "dataset_roots", "erase_owner",
           "finish_erasures", "live_owner_rows", "start_again"]
