"""The cost of TLS + SASL: ``bench/publish.py`` and ``bench/streams.py`` on a plaintext and
on a secure (SASL_SSL, SCRAM-SHA-512, ACLs) embedded broker; one JSON line per figure.

Each mode gets its own throw-away broker (a temporary ``FLYWHEEL_HOME``, free ports, the
jars of the default home), and the two benches run against it as subprocesses, so the
only difference is the transport. For every figure the benches print, this prints
``<figure>_plaintext``, ``<figure>_sasl_ssl`` and ``<figure>_secure_over_plaintext``
(the ratio; CPU on a shared machine is noisy, so compare ratios within one run), e.g.
``publish_observations_per_s_*`` (``bench/publish.py``) and
``faust_worker_observations_per_s_*`` (a real ``streams worker`` process, produce to
last window; ``bench/streams.py`` stops with the reasons if the worker quarantines
anything instead of waiting for windows that cannot come)::

    python bench/transport.py [--tokens 40000] [--threads 40] [--no-worker]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.kafka.security import ROLE_ENV
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV, HOME_ENV, KAFKA_CONFIG_ENV, PORT_ENV
from hebrus_flywheel.streams.broker import BrokerConfig, EmbeddedBroker

BENCH = Path(__file__).resolve().parent
MODES = {"plaintext": True, "sasl_ssl": False}  # name -> insecure_plaintext


def emit(figure: str, value: float, unit: str, **extra: Any) -> None:
    print(json.dumps({"bench": "transport", "figure": figure, "value": value, "unit": unit,
                      **extra}), flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(script: str, args: list[str], env: dict[str, str]) -> dict[str, dict[str, Any]]:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], env=env, text=True,
                          capture_output=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{script} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    figures = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            figures[row["figure"]] = row
    return figures


def run_mode(insecure: bool, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    libs = BrokerConfig().jars_dir
    with tempfile.TemporaryDirectory(prefix="flywheel-transport-") as home:
        port = _free_port()
        config = BrokerConfig(home=Path(home), port=port, controller_port=_free_port(),
                              insecure_plaintext=insecure,
                              libs_dir=libs if (libs / ".pom.sha256").is_file() else None)
        broker = EmbeddedBroker(config)
        env = {k: v for k, v in os.environ.items()
               if k not in (BOOTSTRAP_ENV, KAFKA_CONFIG_ENV, ROLE_ENV)}
        env.update({HOME_ENV: home, PORT_ENV: str(port)})
        try:
            broker.up()
            figures = _run("publish.py", ["--tokens", str(args.tokens), "--skip-capture"], env)
            streams = ["--threads", str(args.threads)] + (["--no-worker"] if args.no_worker
                                                            else [])
            figures.update(_run("streams.py", streams, env))
        finally:
            broker.down()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=40_000,
                        help="token-observations bench/publish.py publishes per mode")
    parser.add_argument("--threads", type=int, default=40)
    parser.add_argument("--no-worker", action="store_true")
    args = parser.parse_args()
    results = {name: run_mode(insecure, args) for name, insecure in MODES.items()}
    for figure, plain in results["plaintext"].items():
        secure = results["sasl_ssl"].get(figure)
        if secure is None or not isinstance(plain["value"], int | float):
            continue
        for name, row in (("plaintext", plain), ("sasl_ssl", secure)):
            emit(f"{figure}_{name}", row["value"], row["unit"], source=row["bench"])
        if plain["value"]:
            emit(f"{figure}_secure_over_plaintext", round(secure["value"] / plain["value"], 3),
                 "ratio", source=plain["bench"])


if __name__ == "__main__":
    main()
