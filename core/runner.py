"""Run a typer app the way every ``flywheel`` entry point does.

Deliberate errors (:class:`~flywheel.errors.FlywheelError`) become one message on
stderr and exit status 2; usage errors keep click's message and status; anything else
is a bug and keeps its traceback. Offline settings for transformers are set first, so
nothing ever tries to reach a model hub.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import typer

from hebrus_flywheel.core.errors import FlywheelError


def offline_environment() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_app(app: typer.Typer, argv: Sequence[str] | None = None) -> None:
    """Run ``app`` and exit with its status (never returns)."""
    # typer vendors click: its usage errors derive from ClickException, whose base is
    # TyperException; show() prints click's usual message.
    try:
        # Without standalone mode click returns an Exit's code instead of exiting.
        sys.exit(app(args=None if argv is None else list(argv), standalone_mode=False) or 0)
    except FlywheelError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("aborted", err=True)
        sys.exit(130)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.TyperException as exc:
        show = getattr(exc, "show", None)
        if show is None:
            raise
        show()
        sys.exit(getattr(exc, "exit_code", 2))
