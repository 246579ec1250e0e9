"""What secure-by-default costs the README's two commands: ``make demo`` and the Kafka-bound
part of ``make test``, on a secure (SASL_SSL, SCRAM-SHA-512, ACLs) and on a plaintext
embedded broker, side by side; one JSON line per figure.

The two modes run *at the same time*, each with its own throw-away ``FLYWHEEL_HOME``, its
own broker on free ports and the jars of the default home, so both see the same machine
load (this machine is shared and noisy; compare the ratios, not the seconds). Each mode
runs the whole demo (``python -m hebrus_flywheel.demo``, every stage, pretraining
included) and then an integration-test subset that exercises every Kafka client kind
(publisher, faust stream worker, replay worker, sealer, trainer, consent ledger) but no
test of the transport itself (those only pass on a secure broker). Figures:

* ``demo_seconds_sasl_ssl`` / ``demo_seconds_plaintext`` and
  ``demo_secure_over_plaintext`` (goal ≤ 1.10), plus ``demo_stage_<name>_secure_over_plaintext``
  from each run's ``demo.json``;
* ``integration_subset_seconds_*`` and ``integration_subset_secure_over_plaintext``
  (goal ≤ 1.10; unit tests never touch the broker, so this is the upper bound on
  ``make test``'s ratio).

Usage: ``python bench/command_time.py [--skip-demo] [--tests FILE ...] [--sequential]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.kafka.security import ROLE_ENV
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV, HOME_ENV, KAFKA_CONFIG_ENV, PORT_ENV
from hebrus_flywheel.streams.broker import BrokerConfig, EmbeddedBroker

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sasl_ssl": False, "plaintext": True}  # name -> insecure_plaintext
SUBSET = (
    "tests/integration/test_capture.py",
    "tests/integration/test_consent.py",
    "tests/integration/test_streams_worker.py",
    "tests/integration/test_replay_worker.py",
    "tests/integration/test_replay_drain_seal.py",
    "tests/integration/test_train_snapshot.py",
)


def emit(figure: str, value: Any, unit: str, **extra: Any) -> None:
    print(json.dumps({"bench": "command_time", "figure": figure, "value": value,
                      "unit": unit, **extra}), flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _timed(argv: list[str], env: dict[str, str], log: Path) -> tuple[float, int]:
    started = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              check=False, timeout=5400)
    return round(time.perf_counter() - started, 1), done.returncode


def run_mode(name: str, insecure: bool, args: argparse.Namespace,
             results: dict[str, dict[str, Any]]) -> None:
    libs = BrokerConfig().jars_dir
    home = Path(tempfile.mkdtemp(prefix=f"flywheel-cmdtime-{name}-"))
    port = _free_port()
    config = BrokerConfig(home=home, port=port, controller_port=_free_port(),
                          insecure_plaintext=insecure,
                          libs_dir=libs if (libs / ".pom.sha256").is_file() else None)
    broker = EmbeddedBroker(config)
    env = {k: v for k, v in os.environ.items() if k not in (BOOTSTRAP_ENV, KAFKA_CONFIG_ENV,
                                                            ROLE_ENV)}
    env.update({HOME_ENV: str(home), PORT_ENV: str(port), "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    row: dict[str, Any] = {"home": str(home)}
    results[name] = row
    try:
        broker.up()
        if not args.skip_demo:
            row["demo"] = _timed([sys.executable, "-m", "hebrus_flywheel.demo"], env,
                                 home / "demo.log")
            for summary in home.glob("demo/runs/epoch-*/demo.json"):
                row["stages"] = json.loads(summary.read_text())["seconds"]
        row["tests"] = _timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "-m", "integration", *args.tests], env, home / "tests.log")
    except Exception as exc:  # reported as the mode's failure below
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        broker.down()
    failed = "error" in row or any(row.get(k, (0, 0))[1] for k in ("demo", "tests"))
    if failed or args.keep_homes:
        print(f"[command_time] {name}: logs and data kept in {home}", file=sys.stderr)
    else:
        shutil.rmtree(home, ignore_errors=True)


def _ratio(secure: float, plain: float) -> float:
    return round(secure / plain, 3) if plain else float("nan")


def report(results: dict[str, dict[str, Any]]) -> int:
    secure, plain = results["sasl_ssl"], results["plaintext"]
    failed = [f"{n}: {r.get('error') or r}" for n, r in results.items()
              if "error" in r or any(r.get(k, (0, 0))[1] for k in ("demo", "tests"))]
    for label, key in (("demo", "demo"), ("integration_subset", "tests")):
        if key not in secure or key not in plain:
            continue
        for name, row in (("sasl_ssl", secure), ("plaintext", plain)):
            emit(f"{label}_seconds_{name}", row[key][0], "s", rc=row[key][1])
        emit(f"{label}_secure_over_plaintext", _ratio(secure[key][0], plain[key][0]), "ratio")
    for stage, seconds in secure.get("stages", {}).items():
        other = plain.get("stages", {}).get(stage)
        if other:
            emit(f"demo_stage_{stage}_secure_over_plaintext", _ratio(seconds, other), "ratio",
                 sasl_ssl_s=seconds, plaintext_s=other)
    for line in failed:
        print(f"[command_time] FAILED {line} (logs under the mode's home)", file=sys.stderr)
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-demo", action="store_true", help="only the test subset")
    parser.add_argument("--tests", nargs="+", default=list(SUBSET),
                        help="integration test files to time (default: the Kafka subset)")
    parser.add_argument("--sequential", action="store_true",
                        help="one mode after the other instead of side by side")
    parser.add_argument("--keep-homes", action="store_true",
                        help="keep each mode's FLYWHEEL_HOME (always kept when a mode fails)")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    workers = [threading.Thread(target=run_mode, args=(name, insecure, args, results))
               for name, insecure in MODES.items()]
    for worker in workers:
        worker.start()
        if args.sequential:
            worker.join()
    for worker in workers:
        worker.join()
    sys.exit(report(results))


if __name__ == "__main__":
    main()
