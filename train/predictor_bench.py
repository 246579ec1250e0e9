"""``flywheel predictors``: train the predictor ablation on one snapshot, score every learned
model and every control at equal budgets, write ``predictor-figures.jsonl``.

Every learned predictor (:class:`train.predictors.PredictorSpec`: architecture x
features x target layer) is trained on the ``train`` split with the ranking objective of
:mod:`train.losses`, calibrated (Platt: temperature and bias) on ``validation`` only,
and scored on every evaluation split beside the training-free controls of
:mod:`train.predictor_data`, at budgets k, 2k, 3k and 4k. Each model keeps, per source
layer, the training state with the best validation score on that layer's rows (step 0
included: for gate-prior models that is the native-gate control itself). Nothing is
ever chosen on the runtime holdout: the best learned model is the one with the highest
validation recall@k (then exact-match@k), and its runtime-holdout figures are reported
as they fall.

Goal (issue 17): the best learned predictor beats the best control by >= 0.02 recall@k
and >= 0.02 exact-match@k on validation and runtime holdout, with ECE <= 0.05.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hebrus_flywheel.core.errors import ConfigError
from hebrus_flywheel.train.baselines import BaselineConfig
from hebrus_flywheel.train.data import Snapshot
from hebrus_flywheel.train.figures import literature_budgets, result_lines
from hebrus_flywheel.train.metrics import EVALUATION_SPLITS, MetricsAccumulator, MetricsConfig
from hebrus_flywheel.train.predictor_data import Controls, GateWeights, Rows, fit_frequency_rows
from hebrus_flywheel.train.predictors import PredictorSpec
from hebrus_flywheel.train.recipe import (
    Inputs,
    Recipe,
    Trained,
    fit_predictor,
    model_scores,
    spec_inputs,
)

log = logging.getLogger(__name__)
GOAL_MARGIN = 0.02
GOAL_MAX_ECE = 0.05
GOAL_SPLITS = ("validation", "runtime_holdout")


def default_specs(widths: tuple[int, ...] = (64,)) -> tuple[PredictorSpec, ...]:
    """The ablation: {per-layer MLP, shared low-rank} x {feature, feature + gate logits}
    x {own layer, P1 next layer}, plus the gate adapters. The width axis is swept only
    where it can decide the outcome: the own-layer gate-prior families (the strongest
    models on every teacher measured so far); every other cell is trained at the middle
    width (the median of ``widths``), so the table stays features x model x target."""
    middle = sorted(widths)[len(widths) // 2]
    specs = [PredictorSpec(architecture=a, gate_prior=g, target_offset=t, width=w)
             for t in (0, 1) for a in ("per_layer_mlp", "shared_lowrank")
             for g in (False, True)
             for w in (widths if (t == 0 and g) else (middle,))]
    return tuple(specs + [PredictorSpec(architecture="gate_adapter", target_offset=t,
                                        width=middle) for t in (0, 1)])


class SharedInputs:
    """Each split's (source rows, targets, gate prior) per (target offset, gate prior),
    computed once and shared by every spec that needs them (the prior is the costly part)."""

    def __init__(self, rows: dict[str, Rows], gate: GateWeights | None) -> None:
        self.rows, self.gate = rows, gate
        self.cache: dict[tuple[str, int, bool], Inputs] = {}

    def get(self, split: str, spec: PredictorSpec) -> Inputs:
        key = (split, spec.target_offset, spec.gate_prior)
        if key not in self.cache:
            self.cache[key] = spec_inputs(self.rows[split], spec, self.gate)
        return self.cache[key]


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """How the predictor bench trains and scores."""

    specs: tuple[PredictorSpec, ...] = field(default_factory=default_specs)
    """The learned predictors to train (the ablation grid)."""
    steps: int = 400
    """Optimiser steps per predictor."""
    batch_size: int = 512
    """Rows per step."""
    lr: float = 3e-3
    """Peak AdamW learning rate (cosine decay to lr/10)."""
    prior_lr_factor: float = 0.3
    """Learning-rate factor of gate-prior models (they start at the control)."""
    eval_every: int = 25
    """Steps between validation checks of the best-state selection."""
    select_on: str = "recall"
    """Validation criterion of the best state: ``recall`` (recall@k) or ``recall+exact``."""
    patience: int = 4
    """Validations without improvement before a model stops early (0: never)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    seed: int = 0
    """Seed of initialisation and batch order."""
    union_max_window: int = 8
    """Largest token window of route-union growth."""
    expert_bytes: int = 1
    """Bytes of one expert: every budget's byte figure is ``budget * expert_bytes``."""
    layer_groups: bool = True
    """Also write per-layer and per-domain figure lines."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", tuple(self.specs))
        for name in ("steps", "batch_size", "union_max_window", "expert_bytes", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"BenchConfig.{name} must be a positive integer, got {value!r}")
        if self.select_on not in ("recall", "recall+exact"):
            raise ConfigError(f"BenchConfig.select_on must be recall or recall+exact, got "
                              f"{self.select_on!r}")
        if not self.specs or len({s.name for s in self.specs}) != len(self.specs):
            raise ConfigError("BenchConfig.specs must be non-empty without repeated names")
        if not (math.isfinite(self.lr) and self.lr > 0) or self.weight_decay < 0 or not (
                0 < self.prior_lr_factor <= 1):
            raise ConfigError("BenchConfig.lr must be > 0, .weight_decay >= 0 and "
                              ".prior_lr_factor in (0, 1]")


def bench_recipe(config: BenchConfig) -> Recipe:
    """The :class:`train.recipe.Recipe` of the bench's settings."""
    return Recipe(steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                  prior_lr_factor=config.prior_lr_factor, weight_decay=config.weight_decay,
                  eval_every=config.eval_every, patience=config.patience,
                  select_on=config.select_on, seed=config.seed)


