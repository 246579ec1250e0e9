"""The typed input bundle of one qualification run.

``flywheel qualify`` fills :class:`QualificationInputs` from a sealed snapshot, a
checkpoint and the simulator; the gates only read it. Every piece of evidence except the
run's identity is optional: a missing piece makes the gates and falsifiers that need it
``not_measurable`` (never a pass). A piece that is present but malformed raises
:class:`~train.qualify.errors.InputError` naming the field.

Field names follow the producers: parity from ``replay/parity.py``'s ``ParityResult``,
offline results from :meth:`train.metrics.MetricsAccumulator.result`, shadow I/O from
:func:`train.sim.shadow_io` / :func:`train.sim.sweep` / :func:`train.sim.break_even`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hebrus_flywheel.core.geometry import RouteGeometry
from hebrus_flywheel.train.projection import ReplayThroughput
from hebrus_flywheel.train.qualify import checks as v
from hebrus_flywheel.train.qualify.candidate_evidence import CandidateEvidence
from hebrus_flywheel.train.qualify.data_evidence import (
    Authorization,
    ConsentMeasure,
    DeterminismEvidence,
    FailClosedEvidence,
    IntegrityEvidence,
    NearDuplicates,
    OpaqueIds,
    Overlap,
    ParityEvidence,
    SplitIntegrity,
)
from hebrus_flywheel.train.qualify.errors import InputError
from hebrus_flywheel.train.qualify.model_evidence import (
    DecodeEvidence,
    EconomicsEvidence,
    OfflineEvidence,
    RuntimeEvidence,
    ShadowEvidence,
    ThroughputEvidence,
)
from hebrus_flywheel.train.qualify.objective import ServiceObjective

__all__ = [
    "Authorization", "CandidateEvidence", "ConsentMeasure", "DecodeEvidence",
    "DeterminismEvidence", "EconomicsEvidence",
    "FailClosedEvidence", "Identity", "IntegrityEvidence", "NearDuplicates",
    "OfflineEvidence", "OpaqueIds", "Overlap", "ParityEvidence", "QualificationInputs",
    "RuntimeEvidence", "ShadowEvidence", "SplitIntegrity", "ThroughputEvidence",
]


@dataclass(frozen=True, kw_only=True)
class Identity:
    """The pinned identities the run was made under."""

    runtime: str
    """Runtime identity digest (model artifact, tokenizer, template, dtype, tie-break)."""
    teacher: str | None = None
    """Teacher (model artifact) digest."""
    tokenizer: str | None = None
    """Tokenizer and chat-template digest."""
    model_family: str | None = None
    """The teacher's model family (transformers ``model_type``, e.g. ``qwen3_next``)."""
    teacher_name: str | None = None
    """A name people know the teacher by (its checkpoint directory's name)."""

    def __post_init__(self) -> None:
        v.text("identity.runtime", self.runtime)
        for name in ("teacher", "tokenizer", "model_family", "teacher_name"):
            v.text(f"identity.{name}", getattr(self, name), optional=True)


