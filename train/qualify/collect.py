"""Build a :class:`~train.qualify.QualificationInputs` from real artefacts.

:func:`collect_inputs` reads a sealed snapshot, a checkpoint and (optionally) a teacher,
a rebuild report and a streams summary or the broker, runs the evaluator and the
simulator, and returns the bundle plus one note per evidence piece saying what it was
built from (or why it is missing). The pieces themselves are built by
:mod:`train.qualify.collect_data` and :mod:`train.qualify.collect_model`.

The optional TOML file (``flywheel qualify --config``) declares what is not measured::

    [objective]          # ServiceObjective (default: hide-ssd-wait, >= 20% less wait)
    [throughput]         # ThroughputEvidence (falsifier #10), when measured elsewhere
    [economics]          # EconomicsEvidence (falsifier #6)
    [authorization]      # Authorization (policy, approved, production_transcripts, ...)
    [sim]                # SimConfig timing/SSD/cache overrides; the model shape and
                         # expert bytes always come from the snapshot's identity
    [sweep]              # bandwidths = [...] (bytes/s), budgets = [...] (default k..4k)
    [break_even]         # tau = { "1" = 1.0, "4" = 2.5 }  accepted tokens per block
    [gates.offline]      # any QualificationConfig section: replay, integrity, offline,
                         # decode, shadow, falsifiers
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hebrus_flywheel.core.configfile import read_toml
from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.core.geometry import StreamGeometry
from hebrus_flywheel.train.exceptions import NoNativeGateError
from hebrus_flywheel.train.projection import ReplayThroughput
from hebrus_flywheel.train.qualify import collect_data as data
from hebrus_flywheel.train.qualify import collect_ids
from hebrus_flywheel.train.qualify import collect_model as model
from hebrus_flywheel.train.qualify.candidate_evidence import CandidateEvidence, candidate_evidence
from hebrus_flywheel.train.qualify.config import QualificationConfig
from hebrus_flywheel.train.qualify.errors import InputError
from hebrus_flywheel.train.qualify.inputs import QualificationInputs
from hebrus_flywheel.train.qualify.model_evidence import (
    DecodeEvidence,
    EconomicsEvidence,
    OfflineEvidence,
    ShadowEvidence,
    ThroughputEvidence,
)
from hebrus_flywheel.train.qualify.objective import ServiceObjective
from hebrus_flywheel.train.sim import SimConfig

DEFAULT_OBJECTIVE = ServiceObjective(name="hide-ssd-wait", min_exposed_wait_reduction=0.2,
                                     max_p95_regression=0.0, max_p99_regression=0.0,
                                     evidence="simulator")
SIM_NOTE = ("geometry from the teacher's identity (routed experts only: intermediate x "
            "hidden x 3 x dtype bytes; shared experts and dense layers resident, not "
            "streamed); SSD, timing and cache share are illustrative deployment settings "
            "(declared, not measured)")
DECODE_NOTE = (" Real-decode recall is the own-layer head's recall@top_k; timely recall counts "
               "every P1 candidate list (own-layer and, when present, next-layer head) that "
               "landed before its MoE in the simulator")
_TABLES = ("objective", "throughput", "economics", "authorization", "sim", "sweep",
           "break_even", "gates")


@dataclass(frozen=True, kw_only=True)
class QualifySettings:
    """What the config file declares (defaults without one)."""

    thresholds: QualificationConfig = field(default_factory=QualificationConfig)
    objective: ServiceObjective = DEFAULT_OBJECTIVE
    throughput: ThroughputEvidence | None = None
    economics: EconomicsEvidence | None = None
    authorization: dict[str, Any] | None = None
    sim_fields: dict[str, Any] = field(default_factory=dict)
    """``[sim]`` overrides of :meth:`SimConfig.for_teacher` (never geometry or dtype)."""
    bandwidths: tuple[float, ...] = model.SWEEP_BANDWIDTHS
    budgets: tuple[int, ...] | None = None
    """Sweep budgets; None: the teacher's k, 2k, 3k, 4k."""
    tau: dict[int, float] | None = None

    def sim_for(self, stream: StreamGeometry) -> SimConfig:
        """The simulator of ``stream``'s teacher with the declared ``[sim]`` overrides."""
        return SimConfig.for_teacher(stream, **self.sim_fields)