def train_one(spec: PredictorSpec, train: Rows | Inputs, validation: Rows | Inputs,
              gate: GateWeights | None, config: BenchConfig, *, layer_count: int,
              expert_count: int) -> Trained:
    """:func:`train.recipe.fit_predictor` with the bench's :class:`Recipe` (the very
    function ``flywheel train`` calls)."""
    return fit_predictor(spec, train, validation, gate, bench_recipe(config),
                         layer_count=layer_count, expert_count=expert_count)


class Scoreboard:
    """One metrics accumulator per model (learned and control), both targets."""

    def __init__(self, metrics: MetricsConfig) -> None:
        self.metrics = metrics
        self.accumulators: dict[str, MetricsAccumulator] = {}
        self.kinds: dict[str, tuple[str, str, str]] = {}

    def add(self, name: str, *, kind: str, target: str, features: str, rows: Rows,
            scores_NE: Any, target_NK: np.ndarray, layer_N: np.ndarray,
            probabilities_NE: Any = None) -> None:
        if name not in self.accumulators:
            self.accumulators[name] = MetricsAccumulator(self.metrics, method=name)
            self.kinds[name] = (kind, target, features)
        self.accumulators[name].update(
            target_ids_BK=target_NK, layer_B=layer_N, split_B=rows.split, scores_BE=scores_NE,
            membership_prob_BE=probabilities_NE, domain_B=rows.domain_N,
            thread_B=rows.thread_N, ordinal_B=rows.ordinal_N)

    def results(self) -> dict[str, dict[str, Any]]:
        return {name: acc.result() for name, acc in self.accumulators.items()}


def score_split(board: Scoreboard, rows: Rows, controls: Controls, trained: list[Trained],
                gate: GateWeights | None) -> None:
    """Add every control and learned model on one evaluation split."""
    same = controls.same_layer(rows)
    for name, scores in same.items():
        board.add(name, kind="control", target="same_layer", features="history/router",
                  rows=rows, scores_NE=scores, target_NK=rows.target_NK, layer_N=rows.layer_N)
    source, _ = rows.next_rows()
    for name, scores in controls.next_layer(rows, same).items():
        board.add(name, kind="control", target="next_layer", features="history/router",
                  rows=source, scores_NE=scores, target_NK=source.next_NK,
                  layer_N=source.layer_N + 1)
    for item in trained:
        src, targets, prior = spec_inputs(rows, item.spec, gate)
        learned_NE = model_scores(item.model, src, prior)
        board.add(item.spec.name, kind="learned",
                  target="next_layer" if item.spec.target_offset else "same_layer",
                  features=item.spec.features, rows=src, scores_NE=learned_NE.double(),
                  target_NK=targets, layer_N=src.layer_N + item.spec.target_offset,
                  probabilities_NE=item.calibration.probabilities(learned_NE))


def _overall(result: dict[str, Any], split: str) -> dict[str, Any] | None:
    node = result["splits"].get(split)
    return None if node is None else node["overall"]