@dataclass(frozen=True, kw_only=True)
class QualificationInputs:
    """Everything one qualification run is judged on."""

    snapshot_id: str
    """Id (manifest digest) of the sealed snapshot."""
    checkpoint_lineage: tuple[str, ...]
    """The qualified checkpoint first, then its ancestors."""
    identity: Identity
    """Pinned identities of the run."""
    geometry: RouteGeometry
    """Routing geometry of the teacher (the base ``RouteGeometry``)."""
    expert_bytes: int
    """Bytes of one routed expert: every byte budget is ``candidates * expert_bytes``."""
    dtype_bytes: float | None = None
    """Bytes per stored weight element of ``geometry``, when the expert bytes are the
    geometry's own (then ``expert_bytes`` must equal ``geometry.expert_bytes``); None when
    they come from elsewhere (the simulator's declared deployment)."""
    parity: ParityEvidence | None = None
    """Gate 1 / falsifier #1."""
    determinism: DeterminismEvidence | None = None
    """Gate 1: None when no rebuild was made."""
    fail_closed: FailClosedEvidence | None = None
    """Gate 1."""
    opaque_ids: tuple[OpaqueIds, ...] | None = None
    """Gate 1: opaque-id reuse across owners and generations (None: not checked)."""
    integrity: IntegrityEvidence | None = None
    """Gate 2."""
    offline: OfflineEvidence | None = None
    """Gate 3, falsifiers #2, #3, #7."""
    decode: DecodeEvidence | None = None
    """Gate 4."""
    shadow_io: ShadowEvidence | None = None
    """Gates 5 and 6, falsifiers #4, #5, #9."""
    objective: ServiceObjective | None = None
    """Gate 6: the declared service objective (None: promotion cannot be judged)."""
    runtime: RuntimeEvidence | None = None
    """Gate 6 when the objective asks for measurements on the real runtime."""
    throughput: ThroughputEvidence | None = None
    """Falsifier #10."""
    economics: EconomicsEvidence | None = None
    """Falsifier #6."""
    predictor_figures: tuple[dict[str, Any], ...] | None = None
    """Gate 3: the lines of ``predictor-figures.jsonl`` (None: not given)."""
    collection: ReplayThroughput | None = None
    """The snapshot's measured clean-path replay throughput (the manifest's
    ``replay_throughput``): the collection-time projection. None: not measured."""
    candidates: CandidateEvidence | None = None
    """Candidate-path evidence (Model B, the governor, replay cost): falsifiers #3, #6
    and the governor plot. None: no candidate-path snapshot was given."""

    def __post_init__(self) -> None:
        v.freeze(self, "checkpoint_lineage", tuple)
        v.text("snapshot_id", self.snapshot_id)
        if not isinstance(self.checkpoint_lineage, tuple) or not self.checkpoint_lineage:
            raise InputError("checkpoint_lineage must list the qualified checkpoint first, "
                             f"then its ancestors; got {self.checkpoint_lineage!r}")
        v.strings("checkpoint_lineage", self.checkpoint_lineage)
        v.instance("identity", self.identity, Identity, optional=False)
        v.instance("geometry", self.geometry, RouteGeometry, optional=False)
        v.count("expert_bytes", self.expert_bytes, positive=True)
        v.number("dtype_bytes", self.dtype_bytes, optional=True)
        if self.dtype_bytes is not None:
            shaped = round(self.geometry.expert_bytes(self.dtype_bytes))
            if shaped != self.expert_bytes:
                raise InputError(f"expert_bytes is {self.expert_bytes} but the geometry gives "
                                 f"{shaped} (3 x hidden x intermediate x dtype bytes); fix one")
        self._check_pieces()

    def _check_pieces(self) -> None:
        kinds = {"parity": ParityEvidence, "determinism": DeterminismEvidence,
                 "fail_closed": FailClosedEvidence, "integrity": IntegrityEvidence,
                 "offline": OfflineEvidence, "decode": DecodeEvidence,
                 "shadow_io": ShadowEvidence, "objective": ServiceObjective,
                 "runtime": RuntimeEvidence, "throughput": ThroughputEvidence,
                 "economics": EconomicsEvidence, "collection": ReplayThroughput,
                 "candidates": CandidateEvidence}
        for name, kind in kinds.items():
            v.instance(name, getattr(self, name), kind)
        if self.opaque_ids is not None:
            v.freeze(self, "opaque_ids", tuple)
            for item in self.opaque_ids:
                v.instance("opaque_ids[]", item, OpaqueIds, optional=False)
        if self.offline is not None:
            self.offline.check_geometry(self.geometry.expert_count, self.geometry.top_k)
        if self.shadow_io is not None:
            self.shadow_io.check_expert_bytes(self.expert_bytes)

    @property
    def checkpoint(self) -> str:
        """The qualified checkpoint."""
        return self.checkpoint_lineage[0]
