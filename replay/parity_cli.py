"""``flywheel parity``: the replay/decode parity gate over runtime_holdout windows.

Windows come from a Kafka topic (read from the beginning to its end at the time of the
call) or from a local *window file*. A window file is a sequence of frames, each a
4-byte big-endian length followed by one Avro single-object ``Window`` message (the
bytes a window topic carries); :func:`write_window_file` writes one.

The command prints a table, optionally writes the :class:`replay.parity.ParityResult`
JSON (``--out``), and exits 0 when the identity is authoritative, 1 when it is not.

torch, transformers and confluent-kafka are imported inside the command, never at
module level, so the rest of the CLI starts fast.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.execution import (
    ATTENTION_OPTION,
    DEVICE_OPTION,
    DTYPE_OPTION,
    Execution,
)
from hebrus_flywheel.core.files import atomic_write_text, create_file, make_dirs
from hebrus_flywheel.core.kafka.security import declare_role
from hebrus_flywheel.replay.exceptions import WindowSourceError

if TYPE_CHECKING:
    from hebrus_flywheel.replay.parity import ParityResult

log = logging.getLogger(__name__)

RUNTIME_HOLDOUT_TOPIC = "flywheel.windows.runtime_holdout.v1"
WINDOW_SCHEMA = "hebrus.flywheel.v1.Window"
_FRAME = struct.Struct(">I")


def write_window_file(path: str | Path, windows: Iterable[Mapping[str, Any]]) -> int:
    """Encode ``windows`` (Window.v1 records) into a window file; returns the count."""
    from hebrus_flywheel.schemas import codec

    count = 0
    with create_file(Path(path)) as handle:
        for window in windows:
            data = codec.encode(f"{WINDOW_SCHEMA}.v1", window)  # a local file, not a topic
            handle.write(_FRAME.pack(len(data)))
            handle.write(data)
            count += 1
    return count


def _decode_window(data: bytes | None, where: str) -> dict[str, Any]:
    from hebrus_flywheel.schemas import codec
    from hebrus_flywheel.schemas.exceptions import SchemaError

    if data is None:
        raise WindowSourceError(f"{where}: is a tombstone (no value); window topics hold none")
    try:
        key, record = codec.decode(data)
    except SchemaError as exc:
        raise WindowSourceError(f"{where}: not a decodable window message: {exc}") from exc
    if key.name != WINDOW_SCHEMA:
        raise WindowSourceError(
            f"{where}: holds a {key.name} record, not a {WINDOW_SCHEMA}; read a window topic"
        )
    from hebrus_flywheel.streams.processors.window_seal import (
        Erased,
        SealOpenError,
        default_sealer,
        readable_window,
    )

    try:
        window = readable_window(key.version, record, default_sealer())
    except SealOpenError as exc:
        raise WindowSourceError(f"{where}: a sealed window that does not open: {exc}") from exc
    if isinstance(window, Erased):
        raise WindowSourceError(f"{where}: the window's owner was erased; it cannot be read")
    return window


def read_window_file(path: str | Path) -> Iterator[dict[str, Any]]:
    """Decoded Window records of a window file, in file order."""
    source = Path(path)
    if not source.is_file():
        raise WindowSourceError(f"window file {source} does not exist; pass an existing file")
    with source.open("rb") as handle:
        index = 0
        while header := handle.read(_FRAME.size):
            if len(header) < _FRAME.size:
                raise WindowSourceError(f"{source}: truncated frame header after {index} windows")
            (size,) = _FRAME.unpack(header)
            data = handle.read(size)
            if len(data) != size:
                raise WindowSourceError(
                    f"{source}: frame {index} claims {size} bytes but only {len(data)} remain; "
                    "the file is truncated"
                )
            yield _decode_window(data, f"{source} frame {index}")
            index += 1


def read_window_topic(
    bootstrap_servers: str, topic: str, *, timeout_s: float
) -> Iterator[dict[str, Any]]:
    """Decoded Window records of ``topic`` from its beginning to its current end."""
    from hebrus_flywheel.streams.processors.inspect import read_topic

    for message in read_topic(bootstrap_servers, topic, timeout_s=timeout_s):
        where = f"{topic}[{message.partition()}]@{message.offset()}"
        yield _decode_window(message.value(), where)


def _windows(
    windows_file: Path | None, bootstrap_servers: str | None, topic: str, timeout_s: float
) -> Iterator[dict[str, Any]]:
    if (windows_file is None) == (bootstrap_servers is None):
        raise ConfigError(
            "windows source: pass exactly one of --windows-file FILE or "
            "--bootstrap-servers HOST:PORT"
        )
    if windows_file is not None:
        return read_window_file(windows_file)
    return read_window_topic(str(bootstrap_servers), topic, timeout_s=timeout_s)


def parity_command(
    teacher: Path = typer.Option(..., "--teacher", help="Teacher checkpoint directory."),
    windows_file: Path | None = typer.Option(
        None, "--windows-file", help="Local window file (length-prefixed Avro frames)."),
    bootstrap_servers: str | None = typer.Option(
        None, "--bootstrap-servers", help="Kafka bootstrap servers to read --topic from."),
    topic: str = typer.Option(RUNTIME_HOLDOUT_TOPIC, "--topic", help="Window topic to read."),
    max_windows: int = typer.Option(0, "--max-windows", help="Read at most N windows (0: all)."),
    out: Path | None = typer.Option(None, "--out", help="Write the ParityResult JSON here."),
    dtype: str = DTYPE_OPTION,
    device: str = DEVICE_OPTION,
    attention: str = ATTENTION_OPTION,
    min_sample: int = typer.Option(1, "--min-sample", help="Windows needed to be authoritative."),
    weight_atol: float = typer.Option(1e-4, "--weight-atol", help="Weight tolerance."),
    max_batch_tokens: int = typer.Option(1024, "--max-batch-tokens", help="Replay batch budget."),
    threads: int = typer.Option(0, "--threads", help="torch intra-op threads (0: leave as is)."),
    timeout_s: float = typer.Option(60.0, "--timeout-s", help="Kafka read timeout, seconds."),
) -> None:
    """Compare replayed top-k with captured decode top-k; exit 1 unless authoritative."""
    declare_role("replay")
    if max_windows < 0:
        raise ConfigError(f"max_windows must be >= 0, got {max_windows}")
    if threads < 0:
        raise ConfigError(f"threads must be >= 0, got {threads}")
    from hebrus_flywheel.replay.parity import ParityConfig, run_parity

    config = ParityConfig(min_sample=min_sample, weight_atol=weight_atol)
    windows = _windows(windows_file, bootstrap_servers, topic, timeout_s)
    if max_windows:
        windows = islice(windows, max_windows)
    execution = Execution(device=device, dtype=dtype, attention=attention)
    replayer = _load_replayer(teacher, execution, max_batch_tokens, threads)
    result = run_parity(replayer, windows, config)
    typer.echo(format_table(result))
    if out is not None:
        make_dirs(out.parent)
        atomic_write_text(out, result.to_json() + "\n")
        typer.echo(f"wrote {out}")
    if not result.authoritative:
        raise typer.Exit(1)


def _load_replayer(teacher_dir: Path, execution: Execution, max_batch_tokens: int,
                   threads: int) -> Any:
    import torch

    from hebrus_flywheel.replay.prefill import PrefillReplayer, ReplayConfig
    from hebrus_flywheel.replay.teacher import load_teacher

    if threads:
        torch.set_num_threads(threads)
    config = ReplayConfig(dtype=execution.dtype, max_batch_tokens=max_batch_tokens)
    teacher = load_teacher(teacher_dir, dtype=execution.dtype, device=execution.device,
                           attention=execution.attention)
    return PrefillReplayer(teacher, config)


def format_table(result: ParityResult) -> str:
    """A human-readable summary: verdict, totals, per-layer rates, margin quantiles."""
    r = result
    verdict = "AUTHORITATIVE" if r.authoritative else "NOT authoritative"
    lines = [
        f"parity: {verdict}  identity {r.identity_id[:16]}…  dtype {r.teacher_dtype}  "
        f"kernels {r.kernel_path or 'unrecorded'}",
        f"windows compared {r.windows_compared} (min_sample {r.min_sample})  skipped "
        f"{r.windows_skipped or 0}",
        f"pairs {r.pairs}  mismatched {r.mismatched_pairs} ({r.mismatch_rate:.4%}, "
        f"primary {r.primary_mismatches})  "
        f"expert-set {r.set_mismatches}  rank-order-only {r.rank_only_mismatches}",
        f"weights: max |diff| {r.max_weight_abs_diff}  over atol {r.weight_atol}: "
        f"{r.weight_violations}",
        f"{'slot':>5} {'layer':>6} {'pairs':>9} {'mismatch':>9} {'rate':>9}",
    ]
    lines += [
        f"{row['slot']:>5} {row['layer']:>6} {row['pairs']:>9} {row['mismatches']:>9} "
        f"{row['mismatch_rate']:>9.4%}"
        for row in r.per_layer
    ]
    for kind, groups in r.margins.items():
        for where, summary in groups.items():
            q = ", ".join(f"{k}={v:.3g}" for k, v in summary["quantiles"].items()) or "-"
            lines.append(f"{kind} margin {where} (n={summary['count']}): {q}")
    return "\n".join(lines)
