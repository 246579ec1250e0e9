"""The split salt of a small synthetic run (the demo, the self-test).

Splits hash owner and thread pseudonyms, which depend on the owner key store, so a run
of a few threads needs a salt under which its threads fill every split later stages
need. Only threads the dedup stage is sure to keep may count: a thread with an exact or
near duplicate among the others can be dropped (which of a pair survives follows
arrival order), and a salt that put the only runtime-holdout thread on such a pair
left the parity gate with nothing to compare (seen in CI: the self-test's sixth
synthetic thread differs from the fifth by one word).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hebrus_flywheel.replay.conversations import Thread
    from hebrus_flywheel.streams.processors.split import SplitConfig


def distinct_threads(threads: Sequence[Thread], teacher_dir: Path) -> list[Thread]:
    """The threads that have no exact or near duplicate among the others, as rendered
    by the teacher's tokenizer (what forced capture decodes)."""
    from hebrus_flywheel.replay.render import render_thread
    from hebrus_flywheel.replay.tokenizer import load_tokenizer
    from hebrus_flywheel.streams.processors.dedup import DedupConfig, duplicated

    tokenizer = load_tokenizer(teacher_dir)
    dropped = duplicated([render_thread(t, tokenizer).token_ids for t in threads],
                         DedupConfig())
    return [t for i, t in enumerate(threads) if i not in dropped]


def distinct_thread_ids(threads: Sequence[Thread], teacher_dir: Path) -> list[tuple[str, str]]:
    """(owner, thread) pseudonyms of :func:`distinct_threads`."""
    from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer

    names = Pseudonymizer(LocalOwnerKeyStore(create=True))
    return [(names.owner(t.owner), names.thread(t.owner, t.thread_id))
            for t in distinct_threads(threads, teacher_dir)]


def split_salt(threads: Sequence[Thread], teacher_dir: Path, config: SplitConfig, *,
               minimum: Mapping[str, int]) -> str | None:
    """The first salt from ``config.salt`` on under which the distinct threads fill
    ``minimum`` (None: no salt does; more threads are needed)."""
    from hebrus_flywheel.streams.processors.split import search_salt

    return search_salt(distinct_thread_ids(threads, teacher_dir), config, minimum=minimum)
