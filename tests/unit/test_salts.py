"""The split salt of small synthetic runs counts only threads dedup keeps for sure."""

from __future__ import annotations

from pathlib import Path

from hebrus_flywheel.core.privacy import LocalOwnerKeyStore, Pseudonymizer
from hebrus_flywheel.replay.capture import load_threads
from hebrus_flywheel.salts import distinct_thread_ids, split_salt
from hebrus_flywheel.streams.processors.split import SplitConfig, draw_splits


def test_near_duplicate_synthetic_threads_do_not_count(teacher_dir: Path) -> None:
    # the self-test's six threads: the sixth differs from the fifth by one word, so the
    # dedup stage keeps only one of them, and which one follows arrival order
    threads = list(load_threads(None, 6, seed=0))
    ids = distinct_thread_ids(threads, teacher_dir)
    assert len(ids) == 4
    kept = {thread for _, thread in ids}
    names = Pseudonymizer(LocalOwnerKeyStore())
    assert names.thread(threads[4].owner, threads[4].thread_id) not in kept
    assert names.thread(threads[5].owner, threads[5].thread_id) not in kept

    config = SplitConfig(salt="s", validation_fraction=0.2, runtime_holdout_fraction=0.5)
    minimum = {"train": 1, "validation": 1, "runtime_holdout": 1}
    salt = split_salt(threads, teacher_dir, config, minimum=minimum)
    assert salt is not None
    counts = draw_splits(ids, SplitConfig(salt=salt, validation_fraction=0.2,
                                          runtime_holdout_fraction=0.5))
    assert all(counts[split] >= n for split, n in minimum.items())
