"""Route payloads are kept only by threads that can become runtime holdouts.

Only ``runtime_holdout`` windows carry captured routes, and a thread's runtime draw
depends on its owner and thread alone, so the capture stage stores the expert ids and
weights of the other threads' tokens as empty (token ids, turns and stages stay: what
completion, route consistency and the summary read). Nothing a window holds changes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from hebrus_flywheel.streams.processors.common import SEP, run_key
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline, ProcessorConfig
from hebrus_flywheel.streams.processors.split import (
    SplitConfig,
    assign_split,
    may_hold_out_runtime,
)
from tests.support.chunks import chunked
from tests.support.streams_synthetic import (
    ProducerClock,
    Scenario,
    encode_message,
    make_identity,
    random_specs,
    thread_messages,
)

IDENTITY = make_identity(layers=4, experts=64, top_k=4)
SPLIT = SplitConfig(runtime_holdout_fraction=0.3)


def _encoded(max_tokens: int, n_threads: int = 24) -> list[tuple[str, bytes, bytes]]:
    clock = ProducerClock(producer_id="runtime-payloads")
    messages: list[Any] = []
    for spec in random_specs(n_threads, n_owners=8, seed=11, assistant_tokens=40):
        messages.extend(thread_messages(spec, IDENTITY, clock))
    if max_tokens:
        return chunked(copy.deepcopy(messages), max_tokens=max_tokens)
    return [(k, key, encode_message(k, copy.deepcopy(r))[0]) for k, key, r in messages]


def _run(encoded: list[tuple[str, bytes, bytes]], *, keep_all: bool = False,
         kinds: tuple[str, ...] = ("transcripts", "observations")) -> LocalPipeline:
    sc = Scenario(LocalPipeline(ProcessorConfig(split=SPLIT)), identity=IDENTITY)
    if keep_all:
        sc.pipeline.capture.sconf = None  # every thread keeps its payloads
    sc.publish_identity()
    for kind, key, value in encoded:
        if kind in kinds:
            sc.send(kind, key, value=value)
    sc.pipeline.flush()
    return sc.pipeline


@pytest.mark.parametrize("max_tokens", [0, 64])
def test_windows_are_the_same_whether_or_not_payloads_are_kept(max_tokens: int) -> None:
    encoded = _encoded(max_tokens)
    lean, full = _run(encoded), _run(encoded, keep_all=True)
    assert lean.quarantined == [] and full.quarantined == []
    assert lean.windows == full.windows
    holdouts = [w for w in lean.windows if w["split"] == "runtime_holdout"]
    assert holdouts and all(w["routes"] and w["routes"]["expert_ids"] for w in holdouts)
    without = lean.counters.get("assemble", "generations_without_route_payloads")
    assert 0 < without < 24 and full.counters.get(
        "assemble", "generations_without_route_payloads") == 0


@pytest.mark.parametrize("max_tokens", [0, 64])
def test_stored_routes_have_payloads_exactly_where_the_draw_allows(max_tokens: int) -> None:
    # observations only: no generation completes, so its routes stay in the store
    pipeline = _run(_encoded(max_tokens), kinds=("observations",))
    store = pipeline.capture_store
    headers = {k[2:]: v for k, v in store.items() if k.startswith("h" + SEP)}
    assert headers
    kept = set()
    for iid, header in headers.items():
        assert header["routes_kept"] == may_hold_out_runtime(header["owner"],
                                                             header["thread"], SPLIT)
        if header["routes_kept"]:
            kept.add(iid)
    assert 0 < len(kept) < len(headers)
    routes = [(k, v) for k, v in store.items() if k.startswith("o" + SEP)]
    # a generation without payloads holds its runs in its header (a few hundred bytes)
    held = [(f"{iid} run {first}", v) for iid, header in headers.items()
            for first, v in header.get("run_values", {}).items()]
    assert routes and bool(held) == bool(max_tokens)
    assert all("run_values" not in headers[iid] for iid in kept)
    for key, value in routes:
        iid = key[2:].rsplit(SEP, 1)[0]  # o|<iid>|<ordinal or r<first>>
        assert bool(value["ids"]) == bool(value["weights"]) == (iid in kept), key
        assert value["stages"]  # what the window stage's route checks still read
        assert max_tokens == 0 or iid in kept, key
    for key, value in held:
        assert value["ids"] == value["weights"] == b"" and value["stages"], key


def test_a_thread_without_payloads_is_never_a_runtime_holdout() -> None:
    owner, thread = next((f"o{i}", "t") for i in range(1000)
                         if may_hold_out_runtime(f"o{i}", "t", SPLIT))
    summary = {"owner": owner, "thread": thread, "routes_complete": True,
               "generated_count": 5, "token_count": 40}
    assert assign_split(summary, SPLIT).split == "runtime_holdout"
    assert assign_split({**summary, "routes_kept": False}, SPLIT).split != "runtime_holdout"


def test_generations_begun_with_run_keys_still_complete_and_drop_them() -> None:
    """Headers restored from a worker before ``run_values`` (every run under its own key)."""
    encoded = _encoded(64)
    baseline = _run(encoded)
    sc = Scenario(LocalPipeline(ProcessorConfig(split=SPLIT)), identity=IDENTITY)
    sc.publish_identity()
    for kind, key, value in encoded:
        if kind == "observations":
            sc.send(kind, key, value=value)
    sc.pipeline.flush()
    store = sc.pipeline.capture_store
    moved = 0
    for hkey in [k for k in store if k.startswith("h" + SEP)]:
        header = dict(store[hkey])
        for first, run in header.pop("run_values", {}).items():
            store[run_key(hkey[2:], first)] = run
            moved += 1
        store[hkey] = header
    assert moved
    for kind, key, value in encoded:
        if kind == "transcripts":
            sc.send(kind, key, value=value)
    sc.pipeline.flush()
    assert sc.pipeline.quarantined == [] and sc.pipeline.windows == baseline.windows
    assert not any(k[0] in "ot" for k in store)  # every content key dropped once done