def goal_summary(results: dict[str, dict[str, Any]], kinds: dict[str, tuple[str, str, str]],
                 top_k: int, target: str) -> dict[str, Any]:
    """Best learned (chosen on validation) against the best control per metric and split."""
    learned = [m for m, (k, t, _) in kinds.items() if k == "learned" and t == target]
    controls = [m for m, (k, t, _) in kinds.items() if k == "control" and t == target]
    if not learned or not controls:
        return {"target": target, "best_learned": None, "splits": {}}

    def figures(method: str, split: str) -> dict[str, float | None]:
        node = _overall(results[method], split)
        if node is None:
            return {"recall": None, "exact": None, "ece": None}
        cal = node.get("calibration")
        return {"recall": node["recall"][str(top_k)], "exact": node["exact_match"],
                "ece": None if cal is None else cal["ece"]}

    best = max(learned, key=lambda m: (figures(m, "validation")["recall"] or -1.0,
                                       figures(m, "validation")["exact"] or -1.0))
    out: dict[str, Any] = {"target": target, "best_learned": best, "chosen_on": "validation",
                           "splits": {}}
    for split in EVALUATION_SPLITS:
        mine = figures(best, split)
        if mine["recall"] is None:
            continue
        theirs = {m: figures(m, split) for m in controls}
        r_ctl = max(theirs, key=lambda m: theirs[m]["recall"] or -1.0)
        e_ctl = max(theirs, key=lambda m: theirs[m]["exact"] or -1.0)
        d_recall = mine["recall"] - (theirs[r_ctl]["recall"] or 0.0)
        d_exact = (mine["exact"] or 0.0) - (theirs[e_ctl]["exact"] or 0.0)
        met = (d_recall >= GOAL_MARGIN and d_exact >= GOAL_MARGIN
               and mine["ece"] is not None and mine["ece"] <= GOAL_MAX_ECE)
        out["splits"][split] = {
            "learned": mine, "best_recall_control": r_ctl,
            "control_recall": theirs[r_ctl]["recall"], "best_exact_control": e_ctl,
            "control_exact": theirs[e_ctl]["exact"], "delta_recall": d_recall,
            "delta_exact": d_exact, "goal_met": met}
    out["goal_met"] = all(out["splits"].get(s, {}).get("goal_met", False) for s in GOAL_SPLITS)
    return out


def run_bench(snapshot: Snapshot, rows: dict[str, Rows], gate: GateWeights | None,
              config: BenchConfig) -> dict[str, Any]:
    """Train the ablation, score everything; the report with figures lines."""
    g = snapshot.geometry
    L, E, K = int(g["layers"]), snapshot.expert_count, int(g["top_k"])
    base = BaselineConfig(layer_count=L, expert_count=E, seed=config.seed,
                          lru_capacity=max(64, 4 * K))
    frequency = fit_frequency_rows(rows["train"], base)
    controls = Controls(base, frequency, gate)
    trained, shared = [], SharedInputs(rows, gate)
    for spec in config.specs:
        item = train_one(spec, shared.get("train", spec), shared.get("validation", spec), gate,
                         config, layer_count=L, expert_count=E)
        log.info("trained %s in %.1f s (best validation step per layer %s, calibration %s)",
                 spec.name, item.seconds, item.best_step, item.calibration)
        trained.append(item)
    board = Scoreboard(MetricsConfig(expert_count=E, top_k=K, budgets=literature_budgets(K),
                                     union_max_window=config.union_max_window))
    splits = [s for s in EVALUATION_SPLITS if s in rows]
    for split in splits:
        score_split(board, rows[split], controls, trained, gate)
    results = board.results()
    widths = {s.name: s.width for s in config.specs if s.architecture != "gate_adapter"}
    lines = [line for name, result in results.items() for line in result_lines(
        result, kind=board.kinds[name][0], target=board.kinds[name][1],
        features=board.kinds[name][2], expert_bytes=config.expert_bytes,
        groups=config.layer_groups, width=widths.get(name))]
    return {"splits": splits, "top_k": K, "budgets": list(literature_budgets(K)),
            "expert_bytes": config.expert_bytes, "results": results, "kinds": board.kinds,
            "lines": lines,
            "training": {t.spec.name: {"seconds": t.seconds, "features": t.spec.features,
                                       "best_step": t.best_step, "steps_run": t.steps_run,
                                       "spec": spec_fields(t.spec),
                                       "calibration": vars(t.calibration)} for t in trained},
            "goal": {t: goal_summary(results, board.kinds, K, t)
                     for t in ("same_layer", "next_layer")}}


