"""``flywheel consent grant|revoke|list``: the admin's hand on the consent ledger.

Owners are given raw (``--owner alice``: pseudonymized here with the local owner key
store, the same key the runtime publisher uses, so the ledger never holds the raw id)
or as a pseudonym (``--owner-pseudonym o…``, e.g. from a report). Writing needs the
admin role (``streams.acls``); every stage reads.
"""

from __future__ import annotations

import getpass
import json
from typing import Annotated, Any

import typer

from hebrus_flywheel.core.durations import format_duration_ms, parse_duration_ms
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.kafka.security import declare_role
from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer, is_pseudonym
from hebrus_flywheel.core.settings import bootstrap_servers
from hebrus_flywheel.streams.cli import BootstrapOpt, TimeoutOpt, _fail_cleanly
from hebrus_flywheel.streams.consent import (
    CONSENT_TOPIC,
    SCOPES,
    Consent,
    grant,
    now_ms,
    parse_scopes,
    revoke,
)
from hebrus_flywheel.streams.consent_book import ConsentBook, write_entries

consent_app = typer.Typer(
    help="Grant, revoke and list owners' consent (the compacted consent ledger).",
    no_args_is_help=True,
)

OwnerOpt = Annotated[str | None, typer.Option(
    "--owner", help="The owner's raw id, pseudonymized with the local owner key store.",
    show_default=False)]
PseudonymOpt = Annotated[str | None, typer.Option(
    "--owner-pseudonym", help="The owner's pseudonym (o + 32 hex), as records carry it.",
    show_default=False)]
PrefixOpt = Annotated[str, typer.Option("--prefix", help="Topic prefix of the catalogue (tests).")]


@consent_app.callback()
def _admin_role() -> None:
    """The consent ledger is written by the admin."""
    declare_role("admin")


def resolve_owner(owner: str | None, pseudonym: str | None) -> str:
    """The ledger key for ``--owner RAW`` or ``--owner-pseudonym P`` (exactly one)."""
    if (owner is None) == (pseudonym is None):
        raise ConfigError("name the owner with exactly one of --owner RAW or "
                          "--owner-pseudonym o<32 hex>")
    if pseudonym is not None:
        if not is_pseudonym(pseudonym, "o"):
            raise ConfigError(f"--owner-pseudonym {pseudonym!r} is not an owner pseudonym "
                              "(o followed by 32 hex digits); pass a raw id with --owner")
        return pseudonym
    raw = owner or ""
    if not raw.strip():
        raise ConfigError("--owner must not be empty")
    return Pseudonymizer(LocalOwnerKeyStore(create=True)).owner(raw)


@consent_app.command("grant")
@_fail_cleanly
def consent_grant(
    owner: OwnerOpt = None,
    owner_pseudonym: PseudonymOpt = None,
    scopes: Annotated[str, typer.Option(
        "--scopes", help=f"Comma-separated subset of {','.join(SCOPES)}.")] = ",".join(SCOPES),
    expires: Annotated[str, typer.Option(
        "--expires", help="How long the grant lasts from when it takes effect (365d, 12w).")]
        = "365d",
    policy_version: Annotated[str, typer.Option(
        "--policy-version", help="The consent policy version the owner agreed to.",
        show_default=False)] = "",
    granted_by: Annotated[str | None, typer.Option(
        "--granted-by", help="Who records the grant [default: the login name].",
        show_default=False)] = None,
    effective_ms: Annotated[int | None, typer.Option(
        "--effective-from-ms", help="When the grant takes effect, Unix ms [default: now]; "
        "records captured before it are not covered.", show_default=False)] = None,
    bootstrap_servers_: BootstrapOpt = None,
    prefix: PrefixOpt = "",
    timeout: TimeoutOpt = 30.0,
) -> None:
    """Record a grant: the owner's data may be used for SCOPES until it expires."""
    key = resolve_owner(owner, owner_pseudonym)
    if not policy_version.strip():
        raise ConfigError("--policy-version is required: name the consent policy text the "
                          "owner agreed to (e.g. --policy-version 2026-01)")
    start = now_ms() if effective_ms is None else effective_ms
    entry = grant(key, parse_scopes(scopes), granted_at_ms=start,
                  expires_at_ms=start + parse_duration_ms(expires, what="--expires"),
                  policy_version=policy_version, granted_by=granted_by or getpass.getuser())
    write_entries(bootstrap_servers(bootstrap_servers_), [entry], topic=prefix + CONSENT_TOPIC,
                  timeout_s=timeout)
    typer.echo(f"granted  {entry.owner}  scopes={','.join(entry.scopes)}  expires_in="
               f"{format_duration_ms(parse_duration_ms(expires, what='--expires'))}  "
               f"policy={entry.policy_version}")


@consent_app.command("revoke")
@_fail_cleanly
def consent_revoke(
    owner: OwnerOpt = None,
    owner_pseudonym: PseudonymOpt = None,
    reason: Annotated[str, typer.Option("--reason", help="Why (kept in the ledger).",
                                        show_default=False)] = "",
    bootstrap_servers_: BootstrapOpt = None,
    prefix: PrefixOpt = "",
    timeout: TimeoutOpt = 30.0,
) -> None:
    """Record a revocation: from now on no stage uses the owner's data for anything."""
    key = resolve_owner(owner, owner_pseudonym)
    if not reason.strip():
        raise ConfigError("--reason is required: say why consent is revoked "
                          "(e.g. --reason 'owner request')")
    entry = revoke(key, reason=reason)
    write_entries(bootstrap_servers(bootstrap_servers_), [entry], topic=prefix + CONSENT_TOPIC,
                  timeout_s=timeout)
    typer.echo(f"revoked  {entry.owner}  reason={entry.reason}")


@consent_app.command("list")
@_fail_cleanly
def consent_list(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document.")] = False,
    bootstrap_servers_: BootstrapOpt = None,
    prefix: PrefixOpt = "",
    timeout: TimeoutOpt = 30.0,
) -> None:
    """Show the latest ledger entry of every owner and whether it is live now."""
    book = ConsentBook(bootstrap=bootstrap_servers(bootstrap_servers_),
                       topic=prefix + CONSENT_TOPIC, timeout_s=timeout)
    book.load()
    now = now_ms()
    rows = [_row(entry, now) for _, entry in sorted(book.ledger.entries.items())]
    if as_json:
        typer.echo(json.dumps({"owners": rows, "invalid_records": book.ledger.invalid},
                              indent=2, sort_keys=True))
        return
    if not rows:
        typer.echo("no consent recorded; grant with `flywheel consent grant`")
    for row in rows:
        detail = (f"scopes={','.join(row['scopes'])} expires_at_ms={row['expires_at_ms']} "
                  f"policy={row['policy_version']}" if row["action"] == "grant"
                  else f"reason={row['reason']}")
        typer.echo(f"{row['owner']}  {row['status']:8} {detail}")
    if book.ledger.invalid:
        typer.echo(f"note: {book.ledger.invalid} ledger record(s) are not valid consent "
                   "entries and allow nothing")


def _row(entry: Consent, now: int) -> dict[str, Any]:
    return {**entry.to_record(), "status": entry.status(now)}
