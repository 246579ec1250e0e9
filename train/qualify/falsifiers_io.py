"""The I/O falsifiers: #4 byte amplification, #5 lateness, #9 the cold-byte roofline
and #10 loader versus trainer throughput."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from hebrus_flywheel.train.qualify.config import QualificationConfig
from hebrus_flywheel.train.qualify.gates_io import amplification_ratio
from hebrus_flywheel.train.qualify.inputs import QualificationInputs
from hebrus_flywheel.train.qualify.model_evidence import ShadowEvidence
from hebrus_flywheel.train.qualify.verdict import (
    FALSIFIED,
    NOT_FALSIFIED,
    NOT_MEASURABLE,
    NOT_MEASURED,
)

Outcome = tuple[str, str, dict[str, Any], str, str]


def outcome(status: str, reason: str, figures: dict[str, Any] | None = None, *,
            measured: str = "", threshold: str = "") -> Outcome:
    """What a falsifier judge returns: ``(status, reason, figures, measured,
    threshold)``; a not-measurable outcome's ``measured`` is ``"not measured"``."""
    if status == NOT_MEASURABLE and not measured:
        measured = NOT_MEASURED
    return status, reason, figures or {}, measured, threshold


def reference_rows(shadow: ShadowEvidence) -> tuple[float | None, list[dict[str, Any]]]:
    """The sweep rows at the declared SSD bandwidth (the swept one nearest to it on a log
    scale; the median swept one when none is declared), in ascending budget order
    (``None`` = every candidate, last)."""
    bandwidths = sorted({float(r["ssd_bandwidth_bytes_per_s"]) for r in shadow.sweep})
    if not bandwidths:
        return None, []
    ref = shadow.sim_config.get("ssd_bandwidth_bytes_per_s")
    if isinstance(ref, int | float) and not isinstance(ref, bool) and ref > 0:
        chosen = min(bandwidths, key=lambda b: (abs(math.log(b / ref)), b))
    else:
        chosen = bandwidths[len(bandwidths) // 2]
    rows = [r for r in shadow.sweep if float(r["ssd_bandwidth_bytes_per_s"]) == chosen]
    rows.sort(key=lambda r: (r["candidate_budget"] is None, r["candidate_budget"] or 0))
    return chosen, rows


def f4_amplification(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    shadow = inputs.shadow_io
    target = config.falsifiers.useful_timely_recall
    bound = config.falsifiers.max_byte_amplification_ratio
    threshold = (f"amplification <= x{bound:.3f} at the first budget reaching timely recall "
                 f"{target:.2f} (FalsifierConfig.max_byte_amplification_ratio, "
                 "useful_timely_recall)")
    if shadow is None or not shadow.sweep:
        return outcome(NOT_MEASURABLE, "no shadow sweep over candidate budgets; run the "
                       "simulator's bandwidth x budget sweep", threshold=threshold)
    bandwidth, rows = reference_rows(shadow)
    curve = [{"budget": r["candidate_budget"], "timely_recall": r.get("timely_recall"),
              "recall": r.get("recall"), "amplification_ratio": amplification_ratio(r),
              "byte_amplification_vs_topk": r.get("byte_amplification_vs_topk")} for r in rows]
    figures: dict[str, Any] = {"ssd_bandwidth_bytes_per_s": bandwidth,
                               "useful_timely_recall": target,
               "bound": bound, "curve": curve}
    useful = [c for c in curve if c["timely_recall"] is not None
              and c["timely_recall"] >= target and c["amplification_ratio"] is not None]
    if not useful:
        best = max((c["timely_recall"] or 0.0 for c in curve), default=0.0)
        return outcome(NOT_MEASURABLE, f"no swept budget reached timely recall {target:.2f} at "
                  f"{bandwidth:.3g} B/s (best {best:.3f}), or the sweep has no baseline; "
                  "extend the budget sweep (see #2 and #5 for a weak predictor)", figures,
                  measured=f"best timely recall {best:.3f}", threshold=threshold)
    first = useful[0]
    figures["first_useful"] = first
    status = FALSIFIED if first["amplification_ratio"] > bound else NOT_FALSIFIED
    return outcome(status, f"the smallest budget reaching timely recall {target:.2f} "
              f"({first['budget']} candidates) reads x{first['amplification_ratio']:.3f} the "
              f"bytes of no prediction (bound x{bound:.3f})", figures,
              measured=f"x{first['amplification_ratio']:.3f} bytes at {first['budget']} "
              "candidates", threshold=threshold)


def f5_late(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    shadow = inputs.shadow_io
    bound = config.falsifiers.meaningful_wait_reduction
    threshold = f"hidden wait >= {bound:.1%} (FalsifierConfig.meaningful_wait_reduction)"
    if shadow is None:
        return outcome(NOT_MEASURABLE, "no shadow I/O simulation; run the simulator on the "
                       "real-decode trace", threshold=threshold)
    m = shadow.metrics
    keys = ("recall", "timely_recall", "late_prefetches", "predictions_issued_after_deadline",
            "slack_p05_s", "slack_p50_s", "hidden_fraction", "exposed_wait_s",
            "baseline_exposed_wait_s", "exposed_wait_reduction")
    figures = {k: m.get(k) for k in keys}
    reduction = m.get("exposed_wait_reduction")
    if reduction is None:
        return outcome(NOT_MEASURABLE, "no exposed SSD wait without predictions to compare with "
                  "(no baseline run, or nothing to hide at this configuration)", figures,
                  threshold=threshold)
    status = FALSIFIED if reduction < bound else NOT_FALSIFIED
    return outcome(status, f"predictions hide {reduction:.1%} of the exposed SSD wait (meaningful: "
              f">= {bound:.1%}); recall {_f(m.get('recall'))} vs timely recall "
              f"{_f(m.get('timely_recall'))}", figures,
              measured=f"{reduction:.1%} of exposed SSD wait hidden", threshold=threshold)


def _f(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.3f}"


def _layer_total(value: Any, layers: int) -> float | None:
    if isinstance(value, list | tuple):
        return float(sum(value))
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) * layers
    return None


def cold_roofline(inputs: QualificationInputs) -> dict[str, float] | None:
    """Per token without cache reuse: the time to read every top-k expert of every layer
    at the declared SSD bandwidth, the compute it could hide behind, and the ratio."""
    shadow = inputs.shadow_io
    cfg: Mapping[str, Any] = {} if shadow is None else shadow.sim_config
    layers, top_k = inputs.geometry.routed_layer_count, inputs.geometry.top_k
    attention = _layer_total(cfg.get("attention_time_s"), layers)
    moe = _layer_total(cfg.get("moe_time_s"), layers)
    bandwidth, overhead = cfg.get("ssd_bandwidth_bytes_per_s"), cfg.get("step_overhead_s", 0.0)
    if attention is None or moe is None or not bandwidth:
        return None
    io = layers * top_k * inputs.expert_bytes / float(bandwidth)
    compute = attention + moe + float(overhead or 0.0)
    return {"cold_io_s_per_token": io, "compute_s_per_token": compute,
            "max_hideable_fraction": min(1.0, compute / io) if io else 1.0}


def f9_roofline(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    shadow = inputs.shadow_io
    roofline = cold_roofline(inputs)
    bound = config.falsifiers.min_oracle_hidden_fraction
    threshold = f"oracle hides >= {bound:.1%} (FalsifierConfig.min_oracle_hidden_fraction)"
    if shadow is None or shadow.oracle is None:
        return outcome(NOT_MEASURABLE, "no perfect-predictor (oracle) shadow run on the same trace "
                  "and configuration", {"roofline": roofline}, threshold=threshold)
    hidden = shadow.oracle.get("hidden_fraction")
    figures = {"oracle_hidden_fraction": hidden,
               "oracle_exposed_wait_reduction": shadow.oracle.get("exposed_wait_reduction"),
               "oracle_timely_recall": shadow.oracle.get("timely_recall"),
               "bound": bound, "roofline": roofline}
    if hidden is None:
        return outcome(NOT_MEASURABLE, "the oracle run served no exact expert from a read",
                       figures, threshold=threshold)
    status = FALSIFIED if hidden < bound else NOT_FALSIFIED
    extra = "" if roofline is None else (
        f"; cold bytes need {roofline['cold_io_s_per_token']:.3g} s/token of SSD time against "
        f"{roofline['compute_s_per_token']:.3g} s of compute")
    return outcome(status, f"a perfect predictor hides {hidden:.1%} of exact I/O time (needs >= "
              f"{bound:.1%}){extra}; timings are the simulator's declared ones", figures,
              measured=f"oracle hides {hidden:.1%} of exact I/O time", threshold=threshold)


def f10_loader(inputs: QualificationInputs, config: QualificationConfig) -> Outcome:
    t = inputs.throughput
    threshold = "data wait <= compute time"
    if t is None:
        return outcome(NOT_MEASURABLE, "feature-loader and trainer throughput were not measured; "
                       "declare them in the [throughput] table", threshold=threshold)
    where = f" on {t.device}" if t.device else ""
    figures = {"loader_examples_per_s": t.loader_examples_per_s,
               "trainer_examples_per_s": t.trainer_examples_per_s,
               "data_wait_s": t.data_wait_s, "compute_s": t.compute_s, "device": t.device}
    if t.data_wait_s is not None and t.compute_s is not None:
        status = FALSIFIED if t.data_wait_s > t.compute_s else NOT_FALSIFIED
        return outcome(status, f"the trainer waited {t.data_wait_s:.3g} s for shards and computed "
                  f"{t.compute_s:.3g} s{where} (measured run)", figures,
                  measured=f"{t.data_wait_s:.3g} s waiting vs {t.compute_s:.3g} s computing",
                  threshold=threshold)
    loader, trainer = t.loader_examples_per_s, t.trainer_examples_per_s
    if not loader or not trainer:
        return outcome(NOT_MEASURABLE, "need data-wait and compute seconds, or both loader and "
                  "trainer examples per second", figures, threshold=threshold)
    wait = max(0.0, 1.0 / loader - 1.0 / trainer)
    figures["estimated_wait_per_compute"] = wait * trainer
    status = FALSIFIED if wait > 1.0 / trainer else NOT_FALSIFIED
    return outcome(status, f"loader {loader:.4g} vs trainer {trainer:.4g} examples/s{where}: with "
              f"full overlap the trainer would wait {wait * trainer:.2f} s per second of "
              "compute (estimate)", figures,
              measured=f"{wait * trainer:.2f} s wait per s of compute (estimate)",
              threshold=threshold)
