"""The input bundle to and from plain JSON (``tests/assets/qualify_inputs.json`` shows
the format). Unknown or missing keys raise :class:`InputError` naming them; value checks
are the dataclasses' own."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.files import atomic_write_json
from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.train.projection import ReplayThroughput
from hebrus_flywheel.train.qualify.config import CONTROL_METHODS
from hebrus_flywheel.train.qualify.errors import InputError
from hebrus_flywheel.train.qualify.inputs import (
    Authorization,
    CandidateEvidence,
    ConsentMeasure,
    DecodeEvidence,
    DeterminismEvidence,
    EconomicsEvidence,
    FailClosedEvidence,
    Identity,
    IntegrityEvidence,
    NearDuplicates,
    OfflineEvidence,
    OpaqueIds,
    Overlap,
    ParityEvidence,
    QualificationInputs,
    RuntimeEvidence,
    ShadowEvidence,
    SplitIntegrity,
    ThroughputEvidence,
)
from hebrus_flywheel.train.qualify.objective import ServiceObjective
from hebrus_flywheel.train.qualify.verdict import jsonable

Converter = Callable[[Any, str], Any]


def build(cls: type, data: Any, where: str,
          nested: Mapping[str, Converter] | None = None) -> Any:
    """``cls(**data)`` after checking the keys and converting the ``nested`` fields."""
    if not isinstance(data, Mapping):
        raise InputError(f"{where} must be a JSON object, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise InputError(f"{where} has unknown key(s) {unknown}; expected some of "
                         f"{sorted(known)}")
    missing = sorted(n for n, f in known.items() if n not in data
                     and f.default is MISSING and f.default_factory is MISSING)
    if missing:
        raise InputError(f"{where} lacks required key(s) {missing}")
    converters = nested or {}
    kwargs = {k: converters[k](v, f"{where}.{k}") if k in converters and v is not None else v
              for k, v in data.items()}
    return cls(**kwargs)


def _list(data: Any, where: str) -> list[Any]:
    if not isinstance(data, list | tuple):
        raise InputError(f"{where} must be a JSON list, got {type(data).__name__}")
    return list(data)


def _tuple(data: Any, where: str) -> tuple[Any, ...]:
    return tuple(_list(data, where))


def _fset(data: Any, where: str) -> frozenset[Any]:
    return frozenset(_list(data, where))


def _int_keys(data: Any, where: str) -> dict[int, Any]:
    if not isinstance(data, Mapping):
        raise InputError(f"{where} must be a JSON object")
    try:
        return {int(k): v for k, v in data.items()}
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where} keys must be layer numbers: {exc}") from exc


def _of(cls: type, nested: Mapping[str, Converter] | None = None) -> Converter:
    return lambda data, where: build(cls, data, where, nested)


def _each(convert: Converter) -> Converter:
    return lambda data, where: tuple(convert(x, f"{where}[{i}]")
                                     for i, x in enumerate(_list(data, where)))


def _splits(data: Any, where: str) -> dict[str, SplitIntegrity]:
    if not isinstance(data, Mapping):
        raise InputError(f"{where} must be a JSON object keyed by split")
    nested = {"owner_ids": _fset, "thread_ids": _fset, "identity_digests": _tuple,
              "teacher_digests": _tuple, "tokenizer_digests": _tuple}
    return {str(k): build(SplitIntegrity, v, f"{where}.{k}", nested) for k, v in data.items()}


def _offline(data: Any, where: str) -> OfflineEvidence:
    if isinstance(data, list):
        learned = sorted({str(r.get("method")) for r in data if isinstance(r, Mapping)}
                         - set(CONTROL_METHODS))
        if len(learned) != 1:
            raise InputError(f"{where} is a bare list with learned methods {learned}; give "
                             '{"candidate": ..., "results": [...]} to name the checkpoint')
        data = {"candidate": learned[0], "results": data}
    return build(OfflineEvidence, data, where, {"results": _tuple})


def _geometry(data: Any, where: str) -> RouteGeometry:
    if not isinstance(data, Mapping):
        raise InputError(f"{where} must be a JSON object of RouteGeometry fields")
    try:
        return RouteGeometry.from_dict(data)
    except ConfigError as exc:
        raise InputError(f"{where}: {exc}") from exc


_NESTED: dict[str, Converter] = {
    "checkpoint_lineage": _tuple,
    "identity": _of(Identity),
    "geometry": _geometry,
    "parity": _of(ParityEvidence, {"per_layer_mismatch_rate": _int_keys}),
    "determinism": _of(DeterminismEvidence),
    "fail_closed": _of(FailClosedEvidence),
    "opaque_ids": _each(_of(OpaqueIds, {"examples": _tuple})),
    "integrity": _of(IntegrityEvidence, {
        "splits": _splits,
        "overlaps": _each(_of(Overlap, {"splits": _tuple, "ids": _tuple})),
        "near_duplicates": _of(NearDuplicates),
        "authorization": _of(Authorization),
        "consent": _of(ConsentMeasure)}),
    "offline": _offline,
    "decode": _of(DecodeEvidence),
    "shadow_io": _of(ShadowEvidence, {"sweep": _tuple, "break_even": _tuple}),
    "objective": _of(ServiceObjective),
    "runtime": _of(RuntimeEvidence),
    "throughput": _of(ThroughputEvidence),
    "economics": _of(EconomicsEvidence),
    "collection": _of(ReplayThroughput, {"machines": _tuple}),
    "candidates": _of(CandidateEvidence),
}


def inputs_from_mapping(data: Any) -> QualificationInputs:
    """A :class:`QualificationInputs` from its JSON form."""
    return build(QualificationInputs, data, "inputs", _NESTED)


def inputs_to_mapping(inputs: QualificationInputs) -> dict[str, Any]:
    """The JSON form of ``inputs`` (sets sorted, tuples as lists, layer keys as strings)."""
    out = jsonable(asdict(inputs))
    out["geometry"] = inputs.geometry.to_dict()
    return out


def load_inputs(path: str | Path) -> QualificationInputs:
    """Read an input bundle written by :func:`dump_inputs` (or by hand)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"cannot read qualification inputs {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON: {exc}") from exc
    return inputs_from_mapping(data)


def dump_inputs(inputs: QualificationInputs, path: str | Path) -> Path:
    """Write ``inputs`` as JSON; returns the path."""
    path = Path(path)
    atomic_write_json(path, inputs_to_mapping(inputs))
    return path