ECE_NOTE = ("ECE: of candidate membership: for each row's 2k best-ranked candidates, the "
            "calibrated probability that the candidate is in the teacher's top-k set against "
            "whether it is (10 equal-width bins). Calibration: Platt (temperature and bias) of "
            "the score or of its distance from the row's top-k edge, whichever has the lower "
            "validation BCE; fitted on validation only.")


def spec_fields(spec: PredictorSpec) -> dict[str, Any]:
    """A spec as plain JSON (``flywheel train --model ... --width ...`` takes these)."""
    return {"architecture": spec.architecture, "gate_prior": spec.gate_prior,
            "target_offset": spec.target_offset, "width": spec.width}


def train_toml(config: BenchConfig | None = None) -> str:
    """The ``flywheel train --config`` of a predictor chosen by ``flywheel predictors``:
    the bench's objective (ranking terms only; calibration is fitted on validation after
    training), weight decay and early stopping, so that with :func:`train_arguments` the
    checkpoint is trained by the same :class:`train.recipe.Recipe`."""
    config = config or BenchConfig()
    return (f"# flywheel train of a predictor chosen by `flywheel predictors` (one recipe)\n"
            f"seed = {config.seed}\n\n[loss]\ncalibration_weight = 0.0\n\n"
            f"[optim]\nweight_decay = {config.weight_decay!r}\n\n"
            f"[schedule]\npatience = {config.patience}\nmonitor = \"recall\"\n")


TRAIN_TOML = train_toml()


def method_name(spec: dict[str, Any]) -> str:
    """A plain method name for a spec: ``per_layer_mlp+gate_prior@64`` ->
    ``per_layer_mlp-gate_prior-w64`` (evaluation and qualification tables)."""
    base = spec["architecture"] + ("-gate_prior" if spec["gate_prior"] else "")
    return ("p1_" if spec.get("target_offset") else "") + f"{base}-w{spec['width']}"


def train_arguments(spec: dict[str, Any], config: BenchConfig | None = None) -> list[str]:
    """``flywheel train`` flags that train ``spec`` (a same-layer spec of
    :func:`spec_fields`) with the bench's learning rate, steps, batch size and
    validation cadence; pair them with ``--config`` of :func:`train_toml`."""
    config = config or BenchConfig()
    if spec.get("target_offset"):
        raise ConfigError(f"{method_name(spec)} predicts the next layer; flywheel train's "
                          "checkpoint needs an own-layer head: pick a same-layer spec")
    starts_at_control = spec["gate_prior"] or spec["architecture"] == "gate_adapter"
    lr = config.lr * (config.prior_lr_factor if starts_at_control else 1.0)
    return ["--model", spec["architecture"], "--width", str(spec["width"]),
            "--gate-prior" if spec["gate_prior"] else "--no-gate-prior",
            "--method", method_name(spec), "--lr", repr(lr), "--max-steps", str(config.steps),
            "--batch-size", str(config.batch_size), "--eval-every", str(config.eval_every)]


def _val(report: dict[str, Any], name: str) -> tuple[float, float]:
    node = _overall(report["results"][name], "validation")
    return (-1.0, -1.0) if node is None else (node["recall"][str(report["top_k"])],
                                              node["exact_match"])


