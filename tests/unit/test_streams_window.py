"""Window stage: boundaries, anchors, routes, size limits, deterministic ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.privacy import LocalOwnerKeyStore
from hebrus_flywheel.schemas import codec
from hebrus_flywheel.streams.processors.pipeline import LocalPipeline, ProcessorConfig
from hebrus_flywheel.streams.processors.split import SplitConfig
from hebrus_flywheel.streams.processors.window import WindowConfig, group_anchors, route_anchor_cap
from hebrus_flywheel.streams.processors.window_seal import seal_window
from hebrus_flywheel.streams.routes import pack_routes, route_arrays, to_v1
from tests.support.streams_synthetic import Scenario, ThreadSpec, make_identity

SMALL = WindowConfig(
    context_length=64,
    min_anchor_context=16,
    max_anchors_per_window=20,
    route_context_length=128,
    max_route_anchors_per_window=8,
)
LONG = ThreadSpec(
    owner="o",
    thread="t",
    turns=(
        ("system", 10),
        ("user", 30),
        ("assistant", 70),
        ("tool", 40),
        ("assistant", 55),
        ("user", 5),
        ("assistant", 90),
    ),
)


def run(
    split: str,
    window: WindowConfig = SMALL,
    identity: dict[str, Any] | None = None,
    spec: ThreadSpec = LONG,
    rewrite: Any = None,
    sealed: bool = False,
) -> tuple[Scenario, list[dict[str, Any]]]:
    runtime = 1.0 if split == "runtime_holdout" else 0.0
    config = ProcessorConfig(
        window=window,
        split=SplitConfig(
            runtime_holdout_fraction=runtime, stress_rate=0.0, validation_fraction=0.0
        ),
    )
    sc = Scenario(LocalPipeline(config), identity=identity)
    sc.pipeline.window.sealed = sealed
    sc.publish_identity()
    messages = sc.messages(spec)
    for i, (kind, key, record) in enumerate(messages):
        wire = rewrite(i, record) if rewrite is not None and kind == "observations" else record
        sc.send(kind, key, wire)
    assert sc.pipeline.quarantined == []
    return sc, messages


def canonical(messages: list[Any]) -> tuple[list[int], list[int], dict[int, Any]]:
    tokens: list[int] = []
    generated: list[int] = []
    routes = {}
    for kind, _, r in messages:
        if kind == "transcripts":
            assert r["token_offset"] == len(tokens)
            for s in r["segments"]:
                if s["generated"]:
                    generated.extend(range(len(tokens) + s["start"], len(tokens) + s["end"]))
            tokens.extend(r["token_ids"])
        else:
            routes[r["token_ordinal"]] = r
    return tokens, sorted(generated), routes


def test_group_anchors_respects_span_and_count() -> None:
    anchors = np.array([0, 1, 2, 50, 51, 120, 121, 122, 123], dtype=np.int64)
    assert group_anchors(anchors, context=64, min_context=16, max_anchors=3) == [
        (0, 3),
        (3, 5),
        (5, 8),
        (8, 9),
    ]
    assert group_anchors(anchors[:0], context=64, min_context=16, max_anchors=3) == []


def test_windows_cover_every_generated_token_exactly_once() -> None:
    _, messages = run("train")
    sc, _ = run("train")
    tokens, generated, _ = canonical(messages)
    windows = sc.pipeline.windows
    seen: list[int] = []
    for w in windows:
        first, toks, anchors = w["first_token_ordinal"], w["token_ids"], w["anchor_positions"]
        assert toks == tokens[first : first + len(toks)]
        assert len(toks) <= SMALL.context_length
        assert anchors == sorted(anchors) and anchors[-1] == len(toks) - 1
        assert len(anchors) <= SMALL.max_anchors_per_window
        for a in anchors:
            ordinal = first + a
            assert ordinal in generated
            assert a + 1 >= min(SMALL.min_anchor_context, ordinal + 1)
            seen.append(ordinal)
        assert w["routes"] is None and w["split"] == "train"
    assert seen == generated
    assert [w["window_index"] for w in windows] == list(range(len(windows)))
    assert {w["window_count"] for w in windows} == {len(windows)}


def test_turn_lineage_covers_the_window() -> None:
    sc, _ = run("train")
    for w in sc.pipeline.windows:
        start, end = w["first_token_ordinal"], w["first_token_ordinal"] + len(w["token_ids"])
        covered = sorted(t["turn_index"] for t in w["turns"])
        assert covered == list(range(covered[0], covered[-1] + 1))
        assert w["turns"][0]["token_offset"] <= start
        last = w["turns"][-1]
        assert last["token_offset"] < end <= last["token_offset"] + last["length"]
        assert last["role"] == "assistant" and last["generated"]


def test_runtime_holdout_windows_carry_the_captured_routes() -> None:
    sc, messages = run("runtime_holdout")
    _, generated, routes = canonical(messages)
    seen = []
    for w in sc.pipeline.windows:
        block = w["routes"]
        assert block is not None and len(w["anchor_positions"]) <= 8
        n, layers, k = len(w["anchor_positions"]), block["layer_count"], block["top_k"]
        ids = np.frombuffer(block["expert_ids"], dtype="<i2").reshape(n, layers, k)
        weights = np.frombuffer(block["weights"], dtype="<f4").reshape(n, layers, k)
        for i, a in enumerate(w["anchor_positions"]):
            ordinal = w["first_token_ordinal"] + a
            captured = route_arrays(routes[ordinal]).in_layer_order()
            assert np.array_equal(ids[i], captured.expert_ids)
            assert np.array_equal(weights[i], captured.weights)
            seen.append(ordinal)
        assert block["stages"] == [0] * block["layer_count"]
    assert seen == generated


def _reordered(index: int, record: dict[str, Any]) -> dict[str, Any]:
    """The same routes, rows written in a rotated layer order."""
    arrays = route_arrays(record)
    order = np.roll(np.arange(len(arrays.layers)), index % len(arrays.layers) + 1)
    return {**record, **pack_routes(arrays.expert_ids[order], arrays.weights[order],
                                    layers=order.tolist(), stages=arrays.stages[order].tolist())}


@pytest.mark.parametrize(
    "rewrite",
    [
        lambda i, r: to_v1(r),  # every observation as RouteObservation.v1
        lambda i, r: to_v1(r) if i % 2 else r,  # v1 and v2 interleaved on one topic
        _reordered,  # v2 rows in another order
    ],
    ids=["v1", "mixed", "v2-reordered"],
)
def test_windows_do_not_depend_on_the_observation_version_or_row_order(rewrite: Any) -> None:
    identity = make_identity(layers=6, experts=64, top_k=4)
    spec = ThreadSpec(owner="o", thread="t", turns=(("user", 10), ("assistant", 40)))
    clean, _ = run("runtime_holdout", identity=identity, spec=spec)
    other, _ = run("runtime_holdout", identity=identity, spec=spec, rewrite=rewrite)
    assert clean.pipeline.windows and other.pipeline.windows == clean.pipeline.windows


def test_full_geometry_window_fits_kafka_default_and_the_schema() -> None:
    identity = make_identity()  # 48 layers x top-10 of 512
    spec = ThreadSpec(owner="o", thread="t", turns=(("user", 50), ("assistant", 300)))
    sc, _ = run("runtime_holdout", window=WindowConfig(), identity=identity, spec=spec)
    cap = route_anchor_cap(WindowConfig(), 48, 10)
    assert cap == WindowConfig().max_route_anchors_per_window
    for w in sc.pipeline.windows:
        value = codec.encode("Window.v1", w)
        assert len(value) < 1_000_000
        _, back = codec.decode(value)
        assert back == w
        assert len(w["anchor_positions"]) <= cap


def test_window_ids_and_digests_are_deterministic() -> None:
    a, _ = run("train")
    b, _ = run("train")
    ids_a = [(w["window_id"], w["content_digest"]) for w in a.pipeline.windows]
    assert ids_a == [(w["window_id"], w["content_digest"]) for w in b.pipeline.windows]
    assert len({i for i, _ in ids_a}) == len(ids_a)
    c, _ = run(
        "train",
        window=WindowConfig(
            context_length=64,
            min_anchor_context=16,
            max_anchors_per_window=20,
            route_context_length=128,
            max_route_anchors_per_window=7,
        ),
    )
    same_cut = [(w["window_id"], w["content_digest"]) for w in c.pipeline.windows]
    assert [i for i, _ in same_cut] == [i for i, _ in ids_a]  # same cut, same ids
    assert [d for _, d in same_cut] != [d for _, d in ids_a]  # config digest differs


@pytest.mark.parametrize("split", ["train", "runtime_holdout"])
def test_a_stage_whose_windows_are_sealed_skips_only_the_plaintext_id_and_digest(
        split: str, tmp_path: Path) -> None:
    digested, _ = run(split)
    undigested, _ = run(split, sealed=True)
    assert digested.pipeline.windows and all(w["content_digest"] and w["window_id"]
                                             for w in digested.pipeline.windows)
    assert [(w["window_id"], w["content_digest"]) for w in undigested.pipeline.windows] == \
        [("", "")] * len(digested.pipeline.windows)
    assert [{**w, "window_id": "", "content_digest": ""} for w in digested.pipeline.windows] \
        == undigested.pipeline.windows
    # sealing gives both the same record: it derives its own id and digest
    keys = LocalOwnerKeyStore(tmp_path / "owners", create=True, max_age_s=0)
    key = keys.data_key(digested.pipeline.windows[0]["owner"], create=True)
    assert [seal_window(w, key) for w in digested.pipeline.windows] == \
        [seal_window(w, key) for w in undigested.pipeline.windows]


def test_window_config_validation() -> None:
    with pytest.raises(ConfigError, match="context_length"):
        WindowConfig(context_length=8, min_anchor_context=16)
    with pytest.raises(ConfigError, match="max_window_bytes"):
        WindowConfig(max_window_bytes=20_000)
