"""A completed generation's routes, kept as they were stored.

The capture stage stores a chunk's tokens as one *run* value (their token ids, and
their expert ids and weights packed end to end) and a single observation as one value
per token (:mod:`streams.processors.assemble`). Reading a generation back used to
expand every run into one dict per token, for every thread twice (when it completes,
and when its windows are cut), though most windows carry no routes at all; in a
one-worker drain of 1,000 threads that expansion took about 5 % of the agents' samples
on the event loop, 3 % of all its samples (py-spy, ``bench/streams.py``, 2026-12-07).

:class:`ThreadRoutes` reads the stored values in place: the ordinals and token ids as
arrays for the checks that look at every token, one token's packed bytes for the
windows that carry routes, and one token's route as a mapping only when asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

Part = tuple[int, Mapping[str, Any]]
"""A stored value and the ordinal of its first token: a run (``token_ids``) or a single
observation (``token_id``)."""


class ThreadRoutes(Mapping[int, Mapping[str, Any]]):
    """Routes by token ordinal (ascending), read from the stored parts (disjoint)."""

    def __init__(self, parts: Sequence[Part]) -> None:
        self._parts = sorted(parts, key=lambda part: part[0])
        self._firsts = np.fromiter((first for first, _ in self._parts), dtype=np.int64,
                                   count=len(self._parts))
        self._counts = np.fromiter((_count(value) for _, value in self._parts),
                                   dtype=np.int64, count=len(self._parts))
        ends = self._firsts + self._counts
        if len(ends) > 1 and bool((ends[:-1] > self._firsts[1:]).any()):
            at = int(np.flatnonzero(ends[:-1] > self._firsts[1:])[0])
            raise ValueError(f"ThreadRoutes: stored routes overlap at ordinal "
                             f"{int(self._firsts[at + 1])}")
        self._ordinals: np.ndarray | None = None

    @property
    def ordinals(self) -> np.ndarray:
        """Every routed ordinal, ascending (int64)."""
        if self._ordinals is None:
            self._ordinals = np.concatenate(
                [np.arange(first, first + n, dtype=np.int64)
                 for first, n in zip(self._firsts.tolist(), self._counts.tolist(), strict=True)]
            ) if len(self._parts) else np.empty(0, dtype=np.int64)
        return self._ordinals

    def token_ids(self) -> np.ndarray:
        """The token id each route names, aligned with :attr:`ordinals` (int64)."""
        if not self._parts:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([
            np.asarray(value["token_ids"] if "token_ids" in value else [value["token_id"]],
                       dtype=np.int64)
            for _, value in self._parts
        ])

    def routed(self, ordinals: np.ndarray) -> np.ndarray:
        """Which of ``ordinals`` have a route (bool mask)."""
        return np.isin(ordinals, self.ordinals)

    def packed(self, ordinal: int) -> tuple[bytes, bytes]:
        """One token's packed expert ids and weights."""
        value, index = self._locate(ordinal)
        if index is None:
            return value["ids"], value["weights"]
        n = len(value["token_ids"])
        step_i, step_w = len(value["ids"]) // n, len(value["weights"]) // n
        return (value["ids"][index * step_i:(index + 1) * step_i],
                value["weights"][index * step_w:(index + 1) * step_w])

    def _locate(self, ordinal: int) -> tuple[Mapping[str, Any], int | None]:
        """The stored value holding ``ordinal`` and its index in a run (None: a single)."""
        at = int(np.searchsorted(self._firsts, ordinal, side="right")) - 1
        if at < 0 or ordinal >= self._firsts[at] + self._counts[at]:
            raise KeyError(ordinal)
        value = self._parts[at][1]
        return value, (ordinal - int(self._firsts[at]) if "token_ids" in value else None)

    def __getitem__(self, ordinal: int) -> Mapping[str, Any]:
        value, index = self._locate(ordinal)
        if index is None:
            return value
        ids, weights = self.packed(ordinal)
        return {"token_id": value["token_ids"][index], "turn_index": value["turn_index"],
                "ids": ids, "weights": weights, "stages": value["stages"]}

    def __contains__(self, ordinal: object) -> bool:
        if not isinstance(ordinal, (int, np.integer)):
            return False
        try:
            self._locate(int(ordinal))
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(self.ordinals.tolist())

    def __len__(self) -> int:
        return int(self._counts.sum())


def _count(value: Mapping[str, Any]) -> int:
    return len(value["token_ids"]) if "token_ids" in value else 1