def width_choice(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per (model, features, target) family: every width's validation recall@k and
    exact@k, and the width chosen on validation only (recall, then exact)."""
    families: dict[str, dict[str, Any]] = {}
    for name, fields in report["training"].items():
        spec = fields["spec"]
        if spec["architecture"] == "gate_adapter":
            continue  # no width: the adapter is the router's own shape
        family = name.rsplit("@", 1)[0]
        entry = families.setdefault(family, {"widths": {}})
        entry["widths"][spec["width"]] = dict(zip(("recall", "exact"), _val(report, name),
                                                  strict=True))
    for entry in families.values():
        entry["chosen_on_validation"] = max(
            entry["widths"], key=lambda w: (entry["widths"][w]["recall"],
                                            entry["widths"][w]["exact"], -w))
    return families


def width_lines(report: dict[str, Any]) -> list[str]:
    """Markdown: the width axis of the ablation, per family, chosen on validation."""
    k, choice = report["top_k"], report.get("widths") or {}
    if not choice:
        return []
    widths = sorted({w for e in choice.values() for w in e["widths"]})
    out = ["| model + features (target) | " + " | ".join(
        f"val R@{k} / exact@{k} @{w}" for w in widths) + " | width chosen on validation |",
        "|" + "---|" * (len(widths) + 2)]
    for family, entry in choice.items():
        cells = [("—" if (v := entry["widths"].get(w)) is None else
                  f"{v['recall']:.3f} / {v['exact']:.3f}") for w in widths]
        out.append(f"| {family} | " + " | ".join(cells)
                   + f" | {entry['chosen_on_validation']} |")
    return out


def ablation_table(report: dict[str, Any]) -> list[str]:
    """Markdown: model x features x width, recall@k / exact@k / ECE on validation and
    runtime holdout (ECE of candidate membership, see :mod:`train.metrics`)."""
    k = report["top_k"]
    head = (f"| model | kind | target | features | width | val R@{k} | val exact@{k} | "
            f"val ECE | rt R@{k} | rt exact@{k} | rt ECE |")
    out = [head, "|" + "---|" * 11]
    for name, result in report["results"].items():
        kind, target, features = report["kinds"][name]
        spec = (report.get("training", {}).get(name) or {}).get("spec") or {}
        width = spec.get("width") if spec.get("architecture") != "gate_adapter" else None
        cells = []
        for split in ("validation", "runtime_holdout"):
            node = _overall(result, split)
            cal = None if node is None else node.get("calibration")
            cells += ["—" if node is None else f"{node['recall'][str(k)]:.3f}",
                      "—" if node is None else f"{node['exact_match']:.3f}",
                      "—" if cal is None else f"{cal['ece']:.4f}"]
        out.append(f"| {name} | {kind} | {target} | {features} | {width or '—'} | "
                   + " | ".join(cells) + " |")
    return out


def write_outputs(report: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """``predictor-figures.jsonl``, ``predictor-summary.json`` and ``predictor-report.md``."""
    import json

    from hebrus_flywheel.core.files import atomic_write_text, make_dirs
    from hebrus_flywheel.train.figures import FIGURES_FILE, write_figures

    make_dirs(out_dir)
    figures = write_figures(out_dir / FIGURES_FILE, report["lines"])
    summary = out_dir / "predictor-summary.json"
    body = {k: v for k, v in report.items() if k not in ("lines", "results")}
    atomic_write_text(summary, json.dumps(body, indent=2, sort_keys=True, default=str))
    markdown = out_dir / "predictor-report.md"
    atomic_write_text(markdown, "\n".join([
        *ablation_table(report), "", *width_lines(report), "", ECE_NOTE, "",
        *goal_lines(report)]) + "\n")
    return {"figures": figures, "summary": summary, "report": markdown}


def goal_lines(report: dict[str, Any]) -> list[str]:
    """The learned-versus-control lines of the closing note."""
    k, out = report["top_k"], []
    for target, goal in report["goal"].items():
        if goal["best_learned"] is None:
            continue
        out.append(f"{target}: best learned (chosen on validation) {goal['best_learned']}")
        for split, row in goal["splits"].items():
            ece = row["learned"]["ece"]
            out.append(
                f"  {split}: R@{k} {row['learned']['recall']:.3f} vs {row['best_recall_control']}"
                f" {row['control_recall']:.3f} ({row['delta_recall']:+.3f}); exact@{k} "
                f"{row['learned']['exact']:.3f} vs {row['best_exact_control']} "
                f"{row['control_exact']:.3f} ({row['delta_exact']:+.3f}); ECE "
                f"{'—' if ece is None else f'{ece:.4f}'}; goal "
                f"{'MET' if row['goal_met'] else 'not met'}")
        out.append(f"  goal (validation and runtime_holdout): "
                   f"{'MET' if goal['goal_met'] else 'NOT MET'}")
    return out


def bench_snapshot(snapshot_path: Path, out_dir: Path, config: BenchConfig, *,
                   teacher_dir: Path | None) -> dict[str, Any]:
    """Load the snapshot's splits (and its teacher's routers), run, write the outputs."""
    from hebrus_flywheel.train.predictor_data import load_gate, load_rows

    snapshot = Snapshot(snapshot_path)
    rows = {s: load_rows(snapshot, s) for s in ("train", *EVALUATION_SPLITS)
            if snapshot.split_rows(s)}
    if "train" not in rows or "validation" not in rows:
        raise ConfigError(f"snapshot {snapshot.snapshot_id} needs train and validation rows "
                          "(training and calibration); capture more threads")
    gate = None if teacher_dir is None else load_gate(teacher_dir, snapshot)
    report = run_bench(snapshot, rows, gate, config)
    report["widths"] = width_choice(report)
    report["snapshot_id"] = snapshot.snapshot_id
    report["outputs"] = {k: str(v) for k, v in write_outputs(report, Path(out_dir)).items()}
    return report
