"""``flywheel erase``: erase one owner (resumable), finish grace periods, scan for a canary.

    flywheel erase --owner RAW_ID [--dataset ROOT ...] [--checkpoints DIR ...] [--grace 7d]
    flywheel erase --owner-pseudonym o<32 hex> ...
    flywheel erase --finish [--dataset ROOT ...]
    flywheel erase --scan-canary 101,7,9981,42 [--scan-root DIR ...] [--owner ...]

The raw id is only used to compute the pseudonym with the local key store; the journal,
the receipt and every output name the pseudonym only. Deliberate errors propagate to
``flywheel.cli.main`` (message and exit status 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.kafka.security import declare_role
from hebrus_flywheel.core.settings import bootstrap_servers, flywheel_home


def _pseudonym(raw: str | None, pseudonym: str | None, key_store: Path | None) -> str | None:
    from hebrus_flywheel.core.privacy import (
        KeyStoreError,
        LocalOwnerKeyStore,
        Pseudonymizer,
        is_pseudonym,
    )

    if raw is not None and pseudonym is not None:
        raise ConfigError("pass either --owner RAW_ID or --owner-pseudonym, not both")
    if pseudonym is not None:
        if not is_pseudonym(pseudonym, "o"):
            raise ConfigError(f"--owner-pseudonym must be o followed by 32 hex digits, got "
                              f"{pseudonym!r}; pass a raw id with --owner instead")
        return pseudonym
    if raw is None:
        return None
    try:
        return Pseudonymizer(LocalOwnerKeyStore(key_store)).owner(raw)
    except KeyStoreError as exc:
        raise ConfigError(f"cannot pseudonymize --owner without the owner key store ({exc}); "
                          "pass the pseudonym with --owner-pseudonym o...") from exc


def _tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", ",").split(",") if t]
    except ValueError as exc:
        raise ConfigError(f"--scan-canary must be comma-separated token ids, got {text!r}") \
            from exc
    if len(tokens) < 2:
        raise ConfigError("--scan-canary needs at least 2 token ids (one id alone is common)")
    return tokens


def canary_report(tokens: list[int], roots: list[Path], owner: str | None,
                  datasets: list[Path]) -> dict[str, Any]:
    """Plaintext canary hits under ``roots`` (broker log dirs called out) and, given an
    owner, the owner's rows in every live snapshot of ``datasets``."""
    from hebrus_flywheel.consumers.erasure import live_owner_rows
    from hebrus_flywheel.core.canary import CanaryScanner
    from hebrus_flywheel.streams.broker import BrokerConfig

    scan = CanaryScanner(tokens).scan(roots)
    result = scan.to_json()
    broker_data = str(BrokerConfig(home=flywheel_home()).data_dir)
    result["broker_log_dir"] = broker_data
    result["broker_log_hits"] = sum(1 for h in scan.hits if h.path.startswith(broker_data))
    result["roots"] = [str(r) for r in roots]
    if owner is not None:
        result["owner"] = owner
        result["owner_rows_live"] = live_owner_rows(datasets, owner)
    return result


