"""Per-teacher Kafka namespaces: the topic prefix (and with it the consumer groups).

Two teachers captured into the same topics interfere (their windows share partitions,
workers and groups), so the commands that know their teacher (``capture``, ``replay
worker``, ``selftest``; ``topics create`` and ``streams worker`` with ``--teacher``)
default to that teacher's own namespace: every topic name and every group id is
prefixed with :func:`teacher_namespace` (``<teacher dir name>-<8 hex>.``, the hex being
a digest of the directory's resolved path, so two checkpoints never share one).

Override order: an explicit ``--prefix`` (``--prefix ""`` is the shared, unprefixed
namespace), then ``$FLYWHEEL_NAMESPACE``, then the teacher's namespace.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

NAMESPACE_ENV = "FLYWHEEL_NAMESPACE"
_SLUG_MAX = 40


def teacher_namespace(teacher_dir: str | Path) -> str:
    """The topic prefix of ``teacher_dir``: ``<slug>-<8 hex>.`` (Kafka-legal characters)."""
    path = Path(teacher_dir).resolve()
    slug = re.sub(r"[^a-z0-9-]+", "-", path.name.lower()).strip("-")[:_SLUG_MAX] or "teacher"
    digest = hashlib.sha256(str(path).encode("utf-8")).hexdigest()[:8]
    return f"{slug}-{digest}."


def resolve_prefix(explicit: str | None, *, teacher: str | Path | None) -> str:
    """The topic prefix to use: ``explicit`` if given, else ``$FLYWHEEL_NAMESPACE``, else
    the teacher's namespace, else the shared namespace (``""``)."""
    if explicit is not None:
        return explicit
    from_env = os.environ.get(NAMESPACE_ENV)
    if from_env is not None:
        return from_env
    return teacher_namespace(teacher) if teacher is not None else ""
