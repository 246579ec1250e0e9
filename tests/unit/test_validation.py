"""Pure record checks: every reason code is produced by a crafted record."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.core.identity import with_identity_id
from hebrus_flywheel.schemas import exceptions as schema_errors
from hebrus_flywheel.schemas.registry import default_registry
from hebrus_flywheel.streams import routes
from hebrus_flywheel.streams.exceptions import PublishValidationError
from hebrus_flywheel.streams.limits import FIELD_MAX_BYTES, ID_MAX_BYTES
from hebrus_flywheel.streams.validation import (
    REASONS,
    IdentityRules,
    OrdinalTracker,
    Reason,
    counter_tracker,
    resolve_geometry,
    validate_identity,
    validate_observation,
    validate_turn,
)

LAYERS, EXPERTS, K, VOCAB = 4, 64, 4, 1000
PINNED_FINGERPRINTS = {
    "hebrus.flywheel.v1.RouteObservation.v2": "77d45b35dd334933",
    "hebrus.flywheel.v1.RuntimeIdentity.v1": "369fb8e37b2b2cd0",
    "hebrus.flywheel.v1.TranscriptTurn.v1": "3e5a92c02609a720",
}
"""Fingerprints before the field limits were written into the docs (docs are not part
of the Parsing Canonical Form, so they must not change)."""


def identity(**change: Any) -> dict[str, Any]:
    fields = {
        "model_family": "qwen3_next", "model_artifact_digest": "a" * 64,
        "tokenizer_digest": "b" * 64, "chat_template_digest": "c" * 64, "dtype": "float32",
        "quantization": "none", "routed_layer_count": LAYERS, "expert_count": EXPERTS,
        "top_k": K, "tie_break_rule": "score_desc_then_expert_id_asc",
        "weight_rule": "softmax_topk_renormalized", "hidden_size": 64,
        "routed_intermediate_size": 32, "runtime_name": "hebrus", "runtime_version": "0.1",
    }
    return with_identity_id({**fields, **change})


GEOMETRY = validate_identity(identity(), vocab_size=VOCAB)


def observation(**change: Any) -> dict[str, Any]:
    record = {
        "owner": "o1", "thread": "t1", "generation": 0, "sequence_id": "r1", "turn_index": 1,
        "token_ordinal": 9, "token_id": 42, "identity_id": GEOMETRY.identity_id,
        "speculative": None,
        "layers": [{"stage": 0, "layer": i, "expert_ids": [i, i + 1, i + 2, i + 3],
                    "weights": [0.4, 0.3, 0.2, 0.1]} for i in range(LAYERS)],
        "producer_id": "p", "counter": 8, "wall_time_ms": 1_767_000_000_456,
    }
    record.update(change)
    return record


def turn(**change: Any) -> dict[str, Any]:
    record = {
        "owner": "o1", "thread": "t1", "turn_index": 0, "generation": 0, "sequence_id": "r1",
        "role": "user", "token_offset": 0, "token_ids": [1, 2, 3, 4],
        "segments": [{"kind": "header", "start": 0, "end": 1, "generated": False},
                     {"kind": "content", "start": 1, "end": 4, "generated": False}],
        "sampling": {"mode": "forced", "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                     "seed": 1, "max_new_tokens": 16},
        "identity_id": GEOMETRY.identity_id, "domain_tags": [], "closes_thread": False,
        "producer_id": "p", "counter": 7, "wall_time_ms": 1_767_000_000_123,
    }
    record.update(change)
    return record


def route(index: int = 0, **change: Any) -> list[dict[str, Any]]:
    """The layers of a valid observation with ``layers[index]`` changed."""
    layers = copy.deepcopy(observation()["layers"])
    layers[index].update(change)
    return layers


def check_obs(record: dict[str, Any]) -> None:
    validate_observation(record, GEOMETRY)


def check_turn(record: dict[str, Any]) -> None:
    validate_turn(record, GEOMETRY)


def _ordinals(reason: str) -> None:
    tracker = OrdinalTracker()
    validate_observation(observation(token_ordinal=5), GEOMETRY, tracker=tracker)
    ordinal = 5 if reason == "duplicate_ordinal" else 4
    validate_observation(observation(token_ordinal=ordinal), GEOMETRY, tracker=tracker)


def _counter() -> None:
    tracker = counter_tracker()
    tracker.check_and_advance("p", 8)
    tracker.check_and_advance("p", 3)


def _codec(cls: type[Exception]) -> Callable[[], object]:
    def raise_it() -> None:
        raise PublishValidationError(getattr(cls, "reason"), "codec failure")  # noqa: B009
    return raise_it


CASES: dict[str, list[Callable[[], object]]] = {
    "missing_field": [
        lambda: check_obs({k: v for k, v in observation().items() if k != "layers"}),
        lambda: check_obs(observation(owner="")),
        lambda: check_turn(turn(sampling={"mode": "forced"})),
        lambda: validate_identity({k: v for k, v in identity().items() if k != "dtype"}),
    ],
    "wrong_type": [
        lambda: check_obs(observation(token_ordinal="9")),
        lambda: check_obs(observation(turn_index=True)),
        lambda: check_obs(observation(layers=route(2, expert_ids=[0, 1, 2, 3.0]))),
        lambda: check_obs(observation(layers=route(1, weights=[0.4, 0.3, "0.2", 0.1]))),
        lambda: check_obs(observation(speculative="spec")),
        lambda: check_turn(turn(closes_thread=1)),
        lambda: check_turn(turn(domain_tags=[1])),
    ],
    "value_out_of_range": [
        lambda: check_obs(observation(generation=-1)),
        lambda: check_obs(observation(turn_index=2**31)),
        lambda: check_turn(turn(role="robot")),
        lambda: check_turn(turn(sampling={**turn()["sampling"], "top_p": 1.5})),
        lambda: check_turn(turn(sampling={**turn()["sampling"], "temperature": math.nan})),
        lambda: validate_identity(identity(top_k=EXPERTS + 1)),
    ],
    "invalid_key": [lambda: check_obs(observation(owner="a/b"))],
    "unknown_identity": [
        lambda: check_obs(observation(identity_id="f" * 64)),
        lambda: resolve_geometry(observation(identity_id="f" * 64), {}),
    ],
    "identity_digest_mismatch": [
        lambda: validate_identity({**identity(), "top_k": 2}),
    ],
    "layer_count_mismatch": [lambda: check_obs(observation(layers=route()[:-1]))],
    "layer_out_of_range": [
        lambda: check_obs(observation(layers=route(3, layer=LAYERS))),
        lambda: check_obs(observation(layers=route(0, layer=-1))),
    ],
    "duplicate_layer": [lambda: check_obs(observation(layers=route(3, layer=0)))],
    "wrong_k": [lambda: check_obs(observation(layers=route(1, expert_ids=[1, 2, 3],
                                                          weights=[0.5, 0.3, 0.2])))],
    "weights_ids_length_mismatch": [
        lambda: check_obs(observation(layers=route(1, weights=[0.5, 0.5]))),
    ],
    "expert_id_out_of_range": [
        lambda: check_obs(observation(layers=route(0, expert_ids=[0, 1, 2, EXPERTS]))),
        lambda: check_obs(observation(layers=route(0, expert_ids=[-1, 1, 2, 3]))),
    ],
    "duplicate_expert_id": [
        lambda: check_obs(observation(layers=route(2, expert_ids=[5, 6, 5, 7]))),
    ],
    "non_finite_weight": [
        lambda: check_obs(observation(layers=route(1, weights=[math.nan, 0.3, 0.2, 0.1]))),
        lambda: check_obs(observation(layers=route(1, weights=[math.inf, 0.3, 0.2, 0.1]))),
        lambda: check_obs(observation(layers=route(1, weights=[1e39, 0.3, 0.2, 0.1]))),
    ],
    "negative_weight": [
        lambda: check_obs(observation(layers=route(1, weights=[0.4, 0.3, 0.2, -0.1]))),
    ],
    "rank_order_violation": [
        lambda: check_obs(observation(layers=route(1, weights=[0.3, 0.4, 0.2, 0.1]))),
    ],
    "token_id_out_of_range": [
        lambda: check_obs(observation(token_id=VOCAB)),
        lambda: check_obs(observation(token_id=-3)),
        lambda: check_turn(turn(token_ids=[1, 2, VOCAB + 5, 3])),
    ],
    "segment_out_of_bounds": [
        lambda: check_turn(turn(segments=[{"kind": "content", "start": 0, "end": 5,
                                           "generated": True}])),
        lambda: check_turn(turn(segments=[{"kind": "content", "start": 3, "end": 2,
                                           "generated": True}])),
    ],
    "segment_overlap": [
        lambda: check_turn(turn(segments=[
            {"kind": "header", "start": 0, "end": 2, "generated": False},
            {"kind": "content", "start": 1, "end": 4, "generated": False}])),
    ],
    "ordinal_not_increasing": [lambda: _ordinals("ordinal_not_increasing")],
    "duplicate_ordinal": [lambda: _ordinals("duplicate_ordinal")],
    "counter_regression": [_counter],
    "schema_violation": [_codec(schema_errors.RecordEncodeError)],
    "unknown_fingerprint": [_codec(schema_errors.UnknownFingerprintError)],
    "undecodable": [_codec(schema_errors.UndecodableRecordError)],
    "header_mismatch": [_codec(schema_errors.SchemaHeaderError)],
    "schema_resolution_failed": [_codec(schema_errors.SchemaResolutionError)],
    "field_too_long": [
        lambda: check_obs(observation(owner="o" * 257)),
        lambda: check_obs(observation(producer_id="é" * 129)),
        lambda: check_turn(turn(thread="t" * 900_000)),
        lambda: check_turn(turn(domain_tags=["ok", "x" * 257])),
        lambda: validate_identity(identity(runtime_version="v" * 300)),
        lambda: resolve_geometry(observation(identity_id="f" * 257), {}),
    ],
}


def test_every_reason_code_has_a_case_and_codes_are_stable_strings() -> None:
    assert set(CASES) == set(REASONS)
    assert len(REASONS) == len(set(REASONS))
    assert all(isinstance(r, str) and r == r.lower() for r in REASONS)
    assert Reason("wrong_k") is Reason.WRONG_K


@pytest.mark.parametrize(("reason", "index"),
                         [(r, i) for r, cases in CASES.items() for i in range(len(cases))])
def test_crafted_record_fails_with_its_reason(reason: str, index: int) -> None:
    with pytest.raises(PublishValidationError) as info:
        CASES[reason][index]()
    assert info.value.reason == reason
    assert str(info.value).startswith(f"[{reason}]")


def test_valid_records_pass_and_errors_name_the_field() -> None:
    check_obs(observation())
    check_obs(observation(speculative={
        "proposal_id": "pr", "proposal_generation": 0, "candidate_position": 2,
        "accepted_prefix_digest": "d", "verifier_generation": 1, "accepted": False}))
    check_turn(turn())
    check_turn(turn(token_ids=[], segments=[]))
    with pytest.raises(PublishValidationError) as info:
        check_obs(observation(layers=route(2, expert_ids=[0, 1, 2, 99])))
    assert info.value.field == "layers[2].expert_ids"


def test_layers_in_any_order_and_numpy_like_ints_pass() -> None:
    class Int(int):
        pass  # a subclass, as numpy scalars are Integral but not ``int``

    layers = list(reversed(route(1, expert_ids=[Int(1), 2, 3, 4])))
    check_obs(observation(layers=layers))


def test_rank_order_is_only_checked_for_monotone_weight_rules() -> None:
    geometry = validate_identity(identity(weight_rule="sigmoid_with_bias_correction"))
    validate_observation(observation(identity_id=geometry.identity_id,
                                     layers=route(1, weights=[0.1, 0.4, 0.2, 0.3])), geometry)


def test_tracker_keys_and_bounds() -> None:
    tracker = OrdinalTracker(max_keys=2)
    validate_observation(observation(token_ordinal=5), GEOMETRY, tracker=tracker)
    # another sequence, and a speculative proposal of the same sequence, have own keys
    validate_observation(observation(token_ordinal=1, sequence_id="r2"), GEOMETRY,
                         tracker=tracker)
    spec = {"proposal_id": "p1", "proposal_generation": 0, "candidate_position": 0,
            "accepted_prefix_digest": "d", "verifier_generation": 0, "accepted": True}
    validate_observation(observation(token_ordinal=3, speculative=spec), GEOMETRY,
                         tracker=tracker)
    assert len(tracker) == 2  # least recently used key (o1/t1/0/r1) forgotten
    validate_observation(observation(token_ordinal=2), GEOMETRY, tracker=tracker)
    # a rejected record never advances the tracker
    with pytest.raises(PublishValidationError):
        validate_observation(observation(token_ordinal=50, token_id=-1), GEOMETRY,
                             tracker=tracker)
    validate_observation(observation(token_ordinal=3), GEOMETRY, tracker=tracker)
    tracker.forget(("o1", "t1", 0, "r1"))
    assert tracker.last(("o1", "t1", 0, "r1")) is None


def test_turn_tracker_checks_turn_index_per_thread_generation() -> None:
    tracker = OrdinalTracker(field="turn_index")
    validate_turn(turn(turn_index=0), GEOMETRY, tracker=tracker)
    validate_turn(turn(turn_index=0, generation=1), GEOMETRY, tracker=tracker)
    with pytest.raises(PublishValidationError, match="turn_index") as info:
        validate_turn(turn(turn_index=0), GEOMETRY, tracker=tracker)
    assert info.value.reason == "duplicate_ordinal"


@pytest.mark.parametrize("change", [{"top_k": 0}, {"expert_count": 2, "top_k": 3},
                                    {"routed_layers": ()}, {"routed_layers": (1, 0)},
                                    {"routed_layers": (0, 4)}, {"weight_rule": ""}])
def test_geometry_config_errors(change: dict[str, Any]) -> None:
    fields = {"family": "f", "routed_layers": (0, 1), "layer_count": 2, "expert_count": 8,
              "top_k": 2, "hidden_size": 4, "routed_intermediate_size": 4, **change}
    with pytest.raises(ConfigError):
        RouteGeometry(**fields)


def test_rules_config_errors() -> None:
    with pytest.raises(ConfigError, match="vocab_size"):
        IdentityRules(identity_id="x", geometry=GEOMETRY.geometry, vocab_size=0)


def test_rules_take_the_geometry_of_the_identity() -> None:
    assert GEOMETRY.geometry == RouteGeometry.from_identity(identity())
    assert GEOMETRY.geometry.routed_layers == tuple(range(GEOMETRY.routed_layer_count))


def test_containers_must_be_lists() -> None:
    layers = route(1)
    layers[1]["expert_ids"] = dict.fromkeys([1, 2, 3, 4], 0)
    with pytest.raises(PublishValidationError) as info:
        check_obs(observation(layers=layers))
    assert info.value.reason == "wrong_type"


# -- RouteObservation.v2: routes packed as uint16 ids / float32 weights ----------------


def packed(**change: Any) -> dict[str, Any]:
    """The valid observation with its routes packed (the v2 shape), ``change`` applied."""
    record = routes.to_v2(observation())
    record.update(change)
    return record


def rows(index: int, *, ids: list[int] | None = None, weights: list[float] | None = None
         ) -> dict[str, Any]:
    """Packed ``expert_ids`` / ``weights`` of the valid observation, row ``index`` replaced."""
    arrays = routes.route_arrays(packed())
    id_rows, w_rows = arrays.expert_ids.astype(np.int64), arrays.weights.astype(np.float64)
    if ids is not None:
        id_rows[index] = ids
    if weights is not None:
        w_rows[index] = weights
    with np.errstate(over="ignore"):  # 1e39 becomes float32 inf, as a runtime would send it
        weight_bytes = w_rows.astype("<f4").tobytes()
    return {"expert_ids": id_rows.astype("<u2").tobytes(), "weights": weight_bytes}


def _without(name: str) -> dict[str, Any]:
    record = packed()
    del record[name]
    return record


def _ordinals_v2(reason: str) -> None:
    tracker = OrdinalTracker()
    validate_observation(packed(token_ordinal=5), GEOMETRY, tracker=tracker)
    ordinal = 5 if reason == "duplicate_ordinal" else 4
    validate_observation(packed(token_ordinal=ordinal), GEOMETRY, tracker=tracker)


_IDS, _WEIGHTS = packed()["expert_ids"], packed()["weights"]
CASES_V2: dict[str, list[Callable[[], object]]] = {
    "missing_field": [
        lambda: check_obs(_without("expert_ids")),
        lambda: check_obs(_without("top_k")),
        lambda: check_obs(packed(stages=None)),
        lambda: check_obs(packed(owner="")),
    ],
    "wrong_type": [
        lambda: check_obs(packed(expert_ids=list(_IDS))),
        lambda: check_obs(packed(weights=bytearray(_WEIGHTS))),
        lambda: check_obs(packed(layers=[0, 1, 2, 3.0])),
        lambda: check_obs(packed(stages=(0, 0, True, 0))),
        lambda: check_obs(packed(top_k="4")),
        lambda: check_obs(packed(token_ordinal="9")),
    ],
    "value_out_of_range": [
        lambda: check_obs(packed(stages=[0, 0, -1, 0])),
        lambda: check_obs(packed(stages=[0, 0, 2**31, 0])),
        lambda: check_obs(packed(generation=-1)),
    ],
    "invalid_key": [lambda: check_obs(packed(owner="a/b"))],
    "unknown_identity": [lambda: check_obs(packed(identity_id="f" * 64))],
    "layer_count_mismatch": [
        lambda: check_obs(packed(layers=[0, 1, 2])),
        lambda: check_obs(packed(stages=[0, 0, 0])),
    ],
    "layer_out_of_range": [
        lambda: check_obs(packed(layers=[0, 1, 2, LAYERS])),
        lambda: check_obs(packed(layers=[-1, 1, 2, 3])),
    ],
    "duplicate_layer": [lambda: check_obs(packed(layers=[0, 1, 2, 0]))],
    "wrong_k": [
        lambda: check_obs(packed(top_k=K - 1)),
        lambda: check_obs(packed(expert_ids=_IDS[:-2])),
    ],
    "weights_ids_length_mismatch": [lambda: check_obs(packed(weights=_WEIGHTS[:-4]))],
    "expert_id_out_of_range": [
        lambda: check_obs(packed(**rows(0, ids=[0, 1, 2, EXPERTS]))),
        lambda: check_obs(packed(**rows(3, ids=[0, 1, 2, 65_535]))),
    ],
    "duplicate_expert_id": [lambda: check_obs(packed(**rows(2, ids=[5, 6, 5, 7])))],
    "non_finite_weight": [
        lambda: check_obs(packed(**rows(1, weights=[math.nan, 0.3, 0.2, 0.1]))),
        lambda: check_obs(packed(**rows(1, weights=[math.inf, 0.3, 0.2, 0.1]))),
        lambda: check_obs(packed(**rows(1, weights=[1e39, 0.3, 0.2, 0.1]))),
        lambda: check_obs(packed(**rows(3, weights=[0.4, 0.3, -math.inf, 0.1]))),
    ],
    "negative_weight": [
        lambda: check_obs(packed(**rows(1, weights=[0.4, 0.3, 0.2, -0.1]))),
    ],
    "rank_order_violation": [
        lambda: check_obs(packed(**rows(1, weights=[0.3, 0.4, 0.2, 0.1]))),
        lambda: check_obs(packed(**rows(3, weights=[0.4, 0.3, 0.2, 0.25]))),
    ],
    "token_id_out_of_range": [lambda: check_obs(packed(token_id=VOCAB))],
    "ordinal_not_increasing": [lambda: _ordinals_v2("ordinal_not_increasing")],
    "duplicate_ordinal": [lambda: _ordinals_v2("duplicate_ordinal")],
    "field_too_long": [lambda: check_obs(packed(owner="o" * 900_000))],
}
NOT_ABOUT_OBSERVATIONS = {
    "identity_digest_mismatch", "segment_out_of_bounds", "segment_overlap",
    "counter_regression", "schema_violation", "unknown_fingerprint", "undecodable",
    "header_mismatch", "schema_resolution_failed",
}
"""Codes whose crafted cases above do not involve an observation's own fields."""


