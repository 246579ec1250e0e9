"""SeaweedFS for the embedded store: the pinned Go module, built once, and its command line.

``go install github.com/seaweedfs/seaweedfs/weed@VERSION`` is refused by the go command
(the module's go.mod has ``replace`` directives, which ``go install pkg@version`` does not
allow), so the same thing is done in two steps: ``go mod download`` fetches the pinned
module (the go command checks it against the checksum database; its ``h1:`` sum must also
equal :data:`MODULE_SUM`), and ``go build -trimpath`` builds ``./weed`` inside the
read-only module directory with the module's own go.mod and go.sum. The binary lands in
``$FLYWHEEL_HOME/storage/bin/weed`` next to ``weed.version`` (what it was built from) and
is reused until the pin changes. The first build takes minutes; later ones in a fresh
home take seconds from Go's build cache (``-trimpath`` keeps it path-independent).

:func:`server_args` is the one command line of the store, for ``flywheel storage up`` and
for compose.yaml's ``object-store`` (checked by tests/unit/test_compose.py).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from hebrus_flywheel.core.files import atomic_write_text, make_dirs
from hebrus_flywheel.core.processes import run_tool
from hebrus_flywheel.core.storage.exceptions import StorageError

MODULE = "github.com/seaweedfs/seaweedfs"
VERSION = "v0.0.0-20261109003541-7506e5f91cd6"
MODULE_SUM = "h1:LOYZFToHq9F7pSR6lkPGfkM8RmHlVFrzndKdhmNZjrU="
RELEASE = "4.53"  # what `weed version` of that commit reports; compose.yaml's image tag
IMAGE = f"chrislusf/seaweedfs:{RELEASE}"
BUILD_TIMEOUT_S = 3600.0
LOOPBACK = "127.0.0.1"


def find_go() -> str:
    found = shutil.which("go")
    if found is None:
        raise StorageError("go not found on PATH; install Go 1.26 or newer (e.g. `apt-get "
                           "install golang`): it builds the embedded store (SeaweedFS) once")
    return found


def _go(args: list[str], what: str, *, cwd: Path | None = None) -> str:
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly -buildvcs=false"}
    return run_tool([find_go(), *args], what=what, timeout_s=BUILD_TIMEOUT_S, cwd=cwd, env=env,
                    error=StorageError,
                    hint="check access to the Go module proxy (GOPROXY) and retry")


def _download() -> Path:
    """The pinned module's directory in the module cache, its checksum checked."""
    info = json.loads(_go(["mod", "download", "-json", f"{MODULE}@{VERSION}"],
                          f"downloading {MODULE}@{VERSION}"))
    if info.get("Sum") != MODULE_SUM:
        raise StorageError(f"{MODULE}@{VERSION} has checksum {info.get('Sum')}, pinned "
                           f"{MODULE_SUM}: refusing to build it")
    return Path(info["Dir"])


def ensure_binary(bin_dir: Path) -> Path:
    """``bin_dir/weed`` built from the pinned module (once; again when the pin changes)."""
    weed, marker = bin_dir / "weed", bin_dir / "weed.version"
    pin = f"{MODULE}@{VERSION} {MODULE_SUM}"
    if weed.is_file() and marker.is_file() and marker.read_text().strip() == pin:
        return weed
    source = _download()
    make_dirs(bin_dir)
    partial = bin_dir / "weed.partial"
    _go(["build", "-trimpath", "-o", str(partial), "./weed"],
        f"building SeaweedFS {RELEASE} from {MODULE}@{VERSION}", cwd=source)
    partial.rename(weed)
    atomic_write_text(marker, pin + "\n")
    return weed


@dataclass(frozen=True, kw_only=True)
class ServerLayout:
    """Where one SeaweedFS server listens and keeps its files.

    Fields:
        s3_port: the S3 API's TLS port (the only one clients use).
        s3_bind: the address the S3 API listens on (``0.0.0.0`` in a container).
        data_dir: master, volume and filer data.
        security_dir: ``s3.json`` (identities), ``ca.crt`` and ``tls.key``.
        internal_ports: master, master gRPC, volume, volume gRPC, filer, filer gRPC and
            S3 gRPC, all on loopback only (the filer and volume APIs have no
            authentication); default ``s3_port + 1..7``.
    """

    s3_port: int
    s3_bind: str
    data_dir: Path
    security_dir: Path
    internal_ports: tuple[int, ...] = ()

    def ports(self) -> tuple[int, ...]:
        return self.internal_ports or tuple(self.s3_port + i for i in range(1, 8))


def server_args(layout: ServerLayout) -> list[str]:
    """``weed`` arguments: master, volume, filer and the S3 gateway in one process, every
    internal port on loopback, TLS on the S3 port, identities from ``s3.json``, no
    telemetry, no Iceberg or Lance ports."""
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3_grpc = layout.ports()
    sec = layout.security_dir
    return ["server", f"-dir={layout.data_dir}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}",
            f"-s3.ip.bind={layout.s3_bind}", f"-master.port={master}",
            f"-master.port.grpc={master_grpc}", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=1024", f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}", "-volume.max=16", "-filer",
            f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}", "-s3",
            f"-s3.port={layout.s3_port}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0",
            "-s3.port.lance=0", f"-s3.config={sec / 's3.json'}",
            f"-s3.cert.file={sec / 'ca.crt'}", f"-s3.key.file={sec / 'tls.key'}"]


def identities(keys: dict[str, dict[str, str]], *,
               checkpoint_bucket: str) -> dict[str, object]:
    """SeaweedFS's ``s3.json``: ``sealer`` reads, lists and writes (delete included),
    ``trainer`` reads and lists and writes only ``checkpoint_bucket`` (its checkpoints),
    ``admin`` (the store's own, for the buckets) is all."""
    actions = {"sealer": ["Read", "List", "Write"],
               "trainer": ["Read", "List", f"Write:{checkpoint_bucket}"],
               "admin": ["Admin"]}
    return {"identities": [
        {"name": role, "actions": actions[role],
         "credentials": [{"accessKey": k["access_key"], "secretKey": k["secret_key"]}]}
        for role, k in sorted(keys.items())]}
