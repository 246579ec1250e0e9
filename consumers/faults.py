"""Fault injection for crash tests: ``os._exit`` at a named point, like a kill -9.

``FLYWHEEL_FAULT=<point>[:<n>]`` makes the process exit with status 137 (without
flushing, closing or committing anything) the ``n``-th time (default 1st) it reaches
``point``. Points:

* ``after_batch``: the engine returned labels for one batch of a block, before the
  block's shard is written (mid-batch: some of the block's labels exist in memory);
* ``mid_write``: one row group of a shard's staging file is written, the file is open;
* ``before_rename``: the staging file is complete and fsynced, not yet renamed;
* ``after_rename``: the shard is durable, its offsets are not committed yet;
* ``after_commit``: the block's offsets are committed;
* ``erase_after_<step>``: ``flywheel erase`` recorded a step as done (``plan``, ``keys``,
  ``changelogs``, ``snapshot``, ``unsealed``, ``checkpoints``, ``purge``);
* ``erase_before_swap``: a superseding snapshot is written, the old one still live;
* ``erase_between_renames``: the old snapshot is retired, the new one not yet in place;
* ``publish_after_shard``: one shard of a sealed epoch is uploaded to its ``s3://`` root;
* ``publish_before_manifest``: every shard is uploaded, the manifest (commit point) is not.

Unset (the normal case), :func:`hit` costs one dictionary look-up.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

FAULT_ENV = "FLYWHEEL_FAULT"
FAULT_EXIT_STATUS = 137
POINTS = ("after_batch", "mid_write", "before_rename", "after_rename", "after_commit",
          "erase_before_swap", "erase_between_renames", "publish_after_shard",
          "publish_before_manifest")
_hits: Counter[str] = Counter()


def _target() -> tuple[str, int] | None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    point, _, count = spec.partition(":")
    return point, int(count) if count.isdigit() and int(count) > 0 else 1


def hit(point: str) -> None:
    """Exit immediately if ``FLYWHEEL_FAULT`` names ``point`` and this is the chosen hit."""
    target = _target()
    if target is None or target[0] != point:
        return
    _hits[point] += 1
    if _hits[point] == target[1]:
        sys.stderr.write(f"fault injection: exiting at {point} (hit {target[1]})\n")
        sys.stderr.flush()
        os._exit(FAULT_EXIT_STATUS)