def test_every_observation_reason_has_a_v2_case() -> None:
    assert set(CASES_V2) == set(REASONS) - NOT_ABOUT_OBSERVATIONS
    assert set(REASONS) >= routes.REASON_CODES


@pytest.mark.parametrize(("reason", "index"),
                         [(r, i) for r, cases in CASES_V2.items() for i in range(len(cases))])
def test_crafted_v2_record_fails_with_its_reason(reason: str, index: int) -> None:
    with pytest.raises(PublishValidationError) as info:
        CASES_V2[reason][index]()
    assert info.value.reason == reason
    assert str(info.value).startswith(f"[{reason}]")


def test_valid_v2_records_pass_and_errors_name_the_field_and_row() -> None:
    check_obs(packed())
    assert routes.is_packed(packed()) and not routes.is_packed(observation())
    with pytest.raises(PublishValidationError, match="row 2") as info:
        check_obs(packed(**rows(2, ids=[0, 1, 2, 99])))
    assert info.value.field == "expert_ids"
    with pytest.raises(PublishValidationError, match="row 1") as info:
        check_obs(packed(**rows(1, weights=[0.1, 0.4, 0.2, 0.3])))
    assert info.value.field == "weights"


def test_v2_rows_in_any_order_and_numpy_ints_pass() -> None:
    arrays = routes.route_arrays(packed())
    order = [2, 0, 3, 1]
    check_obs(packed(**routes.pack_routes(arrays.expert_ids[order], arrays.weights[order],
                                          layers=order, stages=[0] * LAYERS)))
    check_obs(packed(layers=[np.int64(i) for i in range(LAYERS)], top_k=np.int32(K)))


