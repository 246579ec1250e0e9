"""The hash-checked lock of the Python dependencies (``requirements.lock``).

``make lock`` writes it with pip-compile from pyproject.toml (dependencies, the ``dev``
extra) and requirements-build.in (pip, setuptools, wheel); ``make install`` installs only
from it with ``--require-hashes --no-deps``. This script runs on a bare venv (stdlib and
pip's vendored ``packaging``)::

    python tools/lockfile.py check                      # exit 1 when the lock is stale
    python tools/lockfile.py extract pip setuptools     # print those pins with their hashes
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a fresh venv has only pip, which vendors packaging
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
LOCK = "requirements.lock"
BUILD_IN = "requirements-build.in"
EXTRA = "dev"
_PIN_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")
FIX = f"run `make lock` and commit {LOCK}"


def pins(lock_text: str) -> dict[str, str]:
    """``{canonical name: version}`` of every ``name==version`` line in a lock."""
    found = {}
    for line in lock_text.splitlines():
        match = _PIN_RE.match(line)
        if match:
            found[canonicalize_name(match.group(1))] = match.group(2)
    return found


def blocks(lock_text: str) -> dict[str, str]:
    """``{canonical name: its pin line plus hash/comment continuation lines}``."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lock_text.splitlines():
        match = _PIN_RE.match(line)
        if match:
            current = found.setdefault(canonicalize_name(match.group(1)), [])
            current.append(line)
        elif current is not None and line.startswith((" ", "\t")):
            current.append(line)
        else:
            current = None
    return {name: "\n".join(lines) + "\n" for name, lines in found.items()}


def declared(root: Path) -> list[tuple[str, str]]:
    """``(source, requirement)`` for everything the lock must pin."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    reqs = [("pyproject.toml dependencies", r) for r in project["project"]["dependencies"]]
    extra = project["project"].get("optional-dependencies", {}).get(EXTRA, [])
    reqs += [(f"pyproject.toml [{EXTRA}] extra", r) for r in extra]
    reqs += [("pyproject.toml build-system", r) for r in project["build-system"]["requires"]]
    for line in (root / BUILD_IN).read_text().splitlines():
        if line.split("#", 1)[0].strip():
            reqs.append((BUILD_IN, line.split("#", 1)[0].strip()))
    return reqs


def problems(root: Path) -> list[str]:
    """Why ``requirements.lock`` does not cover pyproject.toml (empty when it does)."""
    lock_path = root / LOCK
    if not lock_path.is_file():
        return [f"{lock_path} does not exist"]
    text = lock_path.read_text()
    pinned, found = pins(text), []
    for source, raw in declared(root):
        try:
            req = Requirement(raw)
        except InvalidRequirement as exc:
            found.append(f"{source}: cannot parse {raw!r}: {exc}")
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        version = pinned.get(canonicalize_name(req.name))
        if version is None:
            found.append(f"{source} requires {raw!r} but {LOCK} has no pin for {req.name}")
        elif req.specifier and not req.specifier.contains(version, prereleases=True):
            found.append(f"{source} requires {raw!r} but {LOCK} pins {req.name}=={version}")
    unhashed = [n for n, block in blocks(text).items() if "--hash=sha256:" not in block]
    found += [f"{LOCK} pins {name} without a --hash" for name in unhashed]
    return found


def main(argv: list[str]) -> int:
    if argv[:1] == ["check"] and len(argv) == 1:
        found = problems(ROOT)
        for line in found:
            print(f"lock: {line}", file=sys.stderr)
        if found:
            print(f"lock: {LOCK} is out of date with pyproject.toml; {FIX}", file=sys.stderr)
        return 1 if found else 0
    if argv[:1] == ["extract"] and len(argv) > 1:
        have = blocks((ROOT / LOCK).read_text())
        missing = [n for n in argv[1:] if canonicalize_name(n) not in have]
        if missing:
            print(f"lock: {LOCK} has no pin for {', '.join(missing)}; {FIX}", file=sys.stderr)
            return 1
        sys.stdout.write("".join(have[canonicalize_name(n)] for n in argv[1:]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
