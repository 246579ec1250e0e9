"""``flywheel storage up|down|status|credentials|render-config|ensure-bucket``: the embedded
S3-compatible store (:mod:`streams.storage_server`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from hebrus_flywheel.core.storage.config import (
    ACCESS_ENV,
    CA_ENV,
    DEFAULT_BUCKET,
    ENDPOINT_ENV,
    SECRET_ENV,
    STORAGE_ROLES,
    s3_target,
)
from hebrus_flywheel.streams.cli import _fail_cleanly
from hebrus_flywheel.streams.storage_server import (
    EmbeddedStorage,
    admin_target,
    ensure_buckets,
    render_config,
)

storage_app = typer.Typer(
    help="Run the embedded S3-compatible store (SeaweedFS on loopback, TLS, per-role keys).",
    no_args_is_help=True)


@storage_app.command("up")
@_fail_cleanly
def storage_up(timeout_s: Annotated[float, typer.Option("--timeout-s")] = 120.0) -> None:
    """Start the store (SeaweedFS built, certificate and keys made on the first start)."""
    store = EmbeddedStorage()
    started = store.up(timeout_s)
    status = store.status()
    typer.echo(f"{'started' if started else 'already running'}: S3 store on {status.endpoint} "
               f"(pid {status.pid}), bucket s3://{DEFAULT_BUCKET}, data {status.data_dir}")


@storage_app.command("down")
@_fail_cleanly
def storage_down() -> None:
    """Stop the store (its data stays)."""
    stopped = EmbeddedStorage().down()
    typer.echo("stopped" if stopped else "not running")


@storage_app.command("status")
@_fail_cleanly
def storage_status(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Whether the store runs and answers on its port."""
    status = EmbeddedStorage().status()
    view = {"running": status.running, "pid": status.pid, "endpoint": status.endpoint,
            "reachable": status.reachable, "data_dir": str(status.data_dir),
            "log_file": str(status.log_file)}
    typer.echo(json.dumps(view, indent=2) if as_json else
               "  ".join(f"{k}={v}" for k, v in view.items()))
    if not status.running:
        raise SystemExit(1)


@storage_app.command("credentials")
@_fail_cleanly
def storage_credentials(role: Annotated[str, typer.Option(
        "--role", help=f"One of {', '.join(STORAGE_ROLES)}.")]) -> None:
    """Print the role's settings as shell exports (contains the secret key)."""
    target = s3_target(role)
    typer.echo(f"export {ENDPOINT_ENV}={target.endpoint or ''}")
    typer.echo(f"export {CA_ENV}={target.ca_bundle or ''}")
    typer.echo(f"export {ACCESS_ENV}={target.access_key}")
    typer.echo(f"export {SECRET_ENV}={target.secret_key}")


@storage_app.command("render-config")
@_fail_cleanly
def storage_render_config(
    home: Annotated[Path, typer.Option("--home", help="FLYWHEEL_HOME the clients share (a "
                                       "volume): keys go to <home>/storage/security.")],
    host: Annotated[str, typer.Option("--host", help="The store's host name (certificate).")],
) -> None:
    """Write the store's certificate, per-role keys and SeaweedFS identities (s3.json) for
    a container (compose.yaml); kept when present."""
    for path in render_config(home, host=host):
        typer.echo(f"wrote {path}")


@storage_app.command("ensure-bucket")
@_fail_cleanly
def storage_ensure_bucket() -> None:
    """Create the snapshot and checkpoint buckets with the store's administrator keys if
    they are missing (the embedded store does this when it starts; compose.yaml runs it
    once against object-store)."""
    for store in ensure_buckets(admin_target()):
        typer.echo(f"bucket {store.location} ready")