def test_v2_rank_order_is_only_checked_for_monotone_weight_rules() -> None:
    geometry = validate_identity(identity(weight_rule="sigmoid_with_bias_correction"))
    validate_observation(packed(identity_id=geometry.identity_id,
                                **rows(1, weights=[0.1, 0.4, 0.2, 0.3])), geometry)


def test_v1_and_v2_shapes_carry_the_same_routes() -> None:
    v1, v2 = routes.route_arrays(observation()), routes.route_arrays(packed())
    assert np.array_equal(v1.expert_ids, v2.expert_ids)
    assert np.array_equal(v1.weights, v2.weights)
    assert routes.to_v2(routes.to_v1(packed())) == packed()
    assert [r["expert_ids"] for r in routes.to_v1(packed())["layers"]] == [
        r["expert_ids"] for r in observation()["layers"]]


def test_pack_routes_refuses_what_uint16_cannot_hold() -> None:
    with pytest.raises(PublishValidationError) as info:
        routes.pack_routes(np.array([[1, 70_000]]), np.array([[0.6, 0.4]]))
    assert info.value.reason == "expert_id_out_of_range"
    for ids in (np.array([1, 2]), np.array([[1.0, 2.0]])):
        with pytest.raises(PublishValidationError) as info:
            routes.pack_routes(ids, np.array([[0.6, 0.4]]))
        assert info.value.reason == "wrong_type"
    with pytest.raises(PublishValidationError) as info:
        routes.pack_routes(np.array([[1, 2]]), np.array([[0.6, 0.4, 0.0]]))
    assert info.value.reason == "weights_ids_length_mismatch"


