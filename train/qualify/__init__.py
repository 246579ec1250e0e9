"""Qualification of a route-sidecar checkpoint: the design note's Gates 1–6, its ten
falsifiers, and a readable report. Pure functions over a typed input bundle; no Kafka,
no torch. Typical use::

    from hebrus_flywheel.train.qualify import QualificationConfig, load_inputs, qualify

    inputs = load_inputs("inputs.json")            # or build QualificationInputs(...)
    outcome = qualify(inputs, "report-dir", QualificationConfig())
    outcome.report_json, outcome.report_html, outcome.verdicts, outcome.falsifiers

A missing piece of evidence makes the gates that need it ``not_measurable``; nothing is
ever passed by default. See :mod:`train.qualify.inputs` for the bundle,
:mod:`train.qualify.gates` and :mod:`train.qualify.falsifiers` for the rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hebrus_flywheel.train.qualify.config import (
    CONTROL_METHODS,
    HEURISTIC_METHODS,
    DecodeGateConfig,
    FalsifierConfig,
    IntegrityGateConfig,
    OfflineGateConfig,
    QualificationConfig,
    ReplayGateConfig,
    ShadowGateConfig,
)
from hebrus_flywheel.train.qualify.errors import InputError, QualificationError, ReportError
from hebrus_flywheel.train.qualify.falsifiers import STATEMENTS, evaluate_falsifiers
from hebrus_flywheel.train.qualify.gates import (
    evaluate_gates,
    gate1_replay,
    gate2_integrity,
    gate3_offline,
    gate4_decode,
    gate5_shadow,
    gate6_promotion,
)
from hebrus_flywheel.train.qualify.inputs import (
    Authorization,
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
from hebrus_flywheel.train.qualify.objective import ServiceObjective, evaluate_objective
from hebrus_flywheel.train.qualify.parse import (
    dump_inputs,
    inputs_from_mapping,
    inputs_to_mapping,
    load_inputs,
)
from hebrus_flywheel.train.qualify.plots import PLOT_TITLES, render_plots
from hebrus_flywheel.train.qualify.report import (
    CLAIM_BOUNDARY,
    build_report,
    decision,
    write_report,
)
from hebrus_flywheel.train.qualify.verdict import (
    FAIL,
    FALSIFIED,
    NOT_FALSIFIED,
    NOT_MEASURABLE,
    PASS,
    Check,
    FalsifierVerdict,
    GateVerdict,
)


@dataclass(frozen=True, kw_only=True)
class QualificationOutcome:
    """What :func:`qualify` produced."""

    verdicts: list[GateVerdict]
    """Gates 1–6, in order."""
    falsifiers: list[FalsifierVerdict]
    """Falsifiers #1–#10, in order."""
    report_json: Path
    """The machine-readable report."""
    report_html: Path
    """The self-contained HTML report."""

    @property
    def promoted(self) -> bool:
        """True only when every gate passed."""
        return all(v.status == PASS for v in self.verdicts)


def qualify(inputs: QualificationInputs, out_dir: str | Path,
            config: QualificationConfig | None = None, *,
            date: str | None = None) -> QualificationOutcome:
    """Evaluate every gate and falsifier on ``inputs`` and write the report to ``out_dir``
    (``date``: the ISO day the report is dated, None to leave it out)."""
    config = QualificationConfig() if config is None else config
    verdicts = evaluate_gates(inputs, config)
    falsifiers = evaluate_falsifiers(inputs, config)
    json_path, html_path = write_report(inputs, verdicts, falsifiers, out_dir, config=config,
                                         date=date)
    return QualificationOutcome(verdicts=verdicts, falsifiers=falsifiers,
                                report_json=json_path, report_html=html_path)


__all__ = [
    "CLAIM_BOUNDARY",
    "CONTROL_METHODS",
    "FAIL",
    "FALSIFIED",
    "HEURISTIC_METHODS",
    "NOT_FALSIFIED",
    "NOT_MEASURABLE",
    "PASS",
    "PLOT_TITLES",
    "STATEMENTS",
    "Authorization",
    "Check",
    "ConsentMeasure",
    "DecodeEvidence",
    "DecodeGateConfig",
    "DeterminismEvidence",
    "EconomicsEvidence",
    "FailClosedEvidence",
    "FalsifierConfig",
    "FalsifierVerdict",
    "GateVerdict",
    "Identity",
    "InputError",
    "IntegrityEvidence",
    "IntegrityGateConfig",
    "NearDuplicates",
    "OfflineEvidence",
    "OfflineGateConfig",
    "OpaqueIds",
    "Overlap",
    "ParityEvidence",
    "QualificationConfig",
    "QualificationError",
    "QualificationInputs",
    "QualificationOutcome",
    "ReplayGateConfig",
    "ReportError",
    "RuntimeEvidence",
    "ServiceObjective",
    "ShadowEvidence",
    "ShadowGateConfig",
    "SplitIntegrity",
    "ThroughputEvidence",
    "build_report",
    "decision",
    "dump_inputs",
    "evaluate_falsifiers",
    "evaluate_gates",
    "evaluate_objective",
    "gate1_replay",
    "gate2_integrity",
    "gate3_offline",
    "gate4_decode",
    "gate5_shadow",
    "gate6_promotion",
    "inputs_from_mapping",
    "inputs_to_mapping",
    "load_inputs",
    "qualify",
    "render_plots",
    "write_report",
]
