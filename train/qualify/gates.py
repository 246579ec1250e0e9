"""The qualification matrix: Gate 1–6 evaluators over :class:`QualificationInputs`.

Each evaluator returns a :class:`~train.qualify.verdict.GateVerdict` whose status is
``pass``, ``fail`` or ``not_measurable`` under one fail-closed rule (see
:func:`train.qualify.verdict.combine`): missing evidence is never a pass.
"""

from __future__ import annotations

from hebrus_flywheel.train.qualify.config import QualificationConfig
from hebrus_flywheel.train.qualify.gates_data import gate1_replay, gate2_integrity
from hebrus_flywheel.train.qualify.gates_io import gate4_decode, gate5_shadow, gate6_promotion
from hebrus_flywheel.train.qualify.gates_offline import gate3_offline, strongest_control
from hebrus_flywheel.train.qualify.inputs import QualificationInputs
from hebrus_flywheel.train.qualify.verdict import GateVerdict

__all__ = [
    "evaluate_gates", "gate1_replay", "gate2_integrity", "gate3_offline", "gate4_decode",
    "gate5_shadow", "gate6_promotion", "strongest_control",
]


def evaluate_gates(inputs: QualificationInputs,
                   config: QualificationConfig | None = None) -> list[GateVerdict]:
    """All six gates in order (Gate 6 sees the verdicts of Gates 1–5)."""
    config = QualificationConfig() if config is None else config
    prior = [
        gate1_replay(inputs, config.replay),
        gate2_integrity(inputs, config.integrity),
        gate3_offline(inputs, config.offline),
        gate4_decode(inputs, config.decode),
        gate5_shadow(inputs, config.shadow),
    ]
    return [*prior, gate6_promotion(inputs, prior)]