def test_field_limits_are_exact_and_errors_name_field_and_limit() -> None:
    check_obs(observation(owner="o" * ID_MAX_BYTES, sequence_id="é" * (ID_MAX_BYTES // 2)))
    with pytest.raises(PublishValidationError) as info:
        check_obs(observation(owner="o" * (ID_MAX_BYTES + 1)))
    assert info.value.reason == "field_too_long" and info.value.field == "owner"
    assert f"{ID_MAX_BYTES + 1} bytes" in str(info.value) and f"limit is {ID_MAX_BYTES}" in str(
        info.value)


def test_every_capture_string_field_has_a_documented_limit() -> None:
    for name in ("TranscriptTurn", "RouteObservation", "RuntimeIdentity"):
        entry = default_registry().get(name)
        for path, spec in _string_fields(entry.definition):
            limit = FIELD_MAX_BYTES.get(path.rsplit(".", 1)[-1])
            assert limit is not None, f"{name}.{path} has no limit in FIELD_MAX_BYTES"
            assert f"at most {limit} UTF-8 bytes" in spec.get("doc", ""), f"{name}.{path}"


def test_limit_docs_keep_the_schema_fingerprints() -> None:
    fingerprints = {str(e.key): e.fingerprint.hex() for e in default_registry()}
    assert {k: fingerprints[k] for k in PINNED_FINGERPRINTS} == PINNED_FINGERPRINTS


def _string_fields(definition: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    found = []
    for spec in definition["fields"]:
        types = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
        for kind in types:
            if kind == "string" or (isinstance(kind, dict) and kind.get("items") == "string"):
                found.append((prefix + spec["name"], spec))
            elif isinstance(kind, dict) and kind.get("type") == "record":
                found.extend(_string_fields(kind, f"{prefix}{spec['name']}."))
    return found