def erase_command(
    owner: str | None = typer.Option(None, "--owner", help="The owner's raw id (pseudonymized "
                                     "with the local owner key store; never stored)."),
    owner_pseudonym: str | None = typer.Option(None, "--owner-pseudonym",
                                               help="The owner's pseudonym (o + 32 hex)."),
    dataset: list[Path] = typer.Option([], "--dataset", help="Dataset root to erase from "
                                       "(repeatable; default: every one under $FLYWHEEL_HOME)."),
    checkpoints: list[Path] = typer.Option([], "--checkpoints", help="Folder searched for "
                                           "trained checkpoints (repeatable; default "
                                           "$FLYWHEEL_HOME)."),
    grace: str = typer.Option("7d", "--grace", help="Keep superseded snapshot files this long "
                              "(e.g. 7d, 36h; 0 deletes them at once)."),
    bootstrap: str | None = typer.Option(None, "--bootstrap-servers", help="Kafka bootstrap "
                                         "servers (default: $FLYWHEEL_BOOTSTRAP_SERVERS or "
                                         "embedded)."),
    changelog_prefix: str = typer.Option("", "--changelog-prefix", help="Only stream "
                                         "changelog topics whose name starts with this."),
    no_changelogs: bool = typer.Option(False, "--no-changelogs", help="Skip the changelog "
                                       "tombstones (no broker; recorded in the receipt)."),
    key_store: Path | None = typer.Option(None, "--key-store", help="Owner key store directory "
                                          "[default: $FLYWHEEL_OWNER_KEYS or "
                                          "$FLYWHEEL_HOME/keys/owners]."),
    finish: bool = typer.Option(False, "--finish", help="Only delete superseded snapshot files "
                                "whose grace period ended, then refresh the receipts."),
    scan_canary: str | None = typer.Option(None, "--scan-canary", metavar="IDS",
                                           help="Scan every byte under --scan-root (default "
                                           "$FLYWHEEL_HOME, broker log dirs included) for this "
                                           "token id sequence instead of erasing."),
    scan_root: list[Path] = typer.Option([], "--scan-root", help="Root to scan (repeatable)."),
    allow_running_workers: bool = typer.Option(False, "--allow-running-workers",
                                               help="Erase although stream or replay workers "
                                               "run here (restart the stream workers after)."),
    again: bool = typer.Option(False, "--again", help="Erase an owner whose erasure finished "
                               "before once more (rows written since); the old receipt is "
                               "kept under runs/."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Erase one owner: destroy their data key, tombstone their stream state, supersede
    every snapshot holding their rows, taint checkpoints trained on them; resumable.
    Stop the dataset's replay workers and the stream workers first (or restart the
    stream workers afterwards: they restore their tables from the changelogs on start)."""
    declare_role("admin")
    from hebrus_flywheel.consumers.erasure import (
        EraseConfig,
        EraseError,
        dataset_roots,
        erase_owner,
        finish_erasures,
        start_again,
    )
    from hebrus_flywheel.core.durations import parse_duration_ms

    pseudonym = _pseudonym(owner, owner_pseudonym, key_store)
    roots = list(dataset) or dataset_roots(flywheel_home())
    if scan_canary is not None:
        report = canary_report(_tokens(scan_canary), list(scan_root) or [flywheel_home()],
                               pseudonym, roots)
        _print(report, as_json, f"{report['hits']} plaintext canary hit(s) in "
               f"{report['files']} files ({report['bytes']} bytes)")
        raise typer.Exit(1 if report["hits"] or report.get("owner_rows_live") else 0)
    if finish:
        done = finish_erasures(roots, home=flywheel_home())
        _print({"deleted": done}, as_json, f"deleted {len(done)} superseded snapshot(s)")
        return
    if pseudonym is None:
        raise ConfigError("name the owner to erase: --owner RAW_ID or --owner-pseudonym o...")
    grace_ms = 0 if grace.strip() == "0" else parse_duration_ms(grace, what="--grace")
    config = EraseConfig(
        owner=pseudonym, datasets=tuple(dataset), checkpoints=tuple(checkpoints),
        bootstrap=None if no_changelogs else bootstrap_servers(bootstrap),
        changelog_prefix=changelog_prefix, grace_ms=grace_ms, key_store=key_store,
        allow_running_workers=allow_running_workers)
    if again:
        start_again(config)
    receipt = erase_owner(config)
    _print(receipt, as_json, _summary(receipt))
    if receipt["owner_rows_after"]:
        raise EraseError(
            f"{receipt['owner_rows_after']} row(s) of owner {pseudonym} are still in live "
            f"snapshots: they were written after this erasure planned its work "
            f"({receipt['started_at']}). Run `flywheel erase --owner-pseudonym {pseudonym} "
            "--again` to erase them too")


def _summary(receipt: dict[str, Any]) -> str:
    lines = [f"erased owner {receipt['owner']}: data key generations "
             f"{receipt['keys_destroyed']['generations_destroyed']} destroyed, "
             f"{receipt['changelog_tombstones']['keys']} stream state key(s) tombstoned"]
    for s in receipt["snapshots"]:
        lines.append(f"  epoch={s['epoch']} {s['snapshot_id'][:12]} -> {s['superseded_by'][:12]}"
                     f": {s['rows_removed']} row(s) removed, verifies: {s['verifies']}, "
                     f"superseded files {s['superseded_files']['state']}")
    lines.append(f"  {len(receipt['tainted_checkpoints'])} checkpoint(s) tainted; owner rows "
                 f"left in live snapshots: {receipt['owner_rows_after']}")
    return "\n".join(lines)


def _print(value: dict[str, Any], as_json: bool, text: str) -> None:
    typer.echo(json.dumps(value, indent=2, sort_keys=True) if as_json else text)
