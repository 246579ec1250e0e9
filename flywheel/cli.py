"""``flywheel``: one entry point, one sub-command per stage of the flywheel.

Sub-apps live next to the code they drive (``streams.cli``, ``replay.cli``) and must
not import torch at module level, so ``flywheel broker status`` starts fast. Every
deliberate error (:class:`~flywheel.errors.FlywheelError`) becomes a one-paragraph
message on stderr and exit status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import typer

from hebrus_flywheel.core import __version__
from hebrus_flywheel.core.kafka.config import client_config
from hebrus_flywheel.core.runner import offline_environment, run_app
from hebrus_flywheel.core.settings import KAFKA_CONFIG_ENV

CHAT_TEMPLATE_ENV = "FLYWHEEL_CHAT_TEMPLATE"  # replay.tokenizer.CHAT_TEMPLATE_ENV (no torch here)

app = typer.Typer(
    name="flywheel",
    help="hebrus-flywheel: capture → streams → replay → snapshots → train → qualify.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _mount_subapps() -> None:
    from hebrus_flywheel.consumers.cli import (
        export_command,
        rebuild_command,
        replay_app,
        seal_command,
        snapshots_app,
        verify_command,
    )
    from hebrus_flywheel.consumers.erase_cli import erase_command
    from hebrus_flywheel.replay.capture_cli import capture_command
    from hebrus_flywheel.replay.cli import teacher_app
    from hebrus_flywheel.replay.parity_cli import parity_command
    from hebrus_flywheel.selftest import selftest_command
    from hebrus_flywheel.streams.cli import broker_app, topics_app
    from hebrus_flywheel.streams.consent_cli import consent_app
    from hebrus_flywheel.streams.processors.cli import streams_app
    from hebrus_flywheel.streams.storage_cli import storage_app
    from hebrus_flywheel.train.cli import evaluate_command, predictors_command, train_command
    from hebrus_flywheel.train.qualify_cli import qualify_command

    app.add_typer(broker_app, name="broker",
                  help="Run the embedded Kafka (KRaft): one node or a local cluster.")
    app.add_typer(storage_app, name="storage",
                  help="Run the embedded S3-compatible store (snapshot roots s3://...).")
    app.add_typer(topics_app, name="topics", help="Create and describe the topic catalogue.")
    app.add_typer(consent_app, name="consent", help="Grant, revoke and list owners' consent.")
    app.add_typer(teacher_app, name="teacher", help="Create or describe a frozen teacher.")
    app.command("capture")(capture_command)
    app.add_typer(streams_app, name="streams", help="Validate, split, dedup and window.")
    app.add_typer(replay_app, name="replay", help="Prefill replay workers that write shards.")
    app.command("parity")(parity_command)
    app.command("seal")(seal_command)
    app.command("verify")(verify_command)
    app.command("rebuild")(rebuild_command)
    app.command("export-plaintext")(export_command)
    app.add_typer(snapshots_app, name="snapshots", help="Manage sealed snapshots (expire).")
    app.command("erase")(erase_command)
    app.command("train")(train_command)
    app.command("evaluate")(evaluate_command)
    app.command("predictors")(predictors_command)
    app.command("qualify")(qualify_command)
    app.command("selftest")(selftest_command)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log at DEBUG level."),
    kafka_config: str | None = typer.Option(
        None, "--kafka-config", metavar="FILE",
        help=f"Kafka client properties, key=value lines (security.protocol, sasl.*, ssl.*, "
             f"client.id, ...) for every Kafka client [default: ${KAFKA_CONFIG_ENV}]."),
    chat_template: str | None = typer.Option(
        None, "--chat-template", metavar="FILE",
        help=f"Jinja chat template to render conversations with, for a teacher whose "
             f"tokenizer has none (or to replace its own) [default: ${CHAT_TEMPLATE_ENV}]."),
) -> None:
    if chat_template:
        path = Path(chat_template)
        if not path.is_file():
            raise typer.BadParameter(f"{chat_template} is not a file; pass a Jinja template",
                                     param_hint="--chat-template")
        os.environ[CHAT_TEMPLATE_ENV] = str(path.resolve())
    if kafka_config:
        client_config(kafka_config=kafka_config)  # a bad file fails here, naming the line
        # Through the environment, every command and the processes it starts see it.
        os.environ[KAFKA_CONFIG_ENV] = str(Path(kafka_config).resolve())
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("faust", "aiokafka", "mode", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


@app.command("version")
def version() -> None:
    """Print the package version."""
    typer.echo(__version__)


def main(argv: list[str] | None = None) -> None:
    offline_environment()
    _mount_subapps()
    run_app(app, argv)


if __name__ == "__main__":
    main()