def _table(data_: Mapping[str, Any], name: str, where: str) -> dict[str, Any] | None:
    value = data_.get(name)
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(f"{where}: [{name}] must be a table")
    return None if value is None else dict(value)


def _tau(table: Mapping[str, Any] | None, where: str) -> dict[int, float] | None:
    if table is None:
        return None
    raw = table.get("tau")
    try:
        if not isinstance(raw, Mapping):
            raise TypeError(f"got {raw!r}")
        return {int(k): float(v) for k, v in raw.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: [break_even] tau must map block sizes to expected "
                          f'accepted tokens, e.g. tau = {{ "4" = 2.5 }} ({exc})') from exc


def _sweep(table: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    if table is None:
        return {}
    unknown = sorted(set(table) - {"bandwidths", "budgets"})
    if unknown:
        raise ConfigError(f"{where}: [sweep] has unknown key(s) {unknown}")
    out: dict[str, Any] = {}
    try:
        if "bandwidths" in table:
            out["bandwidths"] = tuple(float(b) for b in table["bandwidths"])
        if "budgets" in table:
            out["budgets"] = tuple(int(b) for b in table["budgets"])
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: [sweep] bandwidths/budgets must be lists of numbers") from exc
    if any(b <= 0 for b in out.get("bandwidths", (1,))) or any(b < 1 for b in
                                                                 out.get("budgets", (1,))):
        raise ConfigError(f"{where}: [sweep] bandwidths must be > 0 and budgets >= 1")
    return out


def settings_from_mapping(raw: Mapping[str, Any], where: str = "config") -> QualifySettings:
    """:class:`QualifySettings` from the parsed TOML (see the module doc)."""
    from hebrus_flywheel.train.config import (
        from_mapping,  # imports torch: only when a config is given
    )

    unknown = sorted(set(raw) - set(_TABLES))
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {unknown}; known: {', '.join(_TABLES)}")
    t = {name: _table(raw, name, where) for name in _TABLES}
    out: dict[str, Any] = {"authorization": t["authorization"], "tau": _tau(t["break_even"],
                                                                           where)}
    if t["objective"] is not None:
        t["objective"] = {"name": DEFAULT_OBJECTIVE.name, **t["objective"]}
    for name, key, cls in (("gates", "thresholds", QualificationConfig),
                           ("objective", "objective", ServiceObjective),
                           ("throughput", "throughput", ThroughputEvidence),
                           ("economics", "economics", EconomicsEvidence)):
        table = t[name]
        if table is not None:
            out[key] = from_mapping(cls, table, f"{where}: [{name}]")
    if t["sim"] is not None:
        out["sim_fields"] = _sim_fields(t["sim"], where, from_mapping)
    out.update(_sweep(t["sweep"], where))
    return QualifySettings(**out)


def _sim_fields(table: Mapping[str, Any], where: str, parse: Any) -> dict[str, Any]:
    fixed = sorted({"geometry", "dtype_bytes"} & set(table))
    if fixed:
        raise ConfigError(f"{where}: [sim] {fixed}: the model shape and expert bytes come "
                          "from the snapshot's runtime identity, not from the config")
    checked = parse(SimConfig, table, f"{where}: [sim]")  # validates every value
    return {k: getattr(checked, k) for k in table}


def load_settings(path: Path | None) -> QualifySettings:
    """The defaults, or what ``path`` (TOML) declares."""
    if path is None:
        return QualifySettings()
    return settings_from_mapping(read_toml(path), str(path))


@dataclass(frozen=True, kw_only=True)
class CollectRequest:
    """The artefacts one qualification run is built from."""

    snapshot: Path
    checkpoint: Path
    teacher: Path | None = None
    rebuild_report: Path | None = None
    streams_summary: Path | None = None
    streams_accounting: Path | None = None
    """JSON of ``flywheel streams accounting``: Gate 1's record accounting is measured."""
    bootstrap: str | None = None
    prefix: str | None = None
    settings: QualifySettings = field(default_factory=QualifySettings)
    progress: bool = False
    erasure_receipt: Path | None = None
    predictor_figures: Path | None = None
    candidate_snapshot: Path | None = None
    """A sealed ``candidate_path`` snapshot: Model B, the governor, falsifiers #3 and #6."""
    candidate_replay_cost_s_per_accepted_token: float | None = None
    """Measured by ``bench/candidates.py`` on the same teacher (falsifier #6)."""


@dataclass(frozen=True, eq=False)
class Collected:
    """The input bundle, what each piece was built from, and how long each step took."""

    inputs: QualificationInputs
    notes: dict[str, str]
    timings_s: dict[str, float]


def checkpoint_lineage(lineage: Mapping[str, Any]) -> tuple[str, ...]:
    """The checkpoint id, then its parents' ids (``parent``: an id, a lineage, a list)."""
    out = [str(lineage["checkpoint_id"])]
    pending = [lineage.get("parent")]
    while pending:
        parent = pending.pop(0)
        if isinstance(parent, str) and parent:
            out.append(parent)
        elif isinstance(parent, Mapping) and parent.get("checkpoint_id"):
            out.append(str(parent["checkpoint_id"]))
            pending.append(parent.get("parent"))
        elif isinstance(parent, list):
            pending.extend(parent)
    return tuple(out)


def kafka_streams_summary(bootstrap: str, prefix: str) -> dict[str, Any]:
    """``summarize_topics`` plus the records on the capture topics (high minus low
    watermark per partition: every record the processors could have read)."""
    from hebrus_flywheel.core import kafka
    from hebrus_flywheel.streams.broker import probe_metadata
    from hebrus_flywheel.streams.processors.inspect import summarize_topics
    from hebrus_flywheel.streams.processors.topology import StreamTopics

    if not probe_metadata(bootstrap, 5.0):
        raise InputError(f"no Kafka broker answers at {bootstrap}; start it (`flywheel broker "
                         "up`), pass --streams-summary FILE instead, or drop --bootstrap-servers")
    summary = summarize_topics(bootstrap, prefix=prefix)
    capture = list(StreamTopics.from_prefix(prefix).capture_kinds().values())
    try:
        marks = kafka.end_watermarks(kafka.client_config(bootstrap), capture, timeout_s=10,
                                     missing_ok=True)
    except kafka.KafkaIOError as exc:
        raise InputError(f"cannot read capture-topic offsets from {bootstrap}: {exc}") from exc
    topics: dict[str, int] = {}
    for (topic, _), (low, high) in marks.items():
        topics[topic] = topics.get(topic, 0) + high - low
    summary["capture"] = {"topics": topics, "records": sum(topics.values())}
    return summary


def _streams_summary(request: CollectRequest, info: data.SnapshotInfo,
                     notes: dict[str, str]) -> dict[str, Any] | None:
    if request.streams_summary is not None:
        notes["streams"] = f"streams summary file {request.streams_summary}"
        return dict(data.read_json(request.streams_summary, "streams summary"))
    if request.bootstrap:
        prefix = request.prefix if request.prefix is not None else str(
            (info.manifest.get("source") or {}).get("prefix") or "")
        notes["streams"] = (f"read from the broker at {request.bootstrap} (prefix {prefix!r}); "
                            "the counts cover the topics' whole history, not only this "
                            "snapshot's epoch")
        return kafka_streams_summary(request.bootstrap, prefix)
    notes["streams"] = ("no streams summary: pass --streams-summary FILE (`flywheel streams "
                        "inspect --json`) or --bootstrap-servers")
    return None


def _data_pieces(request: CollectRequest, info: data.SnapshotInfo,
                 notes: dict[str, str]) -> dict[str, Any]:
    summary = _streams_summary(request, info, notes)
    if summary is not None and request.streams_accounting is not None:
        notes["accounting"] = f"streams accounting ledger {request.streams_accounting}"
        summary = {**summary, "accounting": data.read_json(request.streams_accounting,
                                                           "streams accounting")}
    fail_closed = None if summary is None else data.fail_closed_evidence(summary)
    near = None if summary is None else data.near_duplicates_evidence(summary)
    if summary is not None and fail_closed is None:
        notes["fail_closed"] = ("the streams summary does not say how many capture records "
                                "were seen (capture.records); read it from the broker")
    drill = (None if request.erasure_receipt is None
             else data.read_json(request.erasure_receipt, "erasure receipt"))
    authorization = data.authorization_evidence(info, request.settings.authorization, drill)
    notes["deletion"] = (f"measured by the erasure drill {request.erasure_receipt}" if drill
                         else "no --erasure-receipt given: deletion support not measured")
    determinism = None
    if request.rebuild_report is not None:
        determinism = data.determinism_evidence(
            data.read_json(request.rebuild_report, "rebuild report"), info.snapshot_id)
    notes["determinism"] = (f"rebuild report {request.rebuild_report}" if determinism
                            else "no --rebuild-report given: determinism not measured")
    notes["authorization"] = ("declared in [authorization]" if request.settings.authorization
                              else f"runtime {info.identity.get('runtime_name')!r}: "
                              + ("synthetic by construction" if authorization else
                                 "nothing records that its threads were synthetic; declare "
                                 "[authorization] in the config"))
    notes["coverage"] = "; ".join(f"{k}: {v}" for k, v in data.COVERAGE_MEANING.items())
    return {"parity": data.parity_evidence(info), "determinism": determinism,
            "fail_closed": fail_closed, "opaque_ids": collect_ids.opaque_id_evidence(info),
            "integrity": data.integrity_evidence(
                info, near_duplicates=near, authorization=authorization,
                consent=data.consent_evidence(info, summary))}


def _shadow(request: CollectRequest, info: data.SnapshotInfo, loaded: Any, sim: SimConfig,
            notes: dict[str, str]) -> ShadowEvidence | None:
    rows = model.read_holdout(info)
    if rows is None:
        notes["shadow_io"] = "the snapshot has no runtime_holdout rows: no decode trace"
        return None
    s = request.settings
    top_k, experts = sim.geometry.top_k, sim.geometry.expert_count
    budgets = model.sweep_budgets(top_k, experts, s.budgets)
    own, nxt = model.sidecar_ranked(loaded, rows, max(budgets))
    trace = model.decode_trace(rows, experts, sim.geometry.skip_expert)
    order = (f"{rows.tokens} runtime_holdout tokens of {len(rows.threads)} threads, one "
             "sequence per thread in first-appearance order, anchors by token ordinal, one "
             "token per step; cache carries over between threads")
    heads = "own-layer head at boundary l" + (" + next-layer head (l+1) at boundary l"
                                               if nxt is not None else "")
    notes["shadow_io"] = f"{order}; P1 predictions: {heads}; {SIM_NOTE}"
    controls = {}
    if request.teacher is not None:  # the strongest offline control, at the same budget
        try:
            controls["native_gate"] = model.ranked_predictions(model.native_gate_ranked(
                info.directory, request.teacher, rows, max(budgets)))
        except NoNativeGateError as exc:
            notes["native_gate"] = str(exc)
    return model.shadow_evidence(
        trace, model.ranked_predictions(own, nxt), sim, budget=top_k, budgets=budgets,
        bandwidths=s.bandwidths, tau=s.tau, oracle_lead=1 if nxt is not None else 0,
        notes={"note": SIM_NOTE, "trace": order, "predictions": heads}, controls=controls)


def _decode(offline: OfflineEvidence, shadow: ShadowEvidence | None, top_k: int,
            exact: bool) -> DecodeEvidence:
    timely = None if shadow is None else shadow.metrics.get("timely_recall")
    decode = DecodeEvidence.from_offline(offline, budget=top_k, timely_recall=timely)
    return dataclasses.replace(decode, captures_regenerated=not exact)


def _model_pieces(request: CollectRequest, info: data.SnapshotInfo, parity: Any,
                  sim: SimConfig, notes: dict[str, str],
                  timings: dict[str, float]) -> dict[str, Any]:
    from hebrus_flywheel.train.checkpoint import load_checkpoint

    top_k = int(info.manifest["geometry"]["top_k"])
    started = time.perf_counter()
    offline, report = model.offline_evidence(info.directory, request.checkpoint,
                                             teacher=request.teacher, top_k=top_k,
                                             progress=request.progress)
    timings["evaluate"] = time.perf_counter() - started
    skipped = "; ".join(f"{k}: {v}" for k, v in sorted(report.get("skipped", {}).items()))
    notes["offline"] = ("train.evaluate on " + ", ".join(report["snapshot"]["splits"])
                        + (f" (skipped {skipped})" if skipped else ""))
    loaded = load_checkpoint(request.checkpoint)
    started = time.perf_counter()
    shadow = _shadow(request, info, loaded, sim, notes)
    timings["simulate"] = time.perf_counter() - started
    notes["decode"] = model.holdout_label_note(info, parity) + DECODE_NOTE
    return {"offline": offline, "shadow_io": shadow,
            "decode": _decode(offline, shadow, top_k, model.parity_is_exact(parity)),
            "lineage": checkpoint_lineage(loaded.lineage)}


def _figures(request: CollectRequest, notes: dict[str, str]) -> tuple[dict[str, Any], ...] | None:
    """The lines of ``predictor-figures.jsonl`` when the request names one."""
    if request.predictor_figures is None:
        return None
    from hebrus_flywheel.train.figures import read_figures

    notes["predictor_figures"] = str(request.predictor_figures)
    return tuple(read_figures(request.predictor_figures))


def _candidates(request: CollectRequest, expert_count: int, sim: SimConfig,
                notes: dict[str, str], timings: dict[str, float]) -> CandidateEvidence | None:
    """Model B and the governor on the candidate snapshot when the request names one."""
    if request.candidate_snapshot is None:
        notes["candidates"] = "not measured: no --candidate-snapshot was given"
        return None
    from hebrus_flywheel.core.snapshot import load_manifest
    from hebrus_flywheel.train.candidates.rows import read_candidate_table
    from hebrus_flywheel.train.governor import GovernorConfig

    started = time.perf_counter()
    manifest = load_manifest(Path(request.candidate_snapshot)).to_dict()
    gate = None
    if request.teacher is not None:  # candidate features share the clean snapshot's projection
        from hebrus_flywheel.train.data import Snapshot
        from hebrus_flywheel.train.predictor_data import load_gate

        gate = load_gate(request.teacher, Snapshot(request.snapshot))
    evidence, _ = candidate_evidence(
        read_candidate_table(request.candidate_snapshot), expert_count=expert_count,
        expert_bytes=sim.expert_bytes,
        governor_config=GovernorConfig(expert_bytes=sim.expert_bytes),
        replay_cost_s_per_accepted_token=request.candidate_replay_cost_s_per_accepted_token,
        source=str(request.candidate_snapshot), parity=manifest.get("parity"), sim_config=sim,
        gate=gate)
    timings["candidates"] = time.perf_counter() - started
    notes["candidates"] = (f"Model B and the governor trained/calibrated on "
                           f"{request.candidate_snapshot} (train, validation)")
    return evidence


def collect_inputs(request: CollectRequest) -> Collected:
    """The qualification bundle for ``request`` (see the module doc)."""
    notes: dict[str, str] = {}
    timings: dict[str, float] = {}
    started = time.perf_counter()
    info = data.open_snapshot(request.snapshot)
    pieces = _data_pieces(request, info, notes)
    parity = pieces["parity"]
    if parity is not None:
        label = model.holdout_label_note(info, parity)
        parity = dataclasses.replace(parity, details={**parity.details,
                                                      "runtime_holdout_labels": label})
        pieces["parity"] = parity
    timings["data"] = time.perf_counter() - started
    s = request.settings
    geometry = data.geometry_evidence(info)
    stream = data.stream_geometry(info, geometry)
    sim = s.sim_for(stream)
    found = _model_pieces(request, info, parity, sim, notes, timings)
    notes["break_even"] = ("tau(B) declared in [break_even]" if s.tau else "not measurable: "
                           "no speculative acceptance data yet (declare [break_even] tau)")
    inputs = QualificationInputs(
        snapshot_id=info.snapshot_id, checkpoint_lineage=found["lineage"],
        identity=dataclasses.replace(data.identity_evidence(info), teacher_name=(
            request.teacher.name if request.teacher is not None else None)),
        geometry=geometry, expert_bytes=sim.expert_bytes, dtype_bytes=sim.dtype_bytes,
        offline=found["offline"], decode=found["decode"],
        shadow_io=found["shadow_io"], objective=s.objective, throughput=s.throughput,
        economics=s.economics, predictor_figures=_figures(request, notes),
        collection=ReplayThroughput.from_manifest(info.manifest),
        candidates=_candidates(request, geometry.expert_count, sim, notes, timings),
        **pieces)
    notes["collection"] = ("the manifest's replay_throughput (teacher prefill timed by the "
                           "replay worker)" if inputs.collection is not None else
                           "not measured: the manifest has no replay_throughput")
    return Collected(inputs=inputs, notes=notes, timings_s=timings)
