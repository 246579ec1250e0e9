"""``python -m hebrus_flywheel.consumers``: the consumers' commands without the root CLI.

Same commands and exit statuses as ``flywheel replay worker|seal|verify|rebuild``:
a deliberate error prints one message and exits with status 2.
"""

from __future__ import annotations

import logging
import os
import sys

import click
import typer

from hebrus_flywheel.consumers.cli import rebuild_command, replay_app, seal_command, verify_command
from hebrus_flywheel.core.errors import FlywheelError

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
app.add_typer(replay_app, name="replay")
app.command("seal")(seal_command)
app.command("verify")(verify_command)
app.command("rebuild")(rebuild_command)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(app(args=argv, standalone_mode=False) or 0)
    except FlywheelError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
